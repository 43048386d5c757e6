"""What the network costs a 35-board job: Horovod allreduce over an emulated Pi cluster, fitted and extrapolated.

Needs root: scripts/netcluster.sh builds the cluster (a network namespace per
board, veth pairs through a bridge, each port shaped with tc to a Pi 4's
gigabit line rate, or --line-mbit 100 for a cheap switch) and horovodrun
reaches every rank over ssh, as on real boards. Per line rate:

1. link check: one TCP stream board 1 -> board 2 (payload Mbit/s) and the TCP
   round trip of a 1-byte message, against the line's payload rate;
2. for each rank count (2, 4, 8): one horovodrun job of scripts/_allreduce_probe.py
   timing a float32 allreduce of each size (1-128 MiB), --repeats timed calls
   each (medians); at the largest rank count also with fp16 compression;
3. fit of the ring-allreduce cost t = 2(N-1)/N * S/B + 2(N-1) * L to all float32
   medians (B and L, relative residuals), and the ratio of each 8-rank median
   to the physical floor (the same formula at the line's payload rate, L = 0).

Then, for each registered model at --image-size px: its gradient (trainable
parameters x 4 bytes, x 2 with fp16 compression), the allreduce the fit
predicts at --boards ranks, the compute time of one training step of batch
--batch-size measured here (this VM's cores stand in for a board's; a Pi 4 is
slower, so the predicted efficiency is a lower bound), and from both the
predicted images/s and scaling efficiency, without and with compute/comm overlap.

The allreduce is compute-free (no model runs in the probe), so the 2 cores are
not what limits it; the load average is recorded because the kernel's
forwarding of every packet still needs CPU. Goals: predicted 35-board
efficiency >= 90% for the default model (configs/pi-cluster.yaml's
efficientnet_lite0; here with all layers trained: bench_overlap.py times the
file's 4 frozen stages, with overlap) at 224 px on 1 GbE; every 8-rank
allreduce within 1.2x of the ring floor.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import _bench
import _ring

# What the figures depend on; a change to any makes this benchmark's docs/bench reports stale
# (scripts/stale_benchmarks.py): the probe and the fit; the models only lend their gradient sizes and the compute step time.
MEASURES = (
    "covidxray/config.py",  # the defaults every run takes what it is not told
    "covidxray/strict.py",  # how each setting is read and checked
    "covidxray/registry.py",  # which model, source, task or format a name means
    "covidxray/records.py",  # a record's fields and the label vocabulary
    "scripts/_allreduce_probe.py",
    "scripts/_ring.py",
    "scripts/netcluster.sh",
    "covidxray/train/distributed.py",
    "covidxray/train/models.py",
    "covidxray/train/efficientnet_lite.py",
)

NETCLUSTER = _bench.REPO / "scripts" / "netcluster.sh"
PROBE = _bench.REPO / "scripts" / "_allreduce_probe.py"
GOAL_MODEL = "efficientnet_lite0"  # configs/pi-cluster.yaml's model (issue 23)
CLUSTER_NAME = "cxrb"  # not the default name: the benchmark never tears down a cluster a user built by hand

# Run inside a board's namespace by link_check: a TCP receiver, then a sender that streams for a few seconds.
_RECEIVER = """
import socket, sys, time
server = socket.create_server((sys.argv[1], 5201)); conn, _ = server.accept()
buffer, received, started = bytearray(1 << 20), 0, None
while (n := conn.recv_into(buffer)):
    started = started or time.perf_counter(); received += n
    if n == 1: conn.sendall(b"x")  # ping-pong phase: echo
print(received / (time.perf_counter() - started))
"""
_SENDER = """
import socket, statistics, sys, time
conn = socket.create_connection((sys.argv[1], 5201)); conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
rtts = []
for _ in range(200):
    started = time.perf_counter(); conn.sendall(b"x"); conn.recv(1); rtts.append(time.perf_counter() - started)
data, end = b"\\0" * (1 << 20), time.time() + float(sys.argv[2])
while time.time() < end: conn.sendall(data)
conn.close(); print(statistics.median(rtts))
"""


def netcluster(action: str, *args: str) -> subprocess.CompletedProcess:
    return _bench.run(["bash", str(NETCLUSTER), action, "--name", CLUSTER_NAME, *args], timeout=1800)


def state() -> dict[str, str]:
    env = Path(f"/run/covidxray-netcluster-{CLUSTER_NAME}/env").read_text().split()
    return dict(line.split("=", 1) for line in env)


def in_namespace(namespace: str, code: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        ["ip", "netns", "exec", namespace, sys.executable, "-c", code, *args], stdout=subprocess.PIPE, text=True
    )


def link_check(name: str, subnet: str, seconds: float) -> dict:
    """Payload throughput of one TCP stream and the median 1-byte round trip, board 1 -> board 2 of cluster `name`."""
    target = f"{subnet}.12"
    receiver = in_namespace(f"{name}-b2", _RECEIVER, target)
    time.sleep(1.0)
    sender = in_namespace(f"{name}-b1", _SENDER, target, str(seconds))
    rtt = float(sender.communicate(timeout=120)[0])
    payload = float(receiver.communicate(timeout=120)[0])
    return {"tcp_payload_mbit_per_s": payload * 8 / 1e6, "tcp_rtt_s": rtt}


def horovodrun_on_boards(cluster: dict, ranks: int, workdir: Path, command: list[str]) -> None:
    """`horovodrun -np RANKS COMMAND` from the launcher namespace, one rank on each of the first RANKS boards, over ssh."""
    hostfile = workdir / f"hostfile-{ranks}"
    hostfile.write_text("".join(f"{cluster['SUBNET']}.{10 + i} slots=1\n" for i in range(1, ranks + 1)))
    horovodrun = [
        str(_bench.VENV_BIN / "horovodrun"),
        "--gloo",
        "-np",
        str(ranks),
        "--hostfile",
        str(hostfile),
        "--ssh-identity-file",
        f"{cluster['STATE']}/id_ed25519",
        "--network-interface",
        "eth0",
        "--disable-cache",
        "--start-timeout",
        "300",
    ]
    netcluster("exec", "--", *horovodrun, *command)


def allreduce_job(
    cluster: dict, ranks: int, sizes_mib: list[float], steps: int, compression: str, workdir: Path
) -> dict:
    """One horovodrun job over the emulated boards: {bytes: [seconds of each timed call]}."""
    out = workdir / f"allreduce-{cluster['LINE_MBIT']}-{ranks}-{compression}.json"
    out.unlink(missing_ok=True)
    probe = [
        str(_bench.VENV_BIN / "python"),
        str(PROBE),
        "--sizes-mib",
        *map(str, sizes_mib),
        "--steps",
        str(steps),
        "--warmup",
        "1",
        "--compression",
        compression,
        "--out",
        str(out),
    ]
    horovodrun_on_boards(cluster, ranks, workdir, probe)
    report = json.loads(out.read_text())
    return {entry["bytes"]: entry["seconds"] for entry in report["sizes"]}


def model_gradients(image_size: int, classes: int) -> dict[str, int]:
    """Trainable parameters of every registered model (what one step's gradient allreduce carries)."""
    from covidxray.train.models import MODEL_REGISTRY, build_model

    return {
        name: int(sum(int(v.shape.num_elements()) for v in build_model(name, image_size, classes).trainable_variables))
        for name in MODEL_REGISTRY
    }


def compute_step(model_name: str, image_size: int, classes: int, batch: int, steps: int) -> dict:
    """One training step of `model_name` from scratch, all layers trained (_bench.training_step)."""
    from covidxray.train.models import build_model

    return _bench.training_step(build_model(model_name, image_size, classes), classes, batch, steps)


def _with_int_keys(line_rates: dict) -> dict:
    """JSON turned the integer keys (line rate, ranks, bytes) into strings: turn them back."""

    def sizes(job: dict) -> dict:
        return {int(size): seconds for size, seconds in job.items()}

    return {
        int(line): {
            **m,
            "float32": {int(r): sizes(job) for r, job in m["float32"].items()},
            "fp16_at_max_ranks": sizes(m["fp16_at_max_ranks"]),
        }
        for line, m in line_rates.items()
    }


def main() -> None:
    bench = _bench.Bench("allreduce", __doc__)
    bench.parser.set_defaults(repeats=7)
    bench.parser.add_argument(
        "--ranks", type=int, nargs="+", default=[2, 4, 8], help="emulated boards per job (default: %(default)s)"
    )
    bench.parser.add_argument(
        "--sizes-mib",
        type=float,
        nargs="+",
        default=[1, 2, 4, 8, 16, 32, 64, 128],
        help="allreduce sizes at 1000 Mbit/s (default: %(default)s)",
    )
    bench.parser.add_argument(
        "--slow-sizes-mib",
        type=float,
        nargs="+",
        default=[1, 4, 16, 64],
        help="sizes on slower links, 10x the time per byte (default: %(default)s)",
    )
    bench.parser.add_argument(
        "--line-mbit",
        type=int,
        nargs="+",
        default=[1000, 100],
        help="line rates to emulate; the first is the goal's (default: %(default)s)",
    )
    bench.parser.add_argument(
        "--boards", type=int, default=35, help="extrapolate to this many ranks (default: %(default)s)"
    )
    bench.parser.add_argument("--image-size", type=int, default=224)
    bench.parser.add_argument("--batch-size", type=int, default=16, help="per rank (default: %(default)s)")
    bench.parser.add_argument("--classes", type=int, default=3)
    bench.parser.add_argument(
        "--compute-steps", type=int, default=8, help="timed training steps per model (default: %(default)s)"
    )
    bench.parser.add_argument("--link-seconds", type=float, default=4.0)
    bench.parser.add_argument(
        "--from-measured",
        action="store_true",
        help="skip the network measurements: reuse WORKDIR/allreduce-measured.json of an earlier run",
    )
    args = bench.parse(
        {
            "ranks": [2],
            "sizes_mib": [1, 4],
            "slow_sizes_mib": [1],
            "line_mbit": [1000],
            "compute_steps": 1,
            "link_seconds": 1.0,
            "image_size": 64,
        }
    )
    if os.geteuid() != 0 and not args.from_measured:
        sys.exit("bench_allreduce.py needs root (it builds network namespaces and tc shaping): run it with sudo")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so `finally` tears the cluster down

    measured_file = args.workdir / "allreduce-measured.json"
    results: dict = {
        "line_rates": {},
        "ranks": args.ranks,
        "boards": args.boards,
        "image_size": args.image_size,
        "batch_size_per_rank": args.batch_size,
    }
    if args.from_measured:
        results["line_rates"] = _with_int_keys(json.loads(measured_file.read_text()))
    for line_mbit in [] if args.from_measured else args.line_mbit:
        sizes = args.sizes_mib if line_mbit == args.line_mbit[0] else args.slow_sizes_mib
        netcluster("up", "-n", str(max(args.ranks)), "--line-mbit", str(line_mbit))
        try:
            cluster = state()
            link = link_check(CLUSTER_NAME, cluster["SUBNET"], args.link_seconds)
            jobs = {
                ranks: allreduce_job(cluster, ranks, sizes, args.repeats, "none", args.workdir) for ranks in args.ranks
            }
            fp16 = allreduce_job(cluster, max(args.ranks), sizes, args.repeats, "fp16", args.workdir)
        finally:
            netcluster("down")
        results["line_rates"][line_mbit] = {
            "link": link,
            "float32": jobs,
            "fp16_at_max_ranks": fp16,
            "load_average_after": os.getloadavg(),
        }
        measured_file.write_text(
            json.dumps(results["line_rates"])
        )  # the network part is the slow one: keep it for --from-measured

    rows, fit_rows, floor_rows, model_rows = [], [], [], []
    classes = args.classes
    from covidxray.train.distributed import configure_threads

    configure_threads(1)  # all of this machine's cores, as one rank per board has all of the board's
    gradients = model_gradients(args.image_size, classes)
    compute = {
        name: compute_step(name, args.image_size, classes, args.batch_size, args.compute_steps) for name in gradients
    }
    results["parameters"], results["compute"] = gradients, compute
    top = max(args.ranks)
    for line_mbit, measured in results["line_rates"].items():
        points = [
            (ranks, size, statistics.median(seconds))
            for ranks, job in measured["float32"].items()
            for size, seconds in job.items()
        ]
        model = _ring.fit(points)
        measured["fit"] = model
        payload = _ring.payload_bandwidth(line_mbit)
        link = measured["link"]
        fit_rows.append(
            [
                line_mbit,
                f"{payload * 8 / 1e6:.1f}",
                f"{link['tcp_payload_mbit_per_s']:.1f}",
                f"{link['tcp_rtt_s'] * 1e6:.0f}",
                f"{model['bandwidth_mbit_per_s']:.1f}",
                f"{model['latency_s'] * 1e6:.0f}",
                f"{model['rms_residual']:.1%}",
                f"{model['max_abs_residual']:.1%}",
            ]
        )
        for (ranks, size, seconds), residual in zip(points, model["residuals"]):
            rows.append(
                [
                    line_mbit,
                    ranks,
                    f"{_bench.mib(size):g}",
                    seconds * 1e3,
                    _ring.floor_seconds(ranks, size, line_mbit) * 1e3,
                    f"{seconds / _ring.floor_seconds(ranks, size, line_mbit):.2f}",
                    f"{residual:+.1%}",
                ]
            )
        ratios = {
            size: statistics.median(seconds) / _ring.floor_seconds(top, size, line_mbit)
            for size, seconds in measured["float32"][top].items()
        }
        fp16_ratio = {
            size: statistics.median(measured["fp16_at_max_ranks"][size]) / statistics.median(seconds)
            for size, seconds in measured["float32"][top].items()
        }
        measured["ratio_to_floor_at_max_ranks"], measured["fp16_over_float32_at_max_ranks"] = ratios, fp16_ratio
        for size in ratios:
            floor_rows.append([line_mbit, f"{_bench.mib(size):g}", f"{ratios[size]:.2f}", f"{fp16_ratio[size]:.2f}"])
        if line_mbit == args.line_mbit[0]:
            worst = max(ratios, key=ratios.get)
            bench.at_most(
                f"{top}-rank allreduce / ring floor at {line_mbit} Mbit/s, worst size",
                ratios[worst],
                1.2,
                f"worst at {_bench.mib(worst):g} MiB; per size {', '.join(f'{_bench.mib(s):g} MiB {r:.2f}' for s, r in ratios.items())}; "
                f"load average {measured['load_average_after'][0]:.1f} after the jobs",
            )

        # fp16 halves the bytes on the wire but adds two casts per element: their cost on this CPU is what the
        # measured fp16 time at the largest size exceeds the fit's time for half the bytes
        largest = max(fp16_ratio)
        half = _ring.ring_seconds(top, largest / 2, model["bandwidth_bytes_per_s"], model["latency_s"])
        cast_s_per_byte = max(0.0, statistics.median(measured["fp16_at_max_ranks"][largest]) - half) / largest
        measured["fp16_cast_s_per_float32_byte"] = cast_s_per_byte
        measured["predictions"] = {}
        for name, parameters in gradients.items():
            step = compute[name]["step_s"]
            for compression, size in (("none", parameters * 4), ("fp16", parameters * 2)):
                reduce_s = _ring.ring_seconds(args.boards, size, model["bandwidth_bytes_per_s"], model["latency_s"])
                if compression == "fp16":
                    reduce_s += cast_s_per_byte * parameters * 4
                floor_s = _ring.floor_seconds(args.boards, size, line_mbit)
                # the fitted L also holds each ring step's wait for its peer process to get a core (8 ranks share 2 here);
                # a board's rank has its own cores, so also: fitted B with L = the link's measured one-way latency
                link_latency_s = (
                    reduce_s
                    - _ring.ring_seconds(args.boards, size, model["bandwidth_bytes_per_s"], model["latency_s"])
                    + _ring.ring_seconds(
                        args.boards, size, model["bandwidth_bytes_per_s"], measured["link"]["tcp_rtt_s"] / 2
                    )
                )
                at_link = _ring.predict_step(step, link_latency_s, args.boards, args.batch_size)
                predicted, at_floor = (
                    _ring.predict_step(step, reduce_s, args.boards, args.batch_size),
                    _ring.predict_step(step, floor_s, args.boards, args.batch_size),
                )
                measured["predictions"][f"{name}/{compression}"] = {
                    "gradient_bytes": size,
                    "allreduce_s": reduce_s,
                    "floor_s": floor_s,
                    "compute_s": step,
                    **predicted,
                    "floor_efficiency": at_floor["efficiency"],
                    "link_latency_allreduce_s": link_latency_s,
                    "link_latency_efficiency": at_link["efficiency"],
                    "compute_s_for_90_percent": 9 * reduce_s,
                    "single_board_images_per_s": args.batch_size / step,
                }
                model_rows.append(
                    [
                        line_mbit,
                        name,
                        compression,
                        f"{_bench.mib(size):.1f}",
                        step * 1e3,
                        reduce_s * 1e3,
                        floor_s * 1e3,
                        f"{predicted['images_per_s']:.0f}",
                        f"{predicted['efficiency']:.1%}",
                        f"{predicted['efficiency_full_overlap']:.1%}",
                        f"{at_link['efficiency']:.1%}",
                        f"{at_floor['efficiency']:.1%}",
                        9 * reduce_s * 1e3,
                    ]
                )
                if line_mbit == args.line_mbit[0] and name == GOAL_MODEL:
                    bench.at_least(
                        f"predicted {args.boards}-board efficiency, {GOAL_MODEL} (all layers) @{args.image_size} on {line_mbit} Mbit/s, {compression} (no overlap)",
                        predicted["efficiency"],
                        0.9,
                        f"compute {step * 1e3:.0f} ms/step on this VM, allreduce {reduce_s * 1e3:.0f} ms of {_bench.mib(size):.1f} MiB, floor {floor_s * 1e3:.0f} ms; "
                        f"{at_link['efficiency']:.0%} with L = the link's one-way latency; 90% needs a step of {9 * reduce_s * 1e3:.0f} ms",
                    )

    bench.table(
        "link check: one TCP stream between two emulated boards",
        [
            "line Mbit/s",
            "payload floor Mbit/s",
            "TCP payload Mbit/s",
            "TCP RTT us",
            "fitted B Mbit/s",
            "fitted L us",
            "rms residual",
            "max residual",
        ],
        fit_rows,
    )
    bench.table(
        f"allreduce (Gloo ring, float32), median of {args.repeats} calls, vs the ring floor",
        ["line Mbit/s", "ranks", "MiB", "measured ms", "floor ms", "measured / floor", "fit residual"],
        rows,
    )
    bench.table(
        f"at {top} ranks: measured / floor, and fp16-compressed / float32 time",
        ["line Mbit/s", "MiB", "float32 / floor", "fp16 / float32"],
        floor_rows,
    )
    bench.table(
        f"predicted at {args.boards} boards, batch {args.batch_size} per board, {args.image_size} px (compute measured on this VM)",
        [
            "line Mbit/s",
            "model",
            "compression",
            "gradient MiB",
            "compute ms",
            "allreduce ms (fit)",
            "allreduce ms (floor)",
            "images/s",
            "efficiency",
            "efficiency, full overlap",
            "efficiency, L = link latency",
            "efficiency at floor",
            "compute ms for 90%",
        ],
        model_rows,
    )
    bench.finish(args, results)


if __name__ == "__main__":
    main()
