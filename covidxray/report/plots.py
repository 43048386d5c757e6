"""The report's one drawn figure, training curves from train_log.json, as inline SVG (the evaluation plots are
evaluate's PNGs). SVG, not matplotlib: no import of a plotting stack, crisp in print, a few kB."""

from __future__ import annotations

from covidxray.report.html import esc

WIDTH, HEIGHT, LEFT, BOTTOM, TOP = 250, 175, 46, 24, 34
COLOURS = ("#1f77b4", "#ff7f0e")

PANELS = (  # (title, [(train_log key, legend)])
    ("loss", [("loss", "train"), ("val_loss", "validation")]),
    ("validation AUC / accuracy", [("val_auc", "AUC (macro)"), ("val_accuracy", "accuracy")]),
    ("learning rate", [("lr", "learning rate")]),
    ("training images/s", [("total", "all ranks"), ("slowest", "slowest rank")]),
)


def _segments(points: list[tuple[float, float | None]]) -> list[list[tuple[float, float]]]:
    """Runs of defined points: an undefined value (None) breaks the line."""
    runs: list[list[tuple[float, float]]] = [[]]
    for x, y in points:
        if y is None:
            runs.append([])
        else:
            runs[-1].append((x, y))
    return [run for run in runs if run]


def chart(title: str, steps: list[int], series: list[tuple[str, list[float | None]]]) -> str:
    """One small line chart: x = epoch, each series a polyline with dots, y axis labelled at its ends."""
    values = [v for _, ys in series for v in ys if v is not None]
    low, high = (min(values), max(values)) if values else (0.0, 1.0)
    if high == low:
        low, high = low - 0.5 * (abs(low) or 1), high + 0.5 * (abs(high) or 1)
    first, last = steps[0], steps[-1] if steps[-1] != steps[0] else steps[0] + 1
    plot_w, plot_h = WIDTH - LEFT - 8, HEIGHT - TOP - BOTTOM

    def at(x: float, y: float) -> tuple[float, float]:
        return LEFT + (x - first) / (last - first) * plot_w, TOP + (high - y) / (high - low) * plot_h

    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" role="img" aria-label="{esc(title)}">',
        f'<text x="{WIDTH / 2}" y="12" text-anchor="middle" font-size="12">{esc(title)}</text>',
        f'<rect x="{LEFT}" y="{TOP}" width="{plot_w}" height="{plot_h}" fill="none" stroke="#999"/>',
        f'<text x="{LEFT - 3}" y="{TOP + 4}" text-anchor="end" font-size="9">{high:.3g}</text>',
        f'<text x="{LEFT - 3}" y="{TOP + plot_h}" text-anchor="end" font-size="9">{low:.3g}</text>',
        f'<text x="{LEFT}" y="{HEIGHT - 10}" font-size="9">epoch {first}</text>',
        f'<text x="{LEFT + plot_w}" y="{HEIGHT - 10}" text-anchor="end" font-size="9">{steps[-1]}</text>',
    ]
    for number, (legend, ys) in enumerate(series):
        colour = COLOURS[number % len(COLOURS)]
        parts.append(
            f'<text x="{LEFT + 4 + 100 * number}" y="27" font-size="9" fill="{colour}">&#9632; {esc(legend)}</text>'
        )
        for run in _segments(list(zip(steps, ys))):
            points = [at(x, y) for x, y in run]
            line = " ".join(f"{px:.1f},{py:.1f}" for px, py in points)
            parts.append(f'<polyline fill="none" stroke="{colour}" stroke-width="1.5" points="{line}"/>')
            parts += [f'<circle cx="{px:.1f}" cy="{py:.1f}" r="2" fill="{colour}"/>' for px, py in points]
    parts.append("</svg>")
    return "".join(parts)


def training_curves(epochs: list[dict]) -> str:
    """Four charts side by side: losses, validation AUC and accuracy, learning rate, images/s (all ranks, slowest)."""
    steps = [e["epoch"] for e in epochs]
    rates = [e.get("images_per_s_per_rank") or [] for e in epochs]
    derived = {"total": [sum(r) if r else None for r in rates], "slowest": [min(r) if r else None for r in rates]}
    charts = []
    for title, keys in PANELS:
        series = [(legend, derived[key] if key in derived else [e.get(key) for e in epochs]) for key, legend in keys]
        charts.append(chart(title, steps, series))
    return f'<div class="curves">{"".join(charts)}</div>'
