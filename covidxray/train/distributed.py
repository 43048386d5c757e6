"""The one module that talks to Horovod.

Everything else asks a `World` for rank, size and the few collective
operations training needs, so moving off `horovod.tensorflow.keras` (e.g. to
a custom loop with `hvd.DistributedGradientTape` once Keras 3 is required)
touches only this file. Without a Horovod launcher in the environment the
world is a single process and Horovod is never imported.

Training state (model, optimizer, and a `TrainingState` as `.training`)
lives in a state object that `World.run` synchronises from rank 0 before
training starts. In elastic mode that object is Horovod's `KerasState`: when
a worker is lost, the survivors roll back to the last commit (an epoch
boundary), re-form the ring and call the training function again with the new
rank and size.
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import tensorflow as tf

from covidxray.errors import UserError
from covidxray.train.state import TrainingState

_LAUNCHER_VARIABLES = ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK")


# Horovod's own values when its variables are unset (horovod/common/operations.cc).
HOROVOD_DEFAULTS = {"HOROVOD_FUSION_THRESHOLD": str(128 * 2**20), "HOROVOD_CYCLE_TIME": repr(1.0)}


@dataclass(frozen=True)
class HorovodTuning:
    """How gradients travel: compression on the wire, tensor-fusion buffer, background cycle (train.* keys).

    Horovod reads the buffer size and cycle from the environment once, in
    hvd.init(), so `init_world` sets them just before; they win over
    horovodrun's --fusion-threshold-mb/--cycle-time-ms, so the config and
    train_log.json say what the job really used.
    """

    gradient_compression: str = "none"
    fusion_buffer_mb: int = 128
    cycle_time_ms: float = 1.0

    def environment(self) -> dict[str, str | None]:
        """Horovod's variables for this tuning; None: unset, so Horovod uses its own default.

        A value equal to Horovod's default is left unset rather than written: Horovod 0.28.1 marks every
        value it reads from the environment as fixed for its autotuner, and with both fixed its parameter
        manager dereferences a null pointer when an elastic job re-forms after losing a worker (segfault in
        ParameterManager::BayesianParameter::SetValue; tests/test_horovod.py's elastic tests).
        """
        wanted = {
            "HOROVOD_FUSION_THRESHOLD": str(self.fusion_buffer_mb * 2**20),
            "HOROVOD_CYCLE_TIME": repr(float(self.cycle_time_ms)),
        }
        return {name: None if value == HOROVOD_DEFAULTS[name] else value for name, value in wanted.items()}

    def apply(self, elastic: bool) -> None:
        """Set Horovod's variables before hvd.init() (they win over horovodrun's flags)."""
        environment = self.environment()
        if elastic and all(environment.values()):
            raise UserError(
                "an elastic job cannot change both train.fusion_buffer_mb and train.cycle_time_ms from Horovod's defaults "
                "(128 MiB, 1 ms): Horovod 0.28.1 then crashes the surviving workers when a board drops out. Keep one at its default"
            )
        for name, value in environment.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value

    def record(self) -> dict:
        return {
            "gradient_compression": self.gradient_compression,
            "fusion_buffer_mb": self.fusion_buffer_mb,
            "cycle_time_ms": self.cycle_time_ms,
        }

    def compression(self, hvd):
        return hvd.Compression.fp16 if self.gradient_compression == "fp16" else hvd.Compression.none


def launched_by_horovod() -> bool:
    return any(v in os.environ for v in _LAUNCHER_VARIABLES)


def launched_elastic() -> bool:
    """horovodrun sets this for `--min-np/--max-np/--host-discovery-script` jobs."""
    return os.environ.get("HOROVOD_ELASTIC") == "1"


class StaticState:
    """Training state of a fixed-size job: rank 0's values are broadcast once, before training.

    Mirrors the part of Horovod's elastic `KerasState` interface that training
    uses (`training`, `sync`, `commit`), so the trainer has a single code path.
    """

    def __init__(self, world: World, model: tf.keras.Model, optimizer, training: TrainingState):
        self._world, self._model, self._optimizer, self.training = world, model, optimizer, training

    def sync(self) -> None:
        self._world.broadcast_variables(list(self._model.variables) + list(self._optimizer.variables))
        self.training = self._world.broadcast_object(self.training)

    def commit(self) -> None:
        """Nothing to keep in memory: a fixed-size job does not roll back."""


@dataclass
class World:
    rank: int = 0
    size: int = 1
    local_rank: int = 0
    local_size: int = 1
    hvd: Any = None
    elastic: bool = False
    tuning: HorovodTuning = HorovodTuning()

    @property
    def is_root(self) -> bool:
        return self.rank == 0

    @property
    def hostname(self) -> str:
        """The host as named in horovodrun's -H/hostfile (what the user can act on), else the machine's name."""
        return os.environ.get("HOROVOD_HOSTNAME") or socket.gethostname()

    @property
    def cores_per_rank(self) -> int:
        return cores_per_rank(self.local_size)

    def refresh(self) -> None:
        """Re-read rank and size (they change when an elastic job gains or loses workers)."""
        if self.hvd is not None:
            self.rank, self.size = self.hvd.rank(), self.hvd.size()
            self.local_rank, self.local_size = self.hvd.local_rank(), self.hvd.local_size()

    def distributed_optimizer(self, optimizer):
        if self.hvd is None:
            return optimizer
        return self.hvd.DistributedOptimizer(optimizer, compression=self.tuning.compression(self.hvd))

    def metric_averager(self) -> Callable[[int, dict], None]:
        """`average(epoch, logs)`: every metric in an epoch's logs replaced by its mean over the ranks.

        Horovod's MetricAverageCallback, called by the trainer as one step of
        its end of epoch. It is the only Horovod callback training uses: the LR
        (scaled by size, warmed up, decayed) is set by
        covidxray.train.schedule for one process and many alike, and there is no
        broadcast callback: `World.run` broadcasts (or elastically syncs) rank
        0's state before the first step, so every rank starts from the same,
        possibly resumed, weights and optimizer slots.
        """
        if self.hvd is None:
            return lambda epoch, logs: None
        return self.hvd.callbacks.MetricAverageCallback().on_epoch_end

    def make_state(self, model: tf.keras.Model, optimizer, training: TrainingState):
        """The object `run` syncs and rolls back: model and optimizer variables, and `training`.

        Commit it at epoch ends only (the trainer does, as its last end-of-epoch
        step): a lost worker then costs at most the epoch in progress, which the
        survivors redo, and the per-batch loop stays free of copies. Horovod's
        `UpdateEpochStateCallback` is not used: it counts epochs from 0 in each
        `fit`, while the trainer passes `initial_epoch`, so its epochs are
        absolute already.
        """
        if self.elastic:
            return self.hvd.elastic.KerasState(model, optimizer, training=training)
        return StaticState(self, model, optimizer, training)

    def run(self, train_fn: Callable[[Any], Any], state) -> Any:
        """Call `train_fn(state)` once everyone holds rank 0's state; elastic: again after each membership change."""
        if not self.elastic:
            state.sync()
            return train_fn(state)

        def attempt(current_state):
            self.refresh()
            return train_fn(current_state)

        return self.hvd.elastic.run(attempt)(state)

    def broadcast_variables(self, variables: list) -> None:
        if self.hvd is not None and self.size > 1:
            _core().broadcast_variables(variables, root_rank=0)

    def allgather_object(self, obj: Any) -> list:
        return [obj] if self.hvd is None else _core().allgather_object(obj)

    def broadcast_object(self, obj: Any) -> Any:
        return obj if self.hvd is None else _core().broadcast_object(obj, root_rank=0)


def _core():
    """`horovod.tensorflow`: the variable and object collectives live there, not in its keras module."""
    import horovod.tensorflow as hvd_tf

    return hvd_tf


def cores_per_rank(local_size: int) -> int:
    """The ranks on a board split the cores this process may use (fewer than the board's under taskset or a cpuset)."""
    return max(1, len(os.sched_getaffinity(0)) // max(1, local_size))


def configure_threads(local_size: int) -> None:
    """Give each rank its share of the cores, so ranks do not fight over cores."""
    per_rank = cores_per_rank(local_size)
    tf.config.threading.set_intra_op_parallelism_threads(per_rank)
    tf.config.threading.set_inter_op_parallelism_threads(min(2, per_rank))


def check_launch_mode(elastic: bool) -> None:
    """`--elastic` must match how the job was launched: elastic jobs need the elastic state machinery."""
    if elastic and not launched_elastic():
        raise UserError(
            "--elastic needs an elastic launch: horovodrun -np N --min-np MIN --max-np MAX "
            "--host-discovery-script scripts/discover_hosts.sh covidxray train --elastic ..."
        )
    if launched_elastic() and not elastic:
        raise UserError(
            "this job was launched elastically (horovodrun --min-np/--max-np/--host-discovery-script): add --elastic"
        )


def init_world(tuning: HorovodTuning = HorovodTuning()) -> World:
    if not launched_by_horovod():
        configure_threads(1)
        return World(tuning=tuning)
    import horovod.tensorflow.keras as hvd

    tuning.apply(launched_elastic())
    hvd.init()
    configure_threads(hvd.local_size())
    world = World(hvd=hvd, elastic=launched_elastic(), tuning=tuning)
    world.refresh()
    return world


def standalone_gradient_averager(tuning: HorovodTuning) -> Callable[[list], list] | None:
    """Horovod in this process alone, set up as `tuning` says: what averages gradients in covidxray.train.memory_probe.

    `DistributedOptimizer` skips the allreduce in a 1-rank job, so the probe
    calls `grouped_allreduce` itself: the same fused collective, which fills
    Horovod's fusion buffer as a job's rank does. None when Horovod is not installed.
    """
    try:
        hvd = _core()
    except ImportError:
        return None
    tuning.apply(elastic=False)
    hvd.init()
    compression = tuning.compression(hvd)
    return lambda gradients: hvd.grouped_allreduce(gradients, op=hvd.Average, compression=compression)


def _quietly(fn: Callable[[], Any]) -> Any:
    with contextlib.redirect_stderr(io.StringIO()):
        return fn()


def horovod_build() -> dict:
    """What the installed Horovod was built with, by Horovod's own checks (for `covidxray doctor`)."""
    try:
        import horovod
        from horovod.common import util
    except ImportError as err:
        return {"installed": False, "error": str(err)}
    from horovod.runner import mpi_run

    mpirun = shutil.which("mpirun")
    return {
        "installed": True,
        "version": horovod.__version__,
        "frameworks": {name: bool(util.extension_available(name)) for name in ("tensorflow", "torch", "mxnet")},
        "controllers": {"gloo": bool(util.gloo_built()), "mpi": bool(util.mpi_built())},
        "tensor_operations": {
            "gloo": bool(util.gloo_built()),
            "mpi": bool(util.mpi_built()),
            "nccl": bool(util.nccl_built()),
            "ddl": bool(util.ddl_built()),
            "ccl": bool(util.ccl_built()),
        },
        "mpirun": mpirun or "",
        # horovodrun --mpi recognises MPICH only when `mpirun --version` says "MPICH"; Debian's
        # MPICH 4 prints "HYDRA build details" instead (fixed upstream after 0.28.1, horovod#3984).
        "horovodrun_mpi_detects": _quietly(mpi_run._get_mpi_implementation) if mpirun else "",
    }
