"""Time Horovod's gradient allreduce for one model, alone: run under horovodrun by bench_horovod.py.

Every step of `covidxray train` averages one gradient per trainable variable
across ranks (Horovod fuses them into one buffer). This reduces tensors of
exactly those shapes with `grouped_allreduce`, the same fused collective,
`--steps` times after a warm-up; before each timed call a one-float
allreduce lines the ranks up, so a rank's time is the collective's, not the
wait for a slower peer. Rank 0 writes the JSON.

    horovodrun -np 2 -H localhost:2 --gloo python scripts/_allreduce_probe.py --model small_cnn --image-size 128 --out probe.json
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="small_cnn")
    parser.add_argument("--image-size", type=int, default=128)
    parser.add_argument("--classes", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    import horovod.tensorflow as hvd
    import tensorflow as tf

    from covidxray.train.distributed import init_world
    from covidxray.train.models import build_model

    world = init_world()  # threads per rank as training sets them
    model = build_model(args.model, args.image_size, args.classes)
    gradients = [tf.random.normal(v.shape) for v in model.trainable_variables]
    line_up = tf.zeros([1])
    seconds = []
    for step in range(3 + args.steps):
        hvd.allreduce(line_up).numpy()
        started = time.perf_counter()
        reduced = hvd.grouped_allreduce(gradients, op=hvd.Average)
        reduced[-1].numpy()
        if step >= 3:
            seconds.append(time.perf_counter() - started)
    if world.is_root:
        args.out.write_text(json.dumps({
            "ranks": world.size,
            "tensors": len(gradients),
            "parameters": int(sum(int(g.shape.num_elements()) for g in gradients)),
            "bytes": int(sum(int(g.shape.num_elements()) * g.dtype.size for g in gradients)),
            "seconds": seconds,
        }))


if __name__ == "__main__":
    main()
