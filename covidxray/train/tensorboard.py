"""TensorBoard event files of a training run (`tensorboard --logdir RUN_DIR/tensorboard`, or a folder of runs).

Rank 0 writes one point per finished epoch, global step = epoch (1, 2, ...: train_log.json's numbering), so a
resumed run, an elastic job that changed size and a run with a different number of boards all share one x
axis. Each point is written after the epoch is committed (checkpoint and latest.json written, the elastic state
committed), so the curves only ever hold epochs that a resume or a rollback keeps.

Exactly once per step: when a board opens, it reads the steps the folder's event files hold already and never
writes one of those again. TensorBoard does not de-duplicate a step written twice (its EventAccumulator only
purges "orphaned" points when a step goes backwards, and other readers, e.g. summary_iterator, purge nothing),
so skipping is the only way a restart leaves clean curves. Epochs committed but not yet written when a run
stopped (a crash between commit and write, or a run trained with `train.tensorboard: false`) are written from
the history when the board opens, without their confusion-matrix image, which only the live epoch has.

Event files are appended to, not replaced atomically: a run killed mid-write leaves a truncated last record,
which TensorBoard and `written_steps` skip.
"""

from __future__ import annotations

from pathlib import Path

import cv2
import numpy as np
import tensorflow as tf

NOT_PLOTTED = ("epoch", "steps", "images_per_s_per_rank", "lr", "seconds", "world_size")
CONFUSION_TAG = "validation/confusion_matrix"
CELL = 56  # pixels per confusion-matrix cell; the image is small enough to write every epoch


def epoch_scalars(entry: dict) -> dict[str, float]:
    """train_log.json's entry for one epoch -> TensorBoard tag -> value (undefined metrics, None, are left out)."""
    rates = entry.get("images_per_s_per_rank") or []
    scalars: dict[str, float | None] = {
        "train/learning_rate": entry.get("lr"),
        "time/epoch_seconds": entry.get("seconds"),
        "cluster/world_size": entry.get("world_size"),
    }
    for name, value in entry.items():
        if name in NOT_PLOTTED or not isinstance(value, (int, float)):
            continue
        group = "validation" if name.startswith("val_") else "train"  # loss, accuracy and any other training metric
        scalars[f"{group}/{name.removeprefix('val_')}"] = value
    if rates:
        slowest = int(np.argmin(rates))
        scalars.update({f"throughput/images_per_s_rank_{rank}": rate for rank, rate in enumerate(rates)})
        scalars["throughput/images_per_s_slowest_rank"] = rates[slowest]
        scalars["throughput/slowest_rank"] = slowest
        scalars["throughput/images_per_s_total"] = float(sum(rates))
    return {tag: float(value) for tag, value in scalars.items() if value is not None}


def confusion_image(matrix: np.ndarray, labels: list[str]) -> np.ndarray:
    """Validation confusion matrix (rows true, columns predicted) as an RGB uint8 image, counts in the cells.

    Drawn with OpenCV, not matplotlib: a few milliseconds, so it can be written every epoch.
    """
    matrix = np.asarray(matrix)
    n, margin = len(labels), 110
    image = np.full((margin + n * CELL + 24, margin + n * CELL + 8, 3), 255, np.uint8)
    peak = max(int(matrix.max()), 1)
    font = cv2.FONT_HERSHEY_SIMPLEX
    for (row, col), count in np.ndenumerate(matrix):
        shade = int(235 - 190 * count / peak)
        top, left = margin + row * CELL, margin + col * CELL
        image[top : top + CELL - 2, left : left + CELL - 2] = (shade, shade, 255)  # RGB: red for many images
        cv2.putText(image, str(count), (left + 6, top + CELL // 2 + 5), font, 0.5, (0, 0, 0), 1, cv2.LINE_AA)
    for i, name in enumerate(labels):
        cv2.putText(image, name[:12], (4, margin + i * CELL + CELL // 2 + 4), font, 0.4, (0, 0, 0), 1, cv2.LINE_AA)
        cv2.putText(image, name[:8], (margin + i * CELL + 2, margin - 8), font, 0.4, (0, 0, 0), 1, cv2.LINE_AA)
    cv2.putText(image, "true \\ predicted", (4, 20), font, 0.45, (0, 0, 0), 1, cv2.LINE_AA)
    return image


def written_steps(log_dir: Path) -> set[int]:
    """Steps that any event file in `log_dir` holds a summary for (a truncated last record is ignored)."""
    steps: set[int] = set()
    for path in sorted(Path(log_dir).glob("events.out.tfevents.*")):
        try:
            for event in tf.compat.v1.train.summary_iterator(str(path)):
                if event.HasField("summary"):
                    steps.add(int(event.step))
        except tf.errors.DataLossError:  # the record a killed writer was appending
            continue
    return steps


class EpochBoard:
    """Rank 0's TensorBoard writer for one `fit`; `write` each committed epoch's history entry."""

    def __init__(self, log_dir: Path, labels: list[str], history: list[dict]):
        self.labels = labels
        self.written = written_steps(log_dir)
        self.writer = tf.summary.create_file_writer(str(log_dir))
        for entry in history:  # committed before this board existed; already written ones are skipped
            self.write(entry)

    def write(self, entry: dict, confusion: np.ndarray | None = None) -> None:
        step = int(entry["epoch"])
        if step in self.written:
            return
        with self.writer.as_default(step=step):
            for tag, value in epoch_scalars(entry).items():
                tf.summary.scalar(tag, value)
            if confusion is not None:
                tf.summary.image(CONFUSION_TAG, confusion_image(confusion, self.labels)[None])
        self.writer.flush()  # visible to a running TensorBoard now, and on disk if the run dies next
        self.written.add(step)

    def close(self) -> None:
        self.writer.close()
