"""`covidxray predict`: files and folders in, one result (or one error) per file out.

A bad file never stops the others; its entry carries the error instead. An
image that is not a chest radiograph gets `rejected` instead of a class: by
the cheap checks of covidxray/edge/radiograph_gate.py, because it looks like
a film shown inverted or upside down, or like no film in any orientation
(covidxray/edge/orientation.py: the reason names the orientation), because its
embedding lies beyond the out-of-distribution threshold in the sidecar, or
because its coarse layout is unlike the training films'
(covidxray/edge/chest_layout.py). No
TensorFlow here: `--explain` (Grad-CAM on the Keras model, covidxray/export/gradcam.py)
is handed in by the caller as an `ExplainerFor`.
"""

from __future__ import annotations

import copy
import math
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np

from covidxray.edge import harmonise, radiograph_gate, source_profile
from covidxray.edge.image_header import DEFAULT_MAX_PIXELS
from covidxray.edge.litert import TFLiteClassifier
from covidxray.edge.preprocess import PREPROCESSING_VERSION, ImageError, as_model_input, is_dicom, load_gray
from covidxray.edge.source_profile import SIDECAR_KEY, SourceProfile
from covidxray.errors import UserError, reraise_interrupt
from covidxray.records import IMAGE_SUFFIXES
from covidxray.sidecar import Sidecar

# (source file, decoded gray image, model input, class index) -> written overlay
Explainer = Callable[[Path, np.ndarray, np.ndarray, int], Path]
ExplainerFor = Callable[[TFLiteClassifier], Explainer]  # made once the model and its sidecar are loaded (--explain)
REJECTED = "not a chest radiograph"
OOD_REASON = "out-of-distribution"
LAYOUT_REASON = "not-chest-layout"


def _is_input_file(path: Path) -> bool:
    """Image suffixes, plus suffix-less files with a DICOM preamble (as PACS exports name them).

    A link that leads nowhere and a suffix-less file that cannot be read count as inputs: what they are
    cannot be told, so they are reported rather than passed over.
    """
    if path.name.startswith("."):
        return False
    if path.suffix.lower() in IMAGE_SUFFIXES:
        return True
    if path.suffix:
        return False
    try:
        with open(path, "rb"):
            pass
    except OSError:
        return True
    return path.is_file() and is_dicom(path)


def _folder_inputs(folder: Path) -> list[Path | ImageError]:
    """The input files under `folder`, and an error for each subfolder that cannot be read and each link to a
    folder (not followed: it may lead in a loop or out of the folder given)."""
    found: list[Path | ImageError] = []

    def unreadable(err: OSError) -> None:
        found.append(ImageError("unreadable", err.filename, f"cannot read the folder ({err.strerror or err})"))

    for root, folders, names in os.walk(folder, onerror=unreadable):
        for name in folders:
            if (Path(root) / name).is_symlink():
                found.append(
                    ImageError(
                        "unsupported", Path(root) / name, "a link to a folder: not followed (give that folder itself)"
                    )
                )
        found.extend(Path(root) / name for name in names if _is_input_file(Path(root) / name))
    return sorted(found, key=lambda item: str(item.path if isinstance(item, ImageError) else item))


def expand_inputs(paths: list[Path]) -> list[Path | ImageError]:
    """Folders become their image files (recursively, sorted); a folder with none stays, to be reported as empty.

    Nothing is skipped silently: a folder or link that cannot be followed becomes an error entry in its place.
    """
    inputs: list[Path | ImageError] = []
    for path in paths:
        inputs.extend((_folder_inputs(path) or [path]) if path.is_dir() else [path])
    return inputs


def error_entry(err: ImageError) -> dict:
    return {"file": err.path, "error": err.detail, "reason": err.reason}


def _rejected(path: Path, reason: str, score: float, limit: float) -> dict:
    return {"file": str(path), "rejected": REJECTED, "reason": reason, "score": float(score), "limit": float(limit)}


def predict_path(
    path: Path,
    classifier: TFLiteClassifier,
    explain: Explainer | None = None,
    max_pixels: int = DEFAULT_MAX_PIXELS,
    profile: SourceProfile | None = None,
) -> dict:
    try:
        if path.is_dir():
            raise ImageError("empty", path, f"folder holds no {', '.join(IMAGE_SUFFIXES)} or DICOM files")
        gray = load_gray(path, max_pixels)
    except ImageError as err:
        return error_entry(err)
    except Exception as err:  # a malformed file (WindowCenter "abc", a broken VOI LUT ...) is that file's problem only
        reraise_interrupt(err)
        return {
            "file": str(path),
            "error": f"cannot decode ({type(err).__name__}: {' '.join(str(err).split())})",
            "reason": "unreadable",
        }
    gate = radiograph_gate.check(gray)
    if not gate.passed:
        return _rejected(path, gate.reason, gate.score, gate.limit)
    ood, layout_fit, orientation_fit = classifier.gates()
    image = as_model_input(gray, classifier.image_size, classifier.card.harmonise)
    orientation, probability, upright = orientation_fit.orientation(image)
    if orientation != "upright":
        return _rejected(path, orientation, probability, upright)
    raw, embedding = classifier.infer(image)
    distance = classifier.ood_distance(embedding)
    # None (no embedding to judge) cannot pass the gate; the sidecar check already refuses such a model
    if distance is None or distance > ood.threshold:
        return _rejected(path, OOD_REASON, math.inf if distance is None else distance, ood.threshold)
    layout = layout_fit.score(image)
    if layout > layout_fit.threshold:
        return _rejected(path, LAYOUT_REASON, layout, layout_fit.threshold)
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


def preprocessing_mismatch(card: Sidecar) -> str | None:
    """Why the model's training pixels may differ from this predictor's, or None when both use this preprocessing version."""
    trained = card.preprocessing
    if trained == PREPROCESSING_VERSION:
        return None
    # Before numbered versions a card held a description of every step: made by other code than any version.
    described = f"preprocessing version {trained}" if isinstance(trained, int) else "preprocessing older than version 1"
    return f"was trained on images made by {described}; this predictor does version {PREPROCESSING_VERSION}: export a model trained on data prepared with this version"


class Predictor:
    """The model loaded once (sidecar checked, Grad-CAM prepared); `inputs` and `__call__` give one result per file."""

    def __init__(
        self,
        model_path: Path,
        threads: int = 1,
        explainer_for: ExplainerFor | None = None,
        warn: Callable[[str], None] = lambda _message: None,
        max_pixels: int = DEFAULT_MAX_PIXELS,
    ):
        if threads < 1:
            raise UserError(f"--threads {threads}: give 1 or more")
        self.classifier = TFLiteClassifier(model_path, threads)
        card = self.classifier.card
        harmonise.check_method(card.harmonise, f"{model_path}'s sidecar: harmonise")
        mismatch = preprocessing_mismatch(card)
        if mismatch:
            warn(f"{model_path} {mismatch}")
        try:
            self.profile = source_profile.from_card(card)
        except ValueError as err:
            raise UserError(f"{model_path}'s sidecar: {err}; export again") from None
        self.explain = explainer_for(self.classifier) if explainer_for is not None else None
        self.max_pixels = max_pixels

    def twin(self) -> Predictor:
        """The same model, fits and settings with an interpreter of its own, for another thread (serve's workers).
        The explainer is shared: give twins only one that does not use the interpreter."""
        twin = copy.copy(self)
        twin.classifier = self.classifier.twin()
        return twin

    def __call__(self, item: Path | ImageError) -> dict:
        if isinstance(item, ImageError):
            return error_entry(item)
        return predict_path(item, self.classifier, self.explain, self.max_pixels, self.profile)


def predict_files(paths: list[Path], model_path: Path, threads: int = 1, **options) -> list[dict]:
    """Every result at once (for library use; the CLI prints each as it is done)."""
    predictor = Predictor(model_path, threads, **options)
    return [predictor(item) for item in expand_inputs(paths)]
