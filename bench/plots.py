"""SLO plots from rate sweeps: one line per server (label)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _series(rows: list[dict], key: str) -> dict[str, tuple[list[float], list[float]]]:
    out: dict[str, tuple[list[float], list[float]]] = {}
    for r in sorted(rows, key=lambda r: r["request_rate"]):
        if key in r:
            xs, ys = out.setdefault(r.get("label") or "server", ([], []))
            xs.append(r["request_rate"])
            ys.append(r[key])
    return out


def plot_sweep(rows: list[dict], out_dir: str | Path, slo_text: str = "") -> list[Path]:
    """rows: result dicts with `label`, `request_rate` and vLLM-style keys. Returns PNG paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    figures = [
        ("slo_attainment.png", "SLO attainment " + slo_text, [("goodput_attainment", "{}")], "fraction of requests"),
        ("goodput.png", "Goodput " + slo_text, [("request_goodput", "{}")], "requests/s meeting SLOs"),
        ("ttft.png", "Time to first token", [("median_ttft_ms", "{} p50"), ("p99_ttft_ms", "{} p99")], "ms"),
        ("tpot.png", "Time per output token", [("median_tpot_ms", "{} p50"), ("p99_tpot_ms", "{} p99")], "ms"),
    ]
    paths = []
    for name, title, keys, ylabel in figures:
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for key, fmt in keys:
            for label, (xs, ys) in _series(rows, key).items():
                ax.plot(xs, ys, marker="o", linestyle="-" if "p99" not in fmt else "--", label=fmt.format(label))
        if name == "slo_attainment.png":
            ax.axhline(0.9, color="grey", linewidth=0.8, linestyle=":")
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
        fig.tight_layout()
        path = out_dir / name
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths
