"""Checks on the private training records, run once before the first private step.

A record with a NaN or an infinite value cannot be trained on: its loss or its
gradient is not finite. Nor can a float64 record beyond float32's range when the
model computes in float32: Keras casts it to an infinity. Found by the train step, it would abort `fit` at the
step that happened to sample it, and *when* training stopped would depend on
one record (a release outside the accountant). So `DP_Model.fit` and
`DP_Sequential.fit` look at every record once, before training starts, and
refuse the data with the positions of the records that fail. These checks read
private data to decide whether to train at all: their outcome is shown to
whoever runs training (the data holder), like any data-loading error.
"""

from __future__ import annotations

from typing import List, Optional

import numpy as np
import tensorflow as tf

__all__ = ["NonFiniteRecordError", "check_finite_arrays", "check_finite_dataset"]

_SHOWN = 10  # positions listed in the error message


class NonFiniteRecordError(ValueError):
    """Training records hold NaN or infinite values."""


def _finite_rows(values, dtype) -> np.ndarray:
    """Per-row flag: every float entry of the row is finite once cast to `dtype`, the
    model's compute dtype (non-float arrays always are)."""
    array = np.asarray(values)
    if array.ndim == 0:
        return np.ones(1, bool)
    if not np.issubdtype(array.dtype, np.floating):
        return np.ones(len(array), bool)
    rows = array.reshape(len(array), -1)
    finite = np.isfinite(rows)
    if np.finfo(array.dtype).max > np.finfo(dtype).max:  # a cast to dtype can overflow
        finite &= np.abs(np.where(finite, rows, 0)) <= np.finfo(dtype).max
    return finite.all(axis=1)


def _refuse(where: str, bad: List[str], total: int):
    shown = ", ".join(bad[:_SHOWN]) + (f", ... ({len(bad)} in all)" if len(bad) > _SHOWN else "")
    raise NonFiniteRecordError(
        f"{len(bad)} of {total} training records hold NaN or inf values, or values beyond the "
        f"range of the model's compute dtype ({where}): {shown}. "
        "Remove or repair them before training: a private step cannot use them, and an error "
        "raised when one is first sampled would reveal it.")


def check_finite_arrays(x, y=None, dtype="float32") -> None:
    """Every record of the arrays (or nested structures of arrays) `x` and `y` is finite,
    also once cast to `dtype` (the model's compute dtype).

    Raises:
        NonFiniteRecordError: listing the indices of the records that are not.
    """
    dtype = np.dtype(dtype)
    flags = [_finite_rows(a, dtype) for a in tf.nest.flatten((x, y)) if a is not None]
    if not flags:
        return
    finite = np.logical_and.reduce(flags)
    if not finite.all():
        _refuse("by index in the arrays given to fit",
                [str(i) for i in np.flatnonzero(~finite)], len(finite))


def check_finite_dataset(dataset: tf.data.Dataset, max_batches: Optional[int] = None,
                         dtype="float32") -> None:
    """Every record of one pass over `dataset` (at most `max_batches` batches) is finite,
    also once cast to `dtype` (the model's compute dtype).

    The dataset yields batches of ``(x, y)`` (or ``x``); each float tensor is
    checked row by row, in a `tf.data` map. For a Poisson-sampled pipeline the
    pass sees the records one epoch samples, not necessarily all of them: check
    the arrays (`check_finite_arrays`) before building such a pipeline.
    (`lipdp.data.load_dataset` reads 8-bit images or scikit-learn's tables,
    which are finite, and bounds them without dividing by zero.)

    Raises:
        NonFiniteRecordError: listing ``batch b, row r`` of the records that are not.
    """
    dtype = tf.as_dtype(dtype)

    def finite_rows(t):
        flags = tf.math.is_finite(t)
        if t.dtype.max > dtype.max:  # a cast to dtype can overflow
            flags &= tf.abs(tf.where(flags, t, tf.zeros_like(t))) <= dtype.max
        return tf.reduce_all(tf.reshape(flags, (tf.shape(t)[0], -1)), axis=1)

    def row_flags(*element):
        flags = [finite_rows(t) for t in tf.nest.flatten(element)
                 if t.dtype.is_floating and t.shape.rank != 0]
        if not flags:
            return tf.ones(tf.shape(tf.nest.flatten(element)[0])[:1], tf.bool)
        return tf.reduce_all(tf.stack(flags), axis=0)

    checked = dataset.map(row_flags)
    if max_batches is not None:
        checked = checked.take(max_batches)
    bad, total = [], 0
    for index, finite in enumerate(checked.as_numpy_iterator()):
        bad += [f"batch {index} row {row}" for row in np.flatnonzero(~finite)]
        total += len(finite)
    if bad:
        _refuse("by position in one pass over the dataset", bad, total)
