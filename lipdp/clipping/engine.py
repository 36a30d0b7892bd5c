"""What a per-example norm engine returns."""

from __future__ import annotations

from typing import List, NamedTuple, Optional

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
    """``sum_i factors[i] * per_example[i]``, the factors in the tensor's dtype
    (`factors_in`)."""
    return tf.tensordot(factors_in(factors, per_example.dtype), per_example, axes=1)


def factors_in(factors: tf.Tensor, dtype) -> tf.Tensor:
    """Clipping factors in `dtype`, never larger than the given ones: a float64 factor cast to
    a float32 gradient's dtype is rounded to nearest, which may round it up and let the
    clipped gradient exceed its threshold, so such a factor is moved to the next float32 below
    it. Widening casts are exact. The factors of a model mixing float32 and float64 variables
    are float64 (`lipdp.clipping.rules`); ghost norms are float32 upper bounds, so a float64
    gradient gets float32 factors."""
    dtype = tf.as_dtype(dtype)
    if factors.dtype == dtype:
        return factors
    cast = tf.cast(factors, dtype)
    if dtype.size >= factors.dtype.size:
        return cast
    rounded_up = tf.cast(cast, factors.dtype) > factors
    return tf.where(rounded_up, tf.math.nextafter(cast, tf.zeros_like(cast)), cast)


def usable_examples(losses: tf.Tensor, squared_norms: List[tf.Tensor]) -> tf.Tensor:
    """``(batch,)`` bool: example i's loss and every squared norm of its gradient are finite.

    Each flag depends on example i alone (no batch coupling, `validation`). An example
    without it contributes zero to the clipped sums (`without_unusable`): a record whose
    features are huge but finite overflows in the forward pass or in its norms, and a step
    that stopped there would reveal when the record was sampled.
    """
    usable = tf.math.is_finite(losses)
    for squared in squared_norms:
        usable = tf.logical_and(usable, tf.math.is_finite(squared))
    return usable


def without_unusable(factors: List[tf.Tensor], usable: tf.Tensor) -> List[tf.Tensor]:
    """The clipping factors with those of unusable examples set to 0 (not multiplied: a
    factor that is NaN stays NaN under a product)."""
    return [tf.where(usable, nu, tf.zeros_like(nu)) for nu in factors]


def finite_rows(structure, dtype=tf.float32) -> Optional[tf.Tensor]:
    """``(batch,)`` bool: every floating-point value of row i of every tensor of `structure`
    (inputs or labels, batch first) is finite, also once cast to `dtype` (the model's
    compute dtype: a float64 value beyond float32's range becomes an infinity there); None
    when no tensor is floating-point."""
    dtype = tf.as_dtype(dtype)
    flags = None
    for t in tf.nest.flatten(structure):
        t = tf.convert_to_tensor(t)
        if not t.dtype.is_floating:
            continue
        finite = tf.math.is_finite(t)
        if t.dtype.max > dtype.max:  # a cast to dtype can overflow
            finite = tf.logical_and(finite, tf.abs(t) <= tf.constant(dtype.max, t.dtype))
        row = tf.reduce_all(tf.reshape(finite, [tf.shape(t)[0], -1]), axis=1)
        flags = row if flags is None else tf.logical_and(flags, row)
    return flags


def rows_of_a_usable_example(structure, usable: tf.Tensor):
    """Every tensor of `structure` (inputs or labels, batch first) with the rows of the
    unusable examples replaced by those of the first usable example (row 0 when none is).
    Passed again with a factor of 0, such a row adds exactly 0 to the sums: its activations
    are a usable example's, finite. Zeroed rows are not enough: a model may make a zero
    input non-finite (``log|x|``), and 0 times inf in the batch's backward pass made the
    step's sum NaN, the step then stopping on a finite record (a review, 2026-12-07)."""
    rows = tf.range(tf.shape(usable)[0])
    first = tf.argmax(tf.cast(usable, tf.int32), output_type=tf.int32)
    source = tf.where(usable, rows, first)

    def replaced(t):
        return t if t is None else tf.gather(tf.convert_to_tensor(t), source)

    return tf.nest.map_structure(replaced, structure)


def zero_rows(structure, usable: tf.Tensor):
    """Every tensor of `structure` (inputs or labels, batch first) with the rows of the
    unusable examples set to zero."""
    def zeroed(t):
        if t is None:
            return t
        t = tf.convert_to_tensor(t)
        # The rank read when the step runs: Keras retraces a fit's step for labels of another
        # rank than the last fit's with the rank unknown (a second fit with labels (N, 1)
        # after (N,) failed here).
        trailing = tf.ones(tf.reshape(tf.rank(t) - 1, [1]), tf.int32)
        mask = tf.reshape(usable, tf.concat([tf.shape(usable), trailing], 0))
        return tf.where(mask, t, tf.zeros_like(t))

    return tf.nest.map_structure(zeroed, structure)
