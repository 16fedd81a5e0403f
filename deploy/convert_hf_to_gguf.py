"""llama.cpp's own `convert_hf_to_gguf.py`, run from its source tree, for pdserve's random models.

    python deploy/convert_hf_to_gguf.py LLAMA_CPP_DIR MODEL_DIR --outtype f16 --outfile F.gguf

Our byte-level BPE tokenizer's pre-tokenizer hash is unknown to the converter; the tokenizer is
GPT-2 style, so an unknown hash maps to "gpt-2". Everything else is the converter's own code (so no
pdserve code writes the file).
"""

import sys

sys.path.insert(0, sys.argv.pop(1))  # llama.cpp's source directory
sys.path.insert(0, sys.path[0] + "/gguf-py")
import convert_hf_to_gguf as conv  # noqa: E402

try:  # newer llama.cpp: models live in conversion/
    from conversion.base import TextModel as _base
except ImportError:  # older: one file
    _base = getattr(conv, "TextModel", None) or conv.Model
_pre = _base.get_vocab_base_pre


def _pre_or_gpt2(self, tokenizer):
    try:
        return _pre(self, tokenizer)
    except NotImplementedError:
        return "gpt-2"


_base.get_vocab_base_pre = _pre_or_gpt2
sys.argv[0] = "convert_hf_to_gguf.py"
conv.main()
