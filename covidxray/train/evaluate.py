"""`covidxray evaluate`: the trained model on the test split, with operating thresholds chosen on validation.

The test split is touched once, here, and never for a decision: each class's
one-vs-rest threshold is picked on the validation split (Youden's J) and only
then applied to test. Images go through the same decode path as training
(`make_dataset`, preprocessing inside the model), so evaluation measures the
model that `predict` will run.

Two checks against a model that only looks good: calibration (does a 0.9
probability come true 9 times in 10? ECE and a reliability diagram), and the
same metrics per source, since in a merged set a model can learn which
collection an image came from instead of the disease (see docs/datasets.md).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

import numpy as np

from covidxray.config import Config
from covidxray.errors import UserError
from covidxray.export.keras_file import load_keras_model
from covidxray.files import atomic_open, atomic_path
from covidxray.manifest import PreparedData, check_model_matches, open_prepared, require_intact_shards
from covidxray.reports import Calibration, EvaluationReport, SourceMetrics, evaluation_report, write_evaluation_report
from covidxray.run_folder import (
    EVALUATION,
    MODEL_FILE,
    TEST_PREDICTIONS,
    ModelCard,
    external_copies_name,
    read_model_card,
)
from covidxray.train import external
from covidxray.train.by_source import UNSEEN, per_source_report, split_sources
from covidxray.train.metrics import (
    binary_rates,
    classwise_expected_calibration_error,
    confusion_matrix,
    expected_calibration_error,
    macro_auc,
    reliability_bins,
    roc_auc,
    roc_curve,
    youden_threshold,
)

ROC_PLOT = "roc.png"
CONFUSION_PLOT = "confusion.png"
RELIABILITY_PLOT = "reliability.png"
CALIBRATION_BINS = 15
BATCH = 64


def predict_split(
    model, data: PreparedData, split: str, image_size: int, num_classes: int
) -> tuple[np.ndarray, np.ndarray]:
    from covidxray.train.input import InputSpec, make_dataset, predict_batches

    paths = data.shards(split)
    if not paths:
        return np.zeros((0, num_classes), np.float32), np.zeros(0, np.int64)
    return predict_batches(model, make_dataset(paths, InputSpec(image_size, num_classes, BATCH))[0], num_classes)


def choose_thresholds(labels: np.ndarray, probabilities: np.ndarray) -> list[float | None]:
    """Per class, the one-vs-rest threshold maximising Youden's J (None if the split lacks that class or its complement)."""
    return [youden_threshold(labels == c, probabilities[:, c]) for c in range(probabilities.shape[1])]


def classification_report(
    labels: np.ndarray, probabilities: np.ndarray, class_names: list[str], thresholds: list[float | None]
) -> dict:
    """Accuracy, confusion matrix and per-class metrics, both for the argmax call and at each class's threshold."""
    predicted = probabilities.argmax(1)
    per_class = {}
    for c, name in enumerate(class_names):
        is_class = labels == c
        threshold = thresholds[c]
        per_class[name] = {
            "support": int(is_class.sum()),
            "roc_auc": roc_auc(is_class, probabilities[:, c]),
            "argmax": binary_rates(is_class, predicted == c),
            "operating_point": None
            if threshold is None
            else {"threshold": threshold, **binary_rates(is_class, probabilities[:, c] >= threshold)},
        }
    return {
        "images": int(labels.size),
        "accuracy": float((predicted == labels).mean()) if labels.size else None,
        "macro_roc_auc": macro_auc(labels, probabilities),
        "labels": list(class_names),
        "confusion_matrix": confusion_matrix(labels, predicted, len(class_names)).tolist(),
        "per_class": per_class,
    }


def calibration_report(labels: np.ndarray, probabilities: np.ndarray, bins: int = CALIBRATION_BINS) -> dict:
    return {
        "ece": expected_calibration_error(labels, probabilities, bins),
        "classwise_ece": classwise_expected_calibration_error(labels, probabilities, bins),
        "bins": bins,
        "binning": f"{bins} equal-width bins over (0, 1] of the top-class probability; ECE = sum over bins of "
        "(share of images) x |accuracy - mean top-class probability|. classwise_ece: the same on every "
        "class's probability against that class's frequency, averaged over classes",
        "reliability": reliability_bins(labels, probabilities, bins),
    }


def save_test_predictions(path: Path, labels: np.ndarray, probabilities: np.ndarray) -> None:
    """Every test image's true class and probabilities, in shard order (`covidxray report` picks its examples here)."""
    with atomic_open(path, "wb") as handle:
        np.savez_compressed(handle, labels=labels.astype(np.int64), probabilities=probabilities.astype(np.float32))


def _save_figure(figure, path: Path) -> None:
    with atomic_path(path) as tmp:
        figure.savefig(tmp, format="png", dpi=120, bbox_inches="tight")


def plot_roc(path: Path, labels: np.ndarray, probabilities: np.ndarray, report: EvaluationReport) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    figure, axes = plt.subplots(figsize=(5.5, 5))
    for c, name in enumerate(report.labels):
        entry = report.per_class[name]
        if entry.roc_auc is None:
            continue
        fpr, tpr, _ = roc_curve(labels == c, probabilities[:, c])
        (line,) = axes.plot(fpr, tpr, label=f"{name} (AUC {entry.roc_auc:.3f})")
        point = entry.operating_point
        if point and point.sensitivity is not None and point.specificity is not None:
            axes.plot(1 - point.specificity, point.sensitivity, "o", color=line.get_color())
    axes.plot([0, 1], [0, 1], ":", color="gray")
    axes.set(
        xlabel="1 - specificity",
        ylabel="sensitivity",
        title="Test ROC, one vs rest (dots: val-chosen thresholds)",
        xlim=(0, 1),
        ylim=(0, 1.02),
    )
    axes.legend(loc="lower right")
    _save_figure(figure, path)
    plt.close(figure)


def plot_confusion(path: Path, report: EvaluationReport) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    matrix = np.array(report.confusion_matrix)
    names = report.labels
    figure, axes = plt.subplots(figsize=(1.4 * len(names) + 2, 1.4 * len(names) + 1.5))
    axes.imshow(matrix, cmap="Blues")
    for (row, col), count in np.ndenumerate(matrix):
        axes.text(
            col, row, str(count), ha="center", va="center", color="white" if count > matrix.max() / 2 else "black"
        )
    axes.set(
        xticks=range(len(names)),
        yticks=range(len(names)),
        xticklabels=names,
        yticklabels=names,
        xlabel="predicted",
        ylabel="true",
        title=f"Test confusion matrix (accuracy {report.accuracy:.3f})",
    )
    _save_figure(figure, path)
    plt.close(figure)


def plot_reliability(path: Path, calibration: Calibration) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    table = [b for b in calibration.reliability if b.count]
    width = 1 / calibration.bins
    figure, (top, bottom) = plt.subplots(2, 1, figsize=(5.5, 6.5), sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    top.bar(
        [b.low for b in table],
        [b.accuracy for b in table],
        width=width,
        align="edge",
        edgecolor="black",
        label="accuracy in bin",
    )
    top.plot(
        [b.confidence for b in table],
        [b.accuracy for b in table],
        "o",
        color="tab:red",
        label="(mean confidence, accuracy)",
    )
    top.plot([0, 1], [0, 1], ":", color="gray", label="perfect calibration")
    top.set(
        ylabel="accuracy",
        ylim=(0, 1.02),
        title=f"Test reliability (ECE {calibration.ece:.3f}, {calibration.bins} bins)",
    )
    top.legend(loc="upper left")
    bottom.bar([b.low for b in table], [b.count for b in table], width=width, align="edge", color="gray")
    bottom.set(xlabel="top-class probability", ylabel="images", xlim=(0, 1))
    _save_figure(figure, path)
    plt.close(figure)


def evaluate(
    config: Config,
    say: Callable[[str], None] = print,
    externals: list[str] | tuple[str, ...] = (),
    progress: Callable[..., None] | None = None,
) -> EvaluationReport:
    """The test split's report; with `externals` also each external data set's (covidxray/train/external.py)."""
    run_dir, data_dir = Path(config.train.run_dir), Path(config.data.data_dir)
    model_path = run_dir / MODEL_FILE
    card = read_model_card(run_dir)
    data, same_data, external_sets = checked_data(card, run_dir, data_dir, externals)
    model = load_keras_model(model_path)
    names, size = card.labels, card.image_size
    val_probs, val_labels = predict_split(model, data, "val", size, len(names))
    test_probs, test_labels = predict_split(model, data, "test", size, len(names))
    # Thresholds from val only: the test split is measured, never used for a decision.
    thresholds = choose_thresholds(val_labels, val_probs)
    judge = partial(classification_report, class_names=names, thresholds=thresholds)
    content = {
        **judge(test_labels, test_probs),
        "calibration": calibration_report(test_labels, test_probs),
        "per_source": per_source_on_test(data, test_labels, test_probs, judge),
        "split": "test",
        "thresholds": thresholds_entry(names, thresholds, val_labels),
        "model": model_entry(model_path, card),
        "data_dir": str(data_dir),
        "data_is_training_data": same_data,
    }
    content["external"] = [
        external.external_report(
            model, card, data, external_set, config.data, judge, run_dir / external_copies_name(index), progress, say
        )
        for index, external_set in enumerate(external_sets)
    ]
    report = evaluation_report(content)
    write_evaluation(run_dir, report, test_labels, test_probs)
    for line in summary_lines(report, run_dir):
        say(line)
    return report


def checked_data(
    card: ModelCard, run_dir: Path, data_dir: Path, externals: list[str] | tuple[str, ...]
) -> tuple[PreparedData, bool, list[PreparedData]]:
    """(the data set, whether it is the training data, the external sets) when this model can be evaluated on them,
    refused before any prediction if it cannot: another task or size, an empty test split, damaged shards, a bad
    external set. Each data set's manifest is read once, here."""
    data = open_prepared(data_dir)
    same_data = check_model_matches(card, data)
    if not data.manifest.splits["test"].records:
        raise UserError(f"{data_dir}: the test split is empty")
    require_intact_shards(data, ("val", "test"))
    return data, same_data, external.checked_externals(card, run_dir, data, same_data, externals)


def per_source_on_test(
    data: PreparedData,
    test_labels: np.ndarray,
    test_probs: np.ndarray,
    judge: Callable[[np.ndarray, np.ndarray], dict],
) -> dict:
    """The test metrics of each source's images (a class recognised only across sources may be the source)."""
    test_sources, source_labels = split_sources(data, "test")
    if not np.array_equal(source_labels, test_labels):
        raise AssertionError("the test records' sources are not in the order the predictions were made")
    return per_source_report(test_labels, test_probs, test_sources, data.manifest, judge)


def thresholds_entry(names: list[str], thresholds: list[float | None], val_labels: np.ndarray) -> dict:
    return {
        "chosen_on": "val",
        "rule": "Youden J (sensitivity + specificity - 1), one vs rest",
        "val_images": int(val_labels.size),
        "per_class": dict(zip(names, thresholds)),
    }


def model_entry(model_path: Path, card: ModelCard) -> dict:
    return {"file": str(model_path), "architecture": card.model, "best_epoch": card.best.get("epoch")}


def write_evaluation(run_dir: Path, report: EvaluationReport, test_labels: np.ndarray, test_probs: np.ndarray) -> None:
    """The report, the test predictions `covidxray report` picks examples from, and the three plots."""
    write_evaluation_report(run_dir, report)
    save_test_predictions(run_dir / TEST_PREDICTIONS, test_labels, test_probs)
    plot_roc(run_dir / ROC_PLOT, test_labels, test_probs, report)
    plot_confusion(run_dir / CONFUSION_PLOT, report)
    plot_reliability(run_dir / RELIABILITY_PLOT, report.calibration)


def summary_lines(report: EvaluationReport, run_dir: Path) -> Iterator[str]:
    """What evaluate says when done: the test figures, per class, calibration, per source, external sets, files."""
    yield f"test: {report.images} images, accuracy {_fmt(report.accuracy)}, macro ROC AUC {_fmt(report.macro_roc_auc)}"
    for name, metrics in report.per_class.items():
        point = metrics.operating_point
        threshold, sensitivity, specificity, ppv = (
            (point.threshold, point.sensitivity, point.specificity, point.ppv) if point else (None, None, None, None)
        )
        yield (
            f"  {name:12s} AUC {_fmt(metrics.roc_auc)}  at val threshold {_fmt(threshold)}: "
            f"sensitivity {_fmt(sensitivity)} specificity {_fmt(specificity)} PPV {_fmt(ppv)}"
        )
    calibration = report.calibration
    yield f"  calibration: ECE {calibration.ece:.3f} (top class, {calibration.bins} equal-width bins), classwise ECE {calibration.classwise_ece:.3f}"
    yield "per source (a class recognised only across sources may be the source, not the disease):"
    for source, entry in report.per_source.items():
        yield describe_source(source, entry)
    for external_entry in report.external:
        yield from external.describe(external_entry, describe_source)
    yield f"wrote {EVALUATION}, {TEST_PREDICTIONS}, {ROC_PLOT}, {CONFUSION_PLOT}, {RELIABILITY_PLOT} to {run_dir}"


def describe_source(source: str, entry: SourceMetrics) -> str:
    tag = f" ({UNSEEN}: not in train, a generalisation figure)" if entry.unseen else ""
    counts = ", ".join(f"{name} {n}" for name, n in entry.classes.items() if n)
    rates = "; ".join(
        f"{name} {_fmt(e.argmax.sensitivity)}/{_fmt(e.argmax.specificity)}" for name, e in entry.per_class.items()
    )
    return (
        f"  {source}{tag}: {entry.images} images ({counts}), accuracy {_fmt(entry.accuracy)}, "
        f"macro AUC {_fmt(entry.macro_roc_auc)}, ECE {entry.ece:.3f}; argmax sensitivity/specificity {rates}"
    )


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"
