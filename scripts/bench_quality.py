"""Model quality on real chest X-rays: prepare (if needed), train and evaluate a named recipe, with 95% bootstrap CIs.

Recipes (folders under --data-root, default ../shared/data):
  kaggle-pneumonia  chest-xray-pneumonia-224 (Kermany et al. 2018, pediatric, Guangzhou), task `pneumonia`,
                    `data.split: source`: tested on the official test folder (234 normal / 390 pneumonia);
                    goals: accuracy >= 0.928 and macro AUC >= 0.968 (Kermany et al.'s ImageNet-pretrained
                    Inception v3 on that folder), sensitivity and specificity of each class >= 0.90.
  kaggle-few-films  as kaggle-pneumonia with only the first 150 train films of each class (by name, as
                    tests/test_quality.py; --train-films N: the first N), batch 16: what a few hundred films buy;
                    no goal, a comparison of recipes, best with --seeds (on 300 films the seed moves a model about
                    as much as recipes differ).
  kaggle-nih-pneumonia  as kaggle-pneumonia, with the adult NIH films of covid19-talo-nih-half-512 (normal and
                    pneumonia) added to training and validation; the same official test folder and goals: whether
                    films of another population in training carry over to the test folder's.
  kaggle-train-folder  the first 300 films of each class of chest-xray-pneumonia-224's official train folder
                    alone, split by patient with half of them the test split, batch 16 (--train-films N: the first
                    N): the pretrained start against random weights on films of one population (the official test
                    folder's shift decides the other recipes); no goal, a comparison, best with --seeds.
  chest3-merge      covid-chestxray-sample + chest-xray-pneumonia-224 + covid19-talo-sample, task `chest3`,
                    split by patient; goal: no class's sensitivity below 0.80.
  chest3-full       the three sources of chest3-loso (Kaggle: every 3rd file, see --subsample) all in training,
                    task `chest3`, split by patient; goals: macro AUC >= 0.98, every class's sensitivity >= 0.85.
  chest3-loso       leave one source out (issue 24): covid-chestxray-aug2020-768 (all of ieee8023),
                    chest-xray-pneumonia-224 (every 3rd file in training folds, all of it when held out; see
                    --subsample) and covid19-talo-nih-half-512, task `chest3`. Per fold: the other two sources
                    are prepared (train/val/test by patient), the held-out one separately; the model trains on
                    the first and `covidxray evaluate --external` scores it on its test split (in-sample) and on
                    every held-out image that is no copy of a training image. Macro AUC of a held-out source
                    averages the classes it has both of and train had images of. Goals per fold: held-out
                    macro AUC >= 0.85, held-out normal specificity >= 0.80, and with --baseline (the JSON of
                    the recipe to beat) an in-sample macro AUC at most 0.01 below the baseline's.

Steps, each the command a user types: `covidxray prepare` (reuses its decode cache and finished shards),
`covidxray train` (wall time and peak RSS of that process, measured by a launcher), `covidxray evaluate`;
then the bench predicts the test split with the saved model itself to get per-image probabilities for:
accuracy, macro one-vs-rest ROC AUC, per-class sensitivity/specificity of the argmax call, each with a 95%
percentile bootstrap interval (test images resampled with replacement), and the expected calibration
error (top-label, equal-width confidence bins). `--set section.key=value` passes overrides to prepare and
train (e.g. for an ablation); `--tag` names the run folder so variants do not overwrite each other; `--seeds
0,1,2` trains once per seed and reports each seed's figures with their mean, min and max.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import _bench
import numpy as np

# What the figures depend on; a change to any makes this benchmark's docs/bench reports stale
# (scripts/stale_benchmarks.py): preparing the data, training, evaluating.
MEASURES = (
    "covidxray/config.py",  # the defaults every run takes what it is not told
    "covidxray/strict.py",  # how each setting is read and checked
    "covidxray/registry.py",  # which model, source, task or format a name means
    "covidxray/manifest.py",  # which shards of which split a run reads
    "covidxray/records.py",  # a record's fields and the label vocabulary
    "covidxray/data",
    "covidxray/sources",
    "covidxray/edge/preprocess.py",
    "covidxray/edge/radiograph_gate.py",  # prepare's decode keeps or refuses each image by it
    "covidxray/edge/image_header.py",  # prepare's decode reads the declared size and pixel limit from it
    "covidxray/edge/harmonise.py",
    "covidxray/train",
    "covidxray/export/source_profile.py",
)
# The part of MEASURES that reaches the figures only through what scripts/revalidate_prepared.py digests at two
# commits: the data folder `covidxray prepare` writes and, for leave-one-out recipes, the outcome of `evaluate
# --external`'s copy check. Train, evaluate (--external included) and this script after its prepares take from these
# modules only the names tests/test_prepared_via.py allows, directly or through another module. Left out, as the
# training side uses them otherwise: covidxray/data/__init__.py, labels.py (the task's classes), tfrecord.py
# (reading shards) and edge/harmonise.py (the config's choices).
PREPARED_VIA = (
    # run by prepare only
    "covidxray/data/prepare.py",
    "covidxray/data/split.py",
    "covidxray/data/audit.py",
    "covidxray/data/composition.py",
    # the source adapters: besides prepare only commands this benchmark does not run import them (`covidxray sources`,
    # `report`, `weights download`: train/weights.py's download_weights)
    "covidxray/sources",
    # (a) train takes only PREPROCESSING_VERSION from it (into the model card, which evaluate --external checks
    # against the held-out manifest), and prepare records the same constant in manifest.json ("preprocessing"), so a
    # change of it shows in the digests; (b) the copy check decodes through it on a decode cache miss
    "covidxray/edge/preprocess.py",
    # run by prepare's decode only (and by (b)'s on a cache miss): the gate's verdicts and features are decode cache
    # rows (image_header.py is not here: config.py takes its pixel limit as a default)
    "covidxray/edge/radiograph_gate.py",
    # (b) evaluate --external's copy check (covidxray/train/external.py find_copies: dedup.matches over the decode
    # caches, ImageCache and cache_path) on the fold's two prepared folders; its outcome is digested at both commits
    "covidxray/data/dedup.py",
    "covidxray/data/near_duplicates.py",
    "covidxray/data/image_cache.py",
    # run by prepare's decode (and by (b)'s on a cache miss): the decode worker pool, for image_cache.py
    "covidxray/data/decode_pool.py",
)

# The three real collections in full (ieee8023's whole Aug-2020 snapshot, all of Kaggle, the NIH half of talo)
FULL_COLLECTIONS = {
    "covid-chestxray": "covid-chestxray-aug2020-768",
    "chest-xray-pneumonia": "chest-xray-pneumonia-224",
    "covid19-talo": "covid19-talo-nih-half-512",
}
# Kermany et al.'s ImageNet-pretrained Inception v3 on the official Kaggle test folder, and 0.90 for every class
KAGGLE_TEST_GOALS = {"accuracy": 0.928, "macro_auc": 0.968, "sensitivity": 0.90, "specificity": 0.90}
RECIPES = {
    "kaggle-pneumonia": {
        "sources": {"chest-xray-pneumonia": "chest-xray-pneumonia-224"},
        "task": "pneumonia",
        "sets": ["data.split=source"],
        "goals": KAGGLE_TEST_GOALS,
    },
    "kaggle-nih-pneumonia": {
        "sources": {"chest-xray-pneumonia": "chest-xray-pneumonia-224", "covid19-talo": "covid19-talo-nih-half-512"},
        "task": "pneumonia",
        # the NIH films have no official test folder; test_fraction 0 sends all of them to train and val, so the test
        # split is the official Kaggle test folder alone, as in kaggle-pneumonia
        "sets": ["data.split=source", "data.test_fraction=0"],
        "goals": KAGGLE_TEST_GOALS,
    },
    # few films (issue 23's small-data question): the first 150 train films of each class by name, as
    # tests/test_quality.py takes, scored on the whole official test folder; batch 16 as there. No goal: a comparison
    # of recipes (--seeds: on 300 films the seed moves a model about as much as recipes differ)
    "kaggle-few-films": {
        "sources": {"chest-xray-pneumonia": "chest-xray-pneumonia-224"},
        "task": "pneumonia",
        "sets": ["data.split=source", "train.batch_size=16"],
        "train_films_per_class": 150,
        "goals": {},
    },
    # the ImageNet start against random weights where the test split is no other population (issue 23's test,
    # tests/test_quality.py): the first 300 films of each class of the official train folder alone, split by
    # patient, half of them the test split; batch 16. No goal: a comparison, with --seeds
    "kaggle-train-folder": {
        "sources": {"chest-xray-pneumonia": "chest-xray-pneumonia-224"},
        "task": "pneumonia",
        "sets": ["data.test_fraction=0.5", "train.batch_size=16"],
        "train_films_per_class": 300,
        "train_folder_only": True,
        "goals": {},
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
    # the three-class merge on the full collections (issue 23's goal for the default model): the chest3-loso
    # sources, all three in training, split by patient
    "chest3-full": {
        "sources": FULL_COLLECTIONS,
        "task": "chest3",
        "sets": [],
        "subsample": {"chest-xray-pneumonia": 3},  # as chest3-loso: Kaggle would be 80% of the images otherwise
        "goals": {"macro_auc": 0.98, "sensitivity": 0.85},
    },
    "chest3-loso": {
        "sources": FULL_COLLECTIONS,
        "task": "chest3",
        "sets": [],
        "leave_one_out": True,
        # ieee8023 is the only source with COVID-19 films: without it training has none, and prepare and train
        # refuse a model with an output trained on nothing, so that fold learns and is scored on normal/pneumonia
        "fold_task": {"covid-chestxray": "pneumonia"},
        # the CPU budget: Kaggle's 5,856 films would be 80% of every training fold that holds it
        "subsample": {"chest-xray-pneumonia": 3},
        "goals": {"held_out_macro_auc": 0.85, "held_out_normal_specificity": 0.80, "in_sample_auc_drop": 0.01},
    },
}
BOOTSTRAP_ROUNDS = 2000
QUICK_DEFAULTS = {"image_size": 64, "epochs": 1, "bootstrap": 50, "model": "small_cnn"}


def measured_run(cmd: list[str]) -> dict:
    """Run `cmd`: its wall seconds and peak RSS (of that process tree's largest process)."""
    result, code, peak_rss_mib, seconds = _bench.measured_run(cmd, {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
    if result.returncode != 0 or code != 0:
        sys.exit(f"command failed ({code}): {' '.join(cmd)}\n{result.stderr[-4000:]}")
    return {"seconds": seconds, "peak_rss_mib": peak_rss_mib, "stderr": result.stderr}


def measured_train(args, data_dir: Path, run_dir: Path, more_sets: list[str] | None = None) -> dict:
    """`covidxray train` of --model for --epochs on `data_dir` with the train.* of `more_sets` (a recipe's) then of the
    --set overrides, measured."""
    train_sets = [arg for s in [*(more_sets or []), *args.sets] if s.startswith("train.") for arg in ("--set", s)]
    return measured_run(_bench.covidxray(*_bench.train_args(data_dir, run_dir, args.model, args.epochs, *train_sets)))


def point_metrics(
    labels: np.ndarray, probabilities: np.ndarray, class_names: list[str], auc_classes: list[int] | None = None
) -> dict:
    """Accuracy, macro AUC (over `auc_classes`, default all, where defined) and each class's sensitivity/specificity."""
    from covidxray.train.metrics import binary_rates, roc_auc

    predicted = probabilities.argmax(1)
    aucs = [roc_auc(labels == c, probabilities[:, c]) for c in (auc_classes or range(len(class_names)))]
    defined = [a for a in aucs if a is not None]
    metrics = {
        "accuracy": float((predicted == labels).mean()),
        "macro_auc": float(np.mean(defined)) if defined else None,
    }
    for c, name in enumerate(class_names):
        rates = binary_rates(labels == c, predicted == c)
        metrics[f"{name}_sensitivity"], metrics[f"{name}_specificity"] = rates["sensitivity"], rates["specificity"]
    return metrics


def bootstrap_intervals(
    labels: np.ndarray,
    probabilities: np.ndarray,
    class_names: list[str],
    rounds: int,
    seed: int = 0,
    auc_classes: list[int] | None = None,
) -> dict:
    """95% percentile intervals of every point metric over `rounds` resamples of the test images."""
    rng = np.random.default_rng(seed)
    draws: dict[str, list[float]] = {}
    for _ in range(rounds):
        pick = rng.integers(0, labels.size, labels.size)
        for key, value in point_metrics(labels[pick], probabilities[pick], class_names, auc_classes).items():
            if value is not None:
                draws.setdefault(key, []).append(value)
    return {
        key: [float(np.percentile(values, 2.5)), float(np.percentile(values, 97.5))] for key, values in draws.items()
    }


def test_predictions(run_dir: Path, data_dir: Path) -> tuple[np.ndarray, np.ndarray, list[str]]:
    import tensorflow as tf

    from covidxray.manifest import open_prepared
    from covidxray.train.evaluate import predict_split

    data = open_prepared(data_dir)
    manifest = data.manifest
    model = tf.keras.models.load_model(run_dir / "model.keras", compile=False)
    probabilities, labels = predict_split(model, data, "test", manifest.image_size, len(manifest.labels))
    return labels, probabilities, manifest.labels


def quality_bench() -> _bench.Bench:
    """This benchmark and its command line."""
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
    bench.parser.add_argument(
        "--seeds",
        type=lambda text: [int(seed) for seed in text.split(",")],
        default=[],
        help="recipes that are not leave-one-out: train once per train.seed (comma-separated), each seed's figures "
        "and their mean, min and max in one report; goals judged on the mean",
    )
    bench.parser.add_argument(
        "--train-films",
        type=int,
        metavar="N",
        help="kaggle-few-films, kaggle-train-folder: the first N train films of each class instead of the recipe's",
    )
    bench.parser.add_argument("--bootstrap", type=int, default=BOOTSTRAP_ROUNDS)
    bench.parser.add_argument(
        "--folds", default="", help="leave-one-out recipes: the held-out sources to run, comma-separated (default: all)"
    )
    bench.parser.add_argument(
        "--subsample",
        action="append",
        default=[],
        metavar="SOURCE=N",
        help="every N-th file of SOURCE in training (training folds of leave-one-out recipes; 1: all; overrides the recipe's)",
    )
    bench.parser.add_argument(
        "--baseline", type=Path, help="leave-one-out recipes: the JSON of the recipe to compare in-sample AUC with"
    )
    bench.parser.add_argument(
        "--reuse",
        action="store_true",
        help="leave-one-out recipes: keep a fold's finished training run, re-evaluate it",
    )
    return bench


def main() -> None:
    bench = quality_bench()
    args = bench.parse(QUICK_DEFAULTS)
    recipe = recipe_of(args)
    if recipe.get("leave_one_out"):
        leave_one_source_out(bench, args, recipe)
        return

    run_prepare(recipe_prepare(args, recipe))
    if not args.seeds:
        results = recipe_run(bench, args, recipe, seed=None)
        check_goals(bench, recipe["goals"], results["metrics"], results["test_classes"])
        bench.finish(args, results)
        return
    runs = {seed: recipe_run(bench, args, recipe, seed) for seed in args.seeds}
    metrics = [run["metrics"] for run in runs.values()]
    spread = over_seeds(metrics)
    bench.table(
        f"{args.recipe}: {args.model}, seeds {', '.join(map(str, args.seeds))}: test split, each seed's figure",
        ["metric", *[f"seed {seed}" for seed in args.seeds], "mean", "min - max"],
        [
            [
                key,
                *[f"{m[key]:.3f}" for m in metrics],
                f"{spread[key]['mean']:.3f}",
                f"{spread[key]['min']:.3f} - {spread[key]['max']:.3f}",
            ]
            for key in spread
        ],
    )
    check_goals(
        bench,
        recipe["goals"],
        {key: value["mean"] for key, value in spread.items()},
        next(iter(runs.values()))["test_classes"],
    )
    bench.finish(args, {"seeds": {str(seed): run for seed, run in runs.items()}, "over_seeds": spread})


def recipe_of(args) -> dict:
    """The recipe --recipe names, with --train-films's count of train films when given; --train-films refused for a
    recipe that does not pick its train films, --subsample for one that does."""
    recipe = RECIPES[args.recipe]
    if "train_films_per_class" in recipe and args.subsample:
        sys.exit(f"--subsample: recipe {args.recipe} takes its own train films; leave --subsample out")
    if args.train_films is None:
        return recipe
    if "train_films_per_class" not in recipe:
        sys.exit(f"--train-films: recipe {args.recipe} trains on whole collections; leave --train-films out")
    if args.train_films < 1:
        sys.exit("--train-films: at least 1 film per class")
    return {**recipe, "train_films_per_class": args.train_films}


def over_seeds(metrics: list[dict]) -> dict:
    """Mean, min and max of every metric each seed's run defines."""
    keys = [key for key in metrics[0] if all(m.get(key) is not None for m in metrics)]
    return {
        key: {
            "mean": float(np.mean([m[key] for m in metrics])),
            "min": min(m[key] for m in metrics),
            "max": max(m[key] for m in metrics),
        }
        for key in keys
    }


def recipe_run(bench: _bench.Bench, args, recipe: dict, seed: int | None) -> dict:
    """Train, evaluate and score one run of a recipe that is not leave-one-out (`seed`: train.seed, None: the
    config's); prints its table and returns its results."""
    from covidxray.reports import read_evaluation_report

    data_dir = recipe_data_dir(args)
    run_dir = (
        args.workdir / "runs" / f"{args.recipe}{_train_films_tag(args)}-{args.model}-{args.image_size}-{args.epochs}ep"
        f"{'-' + args.tag if args.tag else ''}{'' if seed is None else f'-seed{seed}'}"
    )
    subsample = training_subsample(args, recipe)
    trained = measured_train(args, data_dir, run_dir, recipe["sets"] + ([] if seed is None else [f"train.seed={seed}"]))
    _bench.run(_bench.covidxray("evaluate", "--data-dir", str(data_dir), "--run-dir", str(run_dir)))

    labels, probabilities, class_names = test_predictions(run_dir, data_dir)
    point = point_metrics(labels, probabilities, class_names)
    evaluation = read_evaluation_report(run_dir)
    if abs(evaluation.accuracy - point["accuracy"]) > 1e-9:  # the same model on the same split: must agree
        sys.exit(
            f"covidxray evaluate and this bench disagree on the test accuracy: {evaluation.accuracy} vs {point['accuracy']}"
        )
    intervals = bootstrap_intervals(labels, probabilities, class_names, args.bootstrap)
    train_log = json.loads((run_dir / "train_log.json").read_text())
    manifest = json.loads((data_dir / "manifest.json").read_text())
    results = {
        "recipe": args.recipe,
        "seed": seed,
        "model": args.model,
        "image_size": args.image_size,
        "overrides": args.sets,
        "subsample": subsample,
        "train_films_per_class": recipe.get("train_films_per_class"),
        "test_images": int(labels.size),
        "test_classes": {name: int((labels == c).sum()) for c, name in enumerate(class_names)},
        "splits": {split: info["classes"] for split, info in manifest["splits"].items()},
        "majority_baseline": float(np.bincount(labels, minlength=len(class_names)).max() / labels.size),
        "metrics": point,
        "ci95": intervals,
        "ece": evaluation.calibration.ece,
        "epochs_run": len(train_log["epochs"]),
        "best_epoch": train_log["best"].get("epoch"),
        "best_val_auc": train_log["best"].get("val_auc"),
        "collapsed_epochs": train_log.get("collapsed_epochs", []),
        "train_seconds": trained["seconds"],
        "train_peak_rss_mib": trained["peak_rss_mib"],
        "images_per_s": [e["images_per_s_per_rank"][0] for e in train_log["epochs"]],
        "run_dir": str(run_dir),
    }

    scored = {"metrics": point, "ci95": intervals}
    bench.table(
        f"{args.recipe}: {args.model} at {args.image_size} px, {args.epochs} epochs"
        f"{'' if seed is None else f', seed {seed}'}; test split, 95% bootstrap CI",
        ["metric", "value [95% CI]"],
        [
            ["accuracy", _cell(scored, "accuracy")],
            ["macro AUC", _cell(scored, "macro_auc")],
            *[[f"{name} sensitivity", _cell(scored, f"{name}_sensitivity")] for name in class_names],
            *[[f"{name} specificity", _cell(scored, f"{name}_specificity")] for name in class_names],
            ["ECE (15 bins)", f"{results['ece']:.3f}"],
            ["majority baseline", f"{results['majority_baseline']:.3f}"],
            ["epochs (best)", f"{results['epochs_run']} ({results['best_epoch']})"],
            ["train wall time", f"{trained['seconds'] / 60:.1f} min"],
            ["train peak RSS", f"{trained['peak_rss_mib']:.0f} MiB"],
        ],
    )
    return results


def check_goals(bench: _bench.Bench, goals: dict, metrics: dict, test_classes: dict) -> None:
    """The recipe's goals against `metrics` (one run's, or the mean over seeds)."""
    for key in ("accuracy", "macro_auc"):
        if key in goals:
            bench.at_least(f"test {key}", metrics.get(key) or 0.0, goals[key])
    for kind in ("sensitivity", "specificity"):
        if kind in goals:
            for name in test_classes:
                if metrics.get(f"{name}_{kind}") is not None:
                    bench.at_least(f"{name} {kind}", metrics[f"{name}_{kind}"], goals[kind])


# --- leave one source out -------------------------------------------------------------------------------


def subsampled(folder: Path, every: int, out: Path) -> Path:
    """A copy of `folder` with every `every`-th image (sorted by name) of each of its folders and every other file
    (metadata tables); reused once complete."""
    return copied_subset(folder, out, lambda _, images: images[::every], f"{folder} {every}")


def first_train_films(folder: Path, per_class: int, out: Path, train_only: bool) -> Path:
    """A copy of `folder` whose folders under a `train` folder keep their first `per_class` images (sorted by name),
    the rest whole (`train_only`: left out); reused once complete."""
    return copied_subset(
        folder,
        out,
        lambda where, images: images[:per_class] if "train" in where.parts else [] if train_only else images,
        f"{folder} first {per_class} train{' only' if train_only else ''}",
    )


def copied_subset(folder: Path, out: Path, pick, stamp: str) -> Path:
    """A copy of `folder` with the images `pick(folder relative to `folder`, its images sorted by name)` returns of
    each of its folders and every other file; reused when its `.complete` holds `stamp`."""
    from covidxray.records import IMAGE_SUFFIXES

    done = out / ".complete"
    if done.is_file() and done.read_text() == stamp:
        return out
    if out.exists():
        shutil.rmtree(out)
    for here, names, files in os.walk(folder):
        names.sort()
        where = Path(here).relative_to(folder)
        target = out / where
        target.mkdir(parents=True, exist_ok=True)
        images = sorted(f for f in files if f.lower().endswith(IMAGE_SUFFIXES) and not f.startswith("."))
        others = [f for f in files if not f.lower().endswith(IMAGE_SUFFIXES)]
        for name in pick(where, images) + others:
            shutil.copy2(Path(here) / name, target / name)
    done.write_text(stamp)
    return out


def prepare_command(sources: dict[str, Path], task: str, size: int, data_dir: Path, sets: list[str]) -> list[str]:
    """`covidxray prepare` of `sources` (name -> folder) into `data_dir`, with the data.* of the --set overrides."""
    args = [arg for name, folder in sources.items() for arg in ("--source", f"{name}={folder}")]
    data_sets = [arg for s in sets if s.startswith("data.") for arg in ("--set", s)]
    return _bench.covidxray(
        "prepare", *args, "--task", task, "--image-size", str(size), "--data-dir", str(data_dir), *data_sets
    )


def run_prepare(command: list[str]) -> None:
    _bench.run(command, timeout=7200)


def prepares_and_copy_checks(args) -> tuple[list[list[str]], list[tuple[Path, Path]]]:
    """Every `covidxray prepare` a run with `args` does, in order (the subsampled copies they read are made under
    --workdir on the way), and the (training, held-out) data folders of every `covidxray evaluate --external` the run
    does (run_fold's: its copy check, covidxray/train/external.py find_copies, reads both); each folder is the
    --data-dir of one of the prepares. scripts/revalidate_prepared.py re-runs both. Call it once per `args`: under
    --quick the plan moves --data-root."""
    recipe = recipe_of(args)
    if not recipe.get("leave_one_out"):
        return [recipe_prepare(args, recipe)], []
    plan = loso_plan(args, recipe)
    commands = [command for held in plan.held_out for command in fold_prepares(args, plan, held)]
    return commands, [fold_data(plan.recipe, held, plan.root)[1:] for held in plan.held_out]


def external_evaluate(training_dir: Path, run_dir: Path, held_dir: Path) -> list[str]:
    """A fold's `covidxray evaluate --external`. No --config: its data config is the defaults and these --set
    overrides, which scripts/revalidate_prepared.py's copy check reads from here."""
    return _bench.covidxray(
        "evaluate", "--data-dir", str(training_dir), "--run-dir", str(run_dir), "--external", str(held_dir)
    )


def recipe_data_dir(args) -> Path:
    return args.workdir / f"{args.recipe}-{args.image_size}{_train_films_tag(args)}"


def _train_films_tag(args) -> str:
    """The data and run folders' mark of --train-films (none for the recipe's own count: older commands keep their folders)."""
    return "" if args.train_films is None else f"-train{args.train_films}"


def recipe_prepare(args, recipe: dict) -> list[str]:
    """The one prepare of a recipe that is not leave-one-out: all its sources into recipe_data_dir."""
    folders = source_folders(args, recipe, training_subsample(args, recipe))
    return prepare_command(folders, recipe["task"], args.image_size, recipe_data_dir(args), recipe["sets"] + args.sets)


def _scored(
    labels: np.ndarray, probabilities: np.ndarray, names: list[str], rounds: int, auc_classes: list[int]
) -> dict:
    return {
        "images": int(labels.size),
        "classes": {name: int((labels == c).sum()) for c, name in enumerate(names)},
        "auc_classes": [names[c] for c in auc_classes],
        "metrics": point_metrics(labels, probabilities, names, auc_classes),
        "ci95": bootstrap_intervals(labels, probabilities, names, rounds, auc_classes=auc_classes),
    }


def fold_data(recipe: dict, held: str, root: Path) -> tuple[str, Path, Path]:
    """The task of the fold that holds `held` out, and its training and held-out data folders under `root`."""
    task = recipe.get("fold_task", {}).get(held, recipe["task"])
    suffix = "" if task == recipe["task"] else f"-{task}"
    return task, root / f"without-{held}{suffix}", root / f"only-{held}{suffix}"


def fold_prepares(args, plan: LosoPlan, held: str) -> list[list[str]]:
    """The fold's two prepares: the other sources (subsampled as planned) for training, then `held` whole."""
    recipe = plan.recipe
    task, training_dir, held_dir = fold_data(recipe, held, plan.root)
    sets = recipe["sets"] + args.sets
    others = {name: plan.folders[name] for name in recipe["sources"] if name != held}
    return [
        prepare_command(others, task, args.image_size, training_dir, sets),
        prepare_command({held: args.data_root / recipe["sources"][held]}, task, args.image_size, held_dir, sets),
    ]


def run_fold(args, plan: LosoPlan, held: str, runs: Path) -> dict:
    """Train without `held`, evaluate in-sample and on `held`; per-image figures with bootstrap intervals."""
    import tensorflow as tf

    from covidxray.manifest import open_prepared
    from covidxray.reports import read_evaluation_report
    from covidxray.train.external import predict_records

    task, training_dir, held_dir = fold_data(plan.recipe, held, plan.root)
    run_dir = runs / training_dir.name
    for command in fold_prepares(args, plan, held):
        run_prepare(command)
    if args.reuse and _trained(run_dir, args.epochs):
        trained = json.loads((run_dir / "bench_train.json").read_text())
    else:
        trained = measured_train(args, training_dir, run_dir)
        (run_dir / "bench_train.json").write_text(json.dumps({k: trained[k] for k in ("seconds", "peak_rss_mib")}))
    evaluated = _bench.run(external_evaluate(training_dir, run_dir, held_dir), timeout=7200)
    evaluation = read_evaluation_report(run_dir)
    (external,) = evaluation.external
    names = evaluation.labels
    model = tf.keras.models.load_model(run_dir / "model.keras", compile=False)
    held_probs, held_labels, _, dropped = predict_records(
        model, open_prepared(held_dir), set(external.dropped_record_ids)
    )
    labels, probabilities, _ = test_predictions(run_dir, training_dir)
    for what, mine, theirs in (
        ("test", (probabilities.argmax(1) == labels).mean(), evaluation.accuracy),
        (held, (held_probs.argmax(1) == held_labels).mean(), external.accuracy),
    ):
        if abs(mine - theirs) > 1e-9:  # the same model on the same images: must agree
            sys.exit(f"covidxray evaluate and this bench disagree on the {what} accuracy: {theirs} vs {mine}")
    profile = source_profile_flags(model, training_dir, held_dir, set(external.dropped_record_ids))
    train_classes = open_prepared(training_dir).manifest.splits["train"].classes
    trained_classes = [c for c, name in enumerate(names) if train_classes[name]]
    train_log = json.loads((run_dir / "train_log.json").read_text())
    untrained = [c for c in range(len(names)) if c not in trained_classes and (held_labels == c).any()]
    restricted = None
    if untrained:  # what the model could have learnt: the held-out films of trained classes, among trained classes
        keep = np.isin(held_labels, trained_classes)
        position = {c: i for i, c in enumerate(trained_classes)}
        subset = held_probs[keep][:, trained_classes]
        restricted = _scored(
            np.array([position[c] for c in held_labels[keep]]),
            subset / subset.sum(1, keepdims=True),
            [names[c] for c in trained_classes],
            args.bootstrap,
            list(range(len(trained_classes))),
        )
        restricted["left_out"] = {names[c]: int((held_labels == c).sum()) for c in untrained}
    return {
        "held_out": held,
        "task": task,
        "held_out_dropped": open_prepared(
            held_dir
        ).manifest.dropped,  # e.g. the COVID-19 films a two-class fold has no use for
        "train_classes": train_classes,
        "held_out_trained_classes": restricted,
        "in_sample": _scored(labels, probabilities, names, args.bootstrap, trained_classes),
        "held_out_set": {
            **_scored(held_labels, held_probs, names, args.bootstrap, trained_classes),
            "images_prepared": external.images_prepared,
            "dropped_as_copies": external.dropped_as_copies,
            "dropped_by_kind": external.dropped_by_kind,
            "dropped_unchecked": external.dropped_unchecked,
            "ece": external.ece,
        },
        "ece_in_sample": evaluation.calibration.ece,
        "source_profile": profile,
        "epochs_run": len(train_log["epochs"]),
        "best_epoch": train_log["best"].get("epoch"),
        "best_val_auc": train_log["best"].get("val_auc"),
        "train_seconds": trained["seconds"],
        "train_peak_rss_mib": trained["peak_rss_mib"],
        "images_per_s": [e["images_per_s_per_rank"][0] for e in train_log["epochs"]],
        "evaluate_stderr_tail": evaluated.stderr[-1500:],
        "run_dir": str(run_dir),
        "dropped_in_bench": dropped,
    }


def _trained(run_dir: Path, epochs: int) -> bool:
    """A finished training run of `epochs` epochs in `run_dir` (what --reuse skips)."""
    try:
        log = json.loads((run_dir / "train_log.json").read_text())
    except (OSError, ValueError):
        return False
    return (
        (run_dir / "model.keras").is_file()
        and (run_dir / "bench_train.json").is_file()
        and len(log["epochs"]) == epochs
    )


def _embeddings(served, data_dir: Path, splits: tuple[str, ...], skip: set[str] = frozenset()) -> tuple:
    from covidxray.data.tfrecord import read_records
    from covidxray.manifest import open_prepared

    data = open_prepared(data_dir)
    records = [r for split in splits for r in read_records(data.shards(split)) if r["record_id"] not in skip]
    images = np.stack([r["image"] for r in records]).astype(np.float32)
    return served.predict(images, batch_size=64, verbose=0)[1], np.array([r["source"] for r in records], dtype=object)


def source_profile_flags(model, training_dir: Path, held_dir: Path, dropped: set[str]) -> dict:
    """Share of each test set predict would warn about (covidxray/edge/source_profile.py, margin 1), the profile
    fitted as export fits it but on the Keras model's embeddings (the float32 TFLite model's, to float precision)."""
    from covidxray.export.class_maps import served_model
    from covidxray.export.source_profile import fit

    served = served_model(model)
    profile = fit(*_embeddings(served, training_dir, ("train",)), *_embeddings(served, training_dir, ("val",)), 1.0)
    test, _ = _embeddings(served, training_dir, ("test",))
    held, _ = _embeddings(served, held_dir, ("train", "val", "test"), dropped)
    return {
        "margin": 1.0,
        "in_sample_test_warned": float(profile.unlike_every_source(test).mean()),
        "held_out_warned": float(profile.unlike_every_source(held).mean()),
    }


def _cell(entry: dict, key: str) -> str:
    value, ci = entry["metrics"].get(key), entry["ci95"].get(key)
    return "n/a" if value is None else f"{value:.3f} [{ci[0]:.3f}, {ci[1]:.3f}]" if ci else f"{value:.3f}"


def training_subsample(args, recipe: dict) -> dict[str, int]:
    """SOURCE -> N: every N-th file of SOURCE goes into training (the recipe's, then --subsample's; --quick: 25
    for the recipes over the full collections, those that subsample)."""
    if args.quick and "subsample" in recipe:  # the pipeline end to end, in minutes: a sliver of every source
        return {name: 25 for name in recipe["sources"]}
    subsample = dict(recipe.get("subsample", {}))
    for spec in args.subsample:
        name, _, every = spec.partition("=")
        subsample[name] = int(every)
    return subsample


def source_folders(args, recipe: dict, subsample: dict[str, int]) -> dict[str, Path]:
    """Each recipe source's folder under --data-root, or its every-N-th copy under --workdir when subsampled."""
    missing = [folder for folder in recipe["sources"].values() if not (args.data_root / folder).is_dir()]
    if missing:
        sys.exit(f"--data-root {args.data_root}: {', '.join(missing)} not found there")
    folders = {}
    for name, folder in recipe["sources"].items():
        every = subsample.get(name, 1)
        if "train_films_per_class" in recipe:
            per_class, train_only = recipe["train_films_per_class"], recipe.get("train_folder_only", False)
            folders[name] = first_train_films(
                args.data_root / folder,
                per_class,
                args.workdir / "subsets" / f"{folder}-train{per_class}{'-only' if train_only else ''}",
                train_only,
            )
        elif every == 1:
            folders[name] = args.data_root / folder
        else:
            folders[name] = subsampled(
                args.data_root / folder, every, args.workdir / "subsets" / f"{folder}-every{every}"
            )
    return folders


@dataclass
class LosoPlan:
    """What a leave-one-out run prepares: the recipe (its sources the --quick slivers under --quick), the folder of
    its data sets, every source's folder for training folds, and the held-out sources to run."""

    recipe: dict
    root: Path
    folders: dict[str, Path]
    held_out: list[str]


def loso_plan(args, recipe: dict) -> LosoPlan:
    """The plan of a leave-one-out run (the subsampled copies made on the way; --quick also moves --data-root)."""
    data_tag = "-".join(s.partition("=")[2] for s in recipe["sets"] + args.sets if s.startswith("data."))
    root = (
        args.workdir
        / f"{args.recipe}-{args.image_size}{'-' + data_tag if data_tag else ''}{'-quick' if args.quick else ''}"
    )
    folders = source_folders(args, recipe, training_subsample(args, recipe))
    if args.quick:  # held out too: the quick run's held-out sets are slivers as well
        args.data_root = args.workdir / "subsets"
        recipe = {**recipe, "sources": {name: folders[name].name for name in recipe["sources"]}}
    held_out = [f for f in args.folds.split(",") if f] or list(recipe["sources"])
    unknown = sorted(set(held_out) - set(recipe["sources"]))
    if unknown:
        sys.exit(f"--folds {', '.join(unknown)}: not a source of {args.recipe} ({', '.join(recipe['sources'])})")
    return LosoPlan(recipe, root, folders, held_out)


def leave_one_source_out(bench, args, recipe: dict) -> None:
    subsample = training_subsample(args, recipe)
    plan = loso_plan(args, recipe)
    recipe = plan.recipe
    runs = (
        args.workdir
        / "runs"
        / f"{args.recipe}-{args.model}-{args.image_size}-{args.epochs}ep{'-' + args.tag if args.tag else ''}{'-quick' if args.quick else ''}"
    )
    baseline = json.loads(args.baseline.read_text())["results"]["folds"] if args.baseline else {}
    folds = {}
    for held in plan.held_out:
        print(f"fold: {held} held out", flush=True)
        folds[held] = run_fold(args, plan, held, runs)
        bench.finish(args, _loso_results(args, recipe, subsample, folds))  # written after every fold: nothing lost
    results = _loso_results(args, recipe, subsample, folds)
    from covidxray.data.labels import get_task

    names = get_task(recipe["task"]).classes  # a fold of another task (fold_task) shows "-" / n/a for the others
    headers = (
        ["fold (held out)", "test set", "images", "accuracy", "macro AUC"]
        + [f"{name} {kind}" for name in names for kind in ("sensitivity", "specificity")]
        + ["predict warns: unlike every training source"]
    )
    rows = []
    for held, fold in folds.items():
        warned = (fold["source_profile"]["in_sample_test_warned"], fold["source_profile"]["held_out_warned"], None)
        restricted = fold.get("held_out_trained_classes")
        sets = [("in-sample test", fold["in_sample"]), (f"{held} (held out)", fold["held_out_set"])]
        if restricted:
            left_out = ", ".join(f"{n} {name}" for name, n in restricted["left_out"].items())
            sets.append((f"{held} (held out), trained classes only: {left_out} left out", restricted))
        for (label, entry), share in zip(sets, warned):
            counts = "/".join(str(entry["classes"].get(name, "-")) for name in names)
            rows.append(
                [held, label, counts, _cell(entry, "accuracy"), _cell(entry, "macro_auc")]
                + [_cell(entry, f"{name}_{kind}") for name in names for kind in ("sensitivity", "specificity")]
                + ["" if share is None else f"{share:.1%}"]
            )
    bench.table(
        f"{args.recipe}: {args.model} at {args.image_size} px, {args.epochs} epochs, overrides {args.sets or 'none'}; "
        f"images = {'/'.join(names)}; 95% bootstrap CI",
        headers,
        rows,
    )
    goals = recipe["goals"]
    for held, fold in folds.items():
        # a class train never saw cannot be recognised by any recipe: judged on the classes it could have learnt
        entry = fold.get("held_out_trained_classes") or fold["held_out_set"]
        auc, specificity = entry["metrics"]["macro_auc"], entry["metrics"].get("normal_specificity")
        counts = f"held-out images {entry['classes']}" + (
            f", left out (no training image of the class): {entry['left_out']}" if "left_out" in entry else ""
        )
        total = sum(entry["classes"].values())
        defined = [name for name in entry["auc_classes"] if 0 < entry["classes"].get(name, 0) < total]
        note = f"mean AUC of {', '.join(defined)} (classes train had and the source has both of); {counts}"
        target = f">= {goals['held_out_macro_auc']}"
        if auc is None:
            bench.goal(f"{held} held out: macro AUC", False, None, target, "undefined: " + note)
        else:
            bench.at_least(f"{held} held out: macro AUC", auc, goals["held_out_macro_auc"], note)
        sensitivity = entry["metrics"].get("normal_sensitivity")
        detail = f"normal sensitivity {'n/a' if sensitivity is None else f'{sensitivity:.3f}'}; {counts}"
        if specificity is None:
            target = f">= {goals['held_out_normal_specificity']}"
            bench.goal(f"{held} held out: normal specificity", False, None, target, "undefined: " + detail)
        else:
            bench.at_least(
                f"{held} held out: normal specificity", specificity, goals["held_out_normal_specificity"], detail
            )
        if held in baseline:
            before = baseline[held]["in_sample"]["metrics"]["macro_auc"]
            after = fold["in_sample"]["metrics"]["macro_auc"]
            bench.at_most(
                f"{held} held out: in-sample macro AUC drop against {args.baseline.name}",
                before - after,
                goals["in_sample_auc_drop"],
                f"{before:.3f} -> {after:.3f}",
            )
    bench.finish(args, results)


def _loso_results(args, recipe: dict, subsample: dict, folds: dict) -> dict:
    held = [(fold.get("held_out_trained_classes") or fold["held_out_set"])["metrics"] for fold in folds.values()]
    aucs = [m["macro_auc"] for m in held if m["macro_auc"] is not None]
    specificities = [m["normal_specificity"] for m in held if m.get("normal_specificity") is not None]
    return {
        "recipe": args.recipe,
        "model": args.model,
        "image_size": args.image_size,
        "epochs": args.epochs,
        "overrides": args.sets,
        "sources": recipe["sources"],
        "subsample_in_training": subsample,
        "folds": folds,
        "held_out_macro_auc_mean": float(np.mean(aucs)) if aucs else None,
        "held_out_normal_specificity_min": min(specificities) if specificities else None,
    }


if __name__ == "__main__":
    main()
