"""Run under horovodrun by test_horovod.py: one optimizer step of a one-weight Keras model, as `covidxray train` takes it.

Rank r feeds x = X[r] with loss = the model's output w * x, so its gradient
is x; with SGD at lr 1 from w = 0, the weight after the step is minus the
average gradient the ranks exchanged. Rank 0 prints it with the Horovod
settings the process saw after `init_world`.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import tensorflow as tf

from covidxray.train.distributed import HorovodTuning, init_world

X = (1.0001, 1.0003)  # both round to 1.0 in float16 (spacing 2**-10 there), their float32 average is 1.0002

compression, fusion_mb, cycle_ms = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
world = init_world(HorovodTuning(compression, fusion_mb, cycle_ms))
inputs = tf.keras.Input((1,))
model = tf.keras.Model(inputs, tf.keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros")(inputs))
model.compile(
    optimizer=world.distributed_optimizer(tf.keras.optimizers.SGD(1.0)),
    loss=lambda _, predicted: tf.reduce_mean(predicted),
)
model.fit(np.array([[X[world.rank]]], np.float32), np.zeros((1, 1), np.float32), epochs=1, verbose=0)
if world.is_root:
    import os

    print(
        json.dumps(
            {
                "weight": float(model.get_weights()[0][0, 0]),
                "size": world.size,
                "environment": {k: os.environ.get(k) for k in HorovodTuning().environment()},
            }
        )
    )
