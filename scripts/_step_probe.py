"""One training rank's compute step and peak memory, in a fresh process: run by scripts/bench_step.py per case.

The model is built and frozen as `covidxray train` does it (build_model, then
the config's frozen stages), from scratch: pretrained weights change the
values, not the work. `_bench.training_step` times its steps on random gray
images; the peak resident memory is the process's VmHWM at the end (the
memory probe's measure), so each case's peak is its own. Prints one JSON line.

Under a user-mode emulator (QEMU runs the arm64 half, scripts/arm64_check.sh)
VmHWM also counts the emulator's own memory: its translated code and its heap.
/proc/self/smaps there lists only the guest's mappings, while VmRSS counts the
whole process, so their difference, sampled during the steps, is the
emulator's share (`emulator_mib`, its largest sample); natively the two agree
(0 up to what the process maps between the two reads).

    python scripts/_step_probe.py --model efficientnet_lite0 --frozen-stages 4 --image-size 224 --batch-size 16
"""

from __future__ import annotations

import argparse
import json
import re
import threading
from pathlib import Path

import _bench

SAMPLE_S = 0.5


def _mib(pattern: str, text: str) -> float:
    return sum(int(kib) for kib in re.findall(pattern, text, re.MULTILINE)) / 1024


class EmulatorMemory(threading.Thread):
    """The largest share of this process's resident memory outside its own mappings, every SAMPLE_S seconds until
    `stop` (a daemon thread: it never holds the probe up)."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.largest_mib = 0.0
        self._stopped = threading.Event()

    def run(self) -> None:
        while not self._stopped.wait(SAMPLE_S):
            mapped = _mib(r"^Rss:\s+(\d+) kB", Path("/proc/self/smaps").read_text())
            resident = _mib(r"^VmRSS:\s+(\d+) kB", Path("/proc/self/status").read_text())
            self.largest_mib = max(self.largest_mib, resident - mapped)

    def stop(self) -> float:
        self._stopped.set()
        self.join()
        return self.largest_mib


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
    emulator = EmulatorMemory()
    emulator.start()
    step = _bench.training_step(model, args.classes, cfg.batch_size, args.steps, args.warmup)
    emulator_mib = emulator.stop()
    trainable = sum(int(v.shape.num_elements()) for v in model.trainable_variables)
    setup = {"model": cfg.model, "frozen_stages": cfg.frozen_stages, "trainable_parameters": trainable}
    print(json.dumps({**step, "peak_rss_mib": peak_rss_mb(), "emulator_mib": emulator_mib, **setup}))


if __name__ == "__main__":
    main()
