"""Model quality on real chest X-rays: prepare (if needed), train and evaluate a named recipe, with 95% bootstrap CIs.

Recipes (folders under --data-root, default ../shared/data):
  kaggle-pneumonia  chest-xray-pneumonia-224 (Kermany et al. 2018, pediatric, Guangzhou), task `pneumonia`,
                    `data.split: source`: tested on the official test folder (234 normal / 390 pneumonia);
                    goals: accuracy >= 0.928 and macro AUC >= 0.968 (Kermany et al.'s ImageNet-pretrained
                    Inception v3 on that folder), sensitivity and specificity of each class >= 0.90.
  chest3-merge      covid-chestxray-sample + chest-xray-pneumonia-224 + covid19-talo-sample, task `chest3`,
                    split by patient; goal: no class's sensitivity below 0.80.

Steps, each the command a user types: `covidxray prepare` (reuses its decode cache and finished shards),
`covidxray train` (wall time and peak RSS of that process, measured by a launcher), `covidxray evaluate`;
then the bench predicts the test split with the saved model itself to get per-image probabilities for:
accuracy, macro one-vs-rest ROC AUC, per-class sensitivity/specificity of the argmax call, each with a 95%
percentile bootstrap interval (test images resampled with replacement), and the expected calibration
error (top-label, equal-width confidence bins). `--set section.key=value` passes overrides to prepare and
train (e.g. for an ablation); `--tag` names the run folder so variants do not overwrite each other.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import _bench
import numpy as np

RECIPES = {
    "kaggle-pneumonia": {
        "sources": {"chest-xray-pneumonia": "chest-xray-pneumonia-224"},
        "task": "pneumonia",
        "sets": ["data.split=source"],
        "goals": {"accuracy": 0.928, "macro_auc": 0.968, "sensitivity": 0.90, "specificity": 0.90},
    },
    "chest3-merge": {
        "sources": {
            "covid-chestxray": "covid-chestxray-sample",
            "chest-xray-pneumonia": "chest-xray-pneumonia-224",
            "covid19-talo": "covid19-talo-sample",
        },
        "task": "chest3",
        "sets": [],
        "goals": {"sensitivity": 0.80},
    },
}
BOOTSTRAP_ROUNDS = 2000


def measured_run(cmd: list[str]) -> dict:
    """Run `cmd`: its wall seconds and peak RSS (of that process tree's largest process)."""
    result, code, peak_rss_mib, seconds = _bench.measured_run(cmd, {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
    if result.returncode != 0 or code != 0:
        sys.exit(f"command failed ({code}): {' '.join(cmd)}\n{result.stderr[-4000:]}")
    return {"seconds": seconds, "peak_rss_mib": peak_rss_mib, "stderr": result.stderr}


def point_metrics(labels: np.ndarray, probabilities: np.ndarray, class_names: list[str]) -> dict:
    from covidxray.train.metrics import binary_rates, macro_auc

    predicted = probabilities.argmax(1)
    metrics = {"accuracy": float((predicted == labels).mean()), "macro_auc": macro_auc(labels, probabilities)}
    for c, name in enumerate(class_names):
        rates = binary_rates(labels == c, predicted == c)
        metrics[f"{name}_sensitivity"], metrics[f"{name}_specificity"] = rates["sensitivity"], rates["specificity"]
    return metrics


def bootstrap_intervals(
    labels: np.ndarray, probabilities: np.ndarray, class_names: list[str], rounds: int, seed: int = 0
) -> dict:
    """95% percentile intervals of every point metric over `rounds` resamples of the test images."""
    rng = np.random.default_rng(seed)
    draws: dict[str, list[float]] = {}
    for _ in range(rounds):
        pick = rng.integers(0, labels.size, labels.size)
        for key, value in point_metrics(labels[pick], probabilities[pick], class_names).items():
            if value is not None:
                draws.setdefault(key, []).append(value)
    return {
        key: [float(np.percentile(values, 2.5)), float(np.percentile(values, 97.5))] for key, values in draws.items()
    }


def test_predictions(run_dir: Path, data_dir: Path) -> tuple[np.ndarray, np.ndarray, list[str]]:
    import tensorflow as tf

    from covidxray.manifest import load_manifest
    from covidxray.train.evaluate import predict_split

    manifest = load_manifest(data_dir)
    model = tf.keras.models.load_model(run_dir / "model.keras", compile=False)
    probabilities, labels = predict_split(model, data_dir, "test", int(manifest["image_size"]), len(manifest["labels"]))
    return labels, probabilities, manifest["labels"]


def main() -> None:
    bench = _bench.Bench("quality", __doc__)
    bench.parser.add_argument("--recipe", choices=sorted(RECIPES), default="kaggle-pneumonia")
    bench.parser.add_argument(
        "--data-root",
        type=Path,
        default=_bench.REPO.parent / "shared" / "data",
        help="folder holding the recipe's source folders",
    )
    bench.parser.add_argument("--model", default="mobilenet_v3_small")
    bench.parser.add_argument("--image-size", type=int, default=224)
    bench.parser.add_argument("--epochs", type=int, default=10)
    bench.parser.add_argument(
        "--set", dest="sets", action="append", default=[], help="config override for prepare and train (repeatable)"
    )
    bench.parser.add_argument("--tag", default="", help="suffix of the run folder (ablation variants)")
    bench.parser.add_argument("--bootstrap", type=int, default=BOOTSTRAP_ROUNDS)
    args = bench.parse({"image_size": 64, "epochs": 1, "bootstrap": 50, "model": "small_cnn"})
    recipe = RECIPES[args.recipe]

    data_dir = args.workdir / f"{args.recipe}-{args.image_size}"
    run_dir = (
        args.workdir
        / "runs"
        / f"{args.recipe}-{args.model}-{args.image_size}-{args.epochs}ep{'-' + args.tag if args.tag else ''}"
    )
    sources = [
        arg for name, folder in recipe["sources"].items() for arg in ("--source", f"{name}={args.data_root / folder}")
    ]
    prepare_sets = [arg for s in recipe["sets"] + args.sets if s.startswith("data.") for arg in ("--set", s)]
    _bench.run(
        _bench.covidxray(
            "prepare",
            *sources,
            "--task",
            recipe["task"],
            "--image-size",
            str(args.image_size),
            "--data-dir",
            str(data_dir),
            *prepare_sets,
        ),
        timeout=7200,
    )
    train_sets = [arg for s in args.sets if s.startswith("train.") for arg in ("--set", s)]
    trained = measured_run(
        _bench.covidxray(
            "train",
            "--data-dir",
            str(data_dir),
            "--run-dir",
            str(run_dir),
            "--model",
            args.model,
            "--epochs",
            str(args.epochs),
            *train_sets,
        )
    )
    _bench.run(_bench.covidxray("evaluate", "--data-dir", str(data_dir), "--run-dir", str(run_dir)))

    labels, probabilities, class_names = test_predictions(run_dir, data_dir)
    point = point_metrics(labels, probabilities, class_names)
    evaluation = json.loads((run_dir / "evaluation.json").read_text())
    if abs(evaluation["accuracy"] - point["accuracy"]) > 1e-9:  # the same model on the same split: must agree
        sys.exit(
            f"covidxray evaluate and this bench disagree on the test accuracy: {evaluation['accuracy']} vs {point['accuracy']}"
        )
    intervals = bootstrap_intervals(labels, probabilities, class_names, args.bootstrap)
    train_log = json.loads((run_dir / "train_log.json").read_text())
    manifest = json.loads((data_dir / "manifest.json").read_text())
    results = {
        "recipe": args.recipe,
        "model": args.model,
        "image_size": args.image_size,
        "overrides": args.sets,
        "test_images": int(labels.size),
        "test_classes": {name: int((labels == c).sum()) for c, name in enumerate(class_names)},
        "splits": {split: info["classes"] for split, info in manifest["splits"].items()},
        "majority_baseline": float(np.bincount(labels, minlength=len(class_names)).max() / labels.size),
        "metrics": point,
        "ci95": intervals,
        "ece": evaluation["calibration"]["ece"],
        "epochs_run": len(train_log["epochs"]),
        "best_epoch": train_log["best"].get("epoch"),
        "best_val_auc": train_log["best"].get("val_auc"),
        "collapsed_epochs": train_log.get("collapsed_epochs", []),
        "train_seconds": trained["seconds"],
        "train_peak_rss_mib": trained["peak_rss_mib"],
        "images_per_s": [e["images_per_s_per_rank"][0] for e in train_log["epochs"]],
        "run_dir": str(run_dir),
    }

    def cell(key: str):
        value, ci = point.get(key), intervals.get(key)
        return "n/a" if value is None else f"{value:.3f} [{ci[0]:.3f}, {ci[1]:.3f}]" if ci else f"{value:.3f}"

    bench.table(
        f"{args.recipe}: {args.model} at {args.image_size} px, {args.epochs} epochs; test split, 95% bootstrap CI",
        ["metric", "value [95% CI]"],
        [
            ["accuracy", cell("accuracy")],
            ["macro AUC", cell("macro_auc")],
            *[[f"{name} sensitivity", cell(f"{name}_sensitivity")] for name in class_names],
            *[[f"{name} specificity", cell(f"{name}_specificity")] for name in class_names],
            ["ECE (15 bins)", f"{results['ece']:.3f}"],
            ["majority baseline", f"{results['majority_baseline']:.3f}"],
            ["epochs (best)", f"{results['epochs_run']} ({results['best_epoch']})"],
            ["train wall time", f"{trained['seconds'] / 60:.1f} min"],
            ["train peak RSS", f"{trained['peak_rss_mib']:.0f} MiB"],
        ],
    )
    goals = recipe["goals"]
    for key in ("accuracy", "macro_auc"):
        if key in goals:
            bench.at_least(f"test {key}", point[key] or 0.0, goals[key])
    for kind in ("sensitivity", "specificity"):
        if kind in goals:
            for name in class_names:
                if point.get(f"{name}_{kind}") is not None:
                    bench.at_least(f"{name} {kind}", point[f"{name}_{kind}"], goals[kind])
    bench.finish(args, results)


if __name__ == "__main__":
    main()
