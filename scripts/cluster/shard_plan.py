"""Which files each board needs for a run: manifest.json and the train and val shards of its ranks.

Ranks are placed on hosts by Horovod's own assignment (`nodes.place_ranks`) and
a rank's shards come from the trainer's own `assign_shards` (train and val are
split over ranks the same way), so the plan is what the run will read, never a
second guess at it.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # covidxray.train.input imports TensorFlow

from horovod.runner.common.util.hosts import HostInfo  # noqa: E402
from nodes import ClusterError, place_ranks  # noqa: E402

from covidxray.errors import UserError  # noqa: E402
from covidxray.manifest import MANIFEST, open_prepared  # noqa: E402
from covidxray.train.input import assign_shards  # noqa: E402

SHARDS = "shards"


@dataclass
class HostPlan:
    host: str
    ranks: list[int] = field(default_factory=list)
    files: list[str] = field(default_factory=list)  # relative to the data dir

    def add(self, relative: list[str]) -> None:
        self.files.extend(f for f in relative if f not in self.files)


def plan(
    data_dir: Path, hosts: list[HostInfo], num_proc: int | None = None, every_shard: bool = False
) -> list[HostPlan]:
    """One HostPlan per host that gets ranks, in hostfile order."""
    try:
        data = open_prepared(data_dir)
    except UserError as err:
        raise ClusterError(str(err)) from None
    slots = place_ranks(hosts, num_proc)
    splits = [data.shards(split) for split in ("train", "val")]
    plans = {slot.hostname: HostPlan(slot.hostname) for slot in slots}
    for slot in slots:
        files = [
            f for paths in splits for f in (paths if every_shard else assign_shards(paths, slot.rank, slot.size).files)
        ]
        plans[slot.hostname].ranks.append(slot.rank)
        plans[slot.hostname].add([MANIFEST] + [f"{SHARDS}/{Path(f).name}" for f in files])
    return list(plans.values())


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--np",
        type=int,
        default=None,
        dest="num_proc",
        help="Ranks the run will use (default: every slot in the hostfile).",
    )
    parser.add_argument(
        "--all",
        action="store_true",
        dest="every_shard",
        help="Every train and val shard on every board (elastic runs re-number ranks).",
    )
