"""A source adversary (`train.source_adversary`): features that do not say which collection a film came from.

Domain-adversarial training (Ganin et al., JMLR 2016): a small head reads the
classifier's penultimate features (the input of its `probabilities` layer)
and learns to tell the training sources apart; between the two sits a gradient
reversal, identity going forward and -lambda x the gradient going back, so the
head gets better at naming the source while the backbone is pushed to make
features from which it cannot, as far as that costs the classifier nothing.
lambda ramps from 0 to 1 over the run, 2 / (1 + exp(-10 p)) - 1 with p the
share of training done (Ganin et al.'s schedule): early features are noise,
and reversing their gradient at full strength would only slow the classifier.
The source loss (sparse cross-entropy of the head) is added to the class loss
with weight train.source_adversary.

`SourceAdversary` is what `fit` trains; called on images it is the classifier,
so validation, BN re-estimation and every saved model see the classifier only
(`classifier`, saved as model.keras, has no head: export and predict never
know there was one).
"""

from __future__ import annotations

import tensorflow as tf

HIDDEN = 64  # units of the head's one hidden layer


@tf.custom_gradient
def reverse_gradient(features: tf.Tensor, strength: tf.Tensor):
    def backward(upstream):
        return -strength * upstream, tf.zeros_like(strength)

    return tf.identity(features), backward


def ramp(progress: tf.Tensor) -> tf.Tensor:
    """Ganin et al.'s lambda: 0 at the start, ~1 from half-way."""
    return 2.0 / (1.0 + tf.exp(-10.0 * progress)) - 1.0


class SourceAdversary(tf.keras.Model):
    """The classifier plus a source head behind a gradient reversal; x = {"image", "source"} while training."""

    def __init__(self, classifier: tf.keras.Model, num_sources: int, weight: float, total_steps: int):
        super().__init__(name=f"{classifier.name}_source_adversary")
        self.classifier = classifier
        features = classifier.get_layer("probabilities").input
        self.with_features = tf.keras.Model(classifier.inputs, [classifier.output, features])
        self.head = tf.keras.Sequential(
            [tf.keras.layers.Dense(HIDDEN, activation="relu"), tf.keras.layers.Dense(num_sources)], name="source_head"
        )
        self.head.build((None, features.shape[-1]))
        self.weight, self.total_steps = float(weight), max(1, int(total_steps))
        # Set past Keras' attribute tracking: a metric's state is each rank's own, and as a tracked attribute it
        # would join the model's weights (checkpoints, the start-of-training broadcast, the replica digest).
        object.__setattr__(
            self,
            "source_metrics",
            (
                tf.keras.metrics.Mean(name="source_loss"),
                tf.keras.metrics.SparseCategoricalAccuracy(name="source_accuracy"),
            ),
        )

    def call(self, inputs, training=False):
        return self.classifier(inputs["image"] if isinstance(inputs, dict) else inputs, training=training)

    @property
    def output_shape(self):
        return self.classifier.output_shape

    @property
    def metrics(self):
        return [*super().metrics, *self.source_metrics]

    def train_step(self, data):
        x, y, sample_weight = tf.keras.utils.unpack_x_y_sample_weight(data)
        progress = tf.minimum(1.0, tf.cast(self.optimizer.iterations, tf.float32) / self.total_steps)
        with tf.GradientTape() as tape:
            probabilities, features = self.with_features(x["image"], training=True)
            class_loss = self.compiled_loss(y, probabilities, sample_weight, regularization_losses=self.losses)
            logits = self.head(reverse_gradient(features, ramp(progress)), training=True)
            source_loss = tf.reduce_mean(
                tf.keras.losses.sparse_categorical_crossentropy(x["source"], logits, from_logits=True)
            )
            loss = class_loss + self.weight * source_loss
        self.optimizer.minimize(loss, self.trainable_variables, tape=tape)
        self.compiled_metrics.update_state(y, probabilities, sample_weight)
        loss_tracker, accuracy = self.source_metrics
        loss_tracker.update_state(source_loss)
        accuracy.update_state(x["source"], logits)
        return {metric.name: metric.result() for metric in self.metrics}


def wrap(classifier: tf.keras.Model, num_sources: int, weight: float, total_steps: int) -> tf.keras.Model:
    """`classifier` itself when `weight` is 0 or there is one source (nothing to be adversarial about)."""
    if weight <= 0 or num_sources < 2:
        return classifier
    return SourceAdversary(classifier, num_sources, weight, total_steps)


def inference_model(model: tf.keras.Model) -> tf.keras.Model:
    """The model to save and deploy: the classifier inside an adversary, else the model itself."""
    return model.classifier if isinstance(model, SourceAdversary) else model
