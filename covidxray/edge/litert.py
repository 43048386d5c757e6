"""A TFLite model plus its sidecar, run with the LiteRT interpreter.

This is what runs on a Pi: it imports `ai_edge_litert` and numpy, never
TensorFlow. The sidecar JSON beside each .tflite (covidxray/sidecar.py) carries labels, input size,
preprocessing, the training data set's id, the temperature, the
out-of-distribution fit and the chest-layout fit, so a model file and its sidecar are all `predict`
needs. The pair is checked before any probability is shown: the sidecar
belongs to this very model and was not edited since export
(covidxray/edge/model_binding.py), its entries are complete and of their types (covidxray/sidecar.py), and
they fit the model's shapes with gate fits of finite numbers: a mislabelled probability or a silently disabled
gate is worse than no answer.
"""

from __future__ import annotations

import copy
import hashlib
import json
import time
from pathlib import Path
from typing import cast

import numpy as np

from covidxray.edge.calibration import apply_temperature
from covidxray.edge.chest_layout import LayoutModel, OtherVersion
from covidxray.edge.model_binding import TFLITE_SHA256, embedded_digest, sidecar_digest
from covidxray.edge.native_stderr import native_stderr_to
from covidxray.edge.ood import OodModel
from covidxray.edge.orientation import OrientationModel
from covidxray.errors import UserError
from covidxray.files import partial_path
from covidxray.run_folder import sidecar_path
from covidxray.sidecar import REQUIRED_KEYS, Sidecar, SidecarError, read_sidecar

EMBEDDING_OUTPUT = "embedding"  # the second output's signature name (covidxray/export/tflite.py)
CLASS_MAPS_OUTPUT = "class_maps"  # optional third: Grad-CAM's maps of every class (covidxray/edge/class_maps.py)
PAIR_READS, PAIR_RETRY_S = 3, 0.5  # a pair read between export's two renames matches when read again


def _shape_problem(card: Sidecar, num_classes: int, input_shape: list[int], embedding_dim: int | None) -> str | None:
    """What makes the (loaded) sidecar unfit for this model's shapes, or its gate fits unusable; None if nothing."""
    if len(card.labels) != num_classes:
        return f"lists {len(card.labels)} labels ({', '.join(card.labels)}) but the model has {num_classes} outputs"
    if [1, card.image_size, card.image_size, 1] != input_shape:
        return f"says image_size {card.image_size!r} but the model takes input {input_shape}"
    if card.ood is None:
        return None  # export, before its fits
    if embedding_dim is None:
        return "has an out-of-distribution section but the model has no `embedding` output"
    try:
        OodModel.from_sidecar(card.ood)
        dim, classes = int(card.ood["dim"]), int(card.ood["classes"])
    except (TypeError, KeyError, ValueError, AttributeError) as err:
        return f"out-of-distribution section is damaged ({type(err).__name__}: {err})"
    if dim != embedding_dim or classes > num_classes:
        return f"out-of-distribution section is for {dim}-d embeddings and {classes} classes; the model gives {embedding_dim}-d and {num_classes}"
    if card.layout is None:
        return None
    try:
        LayoutModel.from_sidecar(card.layout)
    except OtherVersion as err:
        return f"chest-layout section is {err}: export again with this covidxray (or predict with the one that exported it)"
    except (TypeError, KeyError, ValueError, AttributeError) as err:
        return f"chest-layout section is damaged ({type(err).__name__}: {err})"
    if card.orientation is None:
        return None
    try:
        OrientationModel.from_sidecar(card.orientation)
    except (TypeError, KeyError, ValueError, AttributeError) as err:
        return f"orientation section is unusable ({type(err).__name__}: {err}): export again with this covidxray"
    return None


def _class_maps_problem(shape: list[int], num_classes: int) -> str | None:
    if len(shape) != 4 or shape[0] != 1 or shape[-1] != num_classes:
        return f"model's {CLASS_MAPS_OUTPUT} output has shape {shape}, not (1, height, width, {num_classes})"
    return None


def _new_interpreter(flatbuffer: bytes, threads: int):
    """A LiteRT interpreter of `flatbuffer` with its tensors allocated, XNNPACK's banner kept off stderr."""
    from ai_edge_litert.interpreter import Interpreter

    with native_stderr_to(None):
        interpreter = Interpreter(model_content=flatbuffer, num_threads=threads)
        interpreter.allocate_tensors()
    return interpreter


class TFLiteClassifier:
    def __init__(
        self, model_path: str | Path, threads: int = 1, flatbuffer: bytes | None = None, card: dict | None = None
    ):
        """The .tflite at `model_path` with its sidecar, both checked before any use.

        `flatbuffer` and `card` in hand: export, running a model before it binds and writes the pair.
        """
        self.path = Path(model_path)
        bound = flatbuffer is None
        sidecar: object = card
        if flatbuffer is None:
            flatbuffer, sidecar = self._read_pair()
        try:
            self.interpreter = _new_interpreter(flatbuffer, threads)
        except (ValueError, RuntimeError) as err:
            raise UserError(
                f"{self.path} is not a usable TFLite model ({' '.join(str(err).split())}): copy it again from the export, or export again"
            ) from None
        if bound:
            self._check_binding(flatbuffer, sidecar)
        self.flatbuffer, self.threads = flatbuffer, threads  # for `twin`
        self.input = self.interpreter.get_input_details()[0]
        outputs = self._named_outputs()
        self.output = outputs.get("probabilities", self.interpreter.get_output_details()[0])
        self.embedding_output = outputs.get(EMBEDDING_OUTPUT)
        self.class_maps_output = outputs.get(CLASS_MAPS_OUTPUT)
        embedding_dim = int(self.embedding_output["shape"][-1]) if self.embedding_output else None
        try:
            loaded = read_sidecar(sidecar, REQUIRED_KEYS if bound else ("labels", "image_size"))
        except SidecarError as err:
            raise self._unusable(str(err)) from None
        problem = _shape_problem(loaded, int(self.output["shape"][-1]), list(self.input["shape"]), embedding_dim)
        if problem is None and self.class_maps_output is not None:
            problem = _class_maps_problem(list(self.class_maps_output["shape"]), int(self.output["shape"][-1]))
        if problem:
            raise self._unusable(problem)
        self.card: Sidecar = loaded
        # of the sidecar as written (read_sidecar took it, so it is an object): what the model is bound to
        self.sidecar_digest = sidecar_digest(cast(dict, sidecar))
        self.labels: list[str] = loaded.labels
        self.image_size: int = loaded.image_size
        self.temperature = loaded.temperature_value
        # None only in export's hands, before it fits them: every sidecar predict reads has them (REQUIRED_KEYS)
        self.ood = None if loaded.ood is None else OodModel.from_sidecar(loaded.ood)
        self.layout = None if loaded.layout is None else LayoutModel.from_sidecar(loaded.layout)
        self.orientation = None if loaded.orientation is None else OrientationModel.from_sidecar(loaded.orientation)

    def twin(self) -> TFLiteClassifier:
        """This checked model with an interpreter of its own, for another thread (an interpreter is not
        thread-safe): the bytes, the sidecar and its fits are shared, not read, checked and built again."""
        twin = copy.copy(self)
        twin.interpreter = _new_interpreter(self.flatbuffer, self.threads)
        return twin

    def _unusable(self, problem: str) -> UserError:
        return UserError(
            f"sidecar {sidecar_path(self.path)} {problem}: copy the sidecar written by the same `covidxray export` as {self.path.name}, or export again"
        )

    def gates(self) -> tuple[OodModel, LayoutModel, OrientationModel]:
        """The input gate's three fits. Every sidecar predict reads has them (REQUIRED_KEYS); only export's card
        lacks them, before its fits."""
        if self.ood is None or self.layout is None or self.orientation is None:
            raise self._unusable("lacks a fit of the input gate (ood, layout or orientation)")
        return self.ood, self.layout, self.orientation

    def _read_pair(self) -> tuple[bytes, object]:
        """The model's bytes and its sidecar, read again once when they do not match: `export` replaces the two
        files one after the other (covidxray/export/tflite.py), so a reader can fall between the two renames."""
        if not self.path.is_file():
            raise UserError(
                f"model {self.path} not found: run `covidxray export` first (or point --model at a .tflite or run directory)"
            )
        for _ in range(PAIR_READS):
            card = self._read_card()
            try:
                flatbuffer = self.path.read_bytes()
            except OSError as err:
                raise UserError(f"cannot read {self.path} ({err.strerror or err})") from None
            if not isinstance(card, dict) or hashlib.sha256(flatbuffer).hexdigest() == card.get(TFLITE_SHA256):
                break
            time.sleep(PAIR_RETRY_S)
        return flatbuffer, card

    def _check_binding(self, flatbuffer: bytes, card: object) -> None:
        card_path = sidecar_path(self.path)
        if not isinstance(card, dict):
            return  # the constructor names it
        if TFLITE_SHA256 not in card:
            raise UserError(
                f"sidecar {card_path} lacks tflite_sha256, so nothing ties it to {self.path.name}: copy the sidecar written by the same `covidxray export`, or export again"
            )
        if hashlib.sha256(flatbuffer).hexdigest() != card[TFLITE_SHA256]:
            leftovers = [p.name for p in (partial_path(self.path), partial_path(card_path)) if p.exists()]
            cause = (
                f" ({', '.join(leftovers)} beside them: an export was interrupted while replacing the pair; run `covidxray export` again)"
                if leftovers
                else ""
            )
            raise UserError(
                f"{self.path} does not match its sidecar {card_path.name} (sha256 differs){cause}: copy both files from the same export"
            )
        digest = embedded_digest(flatbuffer)
        if digest is None:
            raise UserError(
                f"{self.path} carries no digest of its sidecar (exported by an older covidxray), so an edited sidecar would go unnoticed: export again with this version"
            )
        if digest != sidecar_digest(card):
            raise UserError(
                f"sidecar {card_path} was changed after `covidxray export` wrote it (its content no longer matches the digest recorded in {self.path.name}): labels, thresholds and temperature cannot be trusted; copy the sidecar from the export again"
            )

    def _named_outputs(self) -> dict[str, dict]:
        """Outputs by their signature name (`probabilities`, `embedding`); {} for an unnamed single output."""
        signatures = self.interpreter.get_signature_list()
        if len(signatures) != 1:
            return {}
        runner = self.interpreter.get_signature_runner(next(iter(signatures)))
        return dict(runner.get_output_details())

    def _read_card(self) -> object:
        card = sidecar_path(self.path)
        if not card.is_file():
            raise UserError(f"{card} missing: a .tflite needs the sidecar JSON `covidxray export` writes beside it")
        try:
            return json.loads(card.read_bytes())
        except (ValueError, RecursionError) as err:  # not JSON, not UTF-8, or nested beyond any sidecar
            raise UserError(
                f"{card}: not valid JSON ({type(err).__name__}: {err}); copy it again from the export"
            ) from None
        except OSError as err:
            raise UserError(f"cannot read {card} ({err.strerror or err})") from None

    @property
    def probability_floor(self) -> float:
        """The smallest probability the output can tell from zero: half an int8 step, else float32 resolution."""
        if self.output["dtype"] == np.float32:
            return 1e-7
        return self.output["quantization"][0] / 2

    def _quantize(self, batch: np.ndarray) -> np.ndarray:
        dtype = self.input["dtype"]
        if dtype == np.float32:
            return batch.astype(np.float32)
        scale, zero = self.input["quantization"]
        info = np.iinfo(dtype)
        return np.clip(np.round(batch / scale + zero), info.min, info.max).astype(dtype)

    def _dequantize(self, raw: np.ndarray, details: dict) -> np.ndarray:
        if details["dtype"] == np.float32:
            return raw
        scale, zero = details["quantization"]
        return (raw.astype(np.float32) - zero) * scale

    def infer(self, image: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """(size, size, 1) float32 gray 0..255 -> (the model's own probabilities, embedding or None)."""
        self.interpreter.set_tensor(self.input["index"], self._quantize(image[None]))
        self.interpreter.invoke()
        probabilities = self._dequantize(self.interpreter.get_tensor(self.output["index"]), self.output)[0]
        if self.embedding_output is None:
            return probabilities, None
        return probabilities, self._dequantize(
            self.interpreter.get_tensor(self.embedding_output["index"]), self.embedding_output
        )[0]

    def class_maps(self) -> np.ndarray:
        """(h, w, classes) class activation maps of the last `infer` (covidxray/edge/class_maps.py)."""
        if self.class_maps_output is None:
            raise ValueError(f"{self.path} has no {CLASS_MAPS_OUTPUT} output")
        details = self.class_maps_output
        return self._dequantize(self.interpreter.get_tensor(details["index"]), details)[0]

    def calibrated(self, probabilities: np.ndarray) -> np.ndarray:
        """The sidecar's temperature applied (a model exported without one keeps its own probabilities)."""
        if self.temperature == 1.0:
            return probabilities
        return apply_temperature(probabilities, self.temperature, self.probability_floor).astype(np.float32)

    def predict_one(self, image: np.ndarray) -> np.ndarray:
        """(size, size, 1) float32 gray 0..255 -> calibrated class probabilities."""
        return self.calibrated(self.infer(image)[0])

    def predict(self, images: np.ndarray) -> np.ndarray:
        return np.stack([self.predict_one(image) for image in images])

    def ood_distance(self, embedding: np.ndarray | None) -> float | None:
        """Distance of one embedding from the training data (reject above `self.ood.threshold`); None without a fit."""
        if self.ood is None or embedding is None:
            return None
        return float(self.ood.distances(embedding[None])[0])
