"""Images/s of `covidxray train` under `horovodrun -np 1` vs `-np 2` (Gloo), and the allreduce per step.

Each case (model @ image size) trains on a prepared phantom set, alternating
-np 1 and -np 2 runs `--repeats` times. Throughput comes from the per-epoch
`images_per_s_per_rank` of run_dir/train_log.json (training batches only,
validation excluded): the fastest rank's rate x ranks, because the others'
windows also hold their wait for rank 0's checkpoint (see `job_rate`; the
plain sum is in the JSON too). The first epoch of every run is warm-up and
skipped; figures are medians over all remaining epochs. The system share of
the job's CPU time (from getrusage of the finished launcher) shows what
Horovod's background and Gloo threads take from a one-core rank.

Fairness on one machine: with `--pin` (default) every rank is pinned to its
own core (`taskset -c $HOROVOD_LOCAL_RANK`), and the trainer sizes its
thread pools from the cores it may use, so -np 1 is one rank on one core and
-np 2 is two ranks on one core each: equal threads per rank, and the
speed-up is what a second board would add. `--no-pin` compares the whole
machine as one rank (2 threads) against two ranks of 1 thread.

Ceiling: before each run, the same dense float32 compute runs in 1
and then 2 processes pinned one per core; their speed-up is the most any
2-process job could get from this machine at that time (other jobs, vCPUs
sharing a physical core). The training speed-up is reported against it.

Allreduce: scripts/_allreduce_probe.py reduces tensors shaped like the
model's gradients under the same launcher; bytes per step = trainable
parameters x 4 (float32 gradients).
Goal: -np 2 >= 1.7x the images/s of -np 1.
"""

from __future__ import annotations

import json
import resource
import shutil
import statistics
from pathlib import Path

import _bench

# What the figures depend on; a change to any makes this benchmark's docs/bench reports stale
# (scripts/stale_benchmarks.py): the training loop and the input pipeline under Horovod.
MEASURES = (
    "covidxray/config.py",  # the defaults every run takes what it is not told
    "covidxray/strict.py",  # how each setting is read and checked
    "covidxray/registry.py",  # which model, source, task or format a name means
    "covidxray/manifest.py",  # which shards of which split a run reads
    "covidxray/records.py",  # a record's fields and the label vocabulary
    "covidxray/train",
    "covidxray/data/tfrecord.py",
)


PIN = ["sh", "-c", 'exec taskset -c "$HOROVOD_LOCAL_RANK" "$0" "$@"']


def horovodrun(ranks: int, pin: bool, command: list[str]) -> list[str]:
    return [
        str(_bench.VENV_BIN / "horovodrun"),
        "-np",
        str(ranks),
        "-H",
        f"localhost:{ranks}",
        "--gloo",
        *(PIN if pin else []),
        *command,
    ]


def job_rate(per_rank: list[float]) -> float:
    """Images/s of the whole job in one epoch, from each rank's own rate.

    Steps are synchronised by the allreduce, so every rank's epoch window ends
    together; rank 0 starts its window last (it writes the checkpoint between
    epochs while the others already wait in the first step). The fastest rate
    is thus the one measured over training steps only, as -np 1 is.
    """
    return max(per_rank) * len(per_rank)


def train_run(ranks: int, data: Path, run_dir: Path, model: str, args) -> dict:
    """One `covidxray train` under horovodrun: per-epoch rates after the first, and the job's CPU time split."""
    shutil.rmtree(run_dir, ignore_errors=True)
    train = _bench.covidxray(
        "train",
        "--data-dir",
        str(data),
        "--run-dir",
        str(run_dir),
        "--model",
        model,
        "--epochs",
        str(args.epochs),
        "--batch-size",
        str(args.batch_size),
    )
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    _bench.run(horovodrun(ranks, args.pin, train))
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    user, system = after.ru_utime - before.ru_utime, after.ru_stime - before.ru_stime
    epochs = json.loads((run_dir / "train_log.json").read_text())["epochs"][1:]
    return {
        "job_images_per_s": [job_rate(e["images_per_s_per_rank"]) for e in epochs],
        "sum_images_per_s": [sum(e["images_per_s_per_rank"]) for e in epochs],
        "system_cpu_share": system / (user + system),
    }


def allreduce_probe(model: str, size: int, classes: int, args) -> dict:
    out = args.workdir / f"allreduce-{model}-{size}.json"
    probe = [
        str(_bench.VENV_BIN / "python"),
        str(_bench.REPO / "scripts" / "_allreduce_probe.py"),
        "--model",
        model,
        "--image-size",
        str(size),
        "--classes",
        str(classes),
        "--steps",
        str(args.allreduce_steps),
        "--out",
        str(out),
    ]
    _bench.run(horovodrun(2, args.pin, probe))
    return json.loads(out.read_text())


def main() -> None:
    bench = _bench.Bench("horovod", __doc__)
    bench.parser.set_defaults(repeats=3)
    bench.parser.add_argument(
        "--cases", default="small_cnn@128,mobilenet_v3_small@128", help="model@image_size list (default: %(default)s)"
    )
    bench.parser.add_argument(
        "--epochs", type=int, default=3, help="per run; the first is warm-up (default: %(default)s)"
    )
    bench.parser.add_argument("--batch-size", type=int, default=32, help="per rank (default: %(default)s)")
    bench.parser.add_argument(
        "--patients",
        type=int,
        default=1600,
        help="phantom patients, ~1.6 train images each (default: %(default)s: 80 steps/epoch at -np 1)",
    )
    bench.parser.add_argument(
        "--allreduce-steps", type=int, default=20, help="timed allreduce calls (default: %(default)s)"
    )
    bench.parser.add_argument(
        "--ceiling-seconds",
        type=float,
        default=3.0,
        help="per phase of the 2-process ceiling probe run before each training run (default: %(default)s)",
    )
    bench.parser.add_argument("--pin", action="store_true", default=True, help="one core per rank (default)")
    bench.parser.add_argument("--no-pin", dest="pin", action="store_false", help="let the ranks share all cores")
    args = bench.parse(
        {
            "cases": "small_cnn@32",
            "epochs": 2,
            "patients": 40,
            "batch_size": 16,
            "allreduce_steps": 3,
            "ceiling_seconds": 0.3,
        }
    )

    from covidxray.manifest import open_prepared

    results, rows, reduce_rows = {"pinned": args.pin, "batch_size_per_rank": args.batch_size, "cases": {}}, [], []
    for model, size in _bench.parse_cases(args.cases):
        data = _bench.prepared_synthetic(
            args.workdir / f"horovod-data-{size}", size, args.patients, val_fraction=0.1, test_fraction=0.1
        )
        manifest = open_prepared(data).manifest
        rates: dict[int, list[float]] = {1: [], 2: []}
        summed: dict[int, list[float]] = {1: [], 2: []}
        system: dict[int, list[float]] = {1: [], 2: []}
        ceilings = []
        for repeat in range(args.repeats):
            for ranks in (1, 2) if repeat % 2 == 0 else (2, 1):  # alternate the order: load drifts hit both alike
                ceilings.append(_bench.parallel_ceiling(2, args.ceiling_seconds))
                run = train_run(ranks, data, args.workdir / f"horovod-run-{model}-{size}-np{ranks}", model, args)
                rates[ranks] += run["job_images_per_s"]
                summed[ranks] += run["sum_images_per_s"]
                system[ranks].append(run["system_cpu_share"])
        probe = allreduce_probe(model, size, len(manifest.labels), args)

        one, two = statistics.median(rates[1]), statistics.median(rates[2])
        scaling, ceiling = two / one, statistics.median(ceilings)
        reduce_s = statistics.median(probe["seconds"])
        step_two = args.batch_size / (two / 2)  # seconds per step of one rank at -np 2
        share = reduce_s / step_two
        sys_share = {n: statistics.median(v) for n, v in system.items()}
        results["cases"][f"{model}@{size}"] = {
            "train_images": manifest.splits["train"].records,
            "images_per_s": {"np1": rates[1], "np2": rates[2]},
            "sum_of_rank_rates": {"np1": summed[1], "np2": summed[2]},
            "system_cpu_share": sys_share,
            "np1_images_per_s": one,
            "np2_images_per_s": two,
            "scaling": scaling,
            "step_s_np2": step_two,
            "machine_ceiling": ceiling,
            "machine_ceilings": ceilings,
            "scaling_over_ceiling": scaling / ceiling,
            "allreduce": {**probe, "median_s": reduce_s, "p95_s": _bench.summarize(probe["seconds"])["p95"]},
            "bytes_per_step": probe["bytes"],
            "allreduce_share_of_step": share,
        }
        rows.append(
            [
                model,
                size,
                one,
                two,
                two / 2,
                scaling,
                ceiling,
                f"{scaling / ceiling:.0%}",
                f"{sys_share[1]:.0%} / {sys_share[2]:.0%}",
                len(rates[1]),
                len(rates[2]),
            ]
        )
        reduce_rows.append(
            [
                model,
                size,
                probe["parameters"],
                f"{_bench.mib(probe['bytes']):.1f} MiB",
                reduce_s * 1e3,
                _bench.summarize(probe["seconds"])["p95"] * 1e3,
                step_two * 1e3,
                f"{share:.0%}",
                f"{_bench.mib(probe['bytes']) / reduce_s:.0f} MiB/s",
            ]
        )
        bench.at_least(
            f"-np 2 >= 1.7x -np 1, {model} @{size}",
            scaling,
            1.7,
            f"this machine's 2-process ceiling was {ceiling:.2f}x; allreduce of {_bench.mib(probe['bytes']):.1f} MiB "
            f"takes {reduce_s * 1e3:.0f} ms, {share:.0%} of a -np 2 step; system CPU share "
            f"{sys_share[1]:.0%} at -np 1, {sys_share[2]:.0%} at -np 2",
        )

    pinning = "one core per rank" if args.pin else "ranks share all cores"
    bench.table(
        f"horovodrun -np 1 vs -np 2 (Gloo, {pinning}, batch {args.batch_size} per rank), images/s, median over epochs 2..{args.epochs} of {args.repeats} runs each",
        [
            "model",
            "image size",
            "-np 1",
            "-np 2 total",
            "-np 2 per rank",
            "speed-up",
            "machine ceiling",
            "speed-up / ceiling",
            "system CPU np1 / np2",
            "epochs np1",
            "epochs np2",
        ],
        rows,
    )
    bench.table(
        "gradient allreduce per step at -np 2 (probe, median and p95 of timed calls)",
        [
            "model",
            "image size",
            "parameters",
            "bytes reduced / step",
            "allreduce ms",
            "p95 ms",
            "step ms (-np 2)",
            "share of step",
            "throughput",
        ],
        reduce_rows,
    )
    bench.finish(args, results)


if __name__ == "__main__":
    main()
