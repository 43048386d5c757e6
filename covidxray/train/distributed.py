"""The one module that talks to Horovod.

Everything else asks a `World` for rank, size and the few collective
operations training needs, so moving off `horovod.tensorflow.keras` (e.g. to
a custom loop with `hvd.DistributedGradientTape` once Keras 3 is required)
touches only this file. Without a Horovod launcher in the environment the
world is a single process and Horovod is never imported.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Any

import tensorflow as tf

_LAUNCHER_VARIABLES = ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK")


def launched_by_horovod() -> bool:
    return any(v in os.environ for v in _LAUNCHER_VARIABLES)


@dataclass
class World:
    rank: int = 0
    size: int = 1
    local_rank: int = 0
    local_size: int = 1
    hvd: Any = None

    @property
    def is_root(self) -> bool:
        return self.rank == 0

    @property
    def hostname(self) -> str:
        return socket.gethostname()

    def distributed_optimizer(self, optimizer):
        return optimizer if self.hvd is None else self.hvd.DistributedOptimizer(optimizer)

    def callbacks(self, scaled_lr: float, warmup_epochs: int, steps_per_epoch: int) -> list:
        """Broadcast initial state from rank 0, average metrics before any metric-driven callback, warm up the LR."""
        if self.hvd is None:
            return []
        callbacks = [
            self.hvd.callbacks.BroadcastGlobalVariablesCallback(0),
            self.hvd.callbacks.MetricAverageCallback(),
        ]
        if warmup_epochs > 0 and self.size > 1:
            callbacks.append(
                self.hvd.callbacks.LearningRateWarmupCallback(
                    initial_lr=scaled_lr, warmup_epochs=warmup_epochs, steps_per_epoch=steps_per_epoch, verbose=0
                )
            )
        return callbacks

    def allgather_object(self, obj: Any) -> list:
        if self.hvd is None:
            return [obj]
        import horovod.tensorflow as hvd_tf  # the object collectives live in the core module

        return hvd_tf.allgather_object(obj)

    def broadcast_object(self, obj: Any) -> Any:
        if self.hvd is None:
            return obj
        import horovod.tensorflow as hvd_tf

        return hvd_tf.broadcast_object(obj, root_rank=0)


def configure_threads(local_size: int) -> None:
    """Split the board's cores between the ranks on it, so ranks do not fight over cores."""
    cores = os.cpu_count() or 1
    per_rank = max(1, cores // max(1, local_size))
    tf.config.threading.set_intra_op_parallelism_threads(per_rank)
    tf.config.threading.set_inter_op_parallelism_threads(min(2, per_rank))


def init_world() -> World:
    if not launched_by_horovod():
        configure_threads(1)
        return World()
    import horovod.tensorflow.keras as hvd

    hvd.init()
    configure_threads(hvd.local_size())
    return World(rank=hvd.rank(), size=hvd.size(), local_rank=hvd.local_rank(), local_size=hvd.local_size(), hvd=hvd)
