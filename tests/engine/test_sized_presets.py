"""The presets of the sizes CPU users run (modelgen/make_model.py: Llama-3.2-1B / -3B and
Llama-3.1-8B shapes) keep their real vocabulary: the embedding and LM head get every row the
shape has, past the synthetic tokenizer's tokens (as real checkpoints pad theirs), and a padded
model serves exactly as HF runs it. Checked on a tiny model with the same padding."""

from __future__ import annotations

import json

from pdserve.modelgen.make_model import PRESETS, make_model
from tests.conftest import hf_greedy, random_prompts
from tests.engine.test_engine_vs_hf import GREEDY, MAX_NEW, make_engine


def test_the_sized_presets_pad_to_their_shapes_vocabulary():
    for name in ("llama3.2-1b", "llama3.2-3b", "llama3.1-8b"):
        assert PRESETS[name].pad_vocab and PRESETS[name].vocab_size == 128256
    assert not PRESETS["tiny"].pad_vocab and not PRESETS["real"].pad_vocab


def test_a_padded_vocabulary_serves_as_hf_runs_it(tmp_path):
    folder = make_model(tmp_path / "padded", preset="tiny", seed=3, quiet=True, vocab_size=20000, pad_vocab=True)
    config = json.loads((folder / "config.json").read_text())
    tokens = len(json.loads((folder / "tokenizer.json").read_text())["model"]["vocab"])
    assert config["vocab_size"] == 20000 > tokens  # rows no token names, as in real checkpoints
    engine = make_engine(folder)
    prompts = random_prompts(tokens, [5, 23], seed=1)
    assert engine.generate(prompts, GREEDY) == [hf_greedy(str(folder), tuple(p), MAX_NEW) for p in prompts]
