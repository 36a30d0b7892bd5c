"""What classic DP-SGD needs from a model and a loss, checked at compile time.

Per-example clipping is only meaningful when example i's loss depends on
example i alone: then the gradient of the *sum* of losses splits into
per-example gradients, each of which is clipped. Layers that mix the examples
of a batch break this (and the sensitivity argument with it).
"""

from __future__ import annotations

from typing import Callable, Iterator

import tensorflow as tf

# Layers whose training-mode output for one example depends on the other
# examples of the batch (batch statistics).
_BATCH_COUPLED = ("BatchNormalization", "SyncBatchNormalization", "BatchCentering")


class BatchCouplingError(ValueError):
    """Raised when a model contains a layer that mixes the examples of a batch."""


def leaf_layers(model: tf.keras.Model) -> Iterator[tf.keras.layers.Layer]:
    """Every layer of `model`, nested models expanded, in `model.layers` order."""
    for layer in model.layers:
        if isinstance(layer, tf.keras.Model):
            yield from leaf_layers(layer)
        elif not isinstance(layer, tf.keras.layers.InputLayer):
            yield layer


def check_no_batch_coupling(model: tf.keras.Model) -> None:
    """Refuse layers whose output for one example depends on the other examples.

    Raises:
        BatchCouplingError: naming the first such layer (BatchNormalization and
            its variants: its batch statistics mix examples, so per-example
            gradients are undefined and one example moves every other one's
            gradient, beyond the clipping threshold).
    """
    for layer in leaf_layers(model):
        names = {cls.__name__ for cls in type(layer).__mro__}
        coupled = names.intersection(_BATCH_COUPLED)
        if coupled:
            raise BatchCouplingError(
                f"Layer '{layer.name}' ({type(layer).__name__}) normalises with batch statistics: "
                "its output for one example depends on the other examples of the batch, so "
                "per-example gradients (and their clipping) are undefined and the sensitivity "
                "bound fails. Remove it, or use a per-example normalisation such as "
                "LayerNormalization or GroupNormalization."
            )


def per_example_loss(loss) -> Callable[[tf.Tensor, tf.Tensor], tf.Tensor]:
    """A function ``(y_true, y_pred) -> (batch,)`` of per-example losses.

    Accepted: a `tf.keras.losses.Loss` (its ``call``, which skips the batch
    reduction; DP losses included), a loss name or function resolved with
    `tf.keras.losses.get` (Keras loss functions are per example). Values with
    more than one axis (e.g. per-token losses) are averaged over the non-batch
    axes, as Keras' own reduction would do within an example.

    Raises:
        TypeError: no loss, or an object that is neither.
    """
    if loss is None:
        raise TypeError("A clipped DP model must be compiled with a loss that gives per-example "
                        "values (a tf.keras.losses.Loss, a Keras loss name or a function "
                        "(y_true, y_pred) -> (batch,)). Received: loss=None")
    if isinstance(loss, (str, dict)):
        loss = tf.keras.losses.get(loss)
    if isinstance(loss, tf.keras.losses.Loss):
        function = loss.call
    elif callable(loss):
        function = loss
    else:
        raise TypeError("Received an invalid value for `loss`, expected a tf.keras.losses.Loss, "
                        f"a loss name or a function. Received: loss={loss!r}")

    def per_example(y_true, y_pred):
        values = function(y_true, y_pred)
        rank = values.shape.rank
        if rank == 0:
            raise ValueError(
                f"The loss {loss!r} returned a scalar: classic DP-SGD needs one value per "
                "example. Pass a tf.keras.losses.Loss (its `call` is per example) or a function "
                "returning shape (batch,).")
        if rank is not None and rank > 1:
            values = tf.reduce_mean(values, axis=list(range(1, rank)))
        return values

    return per_example
