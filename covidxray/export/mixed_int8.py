"""Mixed int8 (export.int8_method: mixed): the few layers int8 rounds worst stay float, chosen by measurement.

Post-training int8 (ptq) rounds every layer's output to 256 levels of its calibrated range. Most layers of the
Pi-cluster model lose about half a level to that (root mean square, on the calibration films); two lose about
three: the stem convolution, which carries the folded input scaling, and the first depthwise convolution, both
at full resolution. On near-ties (two classes a few hundredths apart) that error alone flips calls.

TensorFlow's QuantizationDebugger measures it: it calibrates as the converter does, then runs a model in which
each quantized op's output is compared with its float twin fed the same quantized input, on the calibration
films. The `export.int8_float_layers` ops with the largest error in units of their own quantization step
(rmse / scale) are kept in float; everything else is int8 as in ptq, with the same uint8 gray pixels in and
uint8 probabilities out (a quantize / dequantize pair around each float op). The weights of the early layers
are small, so the file hardly grows; the float ops cost some latency, and the model is no longer integer-only,
so no C array is written for TensorFlow Lite Micro (covidxray/export/formats.py).
"""

from __future__ import annotations

import csv
import io
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import tensorflow as tf

# TF 2.15 takes a denylist only through the QuantizationDebugger, whose own non-debug model keeps float input
# and output. The converter's own quantization step (TFLiteConverter._quantize calls it so, after the same
# calibration) takes the denylist and the uint8 interface together.
from tensorflow.lite.python.convert import mlir_quantize


@dataclass(frozen=True)
class LayerError:
    """One quantized op's output error against its float twin on the calibration films."""

    op: str  # e.g. CONV_2D
    tensor: str  # the output tensor's name: what the quantizer's denylist names
    steps: float  # root mean square error in units of the tensor's quantization scale

    @property
    def layer(self) -> str:
        """The op's own layer: the last of the fused names (e.g. efficientnet_lite0/conv_stem/Conv2D)."""
        return self.tensor.rsplit(";", 1)[-1]

    def describe(self) -> str:
        return f"{self.op} {self.layer} ({self.steps:.2f} steps rms)"


def layer_errors(converter: tf.lite.TFLiteConverter) -> tuple[bytes, list[LayerError]]:
    """The calibrated (not yet quantized) model and every quantized op's error, largest first.

    `converter` is configured for int8 (optimizations, representative_dataset); its representative films are
    also the films the errors are measured on."""
    debugger = tf.lite.experimental.QuantizationDebugger(
        converter=converter, debug_dataset=converter.representative_dataset
    )
    debugger.run()
    dump = io.StringIO()
    debugger.layer_statistics_dump(dump)  # the public way to the per-op scale beside the statistics
    errors = [
        LayerError(
            row["op_name"], row["tensor_name"], float(np.sqrt(float(row["mean_squared_error"]))) / float(row["scale"])
        )
        for row in csv.DictReader(io.StringIO(dump.getvalue()))
    ]
    return debugger.calibrated_model, sorted(errors, key=lambda error: -error.steps)


def mixed_int8(converter: tf.lite.TFLiteConverter, float_layers: int, say: Callable[[str], None]) -> tuple[bytes, dict]:
    """The int8 flatbuffer with the `float_layers` worst-rounded ops in float, and its report entries
    (`float_layers`: each kept op, its type and its error)."""
    calibrated, errors = layer_errors(converter)
    kept, rest = errors[:float_layers], errors[float_layers:]
    flatbuffer = mlir_quantize(
        calibrated,
        input_data_type=converter.inference_input_type,
        output_data_type=converter.inference_output_type,
        denylisted_nodes=[error.tensor for error in kept],
    )
    largest_left = f"{rest[0].steps:.2f} steps" if rest else "none, every layer is float"
    say(
        f"int8 (mixed): int8 error of each of the {len(errors)} quantized layers measured on the calibration films; "
        f"kept in float: {'; '.join(error.describe() for error in kept)}; the largest error left in int8: {largest_left}"
    )
    return bytes(flatbuffer), {"float_layers": [error.describe() for error in kept]}
