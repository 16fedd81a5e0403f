"""GGUF files (engine/gguf_file.py, gguf_weights.py, gguf_writer.py): a GGUF written from a tiny
random model is served with greedy output equal to HF's (f32: on the original folder; quantized: on
the file's weights dequantized to fp32), its tokenizer equals the original, and its config and
fingerprint are read without torch."""

from __future__ import annotations

import random
import subprocess
import sys

import gguf
import pytest
import torch

from pdserve.engine.config import ModelConfig
from pdserve.engine.gguf_file import load_tokenizer
from pdserve.engine.gguf_weights import GgufTensor
from pdserve.modelgen.gguf_writer import llama_permute
from tests.engine.family_checks import GREEDY, expected, make_engine, prompts_for
from tests.engine.gguf_fixtures import dequantized_folder, gguf_file, source_folder


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("gguf")


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "phi3"])
def test_f32_gguf_equals_hf_on_the_folder(root, arch):
    file = gguf_file(root, arch, "f32")
    folder = source_folder(root, arch)
    got, want = ModelConfig.from_folder(file), ModelConfig.from_folder(folder)
    assert got.architecture == want.architecture and got.eos_token_ids == want.eos_token_ids
    assert got.fingerprint(torch.float32) == want.fingerprint(torch.float32) + "/gguf-F32"
    engine = make_engine(file)
    prompts = prompts_for(engine.model_config.vocab_size)
    assert engine.generate(prompts, GREEDY) == expected(folder, prompts)


@pytest.mark.parametrize("qtype", ["q8_0", "q4_0"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_quantized_gguf_equals_hf_on_dequantized_weights(root, arch, qtype):
    file = gguf_file(root, arch, qtype)
    engine = make_engine(file, activation_quantization="none")  # fp32 activations: bit for bit
    prompts = prompts_for(engine.model_config.vocab_size)
    got = engine.generate(prompts, GREEDY)
    want = expected(dequantized_folder(root, arch, qtype), prompts)
    differing = sum(a != b for g, w in zip(got, want) for a, b in zip(g, w))
    print(f"{arch} {qtype}: {differing} of {sum(map(len, want))} tokens differ over {len(prompts)} prompts")
    assert differing == 0 and got == want
    if qtype == "q4_0":  # the reference is not the unquantized model's output in disguise
        assert want != expected(source_folder(root, arch), prompts)
    assert ModelConfig.from_folder(file).fingerprint(torch.float32).endswith(f"/gguf-{qtype.upper()}+F32")


def test_llama_qk_permutation_round_trips():
    w = torch.arange(4 * 8 * 3, dtype=torch.float32).reshape(32, 3).numpy()  # 4 heads of 8 rows
    stored = llama_permute(w, 4)
    assert (stored[:2, 0] == w[[0, 4], 0]).all()  # rotate-half pair (0, 4) now adjacent
    back = GgufTensor(gguf.GGMLQuantizationType.F32, (32, 3), stored, permute_heads=4).dequantize()
    assert torch.equal(back, torch.from_numpy(w))


def _strings(tok, n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    pieces = [tok.convert_tokens_to_string([t]) for t in tok.get_vocab()]
    alphabet = "abcXYZ 019 .,!?\n\t  éüñ日本語한국어Ελληνικά🙂🚀→∑€½<|>\\'\""
    out = [rng.choice(pieces) for _ in range(n // 2)]
    for _ in range(n - len(out)):
        parts = [
            rng.choice(pieces) if rng.random() < 0.5 else "".join(rng.choices(alphabet, k=rng.randint(1, 6)))
            for _ in range(rng.randint(1, 12))
        ]
        out.append("".join(parts))
    return out + ["<|im_start|>user\nhi<|im_end|>", "", " ", "  x", "\n\n"]


def test_tokenizer_and_chat_template_equal_the_original(root):
    original = load_tokenizer(source_folder(root, "llama"))
    from_gguf = load_tokenizer(gguf_file(root, "llama", "q4_0"))
    strings = _strings(original, 3000)
    assert [from_gguf.encode(s) for s in strings] == [original.encode(s) for s in strings]
    ids = list(range(len(original)))
    assert from_gguf.decode(ids) == original.decode(ids)
    assert from_gguf.eos_token == original.eos_token and from_gguf.chat_template == original.chat_template
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi 🙂"}]
    kw = dict(add_generation_prompt=True, tokenize=False)
    assert from_gguf.apply_chat_template(messages, **kw) == original.apply_chat_template(messages, **kw)


def test_config_is_read_without_torch(root):
    file = gguf_file(root, "qwen3", "q8_0")
    code = (
        "import sys; from pdserve.engine.config import ModelConfig; "
        f"c = ModelConfig.from_folder({str(file)!r}); "
        "assert 'torch' not in sys.modules, 'torch imported'; print(c.fingerprint('float32'))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "Qwen3ForCausalLM/L2/H4/KV2/D32/V512/float32/gguf-Q8_0+F32"


def test_unsupported_architecture_is_refused(tmp_path):
    path = tmp_path / "gpt2.gguf"
    w = gguf.GGUFWriter(path, "gpt2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", torch.zeros(8, 4).numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'gpt2'"):
        ModelConfig.from_folder(path)


def test_make_model_cli_writes_gguf(tmp_path):
    from pdserve.modelgen.make_model import make_model_main

    assert make_model_main(["--out", str(tmp_path / "m"), "--arch", "qwen2", "--gguf", "q4_0"]) == 0
    cfg = ModelConfig.from_folder(tmp_path / "m" / "model-q4_0.gguf")
    assert cfg.architecture == "Qwen2ForCausalLM" and cfg.qkv_bias and cfg.tie_word_embeddings


@pytest.mark.parametrize("qtype", ["q8_0", "f32"])
def test_a_loaded_model_leaves_its_file_unmapped(root, qtype):
    """The weights are copied out of the file: once loaded, no map of it remains (its pages would
    stay in the worker's resident memory beside the copies: a Q8_0 1B file, 1.0 GB more)."""
    file = gguf_file(root, "llama", qtype)
    engine = make_engine(file)
    with open("/proc/self/maps") as maps:
        mapped = [line for line in maps if line.rstrip().endswith(str(file))]
    assert mapped == [] and engine.generate([[5, 6, 7]], GREEDY)
