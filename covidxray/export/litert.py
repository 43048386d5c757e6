"""A TFLite model plus its sidecar, run with the LiteRT interpreter.

This is what runs on a Pi: it imports `ai_edge_litert` and numpy, never
TensorFlow. The sidecar JSON beside each .tflite carries labels, input size,
preprocessing and the training manifest hash, so a model file and its sidecar
are all `predict` needs.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from covidxray.errors import UserError
from covidxray.export.native_stderr import native_stderr_to

DEFAULT_FORMAT = "float32"


def sidecar_path(model_path: Path) -> Path:
    return model_path.with_suffix(".json")


def tflite_name(fmt: str) -> str:
    return f"model-{fmt}.tflite"


def resolve_model(model: Path, fmt: str | None = None) -> Path:
    """`--model` is a .tflite or a run directory; in a directory `--format` picks the file."""
    if model.is_dir():
        return model / tflite_name(fmt or DEFAULT_FORMAT)
    if fmt:
        raise UserError(f"--format picks a model inside a run directory, but --model {model} already names one file")
    return model


class TFLiteClassifier:
    def __init__(self, model_path: str | Path, threads: int = 1, card: dict | None = None):
        """`card` is the sidecar's content when the caller has it in hand (export, before writing it)."""
        from ai_edge_litert.interpreter import Interpreter

        self.path = Path(model_path)
        if not self.path.is_file():
            raise UserError(f"model {self.path} not found: run `covidxray export` first (or point --model at a .tflite or run directory)")
        self.card = card if card is not None else self._read_card()
        flatbuffer = self.path.read_bytes()
        expected = self.card.get("tflite_sha256")
        if expected and hashlib.sha256(flatbuffer).hexdigest() != expected:
            raise UserError(f"{self.path} does not match its sidecar {sidecar_path(self.path).name} (sha256 differs): copy both files from the same export")
        self.labels: list[str] = self.card["labels"]
        self.image_size: int = int(self.card["image_size"])
        with native_stderr_to(None):  # the XNNPACK banner
            self.interpreter = Interpreter(model_content=flatbuffer, num_threads=threads)
            self.interpreter.allocate_tensors()
        self.input = self.interpreter.get_input_details()[0]
        self.output = self.interpreter.get_output_details()[0]
        expected_shape = [1, self.image_size, self.image_size, 1]
        if list(self.input["shape"]) != expected_shape:
            raise UserError(f"{self.path} takes input {list(self.input['shape'])} but its sidecar says {expected_shape}")

    def _read_card(self) -> dict:
        card = sidecar_path(self.path)
        if not card.is_file():
            raise UserError(f"{card} missing: a .tflite needs the sidecar JSON `covidxray export` writes beside it")
        try:
            return json.loads(card.read_text())
        except json.JSONDecodeError as err:
            raise UserError(f"{card}: not valid JSON ({err}); copy it again from the export") from None

    def _quantize(self, batch: np.ndarray) -> np.ndarray:
        dtype = self.input["dtype"]
        if dtype == np.float32:
            return batch.astype(np.float32)
        scale, zero = self.input["quantization"]
        info = np.iinfo(dtype)
        return np.clip(np.round(batch / scale + zero), info.min, info.max).astype(dtype)

    def _dequantize(self, raw: np.ndarray) -> np.ndarray:
        if self.output["dtype"] == np.float32:
            return raw
        scale, zero = self.output["quantization"]
        return (raw.astype(np.float32) - zero) * scale

    def predict_one(self, image: np.ndarray) -> np.ndarray:
        """(size, size, 1) float32 gray 0..255 -> class probabilities."""
        self.interpreter.set_tensor(self.input["index"], self._quantize(image[None]))
        self.interpreter.invoke()
        return self._dequantize(self.interpreter.get_tensor(self.output["index"]))[0]

    def predict(self, images: np.ndarray) -> np.ndarray:
        return np.stack([self.predict_one(image) for image in images])
