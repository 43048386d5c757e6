"""What `train` checks before its first step: one run per folder, intact shards, and that `--resume` continues the same run.

- Rank 0 takes the run folder's lock (RUN_LOCK) before anything there is
  changed, and holds it until training ends, so a second `train` into the
  same folder stops at once, naming the host and pid of the one running,
  instead of deleting its checkpoints. The lock is an flock on a file that
  records its holder: the kernel releases it when the holder dies, however it
  dies, so a killed run's leftover file never blocks the next one.
- Every rank verifies the shard files it will read against the sha256s in the
  (sealed) manifest, so a bit-flipped or relabelled shard is never trained on.
- `--resume` refuses when the data set (the manifest's content hash: labels,
  image size, preprocessing, every shard's sha256) or a training setting
  differs from what the run started with, naming each difference; `--force`
  continues anyway and records the new inputs. Settings that may change on a
  resume without changing what is learned so far: epochs (to train longer),
  run_dir, elastic, early_stopping_patience and tensorboard. A resume from a checkpoint
  without the record of its inputs refuses too, unless `--force`.

Any rank's problem is gathered to every rank and raised everywhere, so a
Horovod job stops on all boards with the same message instead of hanging.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import fcntl
import json
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

from covidxray.config import Config
from covidxray.errors import UserError
from covidxray.files import output_folder
from covidxray.manifest import MANIFEST, PreparedData, describe_shard_problems, shard_problems
from covidxray.run_folder import CHECKPOINTS, LATEST, RUN_LOCK, write_json
from covidxray.train.input import assign_shards

RUN_INPUTS = "run_inputs.json"  # the data set and settings this run's checkpoints were trained with
RESUMABLE_CHANGES = ("epochs", "run_dir", "elastic", "early_stopping_patience", "tensorboard")


class RunLock:
    """The run folder's lock, held by rank 0 from before it changes anything there until training ends."""

    def __init__(self, run_dir: Path):
        self.run_dir, self.path = run_dir, run_dir / RUN_LOCK
        self.handle: TextIO | None = None

    def acquire(self) -> str | None:
        """Take the lock; None when taken, else why not (another run's host and pid, or a folder that cannot be one)."""
        try:
            output_folder(self.run_dir, "--run-dir")
        except UserError as err:
            return str(err)
        while True:
            try:
                handle = open(self.path, "a+")
            except OSError as err:
                return f"cannot create the lock file {self.path} ({err.strerror or err}); choose another --run-dir"
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                handle.seek(0)
                holder = handle.read().strip() or "a process that is just starting"
                handle.close()
                return (
                    f"{self.run_dir} is in use by another `covidxray train` ({holder}); wait for it to end, or train "
                    f"into another --run-dir. The lock ({self.path}) is released when that process ends, however it ends"
                )
            try:
                same_file = os.stat(self.path).st_ino == os.fstat(handle.fileno()).st_ino
            except FileNotFoundError:  # its holder released (and removed) it between our open and flock
                same_file = False
            if same_file:
                break
            handle.close()
        started = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
        handle.seek(0)
        handle.truncate()
        handle.write(f"host {socket.gethostname()}, pid {os.getpid()}, started {started}")
        handle.flush()
        self.handle = handle
        return None

    def release(self) -> None:
        if self.handle is not None:
            self.path.unlink(missing_ok=True)  # while still held: a waiting opener then sees a new file, not this one
            self.handle.close()
            self.handle = None

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def training_settings(config: Config) -> dict:
    return {k: v for k, v in dataclasses.asdict(config.train).items() if k not in RESUMABLE_CHANGES}


def _rank_shards(world, data: PreparedData) -> tuple[list[str], str | None]:
    """(the train and val shard files this rank reads, what is wrong with them or None)."""
    files = [f for split in ("train", "val") for f in assign_shards(data.shards(split), world.rank, world.size).files]
    problems = shard_problems(data, files)
    if not (problems["missing"] or problems["sha256_mismatch"]):
        return files, None
    return files, f"rank {world.rank} on {world.hostname}: {describe_shard_problems(data.path, problems)}"


def recorded_dataset_id(run_dir: Path) -> str | None:
    """The id of the data set RUN_INPUTS says the run trained on; None when it is absent or damaged."""
    try:
        saved = json.loads((Path(run_dir) / RUN_INPUTS).read_text())
        return _dataset_id(saved)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _dataset_id(saved: dict) -> str:
    """RUN_INPUTS' data set id; `data_sha256` in a run folder of an earlier covidxray: the same id, as first named."""
    return str(saved["dataset_id"] if "dataset_id" in saved else saved["data_sha256"])


def _resume_error(run_dir: Path, inputs: dict, force: bool, say: Callable[[str], None]) -> str | None:
    path = run_dir / RUN_INPUTS
    if not path.is_file():
        if force or not (run_dir / CHECKPOINTS / LATEST).is_file():
            return None  # no checkpoint to continue: nothing to mix up
        return (
            f"{path} is missing, so it is unknown which data set and settings the checkpoint in {run_dir} was trained "
            "with; resume with --resume --force if you are sure they are the same, or start over without --resume"
        )
    try:
        saved = json.loads(path.read_text())
        saved_settings, saved_data = dict(saved["train"]), _dataset_id(saved)
    except (ValueError, KeyError, TypeError) as err:
        if force:
            return None
        return (
            f"{path} is damaged ({err.__class__.__name__}), so it is unknown what this run was trained with; "
            "resume with --resume --force if you are sure the config and data are the same, or start over without --resume"
        )
    differences = (
        [f"data set ({MANIFEST} content sha256 {saved_data[:12]} then, {inputs['dataset_id'][:12]} now)"]
        if saved_data != inputs["dataset_id"]
        else []
    )
    settings = inputs["train"]
    differences += [
        f"train.{key} ({saved_settings.get(key)!r} then, {settings.get(key)!r} now)"
        for key in sorted(set(saved_settings) | set(settings))
        if saved_settings.get(key) != settings.get(key)
    ]
    if not differences:
        return None
    if force:
        say(f"--force: resuming {run_dir} although these differ: {'; '.join(differences)}")
        return None
    return (
        f"--resume would continue {run_dir} with a different {'; '.join(differences)}. Resume with the config and data "
        "it was trained with, start a new --run-dir, or add --force to continue anyway"
    )


def check_before_training(
    world,
    config: Config,
    data: PreparedData,
    effective: dict,
    resume: bool,
    force: bool,
    say: Callable[[str], None],
) -> contextlib.AbstractContextManager:
    """Raise the same UserError on every rank when the run folder is taken, a shard is damaged or a resume does not
    match; else record the inputs (with the `effective` data settings, the prepared set's). Returns the run folder's
    lock (rank 0; a no-op elsewhere): hold it while training."""
    started = time.perf_counter()
    run_dir = Path(config.train.run_dir)
    inputs = {
        "dataset_id": data.dataset_id,
        "data_dir": str(data.path),
        "data": effective,
        "train": training_settings(config),
    }
    lock = RunLock(run_dir) if world.is_root else None
    error = lock.acquire() if lock is not None else None  # first: a second run stops before it verifies or deletes
    files: list[str] = []
    if error is None:
        files, error = _rank_shards(world, data)
    if error is None and world.is_root and resume:
        error = _resume_error(run_dir, inputs, force, say)
    errors = [e for e in world.allgather_object(error) if e]
    if errors:
        if lock is not None:
            lock.release()
        raise UserError("\n".join(errors))
    if world.is_root:
        mb = sum(Path(f).stat().st_size for f in files) / 1e6
        say(f"{len(files)} shard(s) ({mb:.0f} MB) verified against {MANIFEST} in {time.perf_counter() - started:.1f} s")
        write_json(run_dir / RUN_INPUTS, inputs)
    return lock if lock is not None else contextlib.nullcontext()
