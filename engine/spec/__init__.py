"""Speculative decoding in the decode pool (n-gram / prompt lookup, a draft model, an EAGLE head).

config.py     `--speculative-config` JSON -> SpeculativeConfig (torch-free)
ngram.py      proposals: the tokens that followed the latest earlier match of the sequence's tail
adaptive.py   per-sequence draft length from its acceptance history (on only where it pays)
speculator.py proposes for a step's decode-ready sequences; counts drafts and acceptances
verify.py     how many drafts a verification step's target tokens accept
draft_model.py proposals by a small draft model beside the target, with its own paged KV pool
draft_fit.py  whether a draft model shares the target's tokens (vocabulary size, EOS)
eagle_head.py an EAGLE-1 head (vLLM's checkpoint layout) and its strict loader
eagle.py      proposals by an EAGLE head from the target's hidden states, with its own paged KV
"""
