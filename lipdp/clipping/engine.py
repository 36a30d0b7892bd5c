"""What a per-example norm engine returns."""

from __future__ import annotations

from typing import List, NamedTuple

import tensorflow as tf


class ClippedBatch(NamedTuple):
    """One batch through a clipping engine.

    Attributes:
        gradient_sums: ``sum_i nu[v][i] g_{i,v}`` for every trainable variable v
            (dense tensors, *not* divided by the batch denominator).
        squared_norms: ``||g_{i,v}||^2`` (before clipping), ``(batch,)`` per variable.
        losses: per-example losses ``(batch,)``.
        y_pred: the model's output on the batch.
    """

    gradient_sums: List[tf.Tensor]
    squared_norms: List[tf.Tensor]
    losses: tf.Tensor
    y_pred: tf.Tensor


def squared_norms_of(per_example: List[tf.Tensor]) -> List[tf.Tensor]:
    """``(batch,)`` squared L2 norm of each ``(batch,) + shape`` per-example tensor."""
    return [tf.reduce_sum(tf.reshape(tf.square(g), (tf.shape(g)[0], -1)), axis=1)
            for g in per_example]


def weighted_sum(factors: tf.Tensor, per_example: tf.Tensor) -> tf.Tensor:
    """``sum_i factors[i] * per_example[i]``."""
    return tf.tensordot(factors, per_example, axes=1)


def checked(losses: tf.Tensor) -> tf.Tensor:
    """The per-example losses, failing on NaN/inf (bad inputs or labels)."""
    return tf.debugging.check_numerics(
        losses, "Non-finite loss in a private step (NaN/inf inputs or labels?)")
