"""Is the test split a different look from the training data, whatever the recipe? Two questions asked of a
prepared data set, on a backbone's pooled features (no fine-tuning, nothing tuned on the test split):

1. A linear probe: logistic regression (class weights balanced, its C chosen by val AUC) on the train split's
   features, scored on the test split. With the ImageNet backbone frozen whole, only a linear layer can fit the
   training data's look; if the test split's figures stay where fine-tuned recipes leave them, the recipe is not
   what limits them.
2. Per class, how well the test split's images can be told from the train and val splits' images of the same
   class (cross-validated logistic regression, folds by patient, AUC): 0.5 means the same look, 1 a different one;
   and, for comparison, how well each of a few plain pixel statistics of the shard images tells them apart.

    .venv/bin/python scripts/diagnose_test_shift.py DATA_DIR [--run-dir RUN_DIR] [--out FILE.json]

Without --run-dir the features are efficientnet_lite0's with its ImageNet weights (the pinned package's file);
with it, those of the run's trained model (the input of its last Dense layer). The figures in docs/benchmarks.md
§6 (d), "Why the test folder's normal films", come from this script on the kaggle-pneumonia recipe's data
(`data.split=source`: the Kaggle train folder is train and val, its test folder test).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import cv2
import numpy as np
import tensorflow as tf
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import roc_auc_score
from sklearn.model_selection import StratifiedGroupKFold, cross_val_predict
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

from covidxray.data.tfrecord import read_records
from covidxray.export.keras_file import load_keras_model
from covidxray.manifest import open_prepared
from covidxray.train.models import build_model
from covidxray.train.weights import IMAGENET

SPLITS = ("train", "val", "test")
PROBE_C = (0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0)  # inverse regularisation strengths the val split chooses among
SHIFT_C = 0.01  # the probe's choice on the Kaggle folders' ImageNet features; the shift question has no val split
FOLDS = 5
PIXEL_STATISTICS = ("mean", "standard deviation", "1st percentile", "99th percentile", "Laplacian variance")


def feature_model(run_dir: str | None, image_size: int, classes: int) -> tf.keras.Model:
    """The model's input -> the input of its last Dense layer (the pooled features its head reads)."""
    if run_dir:
        model = load_keras_model(Path(run_dir) / "model.keras")  # safe mode, no code from the file
    else:
        model = build_model("efficientnet_lite0", image_size, classes, IMAGENET)
    head = [layer for layer in model.layers if isinstance(layer, tf.keras.layers.Dense)][-1]
    return tf.keras.Model(model.input, head.input)


def pixel_statistics(image: np.ndarray) -> list[float]:
    """PIXEL_STATISTICS of one gray shard image."""
    gray = image.reshape(image.shape[:2])
    low, high = np.percentile(gray, (1, 99))
    sharpness = cv2.Laplacian(gray.astype(np.float32), cv2.CV_32F).var()
    return [float(gray.mean()), float(gray.std()), float(low), float(high), float(sharpness)]


def split_features(model: tf.keras.Model, data) -> dict[str, dict[str, np.ndarray]]:
    """Per split: features, pixel statistics, labels and patient ids of every record in the shards."""
    out = {}
    for split in SPLITS:
        records = list(read_records(data.shards(split)))
        images = np.stack([r["image"] for r in records])
        out[split] = {
            "features": model.predict(images.astype(np.float32), batch_size=64, verbose=0),
            "pixels": np.array([pixel_statistics(image) for image in images]),
            "labels": np.array([r["label"] for r in records]),
            "patients": np.array([r["patient_id"] for r in records]),
        }
        print(f"{split}: {len(records)} images", flush=True)
    return out


def _probe(c: float):
    return make_pipeline(StandardScaler(), LogisticRegression(C=c, class_weight="balanced", max_iter=5000))


def subset(split: dict, count: int, seed: int) -> dict:
    """`count` images of `split` drawn at random (without replacement) by `seed`."""
    chosen = np.random.default_rng(seed).choice(len(split["labels"]), count, replace=False)
    return {key: values[chosen] for key, values in split.items()}


def linear_probe(splits: dict, labels: list[str]) -> dict:
    """Train on train, choose C by val AUC, score test: accuracy, AUC and each class's sensitivity at argmax."""
    train, val, test = (splits[s] for s in SPLITS)
    fitted = {c: _probe(c).fit(train["features"], train["labels"]) for c in PROBE_C}
    val_aucs = {c: _auc(val["labels"], probe.predict_proba(val["features"])) for c, probe in fitted.items()}
    chosen = max(PROBE_C, key=val_aucs.__getitem__)  # the first of equals, as max over PROBE_C gives
    probabilities = fitted[chosen].predict_proba(test["features"])
    predicted = probabilities.argmax(1)
    return {
        "C": chosen,
        "val_auc": val_aucs[chosen],
        "test_accuracy": float(np.mean(predicted == test["labels"])),
        "test_auc": _auc(test["labels"], probabilities),
        "test_sensitivity": {
            name: float(np.mean(predicted[test["labels"] == k] == k)) for k, name in enumerate(labels)
        },
    }


def _auc(truth: np.ndarray, probabilities: np.ndarray) -> float:
    if probabilities.shape[1] == 2:
        return float(roc_auc_score(truth, probabilities[:, 1]))
    return float(roc_auc_score(truth, probabilities, multi_class="ovr"))


def test_split_shift(splits: dict, labels: list[str]) -> dict:
    """Per class: cross-validated AUC of telling its test images from its train and val images (folds by patient)."""
    shift = {}
    for k, name in enumerate(labels):
        parts = [(s, splits[s]["labels"] == k) for s in SPLITS]
        features = np.concatenate([splits[s]["features"][mask] for s, mask in parts])
        is_test = np.concatenate([np.full(mask.sum(), s == "test") for s, mask in parts])
        patients = np.concatenate([splits[s]["patients"][mask] for s, mask in parts])
        if is_test.all() or not is_test.any():
            continue
        folds = StratifiedGroupKFold(FOLDS, shuffle=True, random_state=0)
        scores = cross_val_predict(
            _probe(SHIFT_C), features, is_test, groups=patients, cv=folds, method="predict_proba"
        )[:, 1]
        pixels = np.concatenate([splits[s]["pixels"][mask] for s, mask in parts])
        shift[name] = {
            "test_images": int(is_test.sum()),
            "train_val_images": int((~is_test).sum()),
            "auc": float(roc_auc_score(is_test, scores)),
            # either direction: a statistic lower in the test split separates as well as a higher one
            "pixel_statistic_auc": {
                statistic: float(max(auc, 1 - auc))
                for statistic, auc in zip(
                    PIXEL_STATISTICS, (roc_auc_score(is_test, pixels[:, i]) for i in range(pixels.shape[1]))
                )
            },
        }
    return shift


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("data_dir")
    parser.add_argument(
        "--run-dir", help="a trained run: its model's features instead of ImageNet efficientnet_lite0's"
    )
    parser.add_argument(
        "--train-subset",
        type=int,
        metavar="N",
        help="also fit the probe on N random train images per seed (a small-data recipe against a fine-tune on as few)",
    )
    parser.add_argument("--seeds", type=int, default=3, help="draws of --train-subset (default: %(default)s)")
    parser.add_argument("--out", type=Path, help="also write the figures here as JSON")
    args = parser.parse_args()
    data = open_prepared(args.data_dir)
    labels = data.manifest.labels
    splits = split_features(feature_model(args.run_dir, data.manifest.image_size, len(labels)), data)
    report = {
        "data_dir": str(Path(args.data_dir).resolve()),
        "features": f"trained run {args.run_dir}" if args.run_dir else "efficientnet_lite0, ImageNet weights",
        "linear_probe": linear_probe(splits, labels),
        "test_split_shift": test_split_shift(splits, labels),
    }
    if args.train_subset:
        report["linear_probe_on_train_subsets"] = {
            "train_images": args.train_subset,
            "by_seed": [
                linear_probe({**splits, "train": subset(splits["train"], args.train_subset, seed)}, labels)
                for seed in range(args.seeds)
            ],
        }
    print(json.dumps(report, indent=2))
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
