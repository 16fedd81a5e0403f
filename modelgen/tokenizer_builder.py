"""Build a real byte-level BPE `tokenizer.json` (GPT-2 style) offline and deterministically.

The training text is generated, not downloaded: English glue words plus a seeded synthetic
lexicon with Zipf-like frequencies, so BPE finds enough merges for any vocabulary size we ask
for. Same inputs -> byte-identical files.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

EOS = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [EOS, IM_START, IM_END]

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_GLUE = (
    "the of and to a in is that it for on with as was be by this are or from at an not "
    "but have which one all were they we can you your there their more if will would about "
    "when what some time into only other than then its also after these two first may new "
    "server model token prompt decode prefill cache block request stream batch layer "
    "attention memory latency throughput kernel tensor weight sample queue worker"
).split()
_PUNCT = [".", ",", "!", "?", ";", ":", " -", "\n"]
_UNICODE = [
    "café",
    "naïve",
    "über",
    "señor",
    "日本語",
    "中文",
    "한국어",
    "Ελληνικά",
    "русский",
    "🙂",
    "🚀",
    "✨",
    "→",
    "∑",
    "€",
    "½",
]


def synthetic_corpus(seed: int = 0, num_words: int = 120_000) -> list[str]:
    rng = random.Random(seed)
    onsets = [
        "",
        "b",
        "c",
        "d",
        "f",
        "g",
        "h",
        "k",
        "l",
        "m",
        "n",
        "p",
        "r",
        "s",
        "t",
        "v",
        "w",
        "st",
        "tr",
        "pl",
        "ch",
        "sh",
        "th",
        "br",
        "gr",
        "qu",
    ]
    vowels = ["a", "e", "i", "o", "u", "ai", "ea", "ou", "io", "y"]
    codas = ["", "n", "r", "s", "t", "l", "m", "nd", "st", "ng", "ck", "rt"]
    lexicon = sorted(
        {
            "".join(rng.choice(onsets) + rng.choice(vowels) + rng.choice(codas) for _ in range(rng.randint(1, 3)))
            for _ in range(6000)
        }
    )
    words = _GLUE + lexicon
    weights = [1.0 / (rank + 1) ** 0.9 for rank in range(len(words))]
    lines, line = [], []
    for w in rng.choices(words, weights=weights, k=num_words):
        r = rng.random()
        if r < 0.05:
            w = w.capitalize()
        elif r < 0.07:
            w = str(rng.randint(0, 2048))
        elif r < 0.075:
            w = rng.choice(_UNICODE)
        line.append(w)
        if rng.random() < 0.08:
            line[-1] += rng.choice(_PUNCT[:-1])
        if len(line) >= 16:
            lines.append(" ".join(line))
            line = []
    return lines


def build_tokenizer(out_dir: Path, vocab_size: int, seed: int = 0) -> int:
    """Write tokenizer.json, tokenizer_config.json, special_tokens_map.json; return the vocab size."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tok.train_from_iterator(synthetic_corpus(seed), trainer=trainer)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 1 << 30,
        "bos_token": None,
        "eos_token": EOS,
        "pad_token": EOS,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
        "added_tokens_decoder": {
            str(tok.token_to_id(t)): {
                "content": t,
                "special": True,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "single_word": False,
            }
            for t in SPECIAL_TOKENS
        },
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    (out_dir / "special_tokens_map.json").write_text(
        json.dumps(
            {"eos_token": EOS, "pad_token": EOS, "additional_special_tokens": [IM_START, IM_END]},
            indent=2,
            sort_keys=True,
        )
    )
    return tok.get_vocab_size()
