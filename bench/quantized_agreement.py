"""How close int8 / int4 weights stay to the model: teacher-forced top-1 agreement with fp32.

    python -m pdserve.bench.quantized_agreement [--model DIR] [--sequences 8] [--length 256]

The fp32 model (transformers' own code, the reference the equality tests use) reads random token
sequences; a copy whose linears (q, k, v, o, gate, up, down and the LM head) hold the values of
`--quantization int8|int4` (engine/quantize.py: the group-wise weights the kernels read,
dequantized) reads the same ones. At every position both pick their top token: agreement is the
share of positions where they pick the same one. Also printed: the mean KL divergence of the
quantized next-token distribution from fp32's, and the share of positions whose fp32 top-1 margin
(logit gap to the runner-up) is small, since random-initialised weights (all this project can
make) spread their logits thinner than trained ones and a small margin is easy to flip.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from pdserve.engine.quantize import SCHEMES, quantize
from pdserve.kernels.quant_gemm import dequantize


def _quantized_copy(model: torch.nn.Module, scheme: str, noise_only: bool = False) -> torch.nn.Module:
    """The model with its linears' weights as `scheme` stores them; with `noise_only`, the fp32
    weights plus Gaussian noise of the same RMS as that scheme's rounding error (the control: a
    model this sensitive to any error of that size flips as many tokens, kernels or not)."""
    import copy

    q = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, module in q.named_modules():
            if isinstance(module, torch.nn.Linear) and (name.endswith("_proj") or name == "lm_head"):
                w = module.weight
                stored = dequantize(quantize(w, scheme))
                if noise_only:
                    rms = (stored - w).pow(2).mean().sqrt()
                    stored = w + torch.randn(w.shape, generator=g) * rms
                module.weight = torch.nn.Parameter(stored, requires_grad=False)
    return q


@torch.inference_mode()
def measure(model_dir: str, sequences: int, length: int, seed: int = 0) -> dict[str, dict[str, float]]:
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    vocab = ref.config.vocab_size
    tokens = torch.randint(3, vocab, (sequences, length), generator=torch.Generator().manual_seed(seed))
    base = ref(tokens).logits.float()  # [S, T, V]
    top2 = base.topk(2, dim=-1).values  # [S, T, 2]
    margin = top2[..., 0] - top2[..., 1]
    out = {}
    for scheme in SCHEMES:
        for label, noise_only in ((scheme, False), (f"{scheme}-sized noise", True)):
            logits = _quantized_copy(ref, scheme, noise_only)(tokens).logits.float()  # [S, T, V]
            agree = (logits.argmax(-1) == base.argmax(-1)).float().mean().item()
            kl = F.kl_div(logits.log_softmax(-1), base.log_softmax(-1), log_target=True, reduction="none").sum(-1)
            out[label] = {"agreement": agree, "mean_kl": kl.mean().item()}
    out["fp32"] = {
        "median_margin": margin.median().item(),
        "small_margin_share": (margin < 0.05).float().mean().item(),
        "logit_std": base.std().item(),
    }
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model folder (default: the embedded ~30M model)")
    ap.add_argument("--sequences", type=int, default=8)
    ap.add_argument("--length", type=int, default=256)
    args = ap.parse_args(argv)
    from pdserve.cli.engine_args import resolve_model

    model = resolve_model(args.model)
    res = measure(model, args.sequences, args.length)
    f = res["fp32"]
    print(f"{model}: {args.sequences} x {args.length} positions, teacher-forced")
    print(
        f"fp32 top-1 margin: median {f['median_margin']:.4f}, {f['small_margin_share'] * 100:.1f}% of positions"
        f" under 0.05 (logit std {f['logit_std']:.3f})"
    )
    for label, r in res.items():
        if label != "fp32":
            print(f"{label:<20} top-1 agreement {r['agreement'] * 100:6.2f}%, mean KL {r['mean_kl']:.2e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
