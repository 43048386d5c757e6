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
  `decode_pool.keep_freed_buffers` are in both).
Ceiling: before and after the rounds, dense float32 compute runs in 1 and
then 2 processes pinned one per core (`_bench.parallel_ceiling`); the mean of
the two speed-ups is the most any 2-process job could get from this machine then.
Goals: prepare <= 1.3x the floor's time; prepare 1.8x faster with 2 workers than 1.

--source NAME=PATH (repeatable): the same comparison on a real collection, e.g.
`--source chest-xray-pneumonia=../shared/data/chest-xray-pneumonia-224`: prepare
reads it through its adapter (data.sources NAME, from_path PATH), and the floor
decodes the image files that adapter lists.

--scale: how prepare grows with the number of images. From one generated set
of max(--scale-counts) phantoms (default 1k, 5k, 20k; 256 px, so generating
them stays cheap), each count is an evenly spread subset (hard links, all
classes), prepared cold with 1 worker. Per count: the total, and the wall
time prepare spends in decoding (`ImageCache.decode_configured`: decode,
resize, hashes and dedup features), in dedup matching (`dedup.matches`:
exact, perceptual and geometric) and, within it, in the perceptual
(`dedup.near_pairs`) and geometric (`near_duplicates.confirmed_pairs`)
stages. The growth exponent of each is the slope of log(time) against
log(count), fitted by least squares: 1 is linear, 2 quadratic. Goal: dedup
matching grows at most with exponent 1.2.
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import _bench

# What the figures depend on; a change to any makes this benchmark's docs/bench reports stale
# (scripts/stale_benchmarks.py): prepare end to end (listing, decode, dedup, split, shards) and the decode floor.
MEASURES = (
    "covidxray/config.py",  # the defaults every run takes what it is not told
    "covidxray/strict.py",  # how each setting is read and checked
    "covidxray/registry.py",  # which model, source, task or format a name means
    "covidxray/records.py",  # a record's fields and the label vocabulary
    "covidxray/data",
    "covidxray/edge/preprocess.py",
    "covidxray/edge/radiograph_gate.py",  # decode runs the gate on every image
    "covidxray/edge/image_header.py",
    "covidxray/sources/covid19_talo.py",
    "covidxray/sources/covid_chestxray.py",  # the real collections of --source
    "covidxray/sources/chest_xray_pneumonia.py",
    "covidxray/files.py",
    "covidxray/manifest.py",
)


def _decode_resize(job: tuple[str, int]) -> None:
    from covidxray.edge import preprocess

    path, size = job
    try:
        preprocess.resize_square(preprocess.load_gray(path), size)
    except preprocess.ImageError:  # a real collection's unusable file: prepare tries it too, then drops it
        pass


def floor(paths: list[Path], size: int, workers: int) -> None:
    from covidxray.data.decode_pool import keep_freed_buffers

    jobs = [(str(p), size) for p in paths]
    if workers == 1:
        keep_freed_buffers()
        for job in jobs:
            _decode_resize(job)
        return
    with multiprocessing.get_context("spawn").Pool(workers, initializer=keep_freed_buffers) as pool:
        for _ in pool.imap_unordered(_decode_resize, jobs, chunksize=4):
            pass


def talo(root: Path) -> dict[str, dict]:
    """The data.sources of generated phantoms in the covid19-talo layout."""
    return {"covid19-talo": {"from_path": str(root)}}


def timed_prepare(sources: dict[str, dict], data_dir: Path, image_size: int, workers: int) -> tuple[float, int]:
    """Wall seconds of one `prepare` into a fresh `data_dir`, and the records it wrote; the folder is removed after."""
    from covidxray.config import load_config
    from covidxray.data.prepare import prepare

    shutil.rmtree(data_dir, ignore_errors=True)
    config = load_config(
        None,
        [
            {
                "data": {
                    "sources": sources,
                    "data_dir": str(data_dir),
                    "image_size": image_size,
                    "workers": workers,
                }
            }
        ],
    )
    started = time.perf_counter()
    manifest = prepare(config.data, log=lambda _msg: None)
    seconds = time.perf_counter() - started
    shutil.rmtree(data_dir)
    return seconds, sum(split.records for split in manifest.splits.values())


class PrepareCase(_bench.SelfTimed):
    """One timed `prepare` into a fresh folder; the folder is removed outside the timing."""

    def __init__(self, sources: dict[str, dict], out_root: Path, image_size: int, workers: int):
        self.sources, self.out_root, self.image_size, self.workers = sources, out_root, image_size, workers
        self.records_written = 0

    def __call__(self) -> float:
        data_dir = self.out_root / f"workers-{self.workers}"
        seconds, self.records_written = timed_prepare(self.sources, data_dir, self.image_size, self.workers)
        return seconds


def compare_to_floor(bench: _bench.Bench, args) -> dict:
    workers = [1, 2]

    if args.source:
        sources = {name: {"from_path": path} for name, path in (spec.split("=", 1) for spec in args.source)}
        paths = listed_images(sources, args.image_size)
        what = f"{', '.join(f'{name}={path}' for name, path in sources.items())} ({len(paths)} images)"
    else:
        root = _bench.talo_phantoms(args.workdir / f"talo-{args.images}x{args.image_px}", args.images, args.image_px)
        sources, paths = talo(root), _bench.image_files(root)
        what = f"{len(paths)} images {args.image_px}x{args.image_px} (half PNG, half JPEG)"
    prepares = {w: PrepareCase(sources, args.workdir / "prepare-out", args.image_size, w) for w in workers}
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
        "sources": sources,
        "image_px": None if args.source else args.image_px,
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
        f"prepare vs decode+resize floor: {what} -> {args.image_size} px, median of {args.repeats}",
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
    return results


def listed_images(sources: dict[str, dict], image_size: int) -> list[Path]:
    """The image files prepare reads from `sources` (what their adapters list), for the floor."""
    from covidxray.config import load_config
    from covidxray.data.labels import get_task
    from covidxray.data.prepare import collect_records

    config = load_config(None, [{"data": {"sources": sources, "image_size": image_size}}]).data
    with tempfile.TemporaryDirectory() as cache:
        records = collect_records(config, get_task(config.task), Path(cache)).records
    return sorted({r.image for r in records})


@contextmanager
def stage_seconds(stages: dict[str, tuple[object, str]]) -> Iterator[dict[str, float]]:
    """Wall seconds spent in each named function (`owner.attribute`) while the block runs.

    The functions are wrapped in place and restored after: prepare looks them up
    at call time, so its own code runs unchanged.
    """
    seconds: dict[str, float] = defaultdict(float)
    originals = {name: getattr(owner, attribute) for name, (owner, attribute) in stages.items()}

    def timed(name: str, function):
        def call(*args, **kwargs):
            started = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                seconds[name] += time.perf_counter() - started

        return call

    for name, (owner, attribute) in stages.items():
        setattr(owner, attribute, timed(name, originals[name]))
    try:
        yield seconds
    finally:
        for name, (owner, attribute) in stages.items():
            setattr(owner, attribute, originals[name])


def spread_subset(source_root: Path, files: list[Path], count: int, root: Path) -> Path:
    """`count` of `files`, evenly spread over the sorted list (so every class), hard-linked into `root` in their layout."""
    done = root / ".complete"
    if done.is_file() and done.read_text() == f"{count} of {len(files)}":
        return root
    shutil.rmtree(root, ignore_errors=True)
    for i in range(count):
        path = files[i * len(files) // count]
        link = root / path.relative_to(source_root)
        link.parent.mkdir(parents=True, exist_ok=True)
        os.link(path, link)
    done.write_text(f"{count} of {len(files)}")
    return root


def growth_exponent(counts: list[int], seconds: list[float]) -> float:
    """Least-squares slope of log(seconds) against log(count)."""
    import numpy as np

    return float(np.polyfit(np.log(counts), np.log(seconds), 1)[0])


def scale(bench: _bench.Bench, args) -> dict:
    from covidxray.data import dedup, near_duplicates
    from covidxray.data.image_cache import ImageCache

    stages = {
        "decode": (ImageCache, "decode_configured"),
        "dedup matching": (dedup, "matches"),
        "perceptual": (dedup, "near_pairs"),
        "geometric": (near_duplicates, "confirmed_pairs"),
    }
    counts = sorted(set(args.scale_counts))
    if len(counts) < 2:
        sys.exit("--scale needs at least two --scale-counts to fit a growth exponent")
    largest = max(counts)
    source = _bench.talo_phantoms(args.workdir / f"talo-{largest}x{args.image_px}", largest, args.image_px)
    files = _bench.image_files(source)
    roots = {
        n: spread_subset(source, files, n, args.workdir / f"scale-{n}-of-{largest}x{args.image_px}") for n in counts
    }
    samples: dict[int, dict[str, list[float]]] = {n: defaultdict(list) for n in counts}
    records = {}
    timed_prepare(talo(roots[counts[0]]), args.workdir / "scale-out", args.image_size, 1)  # untimed: imports TensorFlow
    for _ in range(args.repeats):
        for n in counts:
            with stage_seconds(stages) as seconds:
                total, records[n] = timed_prepare(talo(roots[n]), args.workdir / "scale-out", args.image_size, 1)
            for name, value in {"total": total, **seconds}.items():
                samples[n][name].append(value)
    median = {n: {name: _bench.summarize(values)["median"] for name, values in samples[n].items()} for n in counts}
    rows = []
    for n in counts:
        m = median[n]
        rows.append(
            [
                n,
                m["total"],
                m["decode"],
                m["dedup matching"],
                m["perceptual"],
                m["geometric"],
                m["dedup matching"] / m["decode"],
                1e3 * m["dedup matching"] / n,
            ]
        )
    bench.table(
        f"prepare against image count: phantoms {args.image_px}x{args.image_px} -> {args.image_size} px, 1 worker, "
        f"median of {args.repeats}",
        [
            "images",
            "total s",
            "decode s",
            "dedup matching s",
            "of which perceptual s",
            "of which geometric s",
            "matching / decode",
            "matching ms per image",
        ],
        rows,
    )
    exponents = {name: growth_exponent(counts, [median[n][name] for n in counts]) for name in median[counts[0]]}
    bench.table(
        f"growth exponent (log-log slope over {', '.join(map(str, counts))} images)",
        ["total", "decode", "dedup matching", "perceptual", "geometric"],
        [[exponents[name] for name in ("total", "decode", "dedup matching", "perceptual", "geometric")]],
    )
    missing = {n: n - records[n] for n in counts if records[n] != n}
    bench.at_most(
        "dedup matching growth exponent",
        exponents["dedup matching"],
        1.2,
        "1 is linear, 2 quadratic" + (f"; images not in the shards: {missing}" if missing else ""),
    )
    return {
        "mode": "scale",
        "image_px": args.image_px,
        "image_size": args.image_size,
        "workers": 1,
        "counts": counts,
        "records_written": records,
        "median_s": median,
        "samples_s": samples,
        "growth_exponents": exponents,
    }


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
        "--source",
        action="append",
        metavar="NAME=PATH",
        help="time prepare on a real collection instead of phantoms (data.sources NAME with from_path PATH; repeatable)",
    )
    bench.parser.add_argument(
        "--scale", action="store_true", help="time prepare against the image count instead (see above)"
    )
    bench.parser.add_argument(
        "--scale-counts",
        type=int,
        nargs="+",
        default=[1000, 5000, 20000],
        help="image counts of --scale (default: %(default)s)",
    )
    bench.parser.add_argument(
        "--ceiling-seconds",
        type=float,
        default=3.0,
        help="per phase of the 2-process ceiling probe (default: %(default)s)",
    )
    if "--scale" in sys.argv[1:]:  # one cold prepare per count is the measurement; small files keep generating cheap
        bench.parser.set_defaults(repeats=1, image_px=256)
    args = bench.parse({"images": 12, "image_px": 256, "ceiling_seconds": 0.3, "scale_counts": [24, 48]})
    bench.finish(args, scale(bench, args) if args.scale else compare_to_floor(bench, args))


if __name__ == "__main__":
    main()
