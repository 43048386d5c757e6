"""One training rank's step time and peak memory per model, on this machine and on an emulated Pi 4 (arm64).

Issue 23 chooses the Pi-cluster model from, among others, the time of one
training step and the peak RSS of a rank at batch 16 (under 1.5 GB on a 4 GB
board). Each case runs scripts/_step_probe.py in a fresh process: the model
built and frozen as `covidxray train` does it, --warmup untimed then --steps
timed steps of --batch-size random gray images at --image-size px (forward,
backward, Adam; no Horovod, no input pipeline), and the process's peak RSS.
The cases: configs/pi-cluster.yaml's rank (efficientnet_lite0, 4 stages
frozen, batch 16), the same model with every layer trained (the figure
bench_allreduce uses), and mobilenet_v3_small.

scripts/arm64_check.sh's `train-step` step runs this script inside an emulated
arm64 Debian 12 (QEMU_CPU=cortex-a72) and keeps its report; `--emulated
REPORT` puts that report's figures beside this machine's. QEMU translates
every arm64 instruction into x86 code, so an emulated time is not a Pi's: the
comparable figures are the ratios between models, each machine running its own
kernels (oneDNN on x86-64, Eigen/XNNPACK NEON paths on aarch64), and the peak
RSS, which is the arm64 process's memory plus QEMU's own (its translated code
and heap): the probe reads QEMU's share (`emulator_mib`), and the goal is
judged on the process's own memory, the peak without that share.
Goal: each rank of the Pi-cluster candidates peaks under 1.5 GB (1.5e9 bytes)
on both.

    python scripts/bench_step.py --out docs/bench/step.json \\
        --emulated /var/tmp/covidxray-arm64/rootfs/opt/arm64-check/bench-step.json
"""

from __future__ import annotations

import json
import platform
import sys
from pathlib import Path

import _bench

# What the figures depend on (scripts/stale_benchmarks.py): the models, how train freezes them, the probe.
MEASURES = (
    "covidxray/config.py",  # the defaults every run takes what it is not told
    "covidxray/strict.py",  # how each setting is read and checked
    "covidxray/registry.py",  # which model, source, task or format a name means
    "covidxray/manifest.py",  # which shards of which split a run reads
    "covidxray/records.py",  # a record's fields and the label vocabulary
    "scripts/_step_probe.py",
    "covidxray/train/models.py",
    "covidxray/train/efficientnet_lite.py",
    "covidxray/train/finetune.py",
    "covidxray/train/distributed.py",
    "configs/pi-cluster.yaml",
)

PROBE = _bench.REPO / "scripts" / "_step_probe.py"
PI_CLUSTER = _bench.REPO / "configs" / "pi-cluster.yaml"
RSS_LIMIT_MIB = 1.5e9 / 2**20  # issue 23: a rank at batch 16 under 1.5 GB on a 4 GB board


def cases() -> dict[str, tuple[str, int, bool]]:
    """Case name -> (model, frozen stages, a candidate rank): the Pi-cluster rank as its config says, the alternative,
    and the Pi-cluster model with every layer trained (context: the step bench_allreduce uses)."""
    from covidxray.config import load_config

    rank = load_config(PI_CLUSTER).train
    return {
        f"{rank.model}, {rank.frozen_stages} stages frozen (pi-cluster.yaml)": (rank.model, rank.frozen_stages, True),
        "mobilenet_v3_small": ("mobilenet_v3_small", 0, True),
        f"{rank.model}, all layers": (rank.model, 0, False),
    }


def measure(model: str, frozen_stages: int, args) -> dict:
    cmd = [
        sys.executable,
        str(PROBE),
        *("--model", model, "--frozen-stages", str(frozen_stages), "--image-size", str(args.image_size)),
        *("--batch-size", str(args.batch_size), "--steps", str(args.steps), "--warmup", str(args.warmup)),
    ]
    return json.loads(_bench.run(cmd, timeout=4 * 3600).stdout.strip().splitlines()[-1])


def machine_label(environment: dict) -> str:
    return f"{environment['machine']} ({environment['cpu_count']} cores)"


def main() -> None:
    bench = _bench.Bench("step", __doc__)
    bench.parser.add_argument("--image-size", type=int, default=224)
    bench.parser.add_argument("--batch-size", type=int, default=16, help="per rank (default: %(default)s)")
    bench.parser.add_argument("--steps", type=int, default=5, help="timed steps per case (default: %(default)s)")
    bench.parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (default: %(default)s)")
    bench.parser.add_argument(
        "--emulated", type=Path, help="the report of this benchmark run inside the emulated arm64 root file system"
    )
    bench.parser.add_argument(
        "--candidates-only", action="store_true", help="skip the all-layers case (context, the slowest under emulation)"
    )
    args = bench.parse({"image_size": 64, "steps": 1, "warmup": 1})

    emulated = json.loads(args.emulated.read_text()) if args.emulated else None
    setup = {key: getattr(args, key) for key in ("image_size", "batch_size")}  # --steps only sets the precision
    if emulated and any(emulated["results"][key] != value for key, value in setup.items()):
        sys.exit(f"error: {args.emulated} measured another setup than {setup}: run both with the same flags")
    measured, candidates = {}, cases()
    for name, (model, frozen, candidate) in candidates.items():
        if args.candidates_only and not candidate:
            continue
        print(
            f"{name}: {args.warmup} + {args.steps} steps of batch {args.batch_size} at {args.image_size} px", flush=True
        )
        measured[name] = measure(model, frozen, args)
        print(f"  median {measured[name]['step_s'] * 1e3:.0f} ms, peak RSS {measured[name]['peak_rss_mib']:.0f} MiB")
    here = _bench.environment()
    runs = [(machine_label(here), measured, False)]  # (machine, figures, emulated)
    if emulated:
        runs.append((f"emulated {machine_label(emulated['environment'])}", emulated["results"]["cases"], True))

    pi_rank = next(iter(measured))
    rows = []
    for machine, figures, emulated_run in runs:
        for name, m in figures.items():
            # natively VmHWM is the process's own; under QEMU the share the probe read comes off (a report from before the
            # probe read it has none: its peak stands as measured)
            emulator = m.get("emulator_mib", 0.0) if emulated_run else 0.0
            rows.append(
                [
                    name,
                    machine,
                    f"{m['step_s'] * 1e3:.0f}",
                    f"{m['step_s'] / figures[pi_rank]['step_s']:.2f}",
                    f"{m['peak_rss_mib']:.0f}",
                    f"{emulator:.0f}" if emulated_run else "",
                    f"{m['trainable_parameters'] / 1e6:.2f} M",
                ]
            )
            if candidates[name][2]:
                bench.at_most(
                    f"peak RSS of a rank, {name}, {machine}{' (without QEMU own)' if emulated_run else ''}",
                    m["peak_rss_mib"] - emulator,
                    round(RSS_LIMIT_MIB, 1),
                )
    counts = [f"{args.steps} after {args.warmup}"]
    if emulated:
        counts.append(f"{emulated['results']['steps']} after {emulated['results']['warmup']} emulated")
    bench.table(
        f"One rank's training step: batch {args.batch_size}, {args.image_size} px gray, Adam, no Horovod "
        f"(median of {' and '.join(counts)} steps)",
        ["case", "machine", "step ms", "step / Pi-cluster rank's", "peak RSS MiB", "of it QEMU's own MiB", "trainable"],
        rows,
    )
    if emulated:
        (_, host, _), (_, arm, _) = runs
        bench.table(
            "Emulated arm64 against this machine (the same probe)",
            ["case", "x86-64 step ms", "emulated arm64 step ms", "emulated / x86-64"],
            [
                [name, f"{host[name]['step_s'] * 1e3:.0f}", f"{arm[name]['step_s'] * 1e3:.0f}",
                 f"{arm[name]['step_s'] / host[name]['step_s']:.1f}"]
                for name in host
                if name in arm
            ],
        )  # fmt: skip
    results = {
        "image_size": args.image_size,
        "batch_size": args.batch_size,
        "steps": args.steps,
        "warmup": args.warmup,
        "machine": platform.machine(),
        "cases": measured,
        "emulated": {key: emulated[key] for key in ("environment", "command", "date")} | emulated["results"]
        if emulated
        else None,
    }
    bench.finish(args, results)


if __name__ == "__main__":
    main()
