"""What `train` checks before its first step: intact shards, and that `--resume` continues the same run.

- Every rank verifies the shard files it will read against the sha256s in the
  (sealed) manifest, so a bit-flipped or relabelled shard is never trained on.
- `--resume` refuses when the data set (the manifest's content hash: labels,
  image size, preprocessing, every shard's sha256) or a training setting
  differs from what the run started with, naming each difference; `--force`
  continues anyway and records the new inputs. Settings that may change on a
  resume without changing what is learned so far: epochs (to train longer),
  run_dir, elastic and early_stopping_patience.

Any rank's problem is gathered to every rank and raised everywhere, so a
Horovod job stops on all boards with the same message instead of hanging.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable
from pathlib import Path

from covidxray.config import Config
from covidxray.errors import UserError
from covidxray.manifest import MANIFEST, content_sha256, describe_shard_problems, shard_paths, shard_problems
from covidxray.run_folder import write_json
from covidxray.train.input import assign_shards

RUN_INPUTS = "run_inputs.json"  # the data set and settings this run's checkpoints were trained with
RESUMABLE_CHANGES = ("epochs", "run_dir", "elastic", "early_stopping_patience")


def training_settings(config: Config) -> dict:
    return {k: v for k, v in dataclasses.asdict(config.train).items() if k not in RESUMABLE_CHANGES}


def _rank_shards(world, data_dir: Path, manifest: dict) -> tuple[list[str], str | None]:
    """(the train and val shard files this rank reads, what is wrong with them or None)."""
    files = [
        f
        for split in ("train", "val")
        for f in assign_shards(shard_paths(data_dir, split), world.rank, world.size).files
    ]
    problems = shard_problems(data_dir, manifest, files)
    if not (problems["missing"] or problems["sha256_mismatch"]):
        return files, None
    return files, f"rank {world.rank} on {world.hostname}: {describe_shard_problems(data_dir, problems)}"


def _resume_error(run_dir: Path, inputs: dict, force: bool, say: Callable[[str], None]) -> str | None:
    path = run_dir / RUN_INPUTS
    if not path.is_file():
        return None  # a run from before this record existed: nothing to compare with
    try:
        saved = json.loads(path.read_text())
        saved_settings, saved_data = dict(saved["train"]), saved["data_sha256"]
    except (ValueError, KeyError, TypeError) as err:
        if force:
            return None
        return (
            f"{path} is damaged ({err.__class__.__name__}), so it is unknown what this run was trained with; "
            "resume with --resume --force if you are sure the config and data are the same, or start over without --resume"
        )
    differences = (
        [f"data set ({MANIFEST} content sha256 {saved_data[:12]} then, {inputs['data_sha256'][:12]} now)"]
        if saved_data != inputs["data_sha256"]
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
    world, config: Config, data_dir: Path, manifest: dict, resume: bool, force: bool, say: Callable[[str], None]
) -> None:
    """Raise the same UserError on every rank when a shard is damaged or a resume does not match; else record the inputs."""
    started = time.perf_counter()
    run_dir = Path(config.train.run_dir)
    inputs = {"data_sha256": content_sha256(manifest), "data_dir": str(data_dir), "train": training_settings(config)}
    files, error = _rank_shards(world, data_dir, manifest)
    if error is None and world.is_root and resume:
        error = _resume_error(run_dir, inputs, force, say)
    errors = [e for e in world.allgather_object(error) if e]
    if errors:
        raise UserError("\n".join(errors))
    if world.is_root:
        mb = sum(Path(f).stat().st_size for f in files) / 1e6
        say(f"{len(files)} shard(s) ({mb:.0f} MB) verified against {MANIFEST} in {time.perf_counter() - started:.1f} s")
        run_dir.mkdir(parents=True, exist_ok=True)
        write_json(run_dir / RUN_INPUTS, inputs)
