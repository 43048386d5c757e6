"""A TFLite model plus its sidecar, run with the LiteRT interpreter.

This is what runs on a Pi: it imports `ai_edge_litert` and numpy, never
TensorFlow. The sidecar JSON beside each .tflite carries labels, input size,
preprocessing and the training manifest hash, so a model file and its sidecar
are all `predict` needs.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from covidxray.errors import UserError


def sidecar_path(model_path: Path) -> Path:
    return model_path.with_suffix(".json")


class TFLiteClassifier:
    def __init__(self, model_path: str | Path, threads: int = 1):
        from ai_edge_litert.interpreter import Interpreter

        self.path = Path(model_path)
        card = sidecar_path(self.path)
        if not self.path.is_file():
            raise UserError(f"model {self.path} not found: run `covidxray export` first")
        if not card.is_file():
            raise UserError(f"{card} missing: a .tflite needs the sidecar JSON `covidxray export` writes beside it")
        self.card = json.loads(card.read_text())
        self.labels: list[str] = self.card["labels"]
        self.image_size: int = int(self.card["image_size"])
        self.interpreter = Interpreter(model_path=str(self.path), num_threads=threads)
        self.interpreter.allocate_tensors()
        self.input = self.interpreter.get_input_details()[0]
        self.output = self.interpreter.get_output_details()[0]

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
