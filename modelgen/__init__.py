"""Writers of random-initialised models, offline: HF folders of any preset (tiny to the Llama-3.1-8B
shape, and every family the engine serves), their tokenizers, EAGLE heads, and GGUF files (K-quant
blocks included). `pdserve make-model` and the default model of `pdserve serve` use them, as do the
tests and benchmarks; the serving runtime never does."""
