"""Constrained decoding (response_format, vLLM's structured_outputs / guided_*), with llguidance.

`grammar.py` (torch-free: the gateway validates with it) turns a request's StructuredOutput into
a grammar; `matcher.py` keeps one matcher per sequence and a per-engine compile cache;
`bitmask.py` applies token bitmasks to logits.
"""
