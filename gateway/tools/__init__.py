"""OpenAI tools on chat completions: the request's `tools` / `tool_choice` (request.py), the
grammar that forces a call for `required` or a named function (grammar.py, in the chosen parser's
format), one parser per model family's call format (hermes.py, llama3_json.py, mistral.py,
pythonic.py; chosen by --tool-call-parser, registry.py) and the OpenAI deltas of a streamed
answer (stream.py).
"""
