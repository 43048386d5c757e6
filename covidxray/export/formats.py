"""The TFLite formats `covidxray export` can write, each a registered way to set up the converter.

Adding a format is one `@register_format` here: its name becomes a valid
`--format` / export.formats value, appears in `covidxray formats` and in the
CLI help, and `export` writes `model-<name>.tflite` with its sidecar and parity
entry. TensorFlow is imported only when a converter is configured, so the
command line lists the formats without it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from covidxray.errors import UserError
from covidxray.registry import Registry


@dataclass(frozen=True)
class Exporter:
    # (tf.lite.TFLiteConverter, representative images or None) -> None: sets optimisations and types
    configure: Callable[[Any, np.ndarray | None], None]
    needs_representative: bool = False  # calibration images (from the train split) for quantisation
    # What the format writes or decides beyond the model pair, once that pair is written:
    # (the .tflite path, its export report entry, class names, image size, export settings) -> entries to add.
    # A `meets_bar: False` entry makes export fail after writing its report.
    extras: Callable[[Path, dict, list[str], int, Any], dict] | None = None
    # The model to convert instead of the exported one, or None for that one:
    # (the served float Keras model, n -> about n uint8 train films spread over the split, export settings, say) -> model.
    fine_tune: Callable[[Any, Callable[[int], np.ndarray], Any, Callable[[str], None]], Any] | None = None
    # How the configured converter makes the flatbuffer instead of its own convert():
    # (the configured tf.lite.TFLiteConverter, export settings, say) -> (flatbuffer, report entries to add), or None
    # for convert() after all (the settings ask for the plain build).
    quantize: Callable[[Any, Any, Callable[[str], None]], tuple[bytes, dict]] | None = None


FORMATS: Registry[Exporter] = Registry("export format")


def register_format(
    name: str, description: str, needs_representative: bool = False, extras=None, fine_tune=None, quantize=None
):
    return lambda configure: FORMATS.add(
        name, Exporter(configure, needs_representative, extras, fine_tune, quantize), description
    )


@register_format("float32", "float32 weights and activations: the reference the other formats are checked against")
def _float32(converter, representative) -> None:
    """The converter's defaults."""


@register_format("float16", "float16 weights (half the size), float32 arithmetic")
def _float16(converter, representative) -> None:
    import tensorflow as tf

    converter.optimizations = [tf.lite.Optimize.DEFAULT]
    converter.target_spec.supported_types = [tf.float16]


# Why a mixed build has no C array: TFLM boards run integer kernels (CMSIS-NN and the like) and often have no FPU.
NO_C_ARRAY_MIXED = (
    "not written: the mixed build runs some layers in float, and TensorFlow Lite Micro builds are integer-only "
    "(export with export.int8_method=ptq for a board)"
)


def _int8_extras(tflite: Path, entry: dict, labels: list[str], image_size: int, settings) -> dict:
    """The agreement bar (export.int8_min_agreement) and the C array for TensorFlow Lite Micro (an integer-only
    build only: a mixed one removes an earlier export's array, which would be another model)."""
    from covidxray.export.c_array import remove_c_array, write_c_array

    extras = {"method": settings.int8_method, "meets_bar": entry["agreement"] >= settings.int8_min_agreement}
    if settings.int8_method == "mixed":
        remove_c_array(tflite)
        return {**extras, "c_array": [], "c_array_note": NO_C_ARRAY_MIXED}
    return {**extras, "c_array": [path.name for path in write_c_array(tflite, labels, image_size)]}


def _int8_fine_tune(served, train_films, settings, say):
    """export.int8_method qat: the quantization-aware student (covidxray/export/qat.py); ptq: None."""
    if settings.int8_method != "qat":
        return None
    from covidxray.export.qat import quantization_aware

    return quantization_aware(
        served,
        train_films,
        settings.int8_qat_steps,
        settings.int8_qat_learning_rate,
        settings.representative_samples,
        say,
    )


def _int8_quantize(converter, settings, say):
    """export.int8_method mixed: the worst-rounded layers kept float (covidxray/export/mixed_int8.py); else None."""
    if settings.int8_method != "mixed":
        return None
    from covidxray.export.mixed_int8 import mixed_int8

    return mixed_int8(converter, settings.int8_float_layers, say)


@register_format(
    "int8",
    "calibrated on train images, integer only (export.int8_method qat: after quantization-aware fine-tuning; "
    "mixed: the few layers int8 rounds worst kept float, not integer-only): uint8 gray pixels in, uint8 "
    "probabilities out (also the C array for TensorFlow Lite Micro when integer-only)",
    needs_representative=True,
    extras=_int8_extras,
    fine_tune=_int8_fine_tune,
    quantize=_int8_quantize,
)
def _int8(converter, representative) -> None:
    import tensorflow as tf

    def samples():
        for image in representative:
            yield [image[None].astype(np.float32)]

    converter.optimizations = [tf.lite.Optimize.DEFAULT]
    converter.representative_dataset = samples
    converter.target_spec.supported_ops = [tf.lite.OpsSet.TFLITE_BUILTINS_INT8]
    converter.inference_input_type = tf.uint8  # gray pixels 0..255 are exactly uint8
    converter.inference_output_type = tf.uint8


def check_formats(formats: list[str]) -> list[str]:
    unknown = [f for f in formats if f not in FORMATS]
    if unknown or not formats:
        raise UserError(f"export formats {formats}: choose one or more of {', '.join(FORMATS.names())}")
    return list(dict.fromkeys(formats))  # keep order, drop repeats
