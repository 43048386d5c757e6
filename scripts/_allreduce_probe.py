"""Time Horovod's allreduce alone: run under horovodrun by bench_horovod.py and bench_allreduce.py.

Every step of `covidxray train` averages one gradient per trainable variable
across ranks (Horovod fuses them into one buffer). `--model` reduces tensors of
exactly those shapes with `grouped_allreduce`, the same fused collective;
`--sizes-mib` reduces one float32 tensor of each size instead (the network's
cost against message size). Each is timed `--steps` times after a warm-up;
before each timed call a one-float allreduce lines the ranks up, so a rank's
time is the collective's, not the wait for a slower peer. `--compression
fp16` casts to float16 before the reduction and back after, as
`hvd.DistributedOptimizer(compression=hvd.Compression.fp16)` does, so half
the bytes travel. Rank 0 writes the JSON.

    horovodrun -np 2 -H localhost:2 --gloo python scripts/_allreduce_probe.py --model small_cnn --image-size 128 --out probe.json
    horovodrun -np 4 --hostfile hosts --gloo python scripts/_allreduce_probe.py --sizes-mib 1 4 16 --out probe.json
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def time_allreduce(hvd, tensors: list, steps: int, compression, warmup: int = 3) -> list[float]:
    """Seconds of each timed `grouped_allreduce` of `tensors` (after `warmup` untimed calls)."""
    import tensorflow as tf

    line_up = tf.zeros([1])
    seconds = []
    for step in range(warmup + steps):
        hvd.allreduce(line_up).numpy()
        started = time.perf_counter()
        reduced = hvd.grouped_allreduce(tensors, op=hvd.Average, compression=compression)
        reduced[-1].numpy()
        if step >= warmup:
            seconds.append(time.perf_counter() - started)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    what = parser.add_mutually_exclusive_group()
    what.add_argument("--model", default="small_cnn", help="reduce this registered model's gradient shapes")
    what.add_argument("--sizes-mib", type=float, nargs="+", help="reduce one float32 tensor of each size instead")
    parser.add_argument(
        "--frozen-stages", type=int, default=0, help="with --model: leave out the gradients of its first N stages"
    )
    parser.add_argument("--image-size", type=int, default=128)
    parser.add_argument("--classes", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3, help="untimed calls before the timed ones")
    parser.add_argument("--compression", choices=("none", "fp16"), default="none")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    import horovod.tensorflow as hvd
    import tensorflow as tf

    from covidxray.train.distributed import init_world

    world = init_world()  # threads per rank as training sets them
    compression = hvd.Compression.fp16 if args.compression == "fp16" else hvd.Compression.none
    report = {"ranks": world.size, "compression": args.compression}
    if args.sizes_mib:
        report["sizes"] = []
        for size_mib in args.sizes_mib:
            tensor = tf.random.normal([int(size_mib * 2**20) // 4])
            report["sizes"].append(
                {
                    "bytes": int(tensor.shape.num_elements()) * 4,
                    "seconds": time_allreduce(hvd, [tensor], args.steps, compression, args.warmup),
                }
            )
    else:
        from covidxray.train.models import build_model

        model = build_model(args.model, args.image_size, args.classes)
        if args.frozen_stages:
            from covidxray.train.finetune import freeze_leading_stages

            freeze_leading_stages(model, args.model, args.frozen_stages)
        gradients = [tf.random.normal(v.shape) for v in model.trainable_variables]
        report.update(
            {
                "tensors": len(gradients),
                "parameters": int(sum(int(g.shape.num_elements()) for g in gradients)),
                "bytes": int(sum(int(g.shape.num_elements()) * g.dtype.size for g in gradients)),
                "seconds": time_allreduce(hvd, gradients, args.steps, compression, args.warmup),
            }
        )
    if world.is_root:
        args.out.write_text(json.dumps(report))


if __name__ == "__main__":
    main()
