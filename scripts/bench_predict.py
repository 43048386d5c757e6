"""Single-image latency of Keras vs TFLite float32 and int8, model sizes, and the predict process's memory.

Latency: for each thread count, one worker process sets TensorFlow's and the
LiteRT interpreter's threads to it, then interleaves, one call per case per
round: Keras `model.predict(x)`, a direct Keras call `model(x)`, and
`covidxray.edge.litert.TFLiteClassifier.predict_one` for float32 and int8;
plus the shared preprocessing (decode + resize of a real-size file) for
context. Model input is prepared once; only inference is timed.

Memory: `covidxray predict` on real-size images as a subprocess; its peak RSS
is that process's own high-water mark (getrusage of a tiny launcher's child), and `PYTHONPROFILEIMPORTTIME` lists
every module it imported, which shows whether TensorFlow was.

The model: a run built here (phantom data, `covidxray train`, then
`covidxray export --format float32 --format int8`, with the int8 agreement bar
off because the model is barely trained), or an existing one via --run-dir.
Sizes: besides the files, the bytes of each file's constant tensors by type
and of its quantization parameters (read back through LiteRT), so a missed
size goal shows what beyond the int8 weights fills the file.
Goals: int8 >= 2x faster than the direct Keras call, and not slower than
float32 TFLite (the format it replaces on a board: the Keras call is a weak
baseline); int8 <= 1/4 of the float32 file; predict peak RSS within
--rss-budget-mib and no TensorFlow.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import _bench

from covidxray.run_folder import MODEL_FILE, sidecar_path, tflite_name

# What the figures depend on; a change to any makes this benchmark's docs/bench reports stale
# (scripts/stale_benchmarks.py): the edge runtime, the exported formats, and the model whose size and latency it reports.
MEASURES = (
    "covidxray/config.py",  # the defaults every run takes what it is not told
    "covidxray/strict.py",  # how each setting is read and checked
    "covidxray/registry.py",  # which model, source, task or format a name means
    "covidxray/manifest.py",  # which shards of which split a run reads
    "covidxray/records.py",  # a record's fields and the label vocabulary
    "covidxray/edge",
    "covidxray/export",
    "covidxray/train/models.py",
)


FORMATS = ("float32", "int8")


def tensor_bytes(model: Path) -> dict[str, int]:
    """Bytes of the model's constant tensors per dtype, plus its quantization scales and zero points."""
    import numpy as np
    from ai_edge_litert.interpreter import Interpreter

    interpreter = Interpreter(str(model))  # not allocated: only constants have data
    totals: dict[str, int] = {"quantization": 0}
    for tensor in interpreter.get_tensor_details():
        params = tensor["quantization_parameters"]
        totals["quantization"] += params["scales"].nbytes + params["zero_points"].nbytes
        try:
            data = interpreter.get_tensor(tensor["index"])
        except ValueError:  # an activation: no data before allocate_tensors
            continue
        key = str(np.dtype(tensor["dtype"]))
        totals[key] = totals.get(key, 0) + data.nbytes
    return totals


def latency_worker(threads: int, run_dir: Path, image: Path, iterations: int) -> None:
    """In its own process: TensorFlow's thread pools are fixed once it starts."""
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(threads)
    tf.config.threading.set_inter_op_parallelism_threads(threads)
    from covidxray.edge.litert import TFLiteClassifier
    from covidxray.edge.preprocess import model_input

    model = tf.keras.models.load_model(str(run_dir / MODEL_FILE), compile=False)
    lite = {fmt: TFLiteClassifier(run_dir / tflite_name(fmt), threads) for fmt in FORMATS}
    size = lite["float32"].image_size
    x = model_input(image, size)
    batch = x[None]
    cases = {
        "keras predict": lambda: model.predict(batch, verbose=0),
        "keras call": lambda: model(batch, training=False).numpy(),
        **{f"tflite {fmt}": (lambda c=c: c.predict_one(x)) for fmt, c in lite.items()},
        "preprocess": lambda: model_input(image, size),
    }
    samples = _bench.round_robin(cases, iterations, warmup=5)
    print(json.dumps({name: _bench.summarize(s) for name, s in samples.wall.items()}))


def latencies(threads: int, run_dir: Path, image: Path, iterations: int) -> dict:
    cmd = [
        sys.executable,
        __file__,
        "--latency-worker",
        str(threads),
        "--run-dir",
        str(run_dir),
        "--image",
        str(image),
        "--iterations",
        str(iterations),
    ]
    return json.loads(_bench.run(cmd).stdout.strip().splitlines()[-1])


def imported_modules(importtime_log: str) -> set[str]:
    return {
        line.rsplit("|", 1)[1].strip()
        for line in importtime_log.splitlines()
        if line.startswith("import time:") and "|" in line
    }


def predict_process(model_path: Path, images: list[Path]) -> dict:
    """Run `covidxray predict` as a user would; peak RSS of that process alone and what it imported."""
    cmd = _bench.covidxray("predict", *map(str, images), "--model", str(model_path), "--json")
    env = {**os.environ, "PYTHONPROFILEIMPORTTIME": "1", "TF_CPP_MIN_LOG_LEVEL": "2"}
    result, code, peak_rss_mib, seconds = _bench.measured_run(cmd, env)
    if result.returncode != 0 or code != 0:
        sys.exit(f"covidxray predict failed ({code}):\n{result.stderr[-3000:]}")
    modules = imported_modules(result.stderr)
    return {
        "command": " ".join(cmd),
        "images": len(images),
        "predicted": len(json.loads(result.stdout)),
        "peak_rss_mib": peak_rss_mib,
        "wall_s": seconds,
        "tensorflow_imported": any(m == "tensorflow" or m.startswith("tensorflow.") for m in modules),
        "keras_imported": any(m == "keras" or m.startswith("keras.") for m in modules),
        "modules_imported": len(modules),
    }


def build_run(args) -> Path:
    """A trained run with float32 and int8 exports, made once per model and size in the workdir."""
    run_dir = args.workdir / f"predict-run-{args.model}-{args.image_size}"
    if all((run_dir / tflite_name(fmt)).is_file() for fmt in FORMATS):
        return run_dir
    data = _bench.prepared_synthetic(args.workdir / f"predict-data-{args.image_size}", args.image_size, args.patients)
    _bench.run(_bench.covidxray(*_bench.train_args(data, run_dir, args.model, args.epochs)))
    _bench.run(
        _bench.covidxray(
            "export",
            "--run-dir",
            str(run_dir),
            "--data-dir",
            str(data),
            *(f"--format={fmt}" for fmt in FORMATS),
            "--set",
            "export.int8_min_agreement=0",
        )
    )
    return run_dir


def main() -> None:
    bench = _bench.Bench("predict", __doc__)
    bench.parser.add_argument(
        "--run-dir", type=Path, help="existing run with model.keras, model-float32.tflite, model-int8.tflite"
    )
    bench.parser.add_argument(
        "--model", default="small_cnn", help="model to train when no --run-dir (default: %(default)s)"
    )
    bench.parser.add_argument("--image-size", type=int, default=128, help="when no --run-dir (default: %(default)s)")
    bench.parser.add_argument(
        "--patients",
        type=int,
        default=200,
        help="phantom patients to train on when no --run-dir (default: %(default)s)",
    )
    bench.parser.add_argument("--epochs", type=int, default=2, help="when no --run-dir (default: %(default)s)")
    bench.parser.add_argument("--threads", default="1,2", help="thread counts (default: %(default)s)")
    bench.parser.add_argument(
        "--iterations", type=int, default=50, help="latency samples per case (default: %(default)s)"
    )
    bench.parser.add_argument(
        "--image-px", type=int, default=1024, help="side of the files predict reads (default: %(default)s)"
    )
    bench.parser.add_argument(
        "--rss-budget-mib", type=float, default=512, help="predict peak RSS goal (default: %(default)s)"
    )
    bench.parser.add_argument("--latency-worker", type=int, help=argparse.SUPPRESS)
    bench.parser.add_argument("--image", type=Path, help=argparse.SUPPRESS)
    args = bench.parse(
        {"image_size": 32, "patients": 40, "epochs": 1, "threads": "1", "iterations": 3, "image_px": 256}
    )
    if args.latency_worker:
        latency_worker(args.latency_worker, args.run_dir, args.image, args.iterations)
        return

    run_dir = args.run_dir or build_run(args)
    card = json.loads(sidecar_path(run_dir / tflite_name("float32")).read_text())
    images = _bench.image_files(
        _bench.talo_phantoms(args.workdir / f"predict-images-4x{args.image_px}", 4, args.image_px)
    )
    threads = [int(t) for t in args.threads.split(",")]
    sizes = {
        "keras": (run_dir / MODEL_FILE).stat().st_size,
        **{fmt: (run_dir / tflite_name(fmt)).stat().st_size for fmt in FORMATS},
    }
    contents = {fmt: tensor_bytes(run_dir / tflite_name(fmt)) for fmt in FORMATS}
    latency = {t: latencies(t, run_dir, images[0], args.iterations) for t in threads}
    memory = {fmt: predict_process(run_dir / tflite_name(fmt), images) for fmt in FORMATS}

    results = {
        "run_dir": str(run_dir),
        "model": card.get("model"),
        "image_size": card["image_size"],
        "image_px": args.image_px,
        "latency_s": {str(t): v for t, v in latency.items()},
        "bytes": sizes,
        "tensor_bytes": contents,
        "predict_process": memory,
    }
    rows = []
    for name in ("keras predict", "keras call", "tflite float32", "tflite int8", "preprocess"):
        rows.append(
            [name, *(f"{latency[t][name]['median'] * 1e3:.2f} / {latency[t][name]['p95'] * 1e3:.2f}" for t in threads)]
        )
    bench.table(
        f"single-image latency, ms median / p95 ({card.get('model')} @{card['image_size']}, {args.iterations} calls each; "
        f"preprocess = decode + resize of a {args.image_px} px file)",
        ["case", *(f"{t} thread(s)" for t in threads)],
        rows,
    )
    bench.table(
        "model files",
        ["file", "MiB", "vs float32"],
        [[name, _bench.mib(b), f"{b / sizes['float32']:.4f}"] for name, b in sizes.items()],
    )
    kinds = sorted({k for c in contents.values() for k in c if k != "quantization"}) + ["quantization"]
    bench.table(
        "what the .tflite files hold, bytes (constant tensors by type; quantization = scales + zero points; rest = graph and padding)",
        ["file", *kinds, "rest", "total"],
        [[fmt, *(c.get(k, 0) for k in kinds), sizes[fmt] - sum(c.values()), sizes[fmt]] for fmt, c in contents.items()],
    )
    bench.table(
        f"`covidxray predict` on {len(images)} {args.image_px} px images",
        ["model", "peak RSS MiB", "wall s", "TensorFlow imported", "modules imported"],
        [
            [fmt, m["peak_rss_mib"], m["wall_s"], m["tensorflow_imported"], m["modules_imported"]]
            for fmt, m in memory.items()
        ],
    )

    for t in threads:
        keras, int8 = latency[t]["keras call"]["median"], latency[t]["tflite int8"]["median"]
        speedup = keras / int8
        results[f"int8_speedup_vs_keras_{t}t"] = speedup
        bench.at_least(
            f"int8 >= 2x faster than the Keras call, {t} thread(s)",
            speedup,
            2,
            f"float32 TFLite is {keras / latency[t]['tflite float32']['median']:.1f}x faster than Keras",
        )
        over_float32 = latency[t]["tflite float32"]["median"] / int8
        results[f"int8_speedup_vs_float32_tflite_{t}t"] = over_float32
        bench.at_least(f"int8 at least as fast as float32 TFLite, {t} thread(s)", over_float32, 1.0)
    excess = sizes["int8"] - sizes["float32"] / 4
    int8_weights, float_weights = contents["int8"].get("int8", 0), contents["float32"].get("float32", 0)
    results["int8_weights_over_float32_weights"] = int8_weights / float_weights
    bench.at_most(
        "int8 file <= 1/4 of float32",
        sizes["int8"] / sizes["float32"],
        0.25,
        f"{abs(excess) / 1024:.1f} KiB {'over' if excess > 0 else 'under'} a quarter of the float32 file; "
        f"the int8 weights are {int8_weights / float_weights:.4f} of the float32 ones, the rest is int32 biases, "
        f"{contents['int8']['quantization'] / 1024:.1f} KiB of quantization parameters and graph",
    )
    peak = max(m["peak_rss_mib"] for m in memory.values())
    bench.at_most(f"predict peak RSS MiB (budget {args.rss_budget_mib:g} of a 4 GB Pi)", peak, args.rss_budget_mib)
    imported = any(m["tensorflow_imported"] for m in memory.values())
    bench.goal("predict imports no TensorFlow", not imported, imported, "False")
    bench.finish(args, results)


if __name__ == "__main__":
    main()
