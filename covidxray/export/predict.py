"""`covidxray predict`: files and folders in, one result (or one error) per file out.

A bad file never stops the others; its entry carries the error instead.
"""

from __future__ import annotations

from pathlib import Path

from covidxray.data.preprocess import IMAGE_SUFFIXES, ImageError, model_input
from covidxray.errors import UserError
from covidxray.export.litert import TFLiteClassifier


def expand_inputs(paths: list[Path]) -> list[Path]:
    files: list[Path] = []
    for path in paths:
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)
            if not found:
                raise UserError(f"{path}: folder holds no {', '.join(IMAGE_SUFFIXES)} files")
            files.extend(found)
        else:
            files.append(path)
    return files


def predict_files(paths: list[Path], model_path: Path, threads: int = 1) -> list[dict]:
    classifier = TFLiteClassifier(model_path, threads)
    results = []
    for path in expand_inputs(paths):
        try:
            probs = classifier.predict_one(model_input(path, classifier.image_size))
        except ImageError as err:
            results.append({"file": str(path), "error": err.detail, "reason": err.reason})
            continue
        best = int(probs.argmax())
        results.append(
            {
                "file": str(path),
                "label": classifier.labels[best],
                "confidence": float(probs[best]),
                "probabilities": {label: float(p) for label, p in zip(classifier.labels, probs)},
            }
        )
    return results
