"""How much of a pretrained backbone moves in training: BatchNorm statistics and leading stages held fixed.

Both are set on the built model before it is compiled, by `train` and by the
memory probe alike, so `doctor` measures the rank a job will run.

- `train.freeze_batchnorm`: every BN layer in inference mode (batchnorm.py).
- `train.frozen_stages: N`: the backbone's first N stages keep their weights.
  Early stages detect edges and textures that ImageNet taught well; holding
  them fixed leaves less to fit to a few thousand X-rays, and no gradient flows
  through the highest-resolution layers, so their activations are not kept for
  the backward pass (measured on a training rank at batch 16, 224 px: see
  docs/benchmarks.md) and each step does less work.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from covidxray.errors import UserError
from covidxray.train.batchnorm import freeze_batchnorm

if TYPE_CHECKING:
    import tensorflow as tf

    from covidxray.config import TrainConfig

STAGED_MODELS = ("efficientnet_lite0",)  # models whose layers name their stage (efficientnet_lite.stage_of)


def freeze_leading_stages(model: tf.keras.Model, model_name: str, stages: int) -> int:
    """Make the layers of stages 0..stages-1 untrainable; returns how many layers that froze."""
    if model_name not in STAGED_MODELS:
        raise UserError(
            f"train.frozen_stages: {stages} needs a model with named stages ({', '.join(STAGED_MODELS)}), "
            f"not {model_name}; set it to 0"
        )
    from covidxray.train.efficientnet_lite import stage_of

    frozen = [layer for layer in model.layers if (stage := stage_of(layer.name)) is not None and stage < stages]
    for layer in frozen:
        layer.trainable = False
    return len(frozen)


def hold_fixed(model: tf.keras.Model, cfg: TrainConfig) -> None:
    """Apply the config's frozen parts to a freshly built model, before `compile`."""
    if cfg.freeze_batchnorm:
        freeze_batchnorm(model)
    if cfg.frozen_stages:
        freeze_leading_stages(model, cfg.model, cfg.frozen_stages)
