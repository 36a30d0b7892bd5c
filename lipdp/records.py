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

The same holds for token ids outside an ``Embedding``'s ``[0, input_dim)`` (classic
DP-SGD, where such layers are allowed): TensorFlow's CPU lookup fails on them, and
`fit` stopped at the step that sampled the record (measured 2026-12-05 with both
clipping engines). `embedding_id_limits` finds the model inputs that feed an
Embedding directly; ids computed inside the model are not seen. And for class
indices outside ``[0, K)`` given to Keras' sparse categorical cross-entropy
(`sparse_label_classes`): its CPU kernel fails on them too. lipdp's DP losses map every
label onto their domain (their bounds hold for any label), but class indices outside
``[0, K)`` are still refused (`class_index_classes`): they would train on wrong classes.

A pass over a dataset reads at most one epoch of its batches (all the epochs of a `fit`
for a dataset Keras reads as one stream: `check_finite_epochs`): a Poisson pipeline's pass
samples about 63% of the records. The private step itself covers the others: an example
with a NaN or inf feature or label contributes zero in both modes, and in classic DP-SGD
the ids and class indices above are mapped into their ranges (`into_range`).
"""

from __future__ import annotations

from functools import partial
from typing import List, NamedTuple, Optional, Tuple

import numpy as np
import tensorflow as tf

from lipdp.clipping.engine import finite_rows

__all__ = ["LabelDomainError", "NonFiniteRecordError", "OutOfRangeIdError",
           "check_finite_arrays", "check_finite_dataset", "check_finite_epochs",
           "check_ids_in_range", "check_label_domain", "check_sparse_labels",
           "class_index_classes", "embedding_id_limits", "finite_array_rows",
           "input_norms_beyond", "into_range", "listed_positions", "records_in_arrays",
           "row_fingerprints", "sparse_label_classes"]

_SHOWN = 10  # positions listed in the error message


class NonFiniteRecordError(ValueError):
    """Training records hold NaN or infinite values."""


def finite_array_rows(values, dtype) -> np.ndarray:
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


class OutOfRangeIdError(ValueError):
    """Training records hold token ids outside the vocabulary of the Embedding they feed, or
    class indices outside the classes of a sparse cross-entropy."""


class LabelDomainError(ValueError):
    """Training labels that a lipdp loss would train as other labels
    (`lipdp.losses.LABEL_DOMAINS`)."""


def check_label_domain(y, loss, nb_outputs: int) -> None:
    """Every label row of the arrays `y` given to fit is one `loss` takes as it is (its
    ``label_domain``: none for Keras' losses and `DP_MeanAbsoluteError`). A lipdp loss maps
    any label onto its domain, so that no record breaks the bound or stops a step: a soft
    label under a one-vs-all loss trained as its arg-max class, and a target of 0.3 as 1,
    silently (a usability audit, 2026-12-07). Class indices are `check_sparse_labels`'; rows
    that are not finite, `check_finite_arrays`'.

    Raises:
        LabelDomainError: listing the records whose labels the loss would change.
    """
    from lipdp.losses import LABEL_DOMAINS

    domain = getattr(loss, "label_domain", lambda k: None)(nb_outputs)
    if domain is None or y is None or isinstance(y, (dict, list, tuple)):
        return
    labels = np.asarray(y)
    if labels.dtype.kind not in "fiub":
        return
    if labels.ndim == 1 and domain == "signs":
        labels = labels[:, None]
    if labels.ndim != 2 or labels.shape[1] != nb_outputs:
        return  # class indices, or shapes the loss refuses itself
    rows = labels.astype(np.float64)
    if domain == "simplex":  # sums within the rounding of the labels' own dtype
        rounding = np.finfo(labels.dtype).eps if labels.dtype.kind == "f" else 0.0
        slack = max(1e-5, 4.0 * nb_outputs * rounding)
        good = (rows >= 0).all(axis=1) & (rows.sum(axis=1) <= 1.0 + slack)
    elif domain == "one-hot":  # one entry 1, the others 0 or -1 (deel-lip's +-1 labels)
        good = np.isin(rows, (-1.0, 0.0, 1.0)).all(axis=1) & ((rows == 1.0).sum(axis=1) == 1)
    else:
        good = np.isin(rows, (-1.0, 0.0, 1.0)).all(axis=1)
    takes, makes = LABEL_DOMAINS[domain]

    def refuse(where, bad, total):
        raise LabelDomainError(
            f"{len(bad)} of {total} training records hold labels {type(loss).__name__} does "
            f"not take as they are ({where}): {listed_positions(bad)}. It takes {takes}, and "
            f"would train each of these as {makes}. Repair the labels, or choose a loss for "
            "them, before training.")

    _check_rows([good | ~np.isfinite(rows).all(axis=1)], refuse)


def listed_positions(bad: List[str]) -> str:
    """The first `_SHOWN` positions of `bad`, and how many there are in all."""
    return ", ".join(bad[:_SHOWN]) + (f", ... ({len(bad)} in all)" if len(bad) > _SHOWN else "")


def _check_rows(flags, refuse) -> None:
    """`refuse` the rows of the arrays given to fit that are False in any of `flags`."""
    good = np.logical_and.reduce(flags)
    if not good.all():
        refuse("by index in the arrays given to fit",
               [str(i) for i in np.flatnonzero(~good)], len(good))


def _check_dataset_rows(checked, max_batches, refuse, fingerprinted=False):
    """`refuse` the rows that are False in one pass over `checked` (a dataset of per-row
    flags, at most `max_batches` batches, and one more read to tell whether the pass ends
    there); with `fingerprinted`, of ``(flags, row fingerprints)`` pairs. Returns
    ``(fingerprints, complete)``: the pass's fingerprints, one array a batch (None without
    `fingerprinted`), and whether the whole pass was read (it ended within `max_batches`
    batches)."""
    if max_batches is not None:
        checked = checked.take(max_batches + 1)
    bad, total, fingerprints, complete = [], 0, [], True
    for index, element in enumerate(checked.as_numpy_iterator()):
        if index == max_batches:  # the pass goes on: only its first max_batches are checked
            complete = False
            break
        good = element[0] if fingerprinted else element
        if fingerprinted:
            fingerprints.append(element[1])
        bad += [f"batch {index} row {row}" for row in np.flatnonzero(~good)]
        total += len(good)
    if bad:
        refuse("by position in one pass over the dataset", bad, total)
    return (fingerprints if fingerprinted else None), complete


def _refuse(where: str, bad: List[str], total: int):
    raise NonFiniteRecordError(
        f"{len(bad)} of {total} training records hold NaN or inf values, or values beyond the "
        f"range of the model's compute dtype ({where}): {listed_positions(bad)}. "
        "Remove or repair them before training: a private step cannot use them, and an error "
        "raised when one is first sampled would reveal it.")


def check_finite_arrays(x, y=None, dtype="float32") -> None:
    """Every record of the arrays (or nested structures of arrays) `x` and `y` is finite,
    also once cast to `dtype` (the model's compute dtype).

    Raises:
        NonFiniteRecordError: listing the indices of the records that are not.
    """
    dtype = np.dtype(dtype)
    flags = [finite_array_rows(a, dtype) for a in tf.nest.flatten((x, y)) if a is not None]
    if flags:
        _check_rows(flags, _refuse)


def check_finite_dataset(dataset: tf.data.Dataset, max_batches: Optional[int] = None,
                         dtype="float32", count_records: bool = False
                         ) -> Optional["RecordCount"]:
    """Every record of one pass over `dataset` (at most `max_batches` batches) is finite,
    also once cast to `dtype` (the model's compute dtype).

    The dataset yields batches of ``(x, y)`` (or ``x``); each float tensor is
    checked row by row, in a `tf.data` map. For a Poisson-sampled pipeline the
    pass sees the records one epoch samples, not necessarily all of them: check
    the arrays (`check_finite_arrays`) before building such a pipeline.
    (`lipdp.data.load_dataset` reads 8-bit images or scikit-learn's tables,
    which are finite, and bounds them without dividing by zero.)

    Returns:
        With `count_records`, a `RecordCount` ``(records, distinct, complete)``, counted in
        the same pass: the records it yields, how many of them differ from each other, byte
        for byte (`row_fingerprints`: a collision among a million records has probability
        about 3e-8), and whether that was the whole pass (it ended within `max_batches`
        batches); None without it, or when the elements are not dense batches (ragged,
        sparse, scalars).

    Raises:
        NonFiniteRecordError: listing ``batch b, row r`` of the records that are not.
    """
    batches, complete = _read_checked(dataset, max_batches, dtype, count_records)
    return None if batches is None else _record_count(batches, complete)


def check_finite_epochs(dataset: tf.data.Dataset, batches_per_epoch: int, epochs: int,
                        dtype="float32", count_records: bool = False
                        ) -> Optional[List["RecordCount"]]:
    """`check_finite_dataset` over the `epochs` epochs of `batches_per_epoch` batches that
    Keras' `fit` reads from one iterator of `dataset`: it does so for a dataset without a
    repeat given a ``steps_per_epoch`` other than its length, and epochs then cut across
    its passes. Every record of these epochs is checked.

    Returns:
        With `count_records`, one `RecordCount` an epoch read, its records counted apart
        (``complete``: all of its batches were there); None as `check_finite_dataset`.
    """
    batches, _ = _read_checked(dataset, batches_per_epoch * epochs, dtype, count_records)
    if batches is None:
        return None
    epochs_read = [batches[i:i + batches_per_epoch]
                   for i in range(0, len(batches), batches_per_epoch)]
    return [_record_count(epoch, len(epoch) == batches_per_epoch) for epoch in epochs_read]


def _read_checked(dataset, max_batches, dtype, count_records):
    """One read of `dataset` (at most `max_batches` batches), every record checked finite
    in `dtype`: ``(fingerprints, complete)`` as `_check_dataset_rows` returns them,
    fingerprints only with `count_records` and dense batches."""
    def row_flags(*element):  # the private step's own test (`finite_rows`), scalars aside
        tensors = tf.nest.flatten(element)
        flags = finite_rows([t for t in tensors if t.shape.rank != 0], dtype)
        return tf.ones(tf.shape(tensors[0])[:1], tf.bool) if flags is None else flags

    spec = tf.nest.flatten(dataset.element_spec)
    counted = count_records and bool(spec) and all(
        isinstance(s, tf.TensorSpec) and s.shape.rank not in (None, 0) for s in spec)
    checked = dataset.map(
        (lambda *element: (row_flags(*element), row_fingerprints(tf.nest.flatten(element))))
        if counted else row_flags)
    return _check_dataset_rows(checked, max_batches, _refuse, fingerprinted=counted)


def _record_count(batches: List[np.ndarray], complete: bool) -> "RecordCount":
    """The `RecordCount` of the records whose fingerprints `batches` holds."""
    values = np.concatenate(batches) if batches else np.zeros(0, np.int64)
    return RecordCount(len(values), len(np.unique(values)), complete)


class RecordCount(NamedTuple):
    """What `check_finite_dataset` counted in one pass over a dataset."""

    records: int
    distinct: int
    complete: bool  # the whole pass was read


def row_fingerprints(tensors) -> tf.Tensor:
    """One int64 per row (first axis) of the tensors together: `tf.fingerprint` (64-bit
    farmhash of each row's bytes) of each, fingerprinted again side by side."""
    rows = [tf.fingerprint(t) for t in tensors]
    return tf.bitcast(tf.fingerprint(tf.concat(rows, axis=1)), tf.int64)


def input_norms_beyond(x, bound: float, factor: float = 2.0
                       ) -> Optional[Tuple[int, int, float]]:
    """``(records whose input L2 norm exceeds factor * bound, records, median norm)`` of the
    one numeric array `x` given to fit (read by chunks, in float64); None for other inputs."""
    arrays = tf.nest.flatten(x)
    if len(arrays) != 1 or not hasattr(arrays[0], "shape") or len(arrays[0]) == 0:
        return None
    values = np.asarray(arrays[0])
    if values.dtype.kind not in "fiu":
        return None
    rows = values.reshape(len(values), -1)
    step = max(1, 2 ** 22 // max(1, rows.shape[1]))  # about 32 MB of float64 at a time
    norms = np.concatenate([np.sqrt(np.sum(np.square(rows[i:i + step].astype(np.float64)),
                                           axis=1)) for i in range(0, len(rows), step)])
    return int(np.sum(norms > factor * bound)), len(norms), float(np.median(norms))


def records_in_arrays(x, y=None) -> Optional[Tuple[int, int]]:
    """``(records, distinct)`` of the arrays (or nested structures of arrays) `x` and `y`,
    as `check_finite_dataset` counts a pass; None for arrays without a common first axis."""
    arrays = [np.asarray(a) for a in tf.nest.flatten((x, y)) if a is not None]
    if not arrays or any(a.ndim == 0 or len(a) != len(arrays[0]) for a in arrays):
        return None
    values = row_fingerprints([tf.constant(a) for a in arrays]).numpy()
    return len(values), len(np.unique(values))


def embedding_id_limits(model: tf.keras.Model) -> List[Optional[int]]:
    """For each model input (in ``model.inputs`` order), the smallest ``input_dim`` of the
    ``Embedding`` layers it feeds directly, or None when it feeds none."""
    inputs = list(getattr(model, "inputs", None) or [])
    limits: List[Optional[int]] = [None] * len(inputs)
    for layer in model._flatten_layers(include_self=False, recursive=True):
        if not isinstance(layer, tf.keras.layers.Embedding):
            continue
        for node in layer._inbound_nodes:
            for tensor in tf.nest.flatten(node.input_tensors):
                for index, model_input in enumerate(inputs):
                    if tensor is model_input:
                        limit = int(layer.input_dim)
                        limits[index] = limit if limits[index] is None else min(limits[index],
                                                                                limit)
    return limits


def aligned(x, names: List[str]) -> Optional[list]:
    """`x` as a list of the model inputs named `names` (in ``model.inputs`` order): one input,
    a list or tuple of them, or a dict keyed by their names; None when it is none of these."""
    if isinstance(x, dict):
        return [x[name] for name in names] if all(name in x for name in names) else None
    if isinstance(x, (list, tuple)):
        return list(x) if len(x) == len(names) else None
    return [x] if len(names) == 1 else None


def realigned(x, inputs: list, names: List[str]):
    """`inputs` (from `aligned`) put back into the structure of `x`."""
    if isinstance(x, dict):
        return {**x, **dict(zip(names, inputs))}
    if isinstance(x, (list, tuple)):
        return type(x)(inputs)
    return inputs[0]


def _ids_in_range(ids, limit) -> tf.Tensor:
    """Per row: every entry of `ids` lies in ``[0, limit)``."""
    ids = tf.convert_to_tensor(ids)
    flags = tf.logical_and(ids >= tf.cast(0, ids.dtype), ids < tf.cast(limit, ids.dtype))
    return tf.reduce_all(tf.reshape(flags, (tf.shape(ids)[0], -1)), axis=1)


def into_range(ids, limit: int) -> tf.Tensor:
    """`ids` with every entry mapped into ``[0, limit)``, each on its own: clipped to the
    range, a non-finite float entry set to 0; ids already in range are unchanged. What the
    private step of classic DP-SGD applies to the ids and class indices that `fit` checks
    before the first step (`check_ids_in_range`, `check_sparse_labels`), for the records that
    check does not see: TensorFlow's CPU kernels fail on an id outside the range, and the
    step would stop at the one that sampled the record."""
    ids = tf.convert_to_tensor(ids)
    if ids.dtype.is_floating:
        ids = tf.where(tf.math.is_finite(ids), ids, tf.zeros_like(ids))
    return tf.clip_by_value(ids, tf.cast(0, ids.dtype), tf.cast(limit - 1, ids.dtype))


_FAILS = ("TensorFlow fails on them, and an error raised when one is first sampled would "
          "reveal it")
_ID_RANGES = ("ids outside [0, input_dim) of the Embedding layer they feed",
              "map unknown tokens to an id of their own", _FAILS)
_LABEL_RANGES = ("class indices outside [0, K) of the sparse cross-entropy (K model outputs)",
                 "or use a lipdp loss, which maps any label onto its classes", _FAILS)
_CLASS_INDEX_RANGES = ("class indices outside [0, K) (K model outputs)",
                       "labels 1..K are 0..K-1 here",
                       "the DP loss would clip each into [0, K), training on a wrong class")


def _refuse_ids(what, where: str, bad: List[str], total: int):
    raise OutOfRangeIdError(
        f"{len(bad)} of {total} training records hold {what[0]} ({where}): "
        f"{listed_positions(bad)}. Remove or repair them before training ({what[1]}): "
        f"{what[2]}.")


def sparse_label_classes(model: tf.keras.Model, loss) -> Optional[int]:
    """K, the model's outputs, when `loss` is Keras' sparse categorical cross-entropy (its
    name, function or class); None otherwise."""
    losses = tf.keras.losses
    sparse = (loss in ("sparse_categorical_crossentropy", losses.sparse_categorical_crossentropy)
              or isinstance(loss, losses.SparseCategoricalCrossentropy))
    return int(model.output_shape[-1]) if sparse else None


def class_index_classes(model: tf.keras.Model, loss, labels) -> Optional[int]:
    """K, the model's outputs, when `loss` is a lipdp loss of classes (it takes class indices:
    `lipdp.losses.class_labels`), K > 1, and `labels` (the `tf.TensorSpec` of a batch's or the
    arrays' labels, or None when unknown) are class indices, ``(batch,)`` or ``(batch, 1)``;
    None otherwise. The loss clips an index outside ``[0, K)`` into it (its bound holds for
    any label), so labels numbered 1..K trained silently against wrong classes (an audit)."""
    k = model.output_shape[-1]
    if labels is None or not getattr(loss, "takes_class_indices", False) or k is None \
            or k < 2:
        return None
    shape = labels.shape
    if shape.rank not in (1, 2) or (shape.rank == 2 and shape[-1] != 1):
        return None
    return int(k)


def check_sparse_labels(x, y, classes: Optional[int], max_batches: Optional[int] = None,
                        dp_loss: bool = False) -> None:
    """Every record's class index lies in ``[0, classes)`` (nothing to check when `classes`
    is None): for a sparse cross-entropy (`sparse_label_classes`) or, with `dp_loss`, a lipdp
    loss of classes (`class_index_classes`). `x` and `y` as for `check_ids_in_range` (``y``
    None for a dataset).

    Raises:
        OutOfRangeIdError: listing the records that hold another index.
    """
    if classes is None:
        return
    refuse = partial(_refuse_ids, _CLASS_INDEX_RANGES if dp_loss else _LABEL_RANGES)
    if not isinstance(x, tf.data.Dataset):
        if y is not None and not isinstance(y, (dict, list, tuple)):
            _check_rows([_ids_in_range(y, classes).numpy()], refuse)
        return

    spec = x.element_spec
    if isinstance(spec, tuple) and len(spec) == 2 and isinstance(spec[1], tf.TensorSpec):
        _check_dataset_rows(x.map(lambda features, labels: _ids_in_range(labels, classes)),
                            max_batches, refuse)


def check_ids_in_range(x, limits: List[Optional[int]], names: List[str],
                       max_batches: Optional[int] = None) -> None:
    """Every record's ids are within the vocabulary of the Embedding they feed.

    Args:
        x: the arrays given to `fit` (one per model input, or a dict by input name), or a
            dataset of ``(x, y)`` (or ``x``) batches, of which one pass (at most
            `max_batches` batches) is read.
        limits: `embedding_id_limits` of the model.
        names: the model's input names, in the order of `limits`.

    Raises:
        OutOfRangeIdError: listing the records (by index, or ``batch b, row r``) that hold an
            id outside ``[0, input_dim)``.
    """
    if not any(limit is not None for limit in limits):
        return
    if not isinstance(x, tf.data.Dataset):
        arrays = aligned(x, names)
        if arrays is None:
            return
        _check_rows([_ids_in_range(a, n).numpy() for a, n in zip(arrays, limits)
                     if n is not None], partial(_refuse_ids, _ID_RANGES))
        return

    def row_flags(*element):  # a batch (x, y) or x: x first
        arrays = aligned(element[0], names)
        if arrays is None:
            return tf.ones(tf.shape(tf.nest.flatten(element)[0])[:1], tf.bool)
        flags = [_ids_in_range(a, n) for a, n in zip(arrays, limits) if n is not None]
        return tf.reduce_all(tf.stack(flags), axis=0)

    _check_dataset_rows(x.map(row_flags), max_batches, partial(_refuse_ids, _ID_RANGES))
