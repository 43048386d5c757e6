"""Records/s of the training input pipeline against the model's train-step throughput.

Single process, threads as `covidxray train` sets them (`init_world`). Cases,
interleaved round-robin:
- input: `covidxray.train.input.make_dataset(training=True, augment=True)` over
  prepared phantom shards, exactly as the trainer builds it (shuffle, PNG
  decode, albumentations affine + brightness/contrast, one-hot, batch,
  prefetch); and the same without augmentation, to show where its time goes.
  The batches prefetched while other cases ran are discarded before timing.
- step: `model.train_on_batch` on one fixed batch, compiled as the trainer
  compiles it (Adam, categorical cross-entropy, accuracy), so no input work.
Each is measured alone on all cores; in training they share the cores, so
the ratio says how much of the machine the input takes, not only who waits.
Goal: input >= 5x the train step, so training is never input-bound.
"""

from __future__ import annotations

import time

import _bench

# What the figures depend on; a change to any makes this benchmark's docs/bench reports stale
# (scripts/stale_benchmarks.py): the input pipeline, the model step it is weighed against, and the thread setup.
MEASURES = (
    "covidxray/config.py",  # the defaults every run takes what it is not told
    "covidxray/strict.py",  # how each setting is read and checked
    "covidxray/registry.py",  # which model, source, task or format a name means
    "covidxray/manifest.py",  # which shards of which split a run reads
    "covidxray/records.py",  # a record's fields and the label vocabulary
    "covidxray/train/input.py",
    "covidxray/train/models.py",
    "covidxray/train/distributed.py",
    "covidxray/data/tfrecord.py",
)


PROBE_BATCHES_DISCARDED = 3  # PREFETCH_BATCHES + the one being assembled


class InputCase(_bench.SelfTimed):
    def __init__(self, iterator, batches: int):
        self.iterator, self.batches = iterator, batches

    def __call__(self) -> float:
        for _ in range(PROBE_BATCHES_DISCARDED):
            next(self.iterator)
        started = time.perf_counter()
        for _ in range(self.batches):
            next(self.iterator)
        return time.perf_counter() - started


def step_case(model_name: str, size: int, num_classes: int, batch, steps: int):
    import tensorflow as tf

    from covidxray.train.models import build_model

    model = build_model(model_name, size, num_classes)
    model.compile(optimizer=tf.keras.optimizers.Adam(1e-3), loss="categorical_crossentropy", metrics=["accuracy"])
    images, labels = batch

    def case() -> None:
        for _ in range(steps):
            model.train_on_batch(images, labels)

    return case, model.count_params()


def main() -> None:
    bench = _bench.Bench("input", __doc__)
    bench.parser.add_argument(
        "--cases",
        default="small_cnn@128,mobilenet_v3_small@128,mobilenet_v3_small@224",
        help="model@image_size list (default: %(default)s)",
    )
    bench.parser.add_argument(
        "--batches", type=int, default=20, help="batches (input) and steps (model) per round (default: %(default)s)"
    )
    bench.parser.add_argument("--batch-size", type=int, default=32, help="train.batch_size (default: %(default)s)")
    bench.parser.add_argument(
        "--patients", type=int, default=300, help="phantom patients in the prepared set (default: %(default)s)"
    )
    args = bench.parse({"cases": "small_cnn@64", "batches": 2, "patients": 40})

    from covidxray.manifest import open_prepared
    from covidxray.train.distributed import init_world
    from covidxray.train.input import InputSpec, make_dataset

    world = init_world()  # single process: as `covidxray train` outside horovodrun
    model_cases = _bench.parse_cases(args.cases)
    cases, first_batch, sizes, params = {}, {}, sorted({s for _, s in model_cases}), {}
    for size in sizes:
        data = _bench.prepared_synthetic(args.workdir / f"input-data-{size}", size, args.patients)
        prepared = open_prepared(data)
        labels = prepared.manifest.labels
        for augment in (False, True):
            ds, _ = make_dataset(
                prepared.shards("train"),
                InputSpec(
                    size, len(labels), args.batch_size, training=True, augment=augment, threads=world.cores_per_rank
                ),
            )
            iterator = iter(ds)
            first_batch[size] = next(iterator)
            cases[f"input {'decode+augment' if augment else 'decode'} @{size}"] = InputCase(iterator, args.batches)
    for model_name, size in model_cases:
        case, params[(model_name, size)] = step_case(
            model_name, size, first_batch[size][1].shape[-1], first_batch[size], args.batches
        )
        cases[f"step {model_name} @{size}"] = case
    samples = _bench.round_robin(cases, args.repeats, warmup=1)
    stats = {name: _bench.summarize(s) for name, s in samples.wall.items()}
    per_round = args.batches * args.batch_size
    rate = {name: per_round / s["median"] for name, s in stats.items()}

    results = {
        "batch_size": args.batch_size,
        "batches_per_round": args.batches,
        "threads": world.cores_per_rank,
        "cases": stats,
        "records_per_s": rate,
        "ratios": {},
    }
    bench.table(
        f"input pipeline alone, records/s (batch {args.batch_size}, median of {args.repeats} x {args.batches} batches)",
        ["image size", "decode only", "decode + augment", "augment share of time"],
        [
            [
                size,
                rate[f"input decode @{size}"],
                rate[f"input decode+augment @{size}"],
                1 - rate[f"input decode+augment @{size}"] / rate[f"input decode @{size}"],
            ]
            for size in sizes
        ],
    )
    rows = []
    for model_name, size in model_cases:
        step, feed, plain = (
            rate[f"step {model_name} @{size}"],
            rate[f"input decode+augment @{size}"],
            rate[f"input decode @{size}"],
        )
        ratio = feed / step
        results["ratios"][f"{model_name}@{size}"] = ratio
        rows.append([model_name, size, params[(model_name, size)], step, feed, ratio, f"{step / feed:.0%}"])
        bound = "input" if feed < step else "model"
        note = f"decode alone {plain / step:.1f}x the step; augmentation takes {1 - feed / plain:.0%} of the input time; {bound}-bound if run alone"
        bench.at_least(f"input >= 5x train step, {model_name} @{size}", ratio, 5, note)
    bench.table(
        "input pipeline vs train step (records/s)",
        [
            "model",
            "image size",
            "parameters",
            "train step",
            "input (decode+augment)",
            "input / step",
            "machine share the input needs",
        ],
        rows,
    )
    bench.finish(args, results)


if __name__ == "__main__":
    main()
