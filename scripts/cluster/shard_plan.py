"""Which files each board needs for a run: manifest.json, every val shard, and its ranks' train shards.

Ranks are placed on hosts by Horovod's own assignment (`nodes.place_ranks`) and
a rank's train shards come from the trainer's own `assign_shards`, so the plan
is what the run will read, never a second guess at it.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # covidxray.train.input imports TensorFlow

from horovod.runner.common.util.hosts import HostInfo  # noqa: E402
from nodes import ClusterError, place_ranks  # noqa: E402

from covidxray.data.prepare import MANIFEST, load_manifest, shard_paths  # noqa: E402
from covidxray.errors import UserError  # noqa: E402
from covidxray.train.input import assign_shards  # noqa: E402

SHARDS = "shards"


@dataclass
class HostPlan:
    host: str
    ranks: list[int] = field(default_factory=list)
    files: list[str] = field(default_factory=list)  # relative to the data dir

    def add(self, relative: list[str]) -> None:
        self.files.extend(f for f in relative if f not in self.files)

    @property
    def train_shards(self) -> list[str]:
        return [f for f in self.files if Path(f).name.startswith("train-")]


def plan(data_dir: Path, hosts: list[HostInfo], num_proc: int | None = None, every_train_shard: bool = False) -> list[HostPlan]:
    """One HostPlan per host that gets ranks, in hostfile order."""
    try:
        load_manifest(data_dir)
    except UserError as err:
        raise ClusterError(str(err)) from None
    slots = place_ranks(hosts, num_proc)
    train = shard_paths(data_dir, "train")
    common = [MANIFEST] + [f"{SHARDS}/{p.name}" for p in shard_paths(data_dir, "val")]
    plans = {slot.hostname: HostPlan(slot.hostname) for slot in slots}
    for slot in slots:
        files = train if every_train_shard else assign_shards(train, slot.rank, slot.size).files
        plans[slot.hostname].ranks.append(slot.rank)
        plans[slot.hostname].add(common + [f"{SHARDS}/{Path(f).name}" for f in files])
    return list(plans.values())


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--np", type=int, default=None, dest="num_proc", help="Ranks the run will use (default: every slot in the hostfile).")
    parser.add_argument("--all", action="store_true", dest="every_train_shard", help="Every train shard on every board (elastic runs re-number ranks).")
