"""`covidxray predict`: files and folders in, one result (or one error) per file out.

A bad file never stops the others; its entry carries the error instead. An
image that is not a chest radiograph gets `rejected` instead of a class: by
the cheap checks of covidxray/edge/radiograph_gate.py, because its
embedding lies beyond the out-of-distribution threshold in the sidecar, or
because its coarse layout is unlike the training films'
(covidxray/edge/chest_layout.py; sidecars from before it have no such
check). No
TensorFlow here: `--explain` (Grad-CAM on the Keras model, covidxray/export/gradcam.py)
is handed in by the caller as an `ExplainerFor`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

from covidxray.edge import harmonise, radiograph_gate, source_profile
from covidxray.edge.litert import TFLiteClassifier
from covidxray.edge.preprocess import PREPROCESSING_VERSION, ImageError, as_model_input, is_dicom, load_gray
from covidxray.edge.source_profile import SIDECAR_KEY, SourceProfile
from covidxray.errors import UserError
from covidxray.records import IMAGE_SUFFIXES

# (source file, decoded gray image, model input, class index) -> written overlay
Explainer = Callable[[Path, np.ndarray, np.ndarray, int], Path]
ExplainerFor = Callable[[TFLiteClassifier], Explainer]  # made once the model and its sidecar are loaded (--explain)
REJECTED = "not a chest radiograph"
OOD_REASON = "out-of-distribution"
LAYOUT_REASON = "not-chest-layout"


def _is_input_file(path: Path) -> bool:
    """Image suffixes, plus suffix-less files with a DICOM preamble (as PACS exports name them)."""
    if not path.is_file() or path.name.startswith("."):
        return False
    return path.suffix.lower() in IMAGE_SUFFIXES or (not path.suffix and is_dicom(path))


def expand_inputs(paths: list[Path]) -> list[Path]:
    """Folders become their image files (recursively, sorted); an empty folder stays, to be reported."""
    files: list[Path] = []
    for path in paths:
        if path.is_dir():
            files.extend(sorted(p for p in path.rglob("*") if _is_input_file(p)) or [path])
        else:
            files.append(path)
    return files


def _rejected(path: Path, reason: str, score: float, limit: float) -> dict:
    return {"file": str(path), "rejected": REJECTED, "reason": reason, "score": float(score), "limit": float(limit)}


def predict_path(
    path: Path, classifier: TFLiteClassifier, explain: Explainer | None = None, profile: SourceProfile | None = None
) -> dict:
    try:
        if path.is_dir():
            raise ImageError("empty", path, f"folder holds no {', '.join(IMAGE_SUFFIXES)} or DICOM files")
        gray = load_gray(path)
    except ImageError as err:
        return {"file": str(path), "error": err.detail, "reason": err.reason}
    except (
        Exception
    ) as err:  # a malformed file (WindowCenter "abc", a broken VOI LUT sequence, ...) is that file's problem only
        return {
            "file": str(path),
            "error": f"cannot decode ({type(err).__name__}: {' '.join(str(err).split())})",
            "reason": "unreadable",
        }
    gate = radiograph_gate.check(gray)
    if not gate.passed:
        return _rejected(path, gate.reason, gate.score, gate.limit)
    image = as_model_input(gray, classifier.image_size, classifier.card.get("harmonise", harmonise.NONE))
    raw, embedding = classifier.infer(image)
    distance = classifier.ood_distance(embedding)
    if distance is not None and distance > classifier.ood.threshold:
        return _rejected(path, OOD_REASON, distance, classifier.ood.threshold)
    if classifier.layout is not None:
        layout = classifier.layout.score(image)
        if layout > classifier.layout.threshold:
            return _rejected(path, LAYOUT_REASON, layout, classifier.layout.threshold)
    probs = classifier.calibrated(raw)
    best = int(probs.argmax())
    result = {
        "file": str(path),
        "label": classifier.labels[best],
        "confidence": float(probs[best]),
        "probabilities": {label: float(p) for label, p in zip(classifier.labels, probs)},
    }
    if profile is not None and embedding is not None:  # a warning beside the answer, never instead of it
        result[SIDECAR_KEY] = profile.assess(embedding)
    if explain is not None:
        result["gradcam"] = str(explain(path, gray, image, best))
    return result


def preprocessing_mismatch(card: dict) -> str | None:
    """Why the model's training pixels may differ from this predictor's, or None when both use this preprocessing version."""
    trained = card.get("preprocessing")
    if trained == PREPROCESSING_VERSION:
        return None
    # Before numbered versions a card held a description of every step: made by other code than any version.
    described = f"preprocessing version {trained}" if isinstance(trained, int) else "preprocessing older than version 1"
    return f"was trained on images made by {described}; this predictor does version {PREPROCESSING_VERSION}: export a model trained on data prepared with this version"


def predict_files(
    paths: list[Path],
    model_path: Path,
    threads: int = 1,
    explainer_for: ExplainerFor | None = None,
    warn: Callable[[str], None] = lambda _message: None,
) -> list[dict]:
    if threads < 1:
        raise UserError(f"--threads {threads}: give 1 or more")
    classifier = TFLiteClassifier(model_path, threads)
    harmonise.check_method(classifier.card.get("harmonise", harmonise.NONE), f"{model_path}'s sidecar: harmonise")
    mismatch = preprocessing_mismatch(classifier.card)
    if mismatch:
        warn(f"{model_path} {mismatch}")
    try:
        profile = source_profile.from_card(classifier.card)
    except ValueError as err:
        raise UserError(f"{model_path}'s sidecar: {err}; export again") from None
    explain = explainer_for(classifier) if explainer_for is not None else None
    return [predict_path(path, classifier, explain, profile) for path in expand_inputs(paths)]
