"""`--model` resolved: as given, or the embedded default model (written on first use by
modelgen/make_model.py, imported only then: it needs torch, the gateway does not)."""

from __future__ import annotations


def resolve_model(model: str | None) -> str:
    """`--model` as given, or the embedded default model's folder (made on first use)."""
    if model:
        return model
    from pdserve.modelgen.make_model import default_model_path

    return str(default_model_path())
