"""Learning rate per optimizer step: linear warmup, then cosine decay (or constant).

The peak is `train.learning_rate x number of ranks` (the gradient is averaged
over ranks x batch images, Goyal et al. 2017). Warmup ramps linearly from
peak / warmup steps to the peak over `warmup_epochs`, so neither a large
multi-rank LR nor a fresh Adam (whose first steps are sign-like and large)
wrecks the random initial weights; cosine then decays to 0 at the last step,
which lets a short run settle instead of ending at its largest steps.

The schedule is a function of training progress in epochs (epoch + fraction
of its steps), not of the step count, so a resumed job or an elastic job
whose world size (and hence steps per epoch) changed continues on the same
curve, and the LR is set from the current world size at every step.
"""

from __future__ import annotations

import math

import tensorflow as tf

SCHEDULES = ("cosine", "constant")


def learning_rate_at(progress: float, peak: float, warmup_epochs: float, epochs: int, schedule: str) -> float:
    """LR after `progress` epochs of training (progress counts the step about to run, so the first LR is > 0)."""
    if warmup_epochs > 0 and progress < warmup_epochs:
        return peak * progress / warmup_epochs
    if schedule == "constant" or epochs <= warmup_epochs:
        return peak
    done = min(1.0, (progress - warmup_epochs) / (epochs - warmup_epochs))
    return peak * 0.5 * (1.0 + math.cos(math.pi * done))


class LearningRateSchedule(tf.keras.callbacks.Callback):
    """Sets the optimizer's LR before every batch from the absolute epoch and the step within it."""

    def __init__(self, peak: float, warmup_epochs: float, epochs: int, steps_per_epoch: int, schedule: str):
        super().__init__()
        self.peak, self.warmup_epochs, self.epochs, self.steps, self.schedule = (
            peak,
            warmup_epochs,
            epochs,
            steps_per_epoch,
            schedule,
        )
        self.epoch = 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        progress = self.epoch + (batch + 1) / self.steps
        tf.keras.backend.set_value(
            self.model.optimizer.learning_rate,
            learning_rate_at(progress, self.peak, self.warmup_epochs, self.epochs, self.schedule),
        )
