"""What TensorBoard costs an epoch, and what `covidxray report` costs (build time, file size). Issue 29.

TensorBoard: `covidxray.train.trainer.train` runs in this process with `train.tensorboard: true`, and the time
spent in the board (covidxray/train/tensorboard.py: opening it, which reads the event files already there,
every epoch's write with its confusion-matrix image and flush, closing it) is summed by wrapping those three
methods. Overhead = board seconds / train() wall seconds, which is the share of an epoch, validation and
checkpoint included. The confusion matrix itself is a numpy count over predictions validation has anyway.
As a cross-check on the phantom case, whole train() runs with the board on and off alternate `--repeats`
times (which goes first alternates too) and their median wall and CPU times are compared: wall time on a
shared, loaded 2-core machine swings by tens of percent between identical runs, so it is context, and CPU time
(this process's, all threads) is the steadier comparison.
Cases: the demo's phantom set (prepared here) and a real prepared set (`--real-data`, e.g. a few hundred
Kaggle images prepared with `covidxray prepare`).

Report: `covidxray report RUN --out FILE` as a user runs it (a new process: Python, TensorFlow import,
Grad-CAM on the Keras model), median of `--repeats`, and the size of the page, for each `--report-run`
(RUN or RUN=DATA_DIR). Goals: TensorBoard <= 2% of epoch time; report <= 10 s and <= 5 MB.
Run under `flock -x /work/coord/cpu.lock`: the figures are timings.
"""

from __future__ import annotations

import shutil
import statistics
import time
from pathlib import Path

import _bench

# What the figures depend on (scripts/stale_benchmarks.py): the trainer and its board, and the report.
MEASURES = (
    "covidxray/config.py",  # the defaults every run takes what it is not told
    "covidxray/strict.py",  # how each setting is read and checked
    "covidxray/registry.py",  # which model, source, task or format a name means
    "covidxray/manifest.py",  # which shards of which split a run reads
    "covidxray/records.py",  # a record's fields and the label vocabulary
    "covidxray/train/tensorboard.py",
    "covidxray/train/trainer.py",
    "covidxray/report",
)


class BoardClock:
    """Seconds spent inside EpochBoard's methods while it is installed."""

    METHODS = ("__init__", "write", "close")

    def __init__(self):
        from covidxray.train.tensorboard import EpochBoard

        self.seconds, self.writes, self.board = 0.0, 0, EpochBoard
        self.originals = {name: getattr(EpochBoard, name) for name in self.METHODS}
        for name, original in self.originals.items():
            setattr(EpochBoard, name, self._timed(name, original))

    def _timed(self, name, original):
        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - started
                self.writes += name == "write"

        return timed

    def remove(self) -> None:
        for name, original in self.originals.items():
            setattr(self.board, name, original)


def timed_training(data_dir: Path, run_dir: Path, model: str, epochs: int, batch: int, tensorboard: bool) -> dict:
    from covidxray.config import load_config
    from covidxray.train.trainer import train

    shutil.rmtree(run_dir, ignore_errors=True)
    config = load_config(
        None,
        [
            {
                "data": {"data_dir": str(data_dir)},
                "train": {
                    "run_dir": str(run_dir),
                    "model": model,
                    "epochs": epochs,
                    "batch_size": batch,
                    "tensorboard": tensorboard,
                },
            }
        ],
    )
    clock = BoardClock()
    try:
        started, cpu = time.perf_counter(), time.process_time()
        log = train(config, say=lambda _: None)
        wall, cpu = time.perf_counter() - started, time.process_time() - cpu
    finally:
        clock.remove()
    return {
        "train_wall_s": wall,
        "train_cpu_s": cpu,
        "board_s": clock.seconds,
        "epochs": len(log["epochs"]),
        "epoch_training_s_median": statistics.median(e["seconds"] for e in log["epochs"]),
        "board_share": clock.seconds / wall,
        "board_ms_per_epoch": 1000 * clock.seconds / max(1, len(log["epochs"])),
        "writes": clock.writes,
    }


def report_case(run: str, out: Path, repeats: int) -> dict:
    run_dir, _, data_dir = run.partition("=")
    args = ["report", run_dir, "--out", str(out), *(["--data-dir", data_dir] if data_dir else [])]
    walls, cpus = [], []
    for _ in range(repeats):
        cpu = _bench._cpu_seconds()  # the report process is a finished (grand)child by then: its CPU time counts
        _, code, _, seconds = _bench.measured_run(_bench.covidxray(*args))
        if code != 0:
            raise SystemExit(f"covidxray {' '.join(args)} failed ({code})")
        walls.append(seconds)
        cpus.append(_bench._cpu_seconds() - cpu)
    return {
        "run": run_dir,
        "data_dir": data_dir or "(config.yaml)",
        **_bench.summarize(walls),
        "cpu_s_median": statistics.median(cpus),
        "bytes": out.stat().st_size,
    }


def main() -> None:
    bench = _bench.Bench("tensorboard", __doc__ or "")
    bench.parser.add_argument("--epochs", type=int, default=6, help="phantom case epochs (default: %(default)s)")
    bench.parser.add_argument("--real-data", type=Path, help="a prepared real data set (covidxray prepare)")
    bench.parser.add_argument("--real-model", default="small_cnn")
    bench.parser.add_argument("--real-epochs", type=int, default=3)
    bench.parser.add_argument(
        "--report-run", action="append", default=[], help="RUN or RUN=DATA_DIR to build the report of (repeatable)"
    )
    args = bench.parse({"epochs": 2, "real_epochs": 1})
    phantom = _bench.prepared_synthetic(args.workdir / "phantom-64", 64, 600)
    results: dict = {"phantom": {}, "real": None, "reports": []}

    on, off = [], []
    for round_no in range(args.repeats):  # round-robin, first case alternating: load drifts over both alike
        for tensorboard in (True, False) if round_no % 2 == 0 else (False, True):
            result = timed_training(phantom, args.workdir / "run", "small_cnn", args.epochs, 32, tensorboard)
            (on if tensorboard else off).append(result)
    share = statistics.median(r["board_share"] for r in on)
    results["phantom"] = {
        "with_board": on,
        "without_board": off,
        "board_share_median": share,
        "train_wall_on_median_s": statistics.median(r["train_wall_s"] for r in on),
        "train_wall_off_median_s": statistics.median(r["train_wall_s"] for r in off),
        "train_cpu_on_median_s": statistics.median(r["train_cpu_s"] for r in on),
        "train_cpu_off_median_s": statistics.median(r["train_cpu_s"] for r in off),
    }
    wall_ratio = results["phantom"]["train_wall_on_median_s"] / results["phantom"]["train_wall_off_median_s"]
    cpu_ratio = results["phantom"]["train_cpu_on_median_s"] / results["phantom"]["train_cpu_off_median_s"]
    rows = [
        [
            "phantom 64 px, small_cnn",
            args.epochs,
            results["phantom"]["train_wall_on_median_s"],
            statistics.median(r["board_ms_per_epoch"] for r in on),
            share,
            wall_ratio,
            cpu_ratio,
        ]
    ]
    bench.at_most("TensorBoard share of epoch time, phantom", share, 0.02)
    if args.real_data:
        real = timed_training(args.real_data, args.workdir / "run-real", args.real_model, args.real_epochs, 32, True)
        results["real"] = {"data_dir": str(args.real_data), "model": args.real_model, **real}
        rows.append(
            [
                f"{args.real_data.name}, {args.real_model}",
                args.real_epochs,
                real["train_wall_s"],
                real["board_ms_per_epoch"],
                real["board_share"],
                "-",
                "-",
            ]
        )
        bench.at_most("TensorBoard share of epoch time, real data", real["board_share"], 0.02)
    bench.table(
        "TensorBoard cost (median over repeats; board = open + per-epoch writes + close)",
        ["case", "epochs", "train() wall s", "board ms/epoch", "board share of wall", "wall on/off", "CPU on/off"],
        rows,
    )

    report_rows = []
    for i, run in enumerate(args.report_run):
        case = report_case(run, args.workdir / f"report-{i}.html", max(1, args.repeats))
        results["reports"].append(case)
        report_rows.append([case["run"], case["median"], case["cpu_s_median"], case["bytes"] / 1e6])
        bench.at_most(f"report build s, {Path(case['run']).name}", case["median"], 10)
        bench.at_most(f"report MB, {Path(case['run']).name}", case["bytes"] / 1e6, 5)
    if report_rows:
        bench.table(
            "covidxray report (a new process, as a user runs it)",
            ["run", "wall s (median)", "CPU s (median)", "MB"],
            report_rows,
        )
    bench.finish(args, results)


if __name__ == "__main__":
    main()
