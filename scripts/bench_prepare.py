"""Images/s of `covidxray prepare` against the floor of decoding and resizing alone.

Input: N generated 1024x1024 radiograph-like phantoms, half PNG and half JPEG,
in the covid19-talo folder layout, read through `--source covid19-talo=PATH`
(the same adapter and code path as the real collection).

Timed, per round and per worker count, each from a cold start:
- prepare: `covidxray.data.prepare.prepare` into a fresh data_dir, so nothing
  is reused (no decode cache, no shard receipts): listing, decode + resize +
  dedup hashes in `workers` processes, dedup, patient split, TFRecord shards,
  manifest. TensorFlow is imported by the untimed warm-up round.
- floor: `preprocess.load_gray` + `preprocess.resize_square` of the same files,
  in-process for 1 worker and in a fresh spawn pool for more, exactly as
  prepare decodes (so pool start-up and the allocator setting
  `image_cache.keep_freed_buffers` are in both).
Ceiling: before and after the rounds, dense float32 compute runs in 1 and
then 2 processes pinned one per core (`_bench.parallel_ceiling`); the mean of
the two speed-ups is the most any 2-process job could get from this machine then.
Goals: prepare <= 1.3x the floor's time; prepare 1.8x faster with 2 workers than 1.
"""

from __future__ import annotations

import multiprocessing
import shutil
import time
from pathlib import Path

import _bench

# What the figures depend on; a change to any makes this benchmark's docs/bench reports stale
# (scripts/stale_benchmarks.py): prepare end to end (listing, decode, dedup, split, shards) and the decode floor.
MEASURES = (
    "covidxray/data",
    "covidxray/edge/preprocess.py",
    "covidxray/sources/covid19_talo.py",
    "covidxray/files.py",
    "covidxray/manifest.py",
)


def _decode_resize(job: tuple[str, int]) -> None:
    from covidxray.edge import preprocess

    path, size = job
    preprocess.resize_square(preprocess.load_gray(path), size)


def floor(paths: list[Path], size: int, workers: int) -> None:
    from covidxray.data.image_cache import keep_freed_buffers

    jobs = [(str(p), size) for p in paths]
    if workers == 1:
        keep_freed_buffers()
        for job in jobs:
            _decode_resize(job)
        return
    with multiprocessing.get_context("spawn").Pool(workers, initializer=keep_freed_buffers) as pool:
        for _ in pool.imap_unordered(_decode_resize, jobs, chunksize=4):
            pass


class PrepareCase(_bench.SelfTimed):
    """One timed `prepare` into a fresh folder; the folder is removed outside the timing."""

    def __init__(self, source_root: Path, out_root: Path, image_size: int, workers: int):
        self.source_root, self.out_root, self.image_size, self.workers = source_root, out_root, image_size, workers
        self.records_written = 0

    def __call__(self) -> float:
        from covidxray.config import load_config
        from covidxray.data.prepare import prepare

        data_dir = self.out_root / f"workers-{self.workers}"
        shutil.rmtree(data_dir, ignore_errors=True)
        config = load_config(
            None,
            [
                {
                    "data": {
                        "sources": {"covid19-talo": {"from_path": str(self.source_root)}},
                        "data_dir": str(data_dir),
                        "image_size": self.image_size,
                        "workers": self.workers,
                    }
                }
            ],
        )
        started = time.perf_counter()
        manifest = prepare(config.data, log=lambda _msg: None)
        seconds = time.perf_counter() - started
        self.records_written = sum(split["records"] for split in manifest["splits"].values())
        shutil.rmtree(data_dir)
        return seconds


def main() -> None:
    bench = _bench.Bench("prepare", __doc__)
    bench.parser.add_argument("--images", type=int, default=400, help="generated images (default: %(default)s)")
    bench.parser.add_argument(
        "--image-px", type=int, default=1024, help="side of the generated files (default: %(default)s)"
    )
    bench.parser.add_argument(
        "--image-size", type=int, default=128, help="data.image_size prepare resizes to (default: %(default)s)"
    )
    bench.parser.add_argument(
        "--ceiling-seconds",
        type=float,
        default=3.0,
        help="per phase of the 2-process ceiling probe (default: %(default)s)",
    )
    args = bench.parse({"images": 12, "image_px": 256, "ceiling_seconds": 0.3})
    workers = [1, 2]

    source_root = _bench.talo_phantoms(args.workdir / f"talo-{args.images}x{args.image_px}", args.images, args.image_px)
    paths = _bench.image_files(source_root)
    prepares = {w: PrepareCase(source_root, args.workdir / "prepare-out", args.image_size, w) for w in workers}
    cases = {}
    for w in workers:
        cases[f"prepare {w}w"] = prepares[w]
        cases[f"floor {w}w"] = lambda w=w: floor(paths, args.image_size, w)
    ceilings = [_bench.parallel_ceiling(2, args.ceiling_seconds)]
    samples = _bench.round_robin(cases, args.repeats, warmup=1)
    ceilings.append(_bench.parallel_ceiling(2, args.ceiling_seconds))
    ceiling = sum(ceilings) / len(ceilings)
    stats = {name: _bench.summarize(s) for name, s in samples.wall.items()}
    cpu = {name: _bench.summarize(s)["median"] for name, s in samples.cpu.items()}

    n = len(paths)
    results = {
        "images": n,
        "image_px": args.image_px,
        "image_size": args.image_size,
        "cases": stats,
        "cpu_s": cpu,
        "samples_s": samples.wall,
    }
    rows = []
    for w in workers:
        ours, base = stats[f"prepare {w}w"]["median"], stats[f"floor {w}w"]["median"]
        results[f"prepare_over_floor_{w}w"] = ours / base
        results[f"records_written_{w}w"] = prepares[w].records_written
        rows.append([w, n / ours, n / base, ours / base, ours, base, cpu[f"prepare {w}w"] / cpu[f"floor {w}w"]])
    bench.table(
        f"prepare vs decode+resize floor: {n} images {args.image_px}x{args.image_px} (half PNG, half JPEG) -> {args.image_size} px, median of {args.repeats}",
        [
            "workers",
            "prepare img/s",
            "floor img/s",
            "prepare / floor time",
            "prepare s",
            "floor s",
            "prepare / floor CPU time",
        ],
        rows,
    )
    scaling = stats["prepare 1w"]["median"] / stats["prepare 2w"]["median"]
    floor_scaling = stats["floor 1w"]["median"] / stats["floor 2w"]["median"]
    results.update(
        {
            "prepare_scaling_1_to_2": scaling,
            "floor_scaling_1_to_2": floor_scaling,
            "machine_ceiling": ceiling,
            "machine_ceilings": ceilings,
        }
    )
    bench.table(
        "scaling from 1 to 2 workers",
        ["", "prepare", "floor", "machine ceiling (dense compute)"],
        [["speed-up", scaling, floor_scaling, ceiling]],
    )

    for w in workers:
        missing = n - prepares[w].records_written
        note = f"{missing} image(s) not in the shards" if missing else ""
        bench.at_most(f"prepare time <= 1.3x floor, {w} worker(s)", results[f"prepare_over_floor_{w}w"], 1.3, note)
    # What prepare would reach if its decode scaled like the floor and everything else stayed serial (Amdahl).
    serial = stats["prepare 1w"]["median"] - stats["floor 1w"]["median"]
    expected = stats["prepare 1w"]["median"] / (stats["floor 2w"]["median"] + serial)
    results.update({"serial_beyond_decode_s": serial, "expected_scaling_if_rest_serial": expected})
    bench.at_least(
        "prepare speed-up from 1 to 2 workers",
        scaling,
        1.8,
        f"this machine's 2-process ceiling was {ceiling:.2f}x and the floor alone scales {floor_scaling:.2f}x; with prepare's {serial:.2f} s beyond decoding "
        f"kept serial, {expected:.2f}x is expected",
    )
    bench.finish(args, results)


if __name__ == "__main__":
    main()
