"""The training state: what a run needs to carry on after an epoch, and the decisions made on it.

Every rank holds the same `TrainingState` (rank 0's, broadcast before training; validation metrics are
gathered, so every rank then reaches the same decisions), so in an elastic job any survivor can take over
as rank 0 with the full history. `checkpoints/latest.json` stores it beside each checkpoint, and
`--resume` reads it back.

It is frozen: each epoch end builds a new one and hands it to the state object of
covidxray.train.distributed, which commits it. Horovod's elastic state keeps a reference to the committed
value, not a copy, so a value changed in place would also change the copy a rollback restores.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

MONITOR = "val_auc"  # macro one-vs-rest ROC AUC on the validation split
PREDICTED_CLASSES = "val_predicted_classes"  # distinct argmax classes on val; 1 = a constant predictor


@dataclass(frozen=True)
class TrainingState:
    epoch: int = 0  # epochs finished (Keras' next `initial_epoch`)
    history: list[dict] = field(default_factory=list)  # train_log.json's entries, one per finished epoch
    best: dict = field(default_factory=dict)  # {"epoch": n, **metrics} of the best MONITOR so far; {} before any
    epochs_since_best: int = 0  # early stopping's count

    def logged(self, entry: dict) -> TrainingState:
        """With one more history entry, in a new list."""
        return replace(self, history=self.history + [entry])

    def judged(self, metrics: dict) -> TrainingState:
        """With the best score and early-stopping count after epoch `self.epoch`, whose JSON-safe metrics these are.

        An undefined MONITOR (None: a class missing from val) is never an improvement.
        """
        score, best = metrics.get(MONITOR), self.best.get(MONITOR)
        if score is not None and score > (-math.inf if best is None else best):
            return replace(self, best={"epoch": self.epoch, **metrics}, epochs_since_best=0)
        return replace(self, epochs_since_best=self.epochs_since_best + 1)

    def stopped_early(self, patience: int) -> bool:
        """Patience 0 never stops."""
        return patience > 0 and self.epochs_since_best >= patience

    def collapsed_epochs(self) -> list[int]:
        """Epochs after which every validation image was predicted as one class."""
        return [entry["epoch"] for entry in self.history if entry.get(PREDICTED_CLASSES) == 1]
