"""Shared machinery of scripts/bench_*.py: repeats, medians, goal verdicts, tables, JSON.

Machines are noisy (this one is shared by several jobs), so every benchmark
runs its cases round-robin, several rounds, and compares medians taken within
one run: the ratios are the result, absolute figures are context. Tables are
printed as Markdown so they can be pasted into docs unchanged.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import multiprocessing
import os
import platform
import resource
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent
# A benchmark measures the checkout it runs from. The venv's editable install points at the checkout
# scripts/install.sh ran in, so one run from a worktree at another commit (its .venv linked) would otherwise import
# and launch that other checkout's covidxray: REPO goes first on this process's path and, through PYTHONPATH
# (which wins over the editable install's finder, and which horovodrun passes on to its ranks), on every
# command it starts. scripts/revalidate_prepared.py does the same for its worktrees.
sys.path.insert(1, str(REPO))
os.environ["PYTHONPATH"] = os.pathsep.join(path for path in (str(REPO), os.environ.get("PYTHONPATH")) if path)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

PACKAGES = (
    "tensorflow-cpu",
    "tensorflow",
    "tensorflow-cpu-aws",
    "horovod",
    "ai-edge-litert",
    "opencv-python-headless",
    "numpy",
    "albumentations",
)


# --- running -------------------------------------------------------------------------------------------


class Bench:
    """One benchmark run: its arguments, and the report it ends with."""

    def __init__(self, name: str, description: str):
        self.name = name
        self.started_load = os.getloadavg()
        self.parser = argparse.ArgumentParser(
            prog=f"scripts/bench_{name}.py",
            description=description,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        self.parser.add_argument(
            "--out", type=Path, default=Path(f"bench-{name}.json"), help="JSON report (default: %(default)s)"
        )
        self.parser.add_argument(
            "--workdir",
            type=Path,
            default=Path("bench-work"),
            help="generated data, runs, caches (reused between runs)",
        )
        self.parser.add_argument(
            "--repeats", type=int, default=5, help="rounds over all cases; figures are medians (default: %(default)s)"
        )
        self.parser.add_argument(
            "--quick",
            action="store_true",
            help="tiny sizes, one round: checks that the benchmark runs; the figures mean nothing",
        )
        self.tables: list[dict] = []
        self.goals: list[dict] = []

    def parse(self, quick_defaults: dict[str, Any] | None = None, argv: list[str] | None = None) -> argparse.Namespace:
        """Parse `argv` (default: the command line's); `--quick` replaces the defaults named in `quick_defaults`
        (explicit flags still win)."""
        argv = sys.argv[1:] if argv is None else argv
        if "--quick" in argv:
            self.parser.set_defaults(repeats=1, **(quick_defaults or {}))
        args = self.parser.parse_args(argv)
        args.workdir.mkdir(parents=True, exist_ok=True)
        return args

    def table(self, title: str, headers: list[str], rows: list[list[Any]]) -> None:
        self.tables.append({"title": title, "headers": headers, "rows": [[_cell(v) for v in row] for row in rows]})

    def goal(self, name: str, met: bool, measured: Any, target: str, note: str = "") -> None:
        self.goals.append({"goal": name, "met": bool(met), "measured": measured, "target": target, "note": note})

    def at_least(self, name: str, measured: float, target: float, note: str = "") -> None:
        self.goal(name, measured >= target, round(measured, 4), f">= {target:g}", note)

    def at_most(self, name: str, measured: float, target: float, note: str = "") -> None:
        self.goal(name, measured <= target, round(measured, 4), f"<= {target:g}", note)

    def finish(self, args: argparse.Namespace, results: dict) -> dict:
        """Print the tables and verdicts, write the JSON report; exit status stays 0 when a goal is missed."""
        report = {
            "benchmark": self.name,
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "command": command_line(),
            "quick": bool(args.quick),
            "repeats": args.repeats,
            "environment": {
                **environment(),
                "load_average_start": self.started_load,
                "load_average_end": os.getloadavg(),
            },
            "results": results,
            "tables": self.tables,
            "goals": self.goals,
            "verdict": "met" if all(g["met"] for g in self.goals) else "missed",
            "missed": [g["goal"] for g in self.goals if not g["met"]],
        }
        for table in self.tables:
            print(f"\n### {table['title']}\n")
            print(markdown_table(table["headers"], table["rows"]))
        print()
        for g in self.goals:
            note = f" ({g['note']})" if g["note"] else ""
            print(f"goal {'MET' if g['met'] else 'MISSED'}: {g['goal']}: {g['measured']} (target {g['target']}){note}")
        if args.quick:
            print("--quick: tiny sizes and one round; these figures are not meaningful")
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2))
        print(f"wrote {args.out}")
        return report


def command_line() -> str:
    """The command as typed from the current folder, e.g. `.venv/bin/python scripts/bench_input.py --quick`."""
    python = os.path.relpath(sys.executable)
    return shlex.join([sys.executable if python.startswith("..") else python, *sys.argv])


def environment() -> dict:
    versions = {}
    for package in PACKAGES:
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            pass
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
        ).stdout.strip()
    except FileNotFoundError:  # no git: a copy of the checkout, e.g. in scripts/arm64_check.sh's root file system
        commit = ""
    return {
        "python": platform.python_version(),
        "machine": platform.machine(),
        "processor": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "git_commit": commit,
        "packages": versions,
    }


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def run(
    cmd: list[str], env: dict | None = None, timeout: int = 3600, cwd: Path | None = None
) -> subprocess.CompletedProcess:
    """Run a command the way a user would; on failure stop the benchmark with its stderr."""
    full_env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", **(env or {})}
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env, cwd=cwd)
    if result.returncode != 0:
        sys.exit(f"command failed ({result.returncode}): {shlex.join(cmd)}\n{result.stderr[-4000:]}")
    return result


# Peak RSS is measured by a tiny launcher process: Linux carries a parent's RSS high-water mark over
# fork + exec into the child's ru_maxrss, so a child of a TensorFlow-sized benchmark would report the parent's.
_LAUNCHER = (
    "import json, resource, subprocess, sys, time; started = time.perf_counter(); code = subprocess.call(sys.argv[2:]); "
    "open(sys.argv[1], 'w').write(json.dumps([code, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, time.perf_counter() - started]))"
)


def measured_run(cmd: list[str], env: dict | None = None) -> tuple[subprocess.CompletedProcess, int, float, float]:
    """Run `cmd` under the launcher: (its result, exit code, peak RSS in MiB of its largest process, wall seconds)."""
    with tempfile.TemporaryDirectory() as tmp:
        measured = Path(tmp) / "rusage.json"
        result = subprocess.run(
            [sys.executable, "-c", _LAUNCHER, str(measured), *cmd], capture_output=True, text=True, env=env
        )
        code, max_rss_kib, seconds = json.loads(measured.read_text())
    return result, code, max_rss_kib / 1024, seconds  # Linux reports KiB


def covidxray(*args: str) -> list[str]:
    return [str(VENV_BIN / "covidxray"), *args]


def train_args(data_dir: Path, run_dir: Path, model: str, epochs: int, *more: str) -> list[str]:
    """The arguments of `covidxray train` of `model` for `epochs` on `data_dir` into `run_dir`, then `more`."""
    return [
        "train",
        "--data-dir",
        str(data_dir),
        "--run-dir",
        str(run_dir),
        "--model",
        model,
        "--epochs",
        str(epochs),
        *more,
    ]


# --- timing --------------------------------------------------------------------------------------------


class Samples:
    """Seconds per case per round: wall time, and CPU time of this process plus its finished children."""

    def __init__(self, names):
        self.wall: dict[str, list[float]] = {name: [] for name in names}
        self.cpu: dict[str, list[float]] = {name: [] for name in names}


def _cpu_seconds() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


class SelfTimed:
    """A case that keeps its setup or cleanup out of the timing: calling it returns its own wall seconds."""

    def __call__(self) -> float:
        raise NotImplementedError


def round_robin(cases: dict[str, Callable[[], Any]], repeats: int, warmup: int = 1) -> Samples:
    """`warmup` untimed rounds, then `repeats` rounds of every case in turn.

    Interleaving spreads the machine's load changes over all cases alike. A
    case's wall time is the whole call unless it is `SelfTimed`. CPU time is
    load-independent context: it shows overhead even when other jobs steal cores.
    """
    samples = Samples(cases)
    for round_no in range(warmup + repeats):
        for name, case in cases.items():
            cpu, started = _cpu_seconds(), time.perf_counter()
            result = case()
            wall = result if isinstance(case, SelfTimed) else time.perf_counter() - started
            if round_no >= warmup:
                samples.wall[name].append(wall)
                samples.cpu[name].append(_cpu_seconds() - cpu)
    return samples


def summarize(samples: list[float]) -> dict:
    ordered = sorted(samples)
    p95 = statistics.quantiles(ordered, n=20, method="inclusive")[18] if len(ordered) > 1 else ordered[0]
    return {"median": statistics.median(ordered), "p95": p95, "min": ordered[0], "max": ordered[-1], "n": len(ordered)}


def training_step(model, classes: int, batch: int, steps: int, warmup: int = 2) -> dict:
    """Seconds of one training step of `model` (forward, backward, Adam update) on random gray images, on this machine's cores.

    `warmup` untimed steps first (the first traces and compiles the step).
    Wall time on a shared machine includes other jobs' time slices, so the
    step is also given as this process's CPU seconds / usable cores (what the
    step would take alone with perfect use of the cores); `step_s` is the
    smaller of the two medians, which keeps a predicted efficiency conservative.
    """
    import numpy as np
    import tensorflow as tf

    from covidxray.train.distributed import cores_per_rank

    model.compile(optimizer=tf.keras.optimizers.Adam(1e-4), loss="categorical_crossentropy")
    rng = np.random.default_rng(0)
    images = rng.uniform(0, 255, (batch, *model.input_shape[1:])).astype("float32")
    labels = tf.keras.utils.to_categorical(rng.integers(0, classes, batch), classes)
    wall, cpu = [], []
    for step in range(warmup + steps):
        started_wall, started_cpu = time.perf_counter(), time.process_time()
        model.train_on_batch(images, labels)
        if step >= warmup:
            wall.append(time.perf_counter() - started_wall)
            cpu.append(time.process_time() - started_cpu)
    cores = cores_per_rank(1)
    wall_s, cpu_s = statistics.median(wall), statistics.median(cpu) / cores
    return {"wall_s": wall, "cpu_s_per_core": [c / cores for c in cpu], "cores": cores, "step_s": min(wall_s, cpu_s)}


def _dense_compute(core: int, seconds: float, start, rates) -> None:
    """Worker: single-threaded float32 matmuls pinned to `core`; puts the rate achieved."""
    os.environ["OPENBLAS_NUM_THREADS"] = "1"
    os.sched_setaffinity(0, {core})
    import numpy as np

    a = np.random.default_rng(core).random((384, 384), dtype=np.float32)
    start.wait()
    began, done = time.perf_counter(), 0
    while time.perf_counter() - began < seconds:
        a @ a
        done += 1
    rates.put(done / (time.perf_counter() - began))


def parallel_ceiling(processes: int = 2, seconds: float = 3.0) -> float:
    """Speed-up of `processes` copies of dense compute (one pinned per core) over one copy, right now.

    No N-process job can beat it at that moment: it folds in other jobs on the
    machine and vCPUs that share a physical core (a VM cannot see that).
    """
    context = multiprocessing.get_context("spawn")
    cores = sorted(os.sched_getaffinity(0))

    def total_rate(count: int) -> float:
        start, rates = context.Barrier(count), context.Queue()
        workers = [context.Process(target=_dense_compute, args=(cores[i], seconds, start, rates)) for i in range(count)]
        for w in workers:
            w.start()
        total = sum(rates.get() for _ in workers)
        for w in workers:
            w.join()
        return total

    return total_rate(processes) / total_rate(1) if len(cores) >= processes else float("nan")


def parse_cases(text: str) -> list[tuple[str, int]]:
    """`small_cnn@128,mobilenet_v3_small@224` -> [("small_cnn", 128), ("mobilenet_v3_small", 224)]."""
    cases = []
    for item in text.split(","):
        model, _, size = item.strip().partition("@")
        cases.append((model, int(size or 128)))
    return cases


# --- data ----------------------------------------------------------------------------------------------

TALO_FOLDERS = {
    "normal": "No_findings",
    "pneumonia/bacterial": "Pneumonia",
    "pneumonia/viral": "Pneumonia",
    "covid-19": "Covid-19",
}


def _phantom_chunk(job: tuple[Path, int, int, int, int]) -> list[tuple[Path, str, int]]:
    """Worker: render `count` phantoms (one per patient) into a scratch folder; returns (file, label, patient)."""
    from covidxray.sources.synthetic import SyntheticOptions, generate

    scratch, first, count, px, seed = job
    generate(scratch, SyntheticOptions(patients=count, max_images_per_patient=1, image_size=px, seed=seed))
    with open(scratch / "labels.csv", newline="") as handle:
        return [
            (scratch / "images" / row["file"], row["label"], first + int(row["patient"]))
            for row in csv.DictReader(handle)
        ]


def talo_phantoms(root: Path, count: int, px: int) -> Path:
    """`count` phantom radiographs of `px`x`px`, half PNG half JPEG, in the covid19-talo folder layout.

    Written once (rendering 1024 px phantoms takes ~0.6 s each), then reused.
    Files are `X-Ray Image DataSet/{Covid-19,No_findings,Pneumonia}/NNNNNNNN_000.{png,jpg}`,
    one patient each.
    """
    import cv2

    done = root / ".complete"
    if done.is_file() and done.read_text() == f"{count}x{px}":
        return root
    shutil.rmtree(root, ignore_errors=True)
    workers = os.cpu_count() or 1
    bounds = [(i * count // workers, (i + 1) * count // workers) for i in range(workers)]
    jobs = [(root / "scratch" / str(i), lo, hi - lo, px, 1000 + i) for i, (lo, hi) in enumerate(bounds) if hi > lo]
    with multiprocessing.get_context("spawn").Pool(len(jobs)) as pool:
        rendered = [item for chunk in pool.map(_phantom_chunk, jobs) for item in chunk]
    for n, (png, label, patient) in enumerate(rendered):
        folder = root / "X-Ray Image DataSet" / TALO_FOLDERS[label]
        folder.mkdir(parents=True, exist_ok=True)
        if n % 2:
            cv2.imwrite(
                str(folder / f"{patient:08d}_000.jpg"),
                cv2.imread(str(png), cv2.IMREAD_GRAYSCALE),
                [cv2.IMWRITE_JPEG_QUALITY, 95],
            )
        else:
            os.replace(png, folder / f"{patient:08d}_000.png")
    shutil.rmtree(root / "scratch")
    done.write_text(f"{count}x{px}")
    return root


def image_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.suffix.lower() in (".png", ".jpg"))


def prepared_synthetic(
    data_dir: Path,
    image_size: int,
    patients: int,
    records_per_shard: int = 64,
    val_fraction: float = 0.15,
    test_fraction: float = 0.15,
) -> Path:
    """Phantom set prepared by `covidxray.data.prepare.prepare` (idempotent: a re-run reuses its shards)."""
    from covidxray.config import load_config
    from covidxray.data.prepare import prepare

    config = load_config(
        None,
        [
            {
                "data": {
                    "sources": {"synthetic": {"patients": patients}},
                    "data_dir": str(data_dir),
                    "image_size": image_size,
                    "records_per_shard": records_per_shard,
                    "val_fraction": val_fraction,
                    "test_fraction": test_fraction,
                }
            }
        ],
    )
    prepare(config.data, log=lambda _msg: None)
    return data_dir


# --- output --------------------------------------------------------------------------------------------


def _cell(value: Any) -> Any:
    if isinstance(value, float):
        return round(value, 3) if abs(value) < 100 else round(value, 1)
    return value


def markdown_table(headers: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def mib(n_bytes: float) -> float:
    return n_bytes / 2**20
