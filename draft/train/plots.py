"""The loss-curve figure of a training run (``OUT/loss_curve.png``), drawn from its ``metrics.jsonl``.

Invariant: reads the metrics file only and overwrites ``png``; matplotlib runs headless (Agg).
"""
from __future__ import annotations

from pathlib import Path

from draft.train.records import read_jsonl


def save_loss_plot(metrics_path: Path, png: Path) -> None:
    """Losses (log scale) and held-out agreement against the step, from the ``train`` / ``val`` rows of
    ``metrics_path``, written to ``png`` (an absent metrics file gives empty axes)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = read_jsonl(metrics_path) if metrics_path.is_file() else []
    tr = [r for r in rows if r.get("kind") == "train"]
    va = [r for r in rows if r.get("kind") == "val"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    if tr:
        s = [r["step"] for r in tr]
        for key in ("loss", "vloss", "ploss"):
            axes[0].plot(s, [r[key] for r in tr], label=f"train {key}", lw=1)
    if va:
        s = [r["step"] for r in va]
        axes[0].plot(s, [r["vloss"] for r in va], "o--", label="val vloss", ms=3)
        axes[0].plot(s, [r["ploss"] for r in va], "o--", label="val ploss", ms=3)
        for key in ("top1", "top5", "top1_step2"):
            if va[0].get(key) is not None:
                axes[1].plot(s, [r[key] for r in va], "o-", label=f"val {key}", ms=3)
    axes[0].set_yscale("log")
    axes[0].set_xlabel("step")
    axes[0].set_title("losses")
    axes[0].legend(fontsize=7)
    axes[1].set_xlabel("step")
    axes[1].set_title("held-out agreement with the target")
    axes[1].set_ylim(0, 1)
    axes[1].grid(alpha=0.3)
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
