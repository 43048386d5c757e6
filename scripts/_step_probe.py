"""One training rank's compute step and peak memory, in a fresh process: run by scripts/bench_step.py per case.

The model is built and frozen as `covidxray train` does it (build_model, then
the config's frozen stages), from scratch: pretrained weights change the
values, not the work. `_bench.training_step` times its steps on random gray
images; the peak resident memory is the process's VmHWM at the end (the
memory probe's measure), so each case's peak is its own. Prints one JSON line.

Under a user-mode emulator (QEMU runs the arm64 half, scripts/arm64_check.sh)
VmHWM also counts the emulator's own memory: its binary, its heap and its
translated code. QEMU 7.2 shows the guest a /proc/self/maps of the guest's
mappings only, but passes the whole process's /proc/self/smaps through, so
the resident memory of the mappings /proc/self/maps does not list is the
emulator's (`emulator_mib`; natively 0: both list the same mappings). It is
read once, after the steps: by then the code of every kernel they run has been
translated, and the translation buffer does not shrink.

    python scripts/_step_probe.py --model efficientnet_lite0 --frozen-stages 4 --image-size 224 --batch-size 16
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import _bench

MAPPING = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) ", re.MULTILINE)


def emulator_mib(maps: str, smaps: str) -> float:
    """Resident MiB of the `smaps` entries that overlap no mapping of `maps` (both in /proc/self's formats)."""
    own = [(int(start, 16), int(end, 16)) for start, end in MAPPING.findall(maps)]
    outside = 0
    for entry in re.split(r"(?m)^(?=[0-9a-f]+-[0-9a-f]+ )", smaps):
        found = MAPPING.match(entry)
        if found is None:
            continue
        start, end = int(found[1], 16), int(found[2], 16)
        resident = re.search(r"^Rss:\s+(\d+) kB", entry, re.MULTILINE)
        if resident and not any(start < own_end and own_start < end for own_start, own_end in own):
            outside += int(resident[1])
    return outside / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--frozen-stages", type=int, default=0)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--classes", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5, help="timed steps (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (default: %(default)s)")
    args = parser.parse_args()

    from covidxray.config import load_config
    from covidxray.train.distributed import configure_threads
    from covidxray.train.finetune import hold_fixed
    from covidxray.train.memory_probe import peak_rss_mb
    from covidxray.train.models import build_model

    train = {"model": args.model, "frozen_stages": args.frozen_stages, "batch_size": args.batch_size}
    cfg = load_config(None, [{"train": train}]).train
    configure_threads(1)  # one rank per board: all of the cores
    model = build_model(cfg.model, args.image_size, args.classes)
    hold_fixed(model, cfg)
    step = _bench.training_step(model, args.classes, cfg.batch_size, args.steps, args.warmup)
    emulator = emulator_mib(Path("/proc/self/maps").read_text(), Path("/proc/self/smaps").read_text())
    trainable = sum(int(v.shape.num_elements()) for v in model.trainable_variables)
    setup = {"model": cfg.model, "frozen_stages": cfg.frozen_stages, "trainable_parameters": trainable}
    print(json.dumps({**step, "peak_rss_mib": peak_rss_mb(), "emulator_mib": emulator, **setup}))


if __name__ == "__main__":
    main()
