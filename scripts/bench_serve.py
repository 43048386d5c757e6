"""`covidxray serve` under load on 127.0.0.1: latency with concurrent clients against a single `predict`, and memory.

The baseline: `covidxray predict --json IMAGE` run as a user runs it, `--repeats`
times (wall time, median; peak RSS of that process), plus the per-image time of
predict's own code path in one process (`Predictor` on the same image, median),
for context. The server: `covidxray serve --model MODEL --port 0` started as a
user starts it; after a warm-up, `--clients` threads each POST the image back to
back, until `--requests` answers or `--seconds` have passed. Every answer must be 200 with the same label as
predict's; latency is per request (connect to last byte). The server's RSS is
read from /proc after every 100 answers: its value after the last one against
predict's peak, and its growth from the first reading to the last ("flat"). Two phases: /predict (predict's
own answer, the goals' comparison), then /predict?overlay=1 (as the page asks, with the Grad-CAM overlay).

Goals (issue 30): no failed request; p95 latency <= 2 x a single `predict`;
server RSS after 1,000 requests <= predict's peak + 100 MiB; RSS growth over
the run <= 20 MiB. With 8 clients and 2 cores, each request shares the CPU with
the others: p95 over the in-process time per image is reported too, and is
bounded below by clients / cores by arithmetic.

The model: --model (a .tflite with sidecar, ideally exported from real films,
with class maps), else a phantom small_cnn built here. The image: --image, else a
phantom held-out film.
"""

from __future__ import annotations

import json
import statistics
import sys
import threading
import time
from pathlib import Path

import _bench

sys.path.insert(0, str(_bench.REPO / "tests"))
from serving import start_server, stop_server  # noqa: E402  the tests' own way of starting serve

# What the figures depend on; a change to any makes this benchmark's docs/bench reports stale
# (scripts/stale_benchmarks.py): the server, and the predict path and runtime it runs.
MEASURES = (
    "covidxray/config.py",  # the defaults every run takes what it is not told
    "covidxray/strict.py",  # how each setting is read and checked
    "covidxray/records.py",  # a record's fields and the label vocabulary
    "covidxray/serve",
    "covidxray/edge",
)


def build_model(workdir: Path) -> tuple[Path, Path]:
    """A phantom small_cnn exported to float32, and one held-out phantom film."""
    data_dir = _bench.prepared_synthetic(workdir / "data", 128, 300)
    run_dir = workdir / "run"
    if not (run_dir / "model-float32.tflite").exists():
        _bench.run(_bench.covidxray(*_bench.train_args(data_dir, run_dir, "small_cnn", 3)))
        _bench.run(_bench.covidxray("export", "--run-dir", str(run_dir), "--data-dir", str(data_dir)))
    with open(data_dir / "splits.csv") as handle:
        image = next(line.rsplit(",", 1)[1].strip() for line in handle if line.startswith("test,"))
    return run_dir / "model-float32.tflite", Path(image)


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for {pid}")


def in_process_seconds(model: Path, image: Path, repeats: int) -> float:
    """Median wall seconds of predict's code path on `image` in one warm process (decode, gate, inference)."""
    code = (
        "import json, sys, time, statistics\n"
        "from pathlib import Path\n"
        "from covidxray.edge.predict import Predictor\n"
        f"p = Predictor(Path({str(model)!r}))\n"
        f"image = Path({str(image)!r})\n"
        "p(image)\n"
        "times = []\n"
        f"for _ in range({repeats}):\n"
        "    t = time.perf_counter(); p(image); times.append(time.perf_counter() - t)\n"
        "print(json.dumps(statistics.median(times)))\n"
    )
    return float(json.loads(_bench.run([sys.executable, "-c", code]).stdout))


def load(
    server, data: bytes, name: str, clients: int, requests: int, seconds: float, label: str | None, query: str
) -> dict:
    """`clients` threads posting `data` until `requests` answers or `seconds`; latencies, failures, RSS readings."""
    latencies: list[float] = []
    failures: list[str] = []
    issued = [0]
    readings: list[tuple[int, float]] = []
    lock = threading.Lock()
    deadline = time.monotonic() + seconds
    pid = server.process.pid

    def client() -> None:
        while time.monotonic() < deadline:
            with lock:
                if issued[0] >= requests:
                    return
                issued[0] += 1
            started = time.perf_counter()
            status, answer = server.post(data, filename=name, query=query)
            elapsed = time.perf_counter() - started
            with lock:
                overlay_said = "gradcam" in answer or "gradcam_unavailable" in answer  # drawn, or why not
                if status != 200 or answer.get("label") != label or ("overlay" in query) != overlay_said:
                    failures.append(f"{status} {str(answer)[:200]}")
                latencies.append(elapsed)
                if len(latencies) % 100 == 0:
                    readings.append((len(latencies), rss_mib(pid)))

    threads = [threading.Thread(target=client) for _ in range(clients)]
    started = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.monotonic() - started
    ordered = sorted(latencies)
    return {
        "requests": len(latencies),
        "failed": len(failures),
        "failures": failures[:5],
        "wall_s": round(wall, 2),
        "throughput_per_s": round(len(latencies) / wall, 2),
        "latency_s": {
            "median": statistics.median(ordered),
            "p95": ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))],
            "max": ordered[-1],
        },
        "rss_mib_by_requests": readings,
    }


def main() -> None:
    bench = _bench.Bench("serve", __doc__ or "")
    bench.parser.add_argument("--model", type=Path, help="a .tflite with its sidecar (default: a phantom model)")
    bench.parser.add_argument("--image", type=Path, help="the image every client posts (default: a phantom film)")
    bench.parser.add_argument("--clients", type=int, default=8)
    bench.parser.add_argument("--requests", type=int, default=1000, help="POST /predict, predict's own answer")
    bench.parser.add_argument(
        "--overlay-requests", type=int, default=300, help="then POST /predict?overlay=1, as the page (0: none)"
    )
    bench.parser.add_argument("--seconds", type=float, default=600, help="bound on the load phase")
    args = bench.parse({"requests": 100, "overlay_requests": 30, "seconds": 60})
    model, image = (args.model, args.image) if args.model and args.image else build_model(args.workdir)

    predict_runs = [
        _bench.measured_run(_bench.covidxray("predict", "--json", "--model", str(model), str(image)))
        for _ in range(args.repeats)
    ]
    if any(code not in (0, 1) for _, code, _, _ in predict_runs):
        sys.exit(f"predict failed: {predict_runs[0][0].stderr[-2000:]}")
    oracle = json.loads(predict_runs[0][0].stdout)[0]
    predict_wall = statistics.median(seconds for *_, seconds in predict_runs)
    predict_rss = max(rss for _, _, rss, _ in predict_runs)
    per_image = in_process_seconds(model, image, max(5, args.repeats * 4))

    server = start_server(model, args.workdir / "serve.log")
    data = image.read_bytes()
    phases = {"predict": ("", args.requests), "overlay": ("?overlay=1", args.overlay_requests)}
    runs: dict[str, dict] = {}
    try:
        for _ in range(10):  # warm-up: every worker's first call
            server.post(data, filename=image.name)
        for phase, (query, requests) in phases.items():
            if requests:
                label = oracle.get("label")
                runs[phase] = load(server, data, image.name, args.clients, requests, args.seconds, label, query)
        rss_end = rss_mib(server.process.pid)
    finally:
        output = stop_server(server)
    tracebacks = output.count("Traceback")
    readings = runs["predict"]["rss_mib_by_requests"]
    growth = readings[-1][1] - readings[0][1] if len(readings) > 1 else 0.0
    results = {
        "model": str(model),
        "image": str(image),
        "answer": {k: v for k, v in oracle.items() if k != "file"},
        "clients": args.clients,
        "predict_cli": {"wall_s_median": predict_wall, "peak_rss_mib": predict_rss},
        "predict_in_process_s_median": per_image,
        "serve": runs,
        "serve_rss_mib_end": rss_end,
        "serve_rss_growth_mib": growth,
        "tracebacks": tracebacks,
    }
    rows = [
        ["predict CLI wall s (median)", predict_wall, ""],
        ["predict in-process s per image (median)", per_image, ""],
    ]
    for phase, run in runs.items():
        p95 = run["latency_s"]["p95"]
        results[f"{phase}_p95_over_predict_cli"] = p95 / predict_wall
        rows += [
            [f"{phase}: requests", run["requests"], f"failed {run['failed']}"],
            [f"{phase}: latency s median / p95", run["latency_s"]["median"], p95],
            [f"{phase}: p95 / predict CLI, / in-process", p95 / predict_wall, p95 / per_image],
            [f"{phase}: throughput requests/s", run["throughput_per_s"], ""],
        ]
    rows += [
        ["predict peak RSS MiB / serve RSS MiB at the end", predict_rss, rss_end],
        ["serve RSS growth MiB over the first phase (first to last reading)", growth, ""],
    ]
    bench.table(f"serve: {args.clients} clients on 127.0.0.1", ["measure", "value", ""], rows)
    bench.at_most("failed requests and tracebacks", sum(r["failed"] for r in runs.values()) + tracebacks, 0)
    for phase, run in runs.items():
        bench.at_most(
            f"{phase}: p95 latency with {args.clients} clients / a single predict",
            run["latency_s"]["p95"] / predict_wall,
            2.0,
        )
    bench.at_most("serve RSS at the end - predict peak RSS, MiB", rss_end - predict_rss, 100)
    bench.at_most("serve RSS growth over the first phase, MiB (memory flat)", growth, 20)
    bench.goal(
        f"at least {args.requests} requests",
        runs["predict"]["requests"] >= args.requests,
        runs["predict"]["requests"],
        f">= {args.requests}",
    )
    bench.finish(args, results)


if __name__ == "__main__":
    main()
