"""The report's one drawn figure: training curves from train_log.json (the evaluation plots are evaluate's PNGs)."""

from __future__ import annotations

import io

CURVES = (  # (panel title, [(train_log key, legend)])
    ("loss", [("loss", "train"), ("val_loss", "validation")]),
    ("validation AUC / accuracy", [("val_auc", "val AUC (macro)"), ("val_accuracy", "val accuracy")]),
    ("learning rate", [("lr", "learning rate")]),
)


def training_curves(epochs: list[dict]) -> bytes:
    """A 4-panel PNG: losses, validation AUC and accuracy, learning rate, images/s (total and slowest rank)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    steps = [e["epoch"] for e in epochs]
    figure, axes = plt.subplots(1, 4, figsize=(13, 2.8))
    for axis, (title, keys) in zip(axes, CURVES):
        for key, legend in keys:
            values = [e.get(key) for e in epochs]
            if any(v is not None for v in values):
                axis.plot(steps, [float("nan") if v is None else v for v in values], "o-", ms=3, label=legend)
        axis.set(title=title, xlabel="epoch")
        axis.legend(fontsize=7)
    rates = [e.get("images_per_s_per_rank") or [0] for e in epochs]
    axes[3].plot(steps, [sum(r) for r in rates], "o-", ms=3, label="all ranks")
    axes[3].plot(steps, [min(r) for r in rates], "o-", ms=3, label="slowest rank")
    axes[3].set(title="training images/s", xlabel="epoch")
    axes[3].legend(fontsize=7)
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=72)
    plt.close(figure)
    return buffer.getvalue()
