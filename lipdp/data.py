"""Datasets, input bounding and Poisson sampling for private training.

Everything the accountant is told about the data lives in the returned
`DatasetMetadata`; this module makes sure the pipelines honour it:

- **Bounded inputs.** Every input is mapped into the L2 ball of radius ``X0``
  (``metadata.max_norm``) by `bound_clip_value` or `bound_normalize`. The model
  clips again in its forward pass (DESIGN.md), so this is a first line, not the
  only one.
- **Poisson sampling** (``sampling="poisson"``, the default). Each of the
  ``metadata.steps_per_epoch = ceil(N / D)`` steps of an epoch draws a fresh
  batch in which every training example appears independently with
  probability ``q = D / N``. This is exactly the sampling the RDP
  amplification theorem assumes. Batches have a random size (possibly 0);
  gradients must be averaged with the fixed public denominator
  ``D = metadata.batch_size``, never the realised batch size.
- **Shuffling** (``sampling="shuffle"``). One permutation per epoch cut into
  batches of ``D``. Offered because it is the common practice, with a warning:
  the accountant's Poisson-amplified epsilon is not a proof for it.
- **No data-dependent preprocessing.** Every transformation is a fixed
  function of one example (images: ``/255``; digits: ``/16``; breast cancer:
  fixed public per-feature constants). No statistic is ever computed on the
  private training set.

Where the image datasets are looked for (first hit wins):

1. the ``data_dir`` argument (the directory itself, then ``data_dir/<name>``; ``~``
   expanded): when given, the only place looked in (no other place, no download);
2. ``$LIPDP_DATA_DIR/<name>``;
3. ``/usr/share/datasets/<debian-name>`` (Debian's ``dataset-fashion-mnist``
   installs the IDX files in ``/usr/share/datasets/fashion-mnist``);
4. the Keras cache (``$KERAS_HOME`` or ``~/.keras``) ``/datasets/...``: the
   files ``tf.keras.datasets.<name>.load_data()`` leaves there;
5. only if ``download=True``: ``tf.keras.datasets.<name>.load_data()``.

Accepted files in a directory: MNIST / Fashion-MNIST as the four standard IDX
files ``{train,t10k}-{images-idx3,labels-idx1}-ubyte`` (gzipped ``.gz`` or
plain; the ``train-images.idx3-ubyte`` spelling too; two different files for one part
are refused, identical copies, as ``gunzip -k`` leaves, are one) or a Keras-style
``mnist.npz``; CIFAR-10 as the python pickle batches (``data_batch_1`` ...
``data_batch_5``, ``test_batch``), directly or in a ``cifar-10-batches-py``
subdirectory.

Command line: ``python -m lipdp.data NAME [--data-dir DIR] [--no-download]``
checks that a dataset can be found (or downloaded) and says where it is.
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import hashlib
import logging
import math
import os
import pickle
import secrets
import struct
import weakref
import sys
import warnings
import zlib
from typing import Callable, Dict, Hashable, List, Optional, Sequence, Tuple, Union

import numpy as np
import tensorflow as tf

from lipdp.augmentation import AUGMENTATIONS, each_image_alone, stack_views
from lipdp.metadata import DatasetMetadata, Sampling, _parse_enum
from lipdp.records import finite_array_rows, listed_positions

__all__ = [
    "BatchSampler",
    "DATASET_NAMES",
    "DatasetFormatError",
    "InputBound",
    "RawDataset",
    "KnownSeedWarning",
    "ShuffleSamplingWarning",
    "bound_clip_value",
    "bound_normalize",
    "load_arrays",
    "load_dataset",
    "main",
    "read_idx",
    "unshuffled_batching",
]

logger = logging.getLogger(__name__)

#: Root of Debian's dataset packages (module attribute so tests can redirect it).
DEBIAN_DATASETS_DIR = "/usr/share/datasets"
#: Environment variable naming a directory that holds one subdirectory per dataset.
DATA_DIR_ENV = "LIPDP_DATA_DIR"

# Fixed seed of the train/test split of the scikit-learn datasets. The split is
# part of the dataset's definition (like MNIST's fixed test set), so it does not
# depend on the run's `seed`. numpy's legacy RandomState is frozen across numpy
# versions, so the split is reproducible everywhere.
_SKLEARN_SPLIT_SEED = 0
_SKLEARN_TEST_FRACTION = 0.2


class DatasetFormatError(ValueError):
    """A dataset file exists but is corrupt or not in the expected format."""


class ShuffleSamplingWarning(UserWarning):
    """Issued when training batches are shuffled instead of Poisson-sampled."""


class KnownSeedWarning(UserWarning):
    """Issued when the Poisson sampling is drawn from a seed the caller gave: the accountant's
    amplification by subsampling assumes the sampling is secret."""


_KNOWN_SEED_WARNING = (
    "load_dataset(seed={seed}): every batch is a function of this seed. The reported epsilon "
    "counts on amplification by subsampling, which assumes nobody but the trainer knows which "
    "examples each step drew: it holds only while this seed stays secret (keep it out of "
    "published configs, reports and code). Anyone who knows it knows the steps an example "
    "took part in, and the guarantee falls to the Gaussian mechanism composed over those "
    "steps (an audit: epsilon 9.8-13.9 for a run reported at 2.99). Omit the seed (a secret "
    "one is drawn) for training whose epsilon you publish; under several workers, share a "
    "secret seed outside the code (e.g. an environment variable).")


# ----------------------------------------------------------------------------
# Input bounding
# ----------------------------------------------------------------------------


def unshuffled_batching(dataset: tf.data.Dataset,
                        nb_records: Optional[int] = None) -> Optional[str]:
    """Why `dataset`'s batches are not random batches of its records, read from the
    pipeline's graph; None when they are, or when the graph cannot be read or holds no
    batching step (no verdict).

    Each batching op (``Batch*``, ``PaddedBatch*``) must have upstream a shuffle (an op
    whose name holds ``Shuffle``) that mixes every record afresh each epoch: with a buffer
    of at least `nb_records` records (when both are known) and without
    ``reshuffle_each_iteration=False``. A shuffle after batching only reorders fixed
    batches; a smaller buffer only swaps each record with its neighbours in the input
    order (``shuffle(1)`` keeps it), so its batch is largely known in advance; a shuffle of
    whole batches that are then unbatched and batched again only reorders the same batches
    (an audit, 2026-12-07: ``batch(8).shuffle(64).unbatch().batch(8)``); a shuffle
    that replays its order holds the same batches every epoch, and so does one followed by
    a ``cache`` or ``snapshot``, which replay the first epoch's records in their first
    order (an audit, 2026-12-06: ``shuffle(N).batch(B).cache()`` trained on one epoch's
    batches three times, silently). Randomness of another kind
    (a random ``filter``, sampling from datasets) is not seen, nor batches that no batching
    step makes (a ``map`` or a generator yielding them).
    """
    read = _pipeline_graph(dataset)
    if read is None:
        return None
    graph, node_of = read

    def shuffles_upstream(node):
        return [n for n in _upstream(node, node_of) if "Shuffle" in n.op]

    def buffer_size(shuffle):  # its second input, a constant in a serialized pipeline
        const = node_of(shuffle.input[1]) if len(shuffle.input) > 1 else None
        if const is None or const.op != "Const":
            return None
        size = int(tf.make_ndarray(const.attr["value"].tensor))
        return size if size > 0 else None

    def shuffles_batches(shuffle, batch):  # batches made above it, unbatched below it
        below = {n.name for n in _upstream(batch, node_of)}
        return any(n.op.startswith("UnbatchDataset") and n.name in below and
                   shuffle.name in {u.name for u in _upstream(n, node_of)}
                   for n in path) and any(n.name in unbatched and _batching_op(n.op)
                                          for n in _upstream(shuffle, node_of))

    def flaw(shuffle, batch):
        if shuffles_batches(shuffle, batch):
            return ("shuffles whole batches, which are unbatched and batched again "
                    "(batch, shuffle, unbatch, batch): every epoch keeps the records in the "
                    "blocks of their first batching")
        if "reshuffle_each_iteration" in shuffle.attr and \
                not shuffle.attr["reshuffle_each_iteration"].b:
            return ("shuffles with reshuffle_each_iteration=False: every epoch holds the "
                    "same batches")
        if shuffle.name in replayed:
            return ("caches its records after shuffling them (cache or snapshot): every "
                    "epoch replays the first one's order, so holds the same batches")
        size = buffer_size(shuffle)
        if nb_records is not None and size is not None and size < nb_records:
            return (f"shuffles in a buffer of {size} records, fewer than the {nb_records} "
                    "training records: a record only trades places with its neighbours in "
                    "the input order, so its batch is largely known in advance")
        return None

    path = _data_path(graph, node_of)
    replayed = {shuffle.name for node in path
                if node.op.startswith(("CacheDataset", "SnapshotDataset"))
                for shuffle in shuffles_upstream(node)}
    # Batches an `unbatch` undoes downstream are not the training batches.
    unbatched = {n.name for node in path if node.op.startswith("UnbatchDataset")
                 for n in [node, *_upstream(node, node_of)]}
    batches = [n for n in path if _batching_op(n.op) and n.name not in unbatched]
    if not batches:
        return None
    for batch in batches:
        flaws = [flaw(shuffle, batch) for shuffle in shuffles_upstream(batch)]
        if not flaws:
            return "batches its records without shuffling them first"
        if None not in flaws:
            return flaws[0]
    return None


def batches_made_unseen(dataset: tf.data.Dataset) -> bool:
    """Whether `dataset` yields batches that no batching step of its pipeline makes (a
    ``map`` cutting rows, a generator, pre-batched tensors): `unshuffled_batching` has no
    verdict on them, and ``range(8).shuffle(64).map(rows 8k..8k+7)`` gave the same 8
    batches every epoch, silently (an audit, 2026-12-07). False when the graph cannot be read,
    or for a `load_dataset` pipeline (its sampler draws the batches)."""
    if pipeline_sampler(dataset) is not None:
        return False
    read = _pipeline_graph(dataset)
    if read is None:
        return False
    graph, node_of = read
    return not any(_makes_batches(n.op) for n in _data_path(graph, node_of))


def _pipeline_graph(dataset: tf.data.Dataset):
    """``(GraphDef, node_of)`` of `dataset`'s pipeline, serialized by tf.data (``node_of``
    maps an input name to its node); None when it cannot be serialized."""
    from tensorflow.core.framework import graph_pb2

    try:
        graph = graph_pb2.GraphDef()
        graph.ParseFromString(tf.raw_ops.DatasetToGraphV2(
            input_dataset=dataset._variant_tensor).numpy())
    except Exception:  # pylint: disable=broad-except  (an uninspectable pipeline: no verdict)
        return None
    nodes = {node.name: node for node in graph.node}

    def node_of(name):
        return nodes.get(name.split(":")[0].lstrip("^"))

    return graph, node_of


def _batching_op(op: str) -> bool:
    """Whether a serialized tf.data op batches records (`unshuffled_batching` reads the
    shuffles upstream of these)."""
    return op.startswith(("BatchDataset", "PaddedBatchDataset", "ParallelBatchDataset"))


def _makes_batches(op: str) -> bool:
    """Whether a serialized tf.data op makes batches: `_batching_op`, and the ops that batch
    what they map, window or rebatch."""
    return _batching_op(op) or op.startswith((
        "MapAndBatchDataset", "ExperimentalMapAndBatchDataset", "GroupByWindowDataset",
        "WindowDataset", "RebatchDataset"))


def _upstream(node, node_of, seen=None):
    """Every node of a serialized pipeline upstream of `node`, once each, depth first along
    its inputs in order (the nearest first on a chain)."""
    seen = set() if seen is None else seen
    for parent in map(node_of, node.input):
        if parent is None or parent.name in seen:
            continue
        seen.add(parent.name)
        yield parent
        yield from _upstream(parent, node_of, seen)


def _data_path(graph, node_of) -> list:
    """The nodes of a serialized pipeline that its records pass through: everything upstream
    of its output, except what only feeds the selector of a ``DirectedInterleaveDataset``
    (`sample_from_datasets` / `choose_from_datasets` batch a random stream to pick the next
    input: a batch of indices, not of records, once taken for unshuffled batching)."""
    consumed = {node_of(name).name for n in graph.node for name in n.input
                if node_of(name) is not None}
    stack = [n for n in graph.node if n.name not in consumed]
    seen, path = set(), []
    while stack:
        node = stack.pop()
        if node.name in seen:
            continue
        seen.add(node.name)
        path.append(node)
        inputs = list(node.input)
        if node.op.startswith("DirectedInterleaveDataset"):
            inputs = inputs[1:]
        stack.extend(parent for parent in map(node_of, inputs) if parent is not None)
    return path


def repeated_pass(dataset: tf.data.Dataset, example_rank: Optional[int] = None,
                  count_limit: Optional[int] = None) -> Optional[Tuple[str, Optional[int]]]:
    """What a repeated pipeline goes through again and again: ``("records", R)`` when its
    last ``repeat`` comes before its batching (R records a pass), ``("batches", B)`` when
    after it; None without a repeat (a ``repeat(1)`` is none: `_repeats`). Read from
    tf.data's dataset objects (each holds its ``_input_dataset``), from the output down to
    the first repeat met.

    With `example_rank` (the rank of one example's first input tensor) and `count_limit`,
    the pass's records are counted whenever its size is not a known count of records: a
    pass of batches (told from unbatched records by the rank of its elements; their
    number says nothing of their size) or of unknown size (a ``filter``, a generator) is
    read once and ``("records", R)`` returned, R None as soon as more than `count_limit`
    were read. No verdict (None) for an infinite pass (a repeat inside the repeat), a pass
    holding a `load_dataset` Poisson pipeline (random sizes: its sampler keeps the rate),
    or without `count_limit` a pass of unknown size."""
    for d in _chain(dataset):
        if not _repeats(d):
            continue
        inner = getattr(d, "_input_dataset", None)
        if inner is None or any(own_sampler(below) is not None
                                for below in _chain(inner)):
            return None
        size = int(inner.cardinality())
        if size == tf.data.INFINITE_CARDINALITY:
            return None
        rank = tf.nest.flatten(inner.element_spec)[0].shape.rank
        if count_limit is not None and example_rank is not None and \
                rank in (example_rank, example_rank + 1):
            batched = rank == example_rank + 1
            if not batched and size >= 0:
                return "records", size
            return "records", _records_in_pass(inner, batched, count_limit)
        if size < 0:
            return None
        batched = any("Batch" in type(below).__name__ for below in _chain(inner))
        return ("batches" if batched else "records"), size
    return None


def _chain(dataset: tf.data.Dataset):
    """`dataset`, then the dataset it was built from (tf.data's ``_input_dataset``), and so
    on down to the source."""
    while dataset is not None:
        dataset = _unwrapped(dataset)
        yield dataset
        dataset = getattr(dataset, "_input_dataset", None)


def _unwrapped(dataset):
    """The dataset a ``tf.compat.v1.data`` dataset wraps (a ``DatasetV1Adapter``), else
    `dataset` itself: a v1 pipeline's chain was read as adapters only, and its repeat not
    seen (a review, 2026-12-07)."""
    while type(dataset).__name__ == "DatasetV1Adapter" and \
            getattr(dataset, "_dataset", None) is not None:
        dataset = dataset._dataset
    return dataset


def holds_repeat(dataset: tf.data.Dataset) -> bool:
    """Whether a ``repeat`` of more than one pass is on `dataset`'s chain of tf.data datasets
    (`repeated_pass`)."""
    return any(_repeats(d) for d in _chain(dataset))


def repeat_inside_batches(dataset: tf.data.Dataset, count_limit: int) -> Optional[str]:
    """Why a ``repeat`` of `dataset` may put one of its records twice in a batch, or in an
    epoch more often than its passes allow; None when none can (or no verdict). Read from
    tf.data's dataset objects (a `load_dataset` pipeline below ends the search: its sampler
    draws the batches); repeats inside a ``flat_map`` or ``interleave`` function are not
    seen. A repeat of one pass (``repeat(1)``) is no repeat. Refused (audits, 2026-12-07):

    - a shuffle applied after a repeat, which mixes two passes in one buffer:
      ``repeat().shuffle(N).batch(D)`` put some record in 69% of its batches more than once
      (up to 3 times), and one record moved the noiseless update by 2.01 times the
      sensitivity the noise was calibrated to; ``batch(D).repeat().shuffle(k)`` gave one
      record 4 draws in an epoch;
    - a repeat inside a ``zip``, ``concatenate``, ``sample_from_datasets`` or
      ``choose_from_datasets`` (or ``enumerate``, a zip), unless it repeats scalars only
      (``Dataset.counter()``'s seeds): the repeated input comes round
      at its own pace, so ``zip((xs.repeat(), ys.repeat())).shuffle(N).batch(D)`` and a
      repeated class in ``sample_from_datasets`` held a record twice in a batch, and a
      repeated second input of a ``concatenate`` made every later epoch of 8 records;
    - a repeat before a batching step with anything but steps keeping the records one for
      one and in order (``map``, ``prefetch``, options) between them: a ``take``,
      ``filter``, ``unbatch``, another repeat or a non-deterministic parallel ``map`` there
      cuts or mixes the passes;
    - a repeat before a batching step whose batch size cannot be read (``window``,
      ``group_by_window``, ``bucket_by_sequence_length``);
    - a pass of R records, R not a multiple of the batch size, repeated before batching:
      batches straddle two passes (``shuffle(60).repeat().batch(16)`` held a record twice
      in 15% of its batches). R is read from the pipeline when tf.data does not know it
      (no verdict beyond `count_limit` records).
    """
    chain = list(_main_chain(dataset))
    on_chain = {id(d) for d in chain}
    sampled = lambda d: own_sampler(d) is not None  # noqa: E731
    if any(_repeats(d) and id(d) not in on_chain and not _scalars(d)
           for d in _datasets_below(dataset, sampled)):
        return ("repeats a dataset it zips, concatenates or samples from: the repeated input "
                "comes round at its own pace, so a batch or an epoch may hold a record twice")
    batch_size, batched, between, shuffled = None, False, None, False
    deterministic = dataset.options().deterministic is not False
    for d in chain:
        name = type(d).__name__
        if _repeats(d):
            if shuffled:
                return ("shuffles after a repeat: one shuffle buffer mixes two passes over the "
                        "data, so a batch (or an epoch) may hold a record twice")
            if not batched:
                continue
            if between is not None:
                return (f"repeats its records before batching them with a step between them "
                        f"that does not keep them one for one and in order ({between}): it "
                        "cuts or mixes the passes, so a batch may hold a record twice")
            if batch_size is None:
                return ("repeats its records before batching them in batches whose size "
                        "lipdp cannot read (a window or a group by window): a batch may "
                        "straddle two passes over the data, and hold a record twice")
            inner = d._input_dataset
            records = int(inner.cardinality())
            batched_pass = _batched_elements(inner)
            if records < 0 or batched_pass:
                records = _records_in_pass(inner, batched_pass, count_limit)
            if records is not None and batch_size and records % batch_size:
                return (f"batches a repeat of {records} records in batches of {batch_size}: a "
                        "batch straddles two passes over the data, so it may hold a record "
                        "twice")
            between = name  # a repeat below this one is cut by this one's passes
        elif "Shuffle" in name:
            shuffled = True
        elif _batches(name) and not batched:
            batch_size, batched = _static_batch_size(d), True
        elif batched and between is None and not _keeps_order(d, deterministic):
            between = name  # another batching step, an unbatch, a take, a filter...
    return None


def batches_in_repeated_pass(dataset: tf.data.Dataset, count_limit: int) -> Optional[int]:
    """How many batches `dataset` yields in one pass of its outermost repeat whose input is
    finite (on its main chain), from the start of an iterator: the pass `fit` counts copies
    of records in, reading `dataset` itself (the records as the model gets them, after any
    ``map`` behind the repeat), as it counts an epoch's when the dataset holds no repeat (an
    audit, 2026-12-07: a trailing ``repeat()`` switched the count off, and 32 records
    concatenated with themselves trained silently). None without such a repeat, or when the
    pass is not a whole number of batches or holds more than `count_limit` elements (no
    verdict). The pass's elements are counted when tf.data does not know their number."""
    batch_size = None
    for d in _main_chain(dataset):
        if _batches(type(d).__name__) and batch_size is None:
            batch_size = _static_batch_size(d)
        if not _repeats(d):
            continue
        inner = d._input_dataset
        size = int(inner.cardinality())
        if size == tf.data.INFINITE_CARDINALITY:
            continue
        if size < 0:
            size = sum(1 for _ in inner.take(count_limit + 1))
            if size > count_limit:
                return None
        if _batched_elements(inner):
            return size  # a repeat of batches
        return size // batch_size if batch_size and size % batch_size == 0 else None
    return None


def _scalars(dataset: tf.data.Dataset) -> bool:
    """Whether `dataset` yields scalars only: no record of a model's inputs (a
    ``Dataset.counter()`` of seeds zipped with the records repeats one: a review found it
    refused)."""
    return all(getattr(spec, "shape", None) is not None and spec.shape.rank == 0
               for spec in tf.nest.flatten(dataset.element_spec))


def _main_chain(dataset: tf.data.Dataset):
    """`dataset` and the datasets below it while each has one input (a ``zip``,
    ``concatenate`` or sampling from datasets ends it, as does a `load_dataset`
    pipeline)."""
    dataset = _unwrapped(dataset) if dataset is not None else None
    while dataset is not None and own_sampler(dataset) is None:
        yield dataset
        inputs = _inputs_of(dataset)
        dataset = _unwrapped(inputs[0]) if len(inputs) == 1 else None


def _repeats(dataset) -> bool:
    """Whether `dataset` is a ``repeat`` of more than one pass."""
    if "Repeat" not in type(dataset).__name__:
        return False
    count = tf.get_static_value(getattr(dataset, "_count", None))
    return count is None or int(count) != 1


def _keeps_order(dataset, deterministic: bool) -> bool:
    """Whether `dataset` yields one element per input element, in their order (a ``map``,
    ``prefetch``, options): what may sit between a repeat and a batching step. A parallel
    ``map`` with ``deterministic=False`` (or under options that make the pipeline
    non-deterministic, `deterministic` False) reorders: ``shuffle(16).repeat().map(f,
    num_parallel_calls=16, deterministic=False).prefetch(1).batch(8)`` held a record twice in
    61% of its batches (a review, 2026-12-07)."""
    name = type(dataset).__name__
    if "FlatMap" in name or not any(part in name for part in (
            "Map", "Prefetch", "Options", "ThreadPool", "IntraOp", "ModelDataset")):
        return False
    if "ParallelMap" in name:
        order = str(getattr(dataset, "_deterministic", "default")).lower()
        return order == "true" or (order == "default" and deterministic)
    return True


def _batches(name: str) -> bool:
    """Whether a tf.data dataset class of this name groups records into batches or windows
    (``unbatch`` does not; ``rebatch`` re-cuts the batches of a batching step below it)."""
    return ("Batch" in name and "Unbatch" not in name) or "Window" in name


def _static_batch_size(dataset) -> Optional[int]:
    """A batching dataset's batch size, when it is a known number (``map_and_batch`` keeps it
    as ``_batch_size_t``)."""
    size = getattr(dataset, "_batch_size", getattr(dataset, "_batch_size_t", None))
    try:
        return int(tf.get_static_value(size))
    except (TypeError, ValueError):
        return None


def _batched_elements(dataset: tf.data.Dataset) -> bool:
    """Whether `dataset`'s elements are batches: a batching step on its chain that no
    ``unbatch`` undoes above it."""
    for d in _chain(dataset):
        name = type(d).__name__
        if "Unbatch" in name:
            return False
        if _batches(name):
            return True
    return False


def _records_in_pass(dataset: tf.data.Dataset, batched: bool, limit: int) -> Optional[int]:
    """The records of one pass over `dataset` (batches: their rows), read; None as soon as
    more than `limit` were read."""
    count = 0
    for element in dataset:
        count += int(tf.shape(tf.nest.flatten(element)[0])[0]) if batched else 1
        if count > limit:
            return None
    return count


def _check_max_norm(max_norm, argname="max_norm") -> float:
    if (
        isinstance(max_norm, bool)
        or not isinstance(max_norm, (int, float, np.integer, np.floating))
        or not math.isfinite(float(max_norm))
        or float(max_norm) <= 0
        or float(max_norm) > float(np.finfo(np.float32).max)
    ):
        # Above float32's largest number, normalized inputs were inf or NaN (an audit,
        # 2026-12-07: X0 = 1e39 left 0 of 64 test rows finite).
        raise ValueError(
            f"Received an invalid value for `{argname}`, expected a finite positive "
            f"number within float32's range (the L2 bound X0 on every input). Received: "
            f"{argname}={max_norm!r}"
        )
    return float(max_norm)


class InputBound:
    """Maps inputs into the L2 ball of radius ``max_norm`` (callable object).

    ``mode="clip"``:      ``x * min(1, X0 / ||x||)`` (identity inside the ball).
    ``mode="normalize"``: ``x * X0 / ||x||`` (every non-zero input lands on the
    sphere; ``x = 0`` stays 0).

    The norm is the L2 norm over all features of one example. Calling the object
    treats its argument as **one** example (usable in `tf.data` maps);
    `apply_batch` treats the first axis as the batch axis. Both are exact up to
    float32 rounding (relative error about 1e-6 on the resulting norm) for every finite
    input: the norm is taken as ``m ||x / m||``, m the largest ``|x_i|``, since the squares
    of entries below about 1e-19 underflow in float32 (``sqrt(sum x_i^2)`` of inputs near
    1e-19 came out too small: normalized images up to 3.9 X0, clipped ones up to 412 X0 for
    a small X0, an audit, 2026-12-07) and those above about 1e19 overflow (clipped to 0,
    now onto the sphere). An example whose largest entry is subnormal comes out 0; one
    holding a NaN or an infinity comes out NaN (`fit` refuses it). Half-precision inputs are
    bounded in float32 and returned in their dtype.
    """

    def __init__(self, mode: str, max_norm: float):
        if mode not in ("clip", "normalize"):
            raise ValueError(f"Unknown bounding mode {mode!r}, expected 'clip' or 'normalize'.")
        self.mode = mode
        self.max_norm = _check_max_norm(max_norm)

    def _apply(self, x, batched: bool):
        x = tf.convert_to_tensor(x)
        dtype = x.dtype if x.dtype.is_floating else tf.float32
        if x.dtype not in (tf.float32, tf.float64):
            x = tf.cast(x, tf.float32)
        axis = tf.range(1, tf.rank(x)) if batched else tf.range(tf.rank(x))
        largest = tf.reduce_max(tf.abs(x), axis=axis, keepdims=True)
        largest = tf.where(largest >= np.finfo(x.dtype.as_numpy_dtype).tiny, largest, 0)
        unit = tf.math.divide_no_nan(x, largest)  # entries in [-1, 1], one of them +-1
        unit_norm = tf.sqrt(tf.reduce_sum(tf.square(unit), axis=axis, keepdims=True))
        x0 = tf.constant(self.max_norm, dtype=x.dtype)
        on_sphere = unit * tf.math.divide_no_nan(x0, unit_norm)
        if self.mode == "clip":  # ||x|| = largest * unit_norm, inf when it overflows
            bounded = tf.where(largest * unit_norm > x0, on_sphere,
                               x * tf.cast(largest > 0, x.dtype))
        else:
            bounded = on_sphere
        finite = tf.reduce_all(tf.math.is_finite(x), axis=axis, keepdims=True)
        return tf.cast(tf.where(finite, bounded, tf.constant(np.nan, x.dtype)), dtype)

    def __call__(self, x):
        """Bounds one example ``x`` (any shape; the norm is over all of it)."""
        return self._apply(x, batched=False)

    def apply_batch(self, x):
        """Bounds every example of a batch ``x`` of shape ``(B, ...)``."""
        return self._apply(x, batched=True)

    def load_dataset_keyword(self) -> Dict[str, float]:
        """The `load_dataset` keyword that applies this bound: ``{"bound_clip_value": X0}``
        or ``{"bound_normalize": X0}``."""
        return {"bound_clip_value" if self.mode == "clip" else "bound_normalize": self.max_norm}

    def __repr__(self):
        return f"InputBound(mode={self.mode!r}, max_norm={self.max_norm!r})"


def bound_clip_value(max_norm: float) -> InputBound:
    """Returns ``f(x) = x * min(1, max_norm / ||x||_2)`` for one example ``x``.

    ``||f(x)|| <= max_norm`` for every ``x`` (up to float32 rounding), and
    ``f(x) = x`` when ``x`` is already inside the ball; ``f(0) = 0``.
    """
    return InputBound("clip", max_norm)


def bound_normalize(max_norm: float) -> InputBound:
    """Returns ``f(x) = x * max_norm / ||x||_2`` for one example ``x`` (``f(0) = 0``).

    ``||f(x)|| = max_norm`` for every non-zero ``x`` (up to float32 rounding).
    """
    return InputBound("normalize", max_norm)


# ----------------------------------------------------------------------------
# File formats
# ----------------------------------------------------------------------------

_IDX_DTYPES = {
    0x08: np.dtype(np.uint8),
    0x09: np.dtype(np.int8),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}


def _read_maybe_gzip(path: str) -> bytes:
    with open(path, "rb") as f:
        head = f.read(2)
    if head != b"\x1f\x8b":
        with open(path, "rb") as f:
            return f.read()
    try:
        with gzip.open(path, "rb") as f:
            return f.read()
    except (OSError, EOFError, zlib.error) as e:
        raise DatasetFormatError(f"{path}: corrupt gzip stream ({e}).") from e


def read_idx(path: str, expected_ndim: Optional[int] = None) -> np.ndarray:
    """Reads an IDX file (gzipped or plain), as used by MNIST and Fashion-MNIST.

    Format: 2 zero bytes, a type code (0x08 = uint8, ...), the number of
    dimensions, then each dimension as a big-endian uint32, then the data.
    The magic number and the data size are validated; a wrong one raises
    `DatasetFormatError` naming the file.
    """
    data = _read_maybe_gzip(path)
    if len(data) < 4:
        raise DatasetFormatError(f"{path}: not an IDX file (only {len(data)} bytes).")
    magic = struct.unpack(">I", data[:4])[0]
    ndim = data[3]
    expected_magic = ""
    if expected_ndim is not None:
        expected_magic = f" (expected 0x{0x0800 + expected_ndim:08x} for uint8 data with " \
                         f"{expected_ndim} dimension{'s' if expected_ndim > 1 else ''})"
    if data[0] != 0 or data[1] != 0 or data[2] not in _IDX_DTYPES or ndim == 0:
        raise DatasetFormatError(
            f"{path}: bad IDX magic number 0x{magic:08x}{expected_magic}; "
            "the file is corrupt or not an IDX file."
        )
    if expected_ndim is not None and ndim != expected_ndim:
        raise DatasetFormatError(
            f"{path}: IDX magic number 0x{magic:08x} declares {ndim} dimensions"
            f"{expected_magic}."
        )
    header = 4 + 4 * ndim
    if len(data) < header:
        raise DatasetFormatError(f"{path}: truncated IDX header.")
    dims = struct.unpack(">" + "I" * ndim, data[4:header])
    dtype = _IDX_DTYPES[data[2]]
    expected_bytes = int(np.prod(dims, dtype=np.int64)) * dtype.itemsize
    if len(data) - header != expected_bytes:
        raise DatasetFormatError(
            f"{path}: IDX header declares shape {tuple(dims)} ({expected_bytes} bytes of "
            f"data) but the file holds {len(data) - header} bytes; it is truncated or corrupt."
        )
    arr = np.frombuffer(data, dtype=dtype, offset=header).reshape(dims)
    return arr.astype(dtype.newbyteorder("="), copy=False)


class _RestrictedUnpickler(pickle.Unpickler):
    """Unpickler for the CIFAR-10 python batches: dicts, lists, bytes, numpy arrays.

    Refuses every other global, so a malicious pickle in a data directory
    cannot run code.
    """

    _ALLOWED = {
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy.core.numeric", "_frombuffer"),
        ("numpy._core.numeric", "_frombuffer"),
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
        ("numpy.core.multiarray", "scalar"),
        ("numpy._core.multiarray", "scalar"),
        ("_codecs", "encode"),
    }

    def find_class(self, module, name):
        if (module, name) in self._ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"global {module}.{name} is not allowed in a CIFAR batch")


def _read_cifar_batch(path: str) -> Tuple[np.ndarray, np.ndarray]:
    try:
        with open(path, "rb") as f:
            d = _RestrictedUnpickler(f, encoding="bytes").load()
    except Exception as e:  # noqa: BLE001 - any unpickling failure means a bad file
        raise DatasetFormatError(f"{path}: not a CIFAR-10 python batch ({e}).") from e
    if not isinstance(d, dict):
        raise DatasetFormatError(f"{path}: not a CIFAR-10 python batch (no dict).")
    d = {k.decode("latin1") if isinstance(k, bytes) else k: v for k, v in d.items()}
    if "data" not in d or "labels" not in d:
        raise DatasetFormatError(f"{path}: CIFAR-10 batch without 'data'/'labels' entries.")
    x = np.asarray(d["data"])
    y = np.asarray(d["labels"])
    if x.dtype != np.uint8 or x.ndim != 2 or x.shape[1] != 3 * 32 * 32 \
            or y.shape != (x.shape[0],):
        raise DatasetFormatError(
            f"{path}: CIFAR-10 batch with data {x.dtype}{x.shape} and labels {y.shape}; "
            "expected uint8 (n, 3072) and (n,)."
        )
    # Rows are channel-major (1024 red, 1024 green, 1024 blue, each row-major).
    x = x.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
    return x, y.astype(np.int64)


# ----------------------------------------------------------------------------
# Raw arrays
# ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RawDataset:
    """In-memory dataset before batching and bounding.

    Images are stored ``uint8`` in ``[0, 255]`` with shape ``(n, H, W, C)`` and
    scaled to ``[0, 1]`` float32 in the pipeline; tabular data is stored already
    scaled, ``float32`` ``(n, d)``. Labels are integer class indices.
    """

    name: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    nb_classes: int
    source: str

    @property
    def input_shape(self) -> Tuple[int, ...]:
        return tuple(self.x_train.shape[1:])


@dataclasses.dataclass(frozen=True)
class _ImageSpec:
    name: str
    image_shape: Tuple[int, ...]  # (H, W, C)
    nb_classes: int
    subdirs: Tuple[str, ...]  # names tried under data_dir and $LIPDP_DATA_DIR
    debian_name: Optional[str]
    keras_loader: str  # attribute of tf.keras.datasets


_IMAGE_SPECS = {
    "fashion_mnist": _ImageSpec("fashion_mnist", (28, 28, 1), 10,
                                ("fashion_mnist", "fashion-mnist"), "fashion-mnist",
                                "fashion_mnist"),
    "mnist": _ImageSpec("mnist", (28, 28, 1), 10, ("mnist",), "mnist", "mnist"),
    "cifar10": _ImageSpec("cifar10", (32, 32, 3), 10, ("cifar10", "cifar-10-batches-py"),
                          None, "cifar10"),
}
_SKLEARN_NAMES = ("digits", "breast_cancer")
DATASET_NAMES = tuple(_IMAGE_SPECS) + _SKLEARN_NAMES


def image_shape(name: str) -> Optional[Tuple[int, ...]]:
    """``(H, W, C)`` of a named image dataset (`DATASET_NAMES`), None for the others."""
    spec = _IMAGE_SPECS.get(name)
    return None if spec is None else spec.image_shape


_IDX_PARTS = (
    ("x_train", "train", "images", 3),
    ("y_train", "train", "labels", 1),
    ("x_test", "t10k", "images", 3),
    ("y_test", "t10k", "labels", 1),
)


def _idx_candidates(stem: str, kind: str, ndim: int) -> List[str]:
    names = [f"{stem}-{kind}-idx{ndim}-ubyte", f"{stem}-{kind}.idx{ndim}-ubyte"]
    return [n + ext for n in names for ext in (".gz", "")]


def _first_existing(directory: str, names: Sequence[str]) -> Optional[str]:
    present = _existing(directory, names)
    return present[0] if present else None


def _existing(directory: str, names: Sequence[str]) -> List[str]:
    """The files of `names` in `directory`, in order, one per file (names that resolve to
    the same file count once)."""
    present, seen = [], set()
    for n in names:
        p = os.path.join(directory, n)
        if os.path.isfile(p) and os.path.realpath(p) not in seen:
            seen.add(os.path.realpath(p))
            present.append(p)
    return present


def _check_image_arrays(spec: _ImageSpec, where: str, arrays: Dict[str, np.ndarray]):
    h, w, c = spec.image_shape
    out = {}
    for split in ("train", "test"):
        x, y = np.asarray(arrays[f"x_{split}"]), np.asarray(arrays[f"y_{split}"])
        if y.ndim == 2 and y.shape[1] == 1:
            y = y[:, 0]
        if y.ndim != 1:  # (20, 2) labels of 40 images were flattened, paired at random
            raise DatasetFormatError(
                f"{where}: {split} labels have shape {y.shape}; expected one class index an "
                "image, of shape (n,) or (n, 1).")
        if x.ndim == 3 and c == 1:
            x = x[..., None]
        if x.dtype != np.uint8 or x.shape[1:] != (h, w, c):
            raise DatasetFormatError(
                f"{where}: {split} images have type {x.dtype} and shape {x.shape[1:]}; "
                f"expected uint8 images of shape {spec.image_shape} for {spec.name}."
            )
        if x.shape[0] == 0 or x.shape[0] != y.shape[0]:
            raise DatasetFormatError(
                f"{where}: {x.shape[0]} {split} images but {y.shape[0]} {split} labels."
            )
        if not np.issubdtype(y.dtype, np.integer) or y.min() < 0 or y.max() >= spec.nb_classes:
            raise DatasetFormatError(
                f"{where}: {split} labels must be integers in [0, {spec.nb_classes})."
            )
        out[f"x_{split}"], out[f"y_{split}"] = x, y.astype(np.int64)
    return out


def _load_image_dir(spec: _ImageSpec, directory: str):
    """Returns (arrays, description) or (None, reason it was not usable)."""
    if not os.path.isdir(directory):
        return None, "does not exist"
    if spec.name == "cifar10":
        names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
        missing = [n for n in names if not os.path.isfile(os.path.join(directory, n))]
        if missing:
            return None, "no CIFAR-10 python batches (missing " + ", ".join(missing) + ")"
        parts = [_read_cifar_batch(os.path.join(directory, n)) for n in names]
        arrays = {
            "x_train": np.concatenate([p[0] for p in parts[:5]]),
            "y_train": np.concatenate([p[1] for p in parts[:5]]),
            "x_test": parts[5][0],
            "y_test": parts[5][1],
        }
        return _check_image_arrays(spec, directory, arrays), "CIFAR-10 python batches"
    # MNIST-like: four IDX files ...
    found, missing = {}, []
    for key, stem, kind, ndim in _IDX_PARTS:
        cands = _idx_candidates(stem, kind, ndim)
        present = _existing(directory, cands)
        first = read_idx(present[0], expected_ndim=ndim) if len(present) > 1 else None
        if first is not None and any(not np.array_equal(read_idx(p, expected_ndim=ndim), first)
                                     for p in present[1:]):
            # The first was read, silently (an audit, 2026-12-07: an edited plain file
            # beside the original .gz was ignored); identical copies (gunzip -k) are one.
            raise DatasetFormatError(
                f"{directory} holds {len(present)} different files for {stem}-{kind}: "
                f"{', '.join(os.path.basename(p) for p in present)}. Keep one of them.")
        path = present[0] if present else None
        if path is None:
            missing.append(f"{stem}-{kind}-idx{ndim}-ubyte[.gz]")
        else:
            found[key] = path
    if not missing:
        arrays = {key: read_idx(found[key], expected_ndim=ndim)
                  for key, _, _, ndim in _IDX_PARTS}
        return _check_image_arrays(spec, directory, arrays), "IDX files"
    # ... or a Keras-style npz archive.
    npz_names = [f"{spec.name}.npz"] + [f"{s}.npz" for s in spec.subdirs if s != spec.name]
    npz = _first_existing(directory, npz_names)
    if npz is not None:
        try:
            with np.load(npz, allow_pickle=False) as f:
                arrays = {k: f[k] for k in ("x_train", "y_train", "x_test", "y_test")}
        except Exception as e:  # noqa: BLE001
            raise DatasetFormatError(
                f"{npz}: not a valid dataset archive with x_train, y_train, x_test, y_test ({e})."
            ) from e
        return _check_image_arrays(spec, npz, arrays), f"archive {os.path.basename(npz)}"
    if found:
        return None, "incomplete: missing " + ", ".join(missing)
    return None, "no dataset files"


def _keras_datasets_dir() -> str:
    base = os.environ.get("KERAS_HOME") or os.path.join(os.path.expanduser("~"), ".keras")
    return os.path.join(base, "datasets")


def _image_locations(spec: _ImageSpec, data_dir: Optional[str]) -> List[Tuple[str, str]]:
    """(label, directory) pairs in lookup order."""
    locs = []
    if data_dir is not None:
        data_dir = os.fspath(data_dir)
        locs.append(("data_dir argument", data_dir))
        locs += [("data_dir argument", os.path.join(data_dir, s)) for s in spec.subdirs]
    env = os.environ.get(DATA_DIR_ENV)
    if env:
        locs += [(f"${DATA_DIR_ENV}", os.path.join(env, s)) for s in spec.subdirs]
    if spec.debian_name is not None:
        locs.append(("Debian dataset package",
                     os.path.join(DEBIAN_DATASETS_DIR, spec.debian_name)))
    keras_dir = _keras_datasets_dir()
    keras_sub = {"fashion_mnist": "fashion-mnist", "mnist": "",
                 "cifar10": "cifar-10-batches-py"}[spec.name]
    locs.append(("Keras cache", os.path.join(keras_dir, keras_sub) if keras_sub else keras_dir))
    seen, unique = set(), []
    for label, path in locs:
        key = os.path.realpath(path)
        if key not in seen:
            seen.add(key)
            unique.append((label, path))
    return unique


def _how_to_provide(spec: _ImageSpec) -> str:
    if spec.name == "cifar10":
        files = ("the CIFAR-10 python batches data_batch_1 ... data_batch_5 and test_batch "
                 "(the cifar-10-batches-py directory of cifar-10-python.tar.gz)")
    else:
        files = ("the four IDX files train-images-idx3-ubyte.gz, train-labels-idx1-ubyte.gz, "
                 "t10k-images-idx3-ubyte.gz, t10k-labels-idx1-ubyte.gz (gzipped or not)")
        if spec.name == "mnist":
            files += " or a Keras mnist.npz"
    lines = [
        f"To provide {spec.name}, put {files} in a directory and either pass "
        f"data_dir=<that directory> or set {DATA_DIR_ENV} so that "
        f"${DATA_DIR_ENV}/{spec.name} is that directory.",
    ]
    if spec.name == "fashion_mnist":
        lines.append("On Debian/Ubuntu: `apt-get install dataset-fashion-mnist` installs them in "
                     f"{os.path.join(DEBIAN_DATASETS_DIR, 'fashion-mnist')} "
                     "(or run scripts/install_fashion_mnist.sh).")
    lines.append(f"With internet access, download=True lets "
                 f"tf.keras.datasets.{spec.keras_loader}.load_data() fetch them into the "
                 "Keras cache.")
    return "\n".join(lines)


def _load_image_dataset(spec: _ImageSpec, data_dir, download: bool) -> RawDataset:
    tried = []
    if data_dir is not None:
        data_dir = os.path.expanduser(os.fspath(data_dir))
    locations = _image_locations(spec, data_dir)
    if data_dir is not None:
        # A data_dir given is the only place looked in: without its files, lipdp went on to
        # $LIPDP_DATA_DIR, the Debian package or the Keras cache, and trained on that data
        # after one log line (an audit, 2026-12-07).
        locations = [(label, path) for label, path in locations
                     if label == "data_dir argument"]
    for label, path in locations:
        arrays, what = _load_image_dir(spec, path)
        if arrays is not None:
            source = f"{what} in {path} ({label})"
            return RawDataset(spec.name, nb_classes=spec.nb_classes, source=source, **arrays)
        tried.append(f"  - {path} ({label}): {what}")
    if data_dir is not None:
        raise FileNotFoundError(
            f"Dataset {spec.name!r} not found in data_dir={os.fspath(data_dir)!r}:\n"
            + "\n".join(tried) + "\nA data_dir given is the only place looked in; leave it "
            f"out to search ${DATA_DIR_ENV}, the Debian dataset package and the Keras cache.\n"
            + _how_to_provide(spec))
    if not os.environ.get(DATA_DIR_ENV):
        tried.append(f"  - ${DATA_DIR_ENV}/{spec.name}: ${DATA_DIR_ENV} is not set")
    loader = f"tf.keras.datasets.{spec.keras_loader}.load_data()"
    if download:
        try:
            (x_train, y_train), (x_test, y_test) = getattr(
                tf.keras.datasets, spec.keras_loader).load_data()
        except Exception as e:  # noqa: BLE001 - network errors come in many types
            tried.append(f"  - download with {loader}: failed ({type(e).__name__}: {e})")
        else:
            arrays = _check_image_arrays(spec, loader, dict(
                x_train=x_train, y_train=y_train, x_test=x_test, y_test=y_test))
            source = f"downloaded by {loader} (cached under {_keras_datasets_dir()})"
            return RawDataset(spec.name, nb_classes=spec.nb_classes, source=source, **arrays)
    else:
        tried.append(f"  - download with {loader}: not attempted (download=False)")
    raise FileNotFoundError(
        f"Dataset {spec.name!r} not found. Looked in:\n" + "\n".join(tried) + "\n"
        + _how_to_provide(spec)
    )


# --- scikit-learn bundled datasets -------------------------------------------------

# Breast cancer (Wisconsin diagnostic): per-feature [min, max] as published in the
# dataset's documentation (UCI wdbc.names, reproduced in sklearn's DESCR), in
# sklearn's column order. Scaling is x' = (x - min) / (max - min), i.e. into
# about [0, 1], with these *hard-coded* constants: nothing is computed on the
# loaded data, so each preprocessed example depends on that example only.
# Caveat for real deployments: the dataset authors computed these ranges over
# all 569 records; lipdp treats them as public documentation. With truly private
# data, take such constants from domain knowledge, never from the data.
_BREAST_CANCER_RANGES = np.array([
    (6.981, 28.11), (9.71, 39.28), (43.79, 188.5), (143.5, 2501.0), (0.053, 0.163),
    (0.019, 0.345), (0.0, 0.427), (0.0, 0.201), (0.106, 0.304), (0.05, 0.097),
    (0.112, 2.873), (0.36, 4.885), (0.757, 21.98), (6.802, 542.2), (0.002, 0.031),
    (0.002, 0.135), (0.0, 0.396), (0.0, 0.053), (0.008, 0.079), (0.001, 0.03),
    (7.93, 36.04), (12.02, 49.54), (50.41, 251.2), (185.2, 4254.0), (0.071, 0.223),
    (0.027, 1.058), (0.0, 1.252), (0.0, 0.291), (0.156, 0.664), (0.055, 0.208),
], dtype=np.float64)


def _preprocess_digits(x: np.ndarray) -> np.ndarray:
    """8x8 digit images with integer intensities 0..16, flattened: x / 16 in [0, 1]."""
    return (np.asarray(x, dtype=np.float64) / 16.0).astype(np.float32)


def _preprocess_breast_cancer(x: np.ndarray) -> np.ndarray:
    """(x - min) / (max - min) with the documented, hard-coded feature ranges."""
    lo, hi = _BREAST_CANCER_RANGES[:, 0], _BREAST_CANCER_RANGES[:, 1]
    return ((np.asarray(x, dtype=np.float64) - lo) / (hi - lo)).astype(np.float32)


def _stratified_split(y: np.ndarray, test_fraction: float, seed: int):
    """Deterministic stratified split; depends on the labels only, never on features."""
    rng = np.random.RandomState(seed)
    train, test = [], []
    for c in np.unique(y):
        idx = np.flatnonzero(y == c)
        idx = idx[rng.permutation(len(idx))]
        n_test = int(round(test_fraction * len(idx)))
        test.append(idx[:n_test])
        train.append(idx[n_test:])
    train, test = np.concatenate(train), np.concatenate(test)
    # Mix the classes so that "the first n training examples" is a fair subset.
    return train[rng.permutation(len(train))], test[rng.permutation(len(test))]


def _load_sklearn_dataset(name: str) -> RawDataset:
    try:
        import sklearn.datasets
    except ImportError as e:
        raise ImportError(
            f"The {name!r} dataset is bundled with scikit-learn, which is not installed: "
            "pip install scikit-learn"
        ) from e
    if name == "digits":
        x, y = sklearn.datasets.load_digits(return_X_y=True)
        x, nb_classes = _preprocess_digits(x), 10
        how = "divided by 16"
    else:
        x, y = sklearn.datasets.load_breast_cancer(return_X_y=True)
        x, nb_classes = _preprocess_breast_cancer(x), 2
        how = "scaled by the documented per-feature ranges"
    y = np.asarray(y, dtype=np.int64)
    train, test = _stratified_split(y, _SKLEARN_TEST_FRACTION, _SKLEARN_SPLIT_SEED)
    source = (f"scikit-learn bundled dataset sklearn.datasets.load_{name} ({how}; "
              f"fixed stratified {1 - _SKLEARN_TEST_FRACTION:.0%}/"
              f"{_SKLEARN_TEST_FRACTION:.0%} split, seed {_SKLEARN_SPLIT_SEED})")
    return RawDataset(name, x[train], y[train], x[test], y[test], nb_classes, source)


def load_arrays(name: str, *, data_dir=None, download: bool = True) -> RawDataset:
    """Loads a dataset into memory, without pipelines, and logs where it came from.

    Raises:
        ValueError: unknown ``name``.
        FileNotFoundError: the data is nowhere to be found (the message lists
            every place searched and how to provide the files).
        DatasetFormatError: a file was found but is corrupt.
    """
    if not isinstance(name, str):  # arrays raised "unhashable type" (an audit)
        raise TypeError(
            f"load_arrays and load_dataset take a dataset's name (one of "
            f"{sorted(list(_IMAGE_SPECS) + list(_SKLEARN_NAMES))}), not {type(name).__name__}. "
            "For data of your own, build a tf.data pipeline and a lipdp.DatasetMetadata "
            "describing it.")
    if name in _IMAGE_SPECS:
        raw = _load_image_dataset(_IMAGE_SPECS[name], data_dir, download)
    elif name in _SKLEARN_NAMES:
        if data_dir is not None:  # it was ignored, silently (a review, 2026-12-07)
            raise ValueError(f"{name} is bundled with scikit-learn: data_dir={data_dir!r} does "
                             "not apply to it. Leave data_dir out.")
        raw = _load_sklearn_dataset(name)
    else:
        raise ValueError(
            f"Unknown dataset {name!r}, expected one of {', '.join(DATASET_NAMES)}."
        )
    logger.info("lipdp: %s loaded from %s: %d train / %d test examples of shape %s.",
                name, raw.source, len(raw.y_train), len(raw.y_test), raw.input_shape)
    return raw


# ----------------------------------------------------------------------------
# Pipelines
# ----------------------------------------------------------------------------


def _check_positive_int(value, argname):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
        raise ValueError(
            f"Received an invalid value for `{argname}`, expected a positive integer. "
            f"Received: {argname}={value!r}"
        )
    return int(value)


def _as_float(x) -> tf.Tensor:
    """Inputs as the pipelines feed them: uint8 images scaled to [0, 1], float32."""
    x = tf.convert_to_tensor(x)
    return tf.cast(x, tf.float32) / 255.0 if x.dtype == tf.uint8 else tf.cast(x, tf.float32)


def _mapped(feature_map, x: np.ndarray, batch_size: int = 1000, check: bool = False
            ) -> np.ndarray:
    """``feature_map`` of every example of ``x``, in batches, as one float32 array; with
    `check` (the training examples), first refused when a feature is not finite, then
    `_check_per_example` on the first batch (whose probes read non-finite features as a
    mixing map: a map taking the log of a zero pixel was refused for not treating each
    example on its own, an audit, 2026-12-07)."""
    mapped = [np.asarray(feature_map(_as_float(x[i:i + batch_size])), np.float32)
              for i in range(0, len(x), batch_size)]
    if check:
        _refuse_non_finite_features(mapped)
        _check_per_example(feature_map, x[:batch_size], mapped[0])
    return np.concatenate(mapped)


def _refuse_non_finite_features(mapped: List[np.ndarray]) -> None:
    """Refuse training features (`mapped`, batch by batch) holding a NaN or an infinity,
    with the indices of their examples: no step can train on them (the input bound maps
    them to NaN), and found by `fit` they would be refused there or skipped by the step."""
    finite = np.concatenate([finite_array_rows(m, np.float32) for m in mapped])
    bad = np.flatnonzero(~finite)
    if bad.size:
        raise ValueError(
            f"feature_map gives features that are not finite (NaN or inf) to {bad.size} of "
            f"the {len(finite)} training examples (indices "
            f"{listed_positions([str(i) for i in bad])}): no step can train on them. Repair "
            "the map (a logarithm or a division reaching 0, an overflow).")


#: Relative change of another example's features that `_check_per_example` refuses (far above
#: float32 rounding of a deterministic map, which CPU kernels reproduce bitwise).
_PER_EXAMPLE_RTOL = 1e-5
#: Examples in the NaN and out-of-range probes of `_check_per_example`.
_PROBE_ROWS = 64


def _check_per_example(feature_map, batch: np.ndarray, features: np.ndarray) -> None:
    """Refuse a `feature_map` whose features of one example depend on the other examples of
    its batch (a standardisation or a min-max scaling by batch statistics, say): one record
    would then move every other record's features, beyond what the privacy analysis of the
    model covers. A Keras layer adapted on data (`adapt`) is refused too: its statistics are
    the data's, computed without noise.

    Three probes, each a batch mapped again with its first example changed, every other row
    of which must keep its features (`features`: the map of `batch`): the whole batch with
    its first example replaced by its last (moves means and deviations); its first 64
    examples with the first one NaN (reaches any reduction over the batch that propagates
    NaN: a minimum, a maximum, a median) and with the first one beyond every feature's range
    in the batch (moves extremes that ignore NaN). The first probe alone passed a min-max
    scaling by the batch in 20 of 20 draws of 1000 digits (a record is rarely a batch's
    extreme). A map that fails on the NaN or the out-of-range example is not judged by that
    probe."""
    adapted = [layer.name for layer in getattr(feature_map, "_flatten_layers", lambda: [])()
               if getattr(layer, "is_adapted", False)]
    if adapted:
        raise ValueError(
            f"feature_map holds layers adapted on data ({', '.join(adapted)}): their "
            "statistics were computed from records without noise and shape every feature, "
            "outside the privacy guarantee. Give them public statistics (e.g. "
            "Normalization(mean=..., variance=...)).")
    if len(batch) < 3 or not features[1:].size:
        return
    last = _as_float(batch).numpy()
    last[0] = last[-1]
    head = _as_float(batch[:_PROBE_ROWS]).numpy()
    nan, beyond = head.copy(), head.copy()
    nan[0] = np.nan
    beyond[0] = head.max(axis=0) + (head.max(axis=0) - head.min(axis=0)) + 1.0
    scale = float(np.max(np.abs(features[1:])))
    for probe, changed, unusual in [
            ("replacing one example by another", last, False),
            ("making one example NaN", nan, True),
            ("moving one example beyond every feature's range", beyond, True)]:
        try:
            again = np.asarray(feature_map(tf.constant(changed)), np.float32)
        except Exception:  # pylint: disable=broad-except  (a map's domain may exclude it)
            if unusual:
                continue
            raise
        difference = float(np.max(np.abs(again[1:] - features[1:len(changed)])))
        if not difference <= _PER_EXAMPLE_RTOL * scale:
            raise ValueError(
                f"feature_map does not treat each example on its own: {probe} in a batch of "
                f"{len(changed)} changed the features of the others (by up to "
                f"{difference:.3g}, features up to {scale:.3g}). A map that mixes the "
                "examples of a batch (batch statistics, a normalisation or a min-max scaling "
                "over the batch axis) lets one record move every other record's features, "
                "beyond what the privacy analysis covers. Map each example alone, with "
                "statistics from public data.")


_FEATURE_CACHE: Dict[Hashable, Tuple[np.ndarray, np.ndarray]] = {}


def _fingerprint(*arrays) -> str:
    """A digest of the arrays' shapes, dtypes and bytes (BLAKE2b): equal only for equal data."""
    digest = hashlib.blake2b(digest_size=32)
    for array in arrays:
        array = np.ascontiguousarray(array)
        digest.update(repr((array.shape, array.dtype.str)).encode())
        digest.update(memoryview(array).cast("B"))
    return digest.hexdigest()


def _features(feature_map, x_train, x_test, key):
    """The mapped train and test inputs; the last result is kept under `key` (if not None)
    and the data's `_fingerprint`, so that changed files are mapped again (an audit replaced
    a record in the files and the cached features trained on the old one, with the new
    label, in the same process)."""
    if key is not None:
        key = (key, _fingerprint(x_train, x_test))
        if key in _FEATURE_CACHE:
            return _FEATURE_CACHE[key]
    _refuse_state(feature_map, x_train.shape[1:], "feature_map")
    mapped = _mapped(feature_map, x_train, check=True), _mapped(feature_map, x_test)
    if key is not None:
        _FEATURE_CACHE.clear()  # one entry: features can take gigabytes
        _FEATURE_CACHE[key] = mapped
    return mapped


#: Stateful TensorFlow ops a user's augmentation or feature map may hold (`_refuse_state`):
#: random draws (`_DRAWS`), reads, control flow (whose bodies are read too), assertions,
#: numeric checks and prints, per-call tensor arrays, table look-ups and Python functions
#: (whose state, in Python, is not seen).
_STATE_READS = frozenset({
    "ReadVariableOp", "VarHandleOp", "VariableShape", "ResourceGather", "ResourceGatherNd",
    "DestroyResourceOp", "If", "While", "Case", "StatefulPartitionedCall", "PartitionedCall",
    "Assert", "Print", "PrintV2", "CheckNumerics", "CheckNumericsV2", "DebugIdentityV2",
    "DebugIdentityV3", "Timestamp", "StatelessRandomGetAlg",
    "RandomShuffle",  # its count of draws, its input's length, is not checked
    "EagerPyFunc", "PyFunc", "HashTable", "HashTableV2",
    "MutableHashTable", "MutableHashTableV2", "MutableHashTableOfTensorsV2",
    "MutableDenseHashTableV2", "LookupTableFind", "LookupTableFindV2", "LookupTableSize",
    "LookupTableSizeV2", "LookupTableExportV2"})
#: Random draws, and skips of a generator: each advances a random state by a count of draws
#: (its input of this name), which must not depend on the data: ``g.skip(sum(x))``, a skip
#: by the size of ``tf.where(x > 0.5)`` or noise drawn on the bright pixels only carried an
#: image into the next call's draws (reviews, 2026-12-07).
_DRAWS = {op: count for count, ops in [
    ("shape", ("RandomUniform", "RandomUniformInt", "RandomStandardNormal", "TruncatedNormal",
               "ParameterizedTruncatedNormal", "RandomGamma", "RandomPoisson",
               "RandomPoissonV2", "StatefulUniform", "StatefulUniformInt",
               "StatefulUniformFullInt", "StatefulStandardNormal", "StatefulStandardNormalV2",
               "StatefulTruncatedNormal", "StatefulRandomBinomial", "NonDeterministicInts")),
    ("num_samples", ("Multinomial",)), ("delta", ("RngReadAndSkip", "RngSkip"))]
    for op in ops}


def _refuse_state(function, example_shape, what: str) -> None:
    """Refuse a user's `augmentation` or `feature_map` whose traced graph (its functions
    included: loops, conditions) holds a stateful op other than `_STATE_READS` and `_DRAWS`
    (a variable, table or queue written, an optimizer's update), or draws a count of random
    numbers that depends on the data: called on one image after another, such state carries
    one record into another's view or features, beyond what the privacy analysis covers (an
    augmentation adding a tenth of the previous call's last image, kept in a tf.Variable,
    passed every other check; reviews then carried state through an optimizer op, a queue,
    a generator skipped by a count of the data, a write only traced for batches of one, and
    draws sized by the data).

    Traced on batches of `example_shape` of unknown size, then of one image (how
    `each_image_alone` calls it), where every shape is static, so that a count of draws
    computed from constants and shapes is a constant (Keras' random layers); a function that
    cannot be traced so is not judged."""
    from tensorflow.python.framework import op_def_registry

    for batch in (None, 1):
        try:
            traced = tf.function(function).get_concrete_function(
                tf.TensorSpec((batch,) + tuple(example_shape), tf.float32))
        except Exception:  # pylint: disable=broad-except  (not traceable here: no verdict)
            continue
        graph = traced.graph.as_graph_def()
        found = set()
        for nodes in [graph.node] + [f.node_def for f in graph.library.function]:
            by_name = {node.name: node for node in nodes}
            for node in nodes:
                op_def = op_def_registry.get(node.op)
                if op_def is None or not op_def.is_stateful or node.op in _STATE_READS or \
                        node.op.startswith("TensorArray"):  # created by each call
                    continue
                if node.op in _DRAWS:
                    names = [arg.name for arg in op_def.input_arg]
                    count = names.index(_DRAWS[node.op])
                    if batch is None or (count < len(node.input) and
                                         _from_constants(node.input[count], by_name)):
                        continue
                    found.add(f"{node.op} of a count computed from the data")
                    continue
                found.add(node.op)
        if found:
            raise ValueError(
                f"`{what}` holds stateful operations ({', '.join(sorted(found))}) that can "
                "carry one call's input into the next: called on one record after another, "
                "such state moves one record into the next one's " +
                ("view" if what.startswith("augmentation") else "features") +
                ", beyond what the privacy analysis covers. Compute from each record alone "
                "(random draws of fixed sizes are fine; variables, tables and queues written, "
                "and counts of draws computed from the data, are not).")


def _from_constants(name: str, by_name) -> bool:
    """Whether the tensor `name` of a function body is computed from constants only (never
    from an input of the body, nor from a shape TensorFlow did not know when tracing)."""
    stack, seen = [name], set()
    while stack:
        node = by_name.get(stack.pop().split(":")[0].lstrip("^"))
        if node is None or node.op in ("Placeholder", "Shape", "ShapeN", "Size", "Rank"):
            return False  # an input of the body or of the function, or a dynamic shape
        if node.name in seen or node.op == "Const":
            continue
        seen.add(node.name)
        stack.extend(node.input)
    return True


def _check_augmentation_per_example(augmentation, images: np.ndarray, tries: int = 32) -> None:
    """Refuse an `augmentation` that mixes the images of a batch (mixup, cutmix, statistics of
    the batch): one record would then move other records' views, beyond what the privacy
    analysis covers. Its randomness is not reproducible from outside, so the probe marks an
    image instead: the batch with its first image NaN, augmented `tries` times, must keep
    every other image free of NaN. A mixup over 16 images spares the marked image with
    probability 1/16 a call; one applied to a random quarter of the batches escapes a call
    with probability 0.77, 32 calls with 2e-4 (3 calls, the first version: 0.45). An
    augmentation that fails on NaN, or removes NaN, is not judged."""
    if len(images) < 2:
        return
    marked = _as_float(images).numpy()
    marked[0] = np.nan
    for _ in range(tries):
        try:
            views = np.asarray(augmentation(tf.constant(marked)), np.float32)
        except (tf.errors.InvalidArgumentError, ValueError):
            return
        if views.shape[:1] == marked.shape[:1] and np.isnan(views[1:]).any():
            raise ValueError(
                "`augmentation` does not transform each image on its own: NaN in one image "
                "of a batch reached other images' views (a mixup, a cutmix, statistics of the "
                "batch). Then one record moves other records' views, and so their gradients, "
                "beyond what the privacy analysis covers. Augment each image alone.")


def _make_transform(bound: InputBound, nb_classes: int, augmentation=None,
                    multiplicity: int = 1):
    """Scaling, augmentation (k views when `multiplicity` k > 1: ``(B, k, ...)``), the
    input bound on every view, one-hot labels."""
    def transform(x, y):
        x = _as_float(x)
        if multiplicity > 1:
            views = stack_views(x, augmentation, multiplicity)
            shape = tf.shape(views)
            flat = tf.reshape(views, tf.concat([[-1], shape[2:]], axis=0))
            x = tf.reshape(bound.apply_batch(flat), shape)
        else:
            x = bound.apply_batch(x if augmentation is None else augmentation(x))
        return x, tf.one_hot(y, nb_classes, dtype=tf.float32)

    return transform


#: The samplers of this process with an explicit seed (their draws repeat across pipelines
#: of that seed): `seeded_samplers`.
_SEEDED_SAMPLERS = weakref.WeakSet()


class _DrawCounter:
    """Where the draws of one seed stand in this process: ``next_step``, the first
    step the next pass draws (an int64 `tf.Variable` the pipeline advances, and which never
    goes back: `BatchSampler.start_at`). The live pipelines of one explicit seed share one:
    a loop over a second pipeline of the seed drew the first's batches again (an audit,
    2026-12-06)."""

    def __init__(self, seed: int):
        self.seed = seed
        with tf.init_scope():
            self.next_step = tf.Variable(0, dtype=tf.int64, trainable=False,
                                         name="poisson_next_step")
        _EVERY_NEXT_STEP.append(self.next_step)


# The counters of every training pipeline this process built, kept after the pipelines: a
# loop over batches listed from a pipeline since dropped trained on draws no live counter
# held (a review, 2026-12-06). One scalar variable per pipeline.
_EVERY_NEXT_STEP = []
_COUNTERS_BY_SEED = weakref.WeakValueDictionary()  # explicit seed -> its `_DrawCounter`


def reserved_draws() -> int:
    """The end of every draw the training pipelines of this process reserved, live or
    dropped (the highest ``next_step``; 0 without one). A DP model's `train_on_batch`, which
    cannot tell which pipeline its batch came from, raises its ``poisson_draws_until`` to
    it."""
    return max((int(step.numpy()) for step in _EVERY_NEXT_STEP), default=0)


def _inputs_of(dataset: tf.data.Dataset) -> list:
    """The tf.data datasets `dataset` was built from (each dataset object holds its inputs)."""
    return [_unwrapped(d) for d in _unwrapped(dataset)._inputs()
            if isinstance(d, tf.data.Dataset)]


def _datasets_below(dataset, stop=lambda d: False):
    """`dataset` and every tf.data dataset it was built from, each once (through every input
    of a ``zip`` or ``concatenate``, not only `_chain`'s first); the inputs of a dataset
    for which `stop` holds are not walked."""
    stack, seen = [_unwrapped(dataset)], set()
    while stack:
        current = stack.pop()
        if id(current) in seen or not isinstance(current, tf.data.Dataset):
            continue
        seen.add(id(current))
        yield current
        if not stop(current):
            stack.extend(_inputs_of(current))


def own_sampler(dataset) -> Optional["BatchSampler"]:
    """The `BatchSampler` of `dataset` when it is a training pipeline as `load_dataset`
    returned it (its ``lipdp_sampler`` attribute); None for anything else, a dataset made
    from such a pipeline included (`pipeline_sampler` finds the sampler below those)."""
    return getattr(dataset, "lipdp_sampler", None)


def pipeline_sampler(dataset) -> Optional["BatchSampler"]:
    """The `BatchSampler` of the `load_dataset` pipeline `dataset` is or was built from by
    tf.data transformations (a ``map``, ``prefetch``, ``with_options``); None without one.
    `fit` manages that sampler's draws (a mapped pipeline was left where it stood, and a run
    continued in another process replayed its draws: a review, 2026-12-06); whether the
    batches are still Poisson is judged apart."""
    return next((sampler for sampler in map(own_sampler, _datasets_below(dataset))
                 if sampler is not None), None)


def cached_sampler(dataset) -> Optional["BatchSampler"]:
    """The `BatchSampler` of a `load_dataset` pipeline that a ``cache`` or ``snapshot`` of
    `dataset`'s chain stores (None without one): such a pipeline replays its first pass's
    batches every epoch, draws or permutation alike. `unshuffled_batching` reads a cache
    after a shuffle in the pipeline's graph, where a load_dataset pipeline's shuffle and
    batching lie inside a function: ``fit(ds.cache())`` on a shuffled one trained one
    permutation every epoch, silently (an audit, 2026-12-07)."""
    for d in _datasets_below(dataset):
        name = type(d).__name__
        sampler = pipeline_sampler(d) if "Cache" in name or "Snapshot" in name else None
        if sampler is not None:
            return sampler
    return None


def derived_from(data: tf.data.Dataset, source: tf.data.Dataset) -> Optional[bool]:
    """Whether the elements of `data` come from `source` by tf.data transformations: True
    when `source` is its only origin (a ``take``, ``map``, ``shuffle``, ``batch`` of it),
    None when it is one of several (a ``concatenate``, a ``zip`` with another dataset),
    False when it is none."""
    found = other = False
    source = _unwrapped(source)
    for d in _datasets_below(data, stop=lambda d: d is source):
        found = found or d is source
        other = other or (d is not source and not _inputs_of(d))
    return (None if other else True) if found else False


def seeded_samplers() -> list:
    """The live samplers of this process with an explicit seed. One whose last pass began
    below a model's ``poisson_draws_until`` draws, for that model, batches its earlier steps
    may have used (`fit` starts a pipeline there; a custom loop must)."""
    return list(_SEEDED_SAMPLERS)


class BatchSampler:
    """How a training pipeline of `load_dataset` draws its batches (``ds_train.lipdp_sampler``).

    Poisson sampling: the batch of private step t holds example i iff ``u_i < q``, with
    ``u = stateless_uniform(N, seed=(seed, t))``: each example joins each step's batch
    independently with probability q, and the draw of step t is a function of
    ``(seed, t)`` alone. ``next_step`` is the step the pipeline's next pass starts its
    draws at (a pass reserves one epoch of steps when it begins). It never goes back, and a
    DP model's `fit` moves it up to the model's ``poisson_draws_until`` (every draw its
    history may have used, saved with its weights) before each epoch, after
    `tf.keras.callbacks.BackupAndRestore` restored the model, so that

    - no draw is ever used twice in a model's history: a second `fit`, a second model, a
      new pipeline with the same seed, a custom loop before or after a `fit` (an iterator
      kept across it included), or a run resumed from a checkpoint in this process or
      another draws on instead of replaying earlier batches (replayed batches are not the
      independent subsampling the accountant's amplification assumes). The live
      pipelines of one explicit seed share their counter (`_DrawCounter`);
    - a run resumed at an epoch's end trains on the same batches as an uninterrupted one
      (a run resumed mid-epoch draws on from the end of the epoch it left: the draws of
      that epoch's remaining steps are skipped, never reused);
    - every worker of a `tf.distribute` strategy draws the same global batch, of
      which each replica takes its share (``seed`` must then be given: a seed
      drawn in each process would differ between workers).

    Shuffled batches: a pass is the batches of one permutation of the N examples, a
    function of ``(seed, t)`` for the pass whose draws start at step t, and the pass reserves
    its steps on the same counter, so every point above holds for them too: a pipeline
    built again with the seed (a run resumed in another process, a second model) shuffled
    the first run's permutations again, in the same order (an audit, 2026-12-07).

    Attributes:
        sampling: `Sampling.POISSON` or `Sampling.SHUFFLE`.
        seed: the seed given to `load_dataset`, or one drawn from the operating
            system's secret randomness when none was given.
        explicit_seed: whether the seed was given.
        next_step: int64 `tf.Variable`, the first step of the next pass's draws.
        nb_samples, batch_size: the training set's size N and the (expected) batch size D
            the pipeline samples with (rate q = D / N), which a DP model's `fit` checks
            against its metadata; None when not given.
        data_digest: a digest of the training examples (with an explicit seed), which the
            workers of a multi-worker `fit` compare; None when not given.
    """

    def __init__(self, sampling: Sampling, seed: Optional[int],
                 nb_samples: Optional[int] = None, batch_size: Optional[int] = None,
                 data_digest: Optional[str] = None):
        self.sampling = sampling
        self.nb_samples = nb_samples
        self.batch_size = batch_size
        self.data_digest = data_digest
        self.explicit_seed = seed is not None
        self.seed = int(seed) if seed is not None else secrets.randbits(62)
        self.pass_steps = 0  # the draws one pass reserves (`_reserved_passes`)
        if tf.distribute.has_strategy():
            raise RuntimeError(
                "Load the data outside `strategy.scope()`: the sampler's step counter is the "
                "pipeline's own, not a variable mirrored across replicas.")
        counter = _COUNTERS_BY_SEED.get(self.seed) if self.explicit_seed else None
        if counter is None:
            counter = _DrawCounter(self.seed)
        if self.explicit_seed:
            _COUNTERS_BY_SEED[self.seed] = counter
            _SEEDED_SAMPLERS.add(self)
        self._counter = counter
        self.next_step = self._counter.next_step
        with tf.init_scope():  # the first step of this pipeline's last pass (-1: none)
            self._pass_start = tf.Variable(-1, dtype=tf.int64, trainable=False,
                                           name="sampler_pass_start")
        # the step the first pass since construction or `start_at` draws (a shared counter
        # may be ahead)
        self.started_at = int(self.next_step.numpy())

    def start_at(self, step: int) -> None:
        """The next pass draws from private step `step` on, or from where the draws of this
        seed stand in this process if further: the counter never goes back. Set back to a
        model's step, it replayed the draws of an iterator opened before a `fit` and trained
        on after it, of a loop over the pipeline, and of a pass a `fit` kept over several
        epochs (audits, 2026-12-06)."""
        step = max(int(step), int(self.next_step.numpy()))
        self.next_step.assign(step)
        self.started_at = step

    def last_pass_start(self) -> int:
        """The step this pipeline's last pass began its draws at; `started_at` when none
        began (a pipeline built while another of its seed lives starts where that one is:
        reading their shared counter's last pass gave a false replay warning, a review)."""
        start = int(self._pass_start.numpy())
        return start if start >= 0 else self.started_at

    def __repr__(self):
        seed = self.seed if self.explicit_seed else "secret"
        return f"BatchSampler({self.sampling.value}, seed={seed})"


def _poisson_pipeline(x, y, steps: int, q: float, sampler: BatchSampler, transform):
    """One pass over the pipeline draws the batches of ``steps`` consecutive private steps,
    from ``next_step`` as it stands when the pass begins (its first element is asked for);
    the pass reserves them all (``next_step += steps``), whatever number of them is used.

    The draw of a pass's k-th batch is a function of ``(seed, start + k)`` alone, never of
    how far a prefetching thread has read ahead, and a DP model's `fit` raises its
    ``poisson_draws_until`` past the draws a pass reserves before the pass begins
    (`lipdp.model`'s ``_StartSampler``; a pass a ``repeat`` begins inside the epoch, after
    the step that used it: ``_MarkTrainedDraws``), so that checkpoints saved during the
    epoch hold them. With a counter advanced draw by draw, an epoch resumed mid-way by
    ``BackupAndRestore`` (``save_freq`` an integer) used only its first batches while the
    prefetch had drawn the rest, and a second resume, starting the draws at the model's step
    again, trained on draws already used (an audit, 2026-12-06: 5 of 92 steps, epsilon
    1.036 reported for 1.142)."""
    n = int(x.shape[0])
    seed = tf.constant(sampler.seed, tf.int64)

    def draw(step):
        # One uniform per example: example i joins this batch iff u_i < q,
        # independently of the others and of every other step. float64 uniforms
        # lie on a 2^-52 grid, so P(u_i < q) = q up to 2^-52 (float32 would
        # give an inclusion probability up to 2^-23 above q).
        u = tf.random.stateless_uniform([n], seed=tf.stack([seed, step]), dtype=tf.float64)
        return tf.reshape(tf.where(u < tf.constant(q, tf.float64)), [-1])

    indices = _reserved_passes(
        sampler, steps, lambda start: tf.data.Dataset.range(steps).map(lambda k: draw(start + k)))
    return _index_pipeline(x, y, indices, transform)


def _shuffle_pipeline(x, y, batch_size: int, drop_remainder: bool, sampler: BatchSampler,
                      transform):
    """One pass over the pipeline is the batches of one permutation of the N examples, drawn
    from ``(seed, start)``, ``start`` the ``next_step`` of the sampler when the pass begins;
    the pass reserves its steps (``next_step += steps``) as a Poisson pass does
    (`_poisson_pipeline`), so that a DP model's `fit` starts it past every permutation the
    model's history used. ``tf.data``'s own ``shuffle(seed=...)`` restarted its sequence of
    permutations in each pipeline built with the seed: a run continued on a new one trained
    on the first run's epochs again, batch for batch (an audit, 2026-12-07)."""
    n = int(x.shape[0])
    steps = n // batch_size if drop_remainder else -(-n // batch_size)
    seed = tf.constant(sampler.seed, tf.int64)

    def permuted(start):
        order = tf.random.experimental.stateless_shuffle(
            tf.range(n, dtype=tf.int64), seed=tf.stack([seed, start]))
        return tf.data.Dataset.from_tensor_slices(order).batch(
            batch_size, drop_remainder=drop_remainder)

    return _index_pipeline(x, y, _reserved_passes(sampler, steps, permuted), transform)


def _reserved_passes(sampler: BatchSampler, steps: int, pass_indices) -> tf.data.Dataset:
    """The index batches of one pass, ``pass_indices(start)`` (a dataset of `steps`
    batches), ``start`` the sampler's ``next_step`` when the pass begins (its first element
    is asked for): the pass reserves its steps (``next_step += steps``) and records its start
    (`BatchSampler.last_pass_start`), whatever number of them is used. What a Poisson pass
    and a shuffled one share (`_poisson_pipeline`, `_shuffle_pipeline`)."""
    sampler.pass_steps = int(steps)

    def one_pass(_):
        start = sampler.next_step.assign_add(steps) - steps
        with tf.control_dependencies([sampler._pass_start.assign(start)]):
            return pass_indices(start)

    return tf.data.Dataset.range(1).flat_map(one_pass).apply(
        tf.data.experimental.assert_cardinality(steps))


def _without_autotuning(ds: tf.data.Dataset) -> tf.data.Dataset:
    """`ds` with `tf.data`'s autotuning model switched off: its parallel maps run one call
    per core, and its elements are the same. With autotuning on, dropping an iterator
    (Keras drops each epoch's before the next) waited for the autotuner's thread to wake
    from a sleep that doubles up to 60 s: up to 1.3 s between two epochs of a `fit` (2.8 s
    of a 14 s fit of 8 epochs), 60 s in one test of the suite (docs/speed.md)."""
    options = tf.data.Options()
    options.autotune.enabled = False
    return ds.with_options(options)


def _index_pipeline(x, y, indices: tf.data.Dataset, transform):
    def gather(idx):
        return tf.gather(x, idx), tf.gather(y, idx)

    return indices.map(gather, num_parallel_calls=tf.data.AUTOTUNE).map(
        transform, num_parallel_calls=tf.data.AUTOTUNE)


_SHUFFLE_WARNING = (
    "sampling='shuffle': the training set is shuffled into fixed-size batches, but the "
    "privacy accountant assumes Poisson sampling (each example in each batch "
    "independently with probability q = batch_size / N), which shuffling does not "
    "provide. The reported epsilon is then the conventional heuristic of the "
    "literature, not a proven guarantee. Use sampling='poisson' for a proof."
)


def load_dataset(
    name: str,
    batch_size: int,
    *,
    bound_clip_value: Optional[float] = None,
    bound_normalize: Optional[float] = None,
    sampling="poisson",
    drop_remainder: bool = False,
    data_dir=None,
    seed: Optional[int] = None,
    nb_samples_train: Optional[int] = None,
    download: bool = True,
    feature_map: Optional[Callable[[tf.Tensor], tf.Tensor]] = None,
    feature_cache_key: Optional[Hashable] = None,
    augmentation: Union[None, str, Callable[[tf.Tensor], tf.Tensor]] = None,
    augmentation_multiplicity: int = 1,
) -> Tuple[tf.data.Dataset, tf.data.Dataset, DatasetMetadata]:
    """Loads a dataset as bounded `tf.data` pipelines and its public metadata.

    Args:
        name: one of ``fashion_mnist``, ``mnist``, ``cifar10``, ``digits``,
            ``breast_cancer``.
        batch_size: D, the public batch denominator: the expected batch size with
            Poisson sampling, the size of every full batch with shuffling, and the
            batch size of the test pipeline.
        bound_clip_value: X0; inputs are mapped by ``x * min(1, X0/||x||)``.
        bound_normalize: X0; inputs are mapped by ``x * X0/||x||``. Exactly one of
            the two must be given; it becomes ``metadata.max_norm``.
        sampling: ``"poisson"`` (default; what the accountant assumes) or
            ``"shuffle"`` (warns, see `ShuffleSamplingWarning`).
        drop_remainder: with ``"shuffle"`` only: drop the last partial batch. The
            dropped examples are simply not used in that epoch (a different
            random subset each epoch); ``metadata.nb_samples_train`` stays the size
            of the set, and the pipeline yields ``floor(N / D)`` batches, one
            fewer than ``metadata.steps_per_epoch`` when D does not divide N (an
            accountant counting ``steps_per_epoch`` then over-counts, which is
            conservative).
        data_dir: directory holding the files (see the module docstring).
        seed: makes the sampling reproducible (`BatchSampler`: Poisson step t draws
            with ``(seed, t)``, a shuffled pass starting at step t permutes with it);
            every step still draws anew. Required under a multi-worker `tf.distribute`
            strategy, where every worker must draw the same batches. Without it, a seed
            is drawn from the system's secret randomness. With it, the pipeline warns
            (`KnownSeedWarning`): the epsilon holds only while the seed stays secret.
        nb_samples_train: use only the first n training examples.
        download: allow ``tf.keras.datasets.<name>.load_data()`` as last resort (never
            with a ``data_dir``, the only place then looked in).
        feature_map: a fixed map of a batch of inputs (float32, images scaled to [0, 1])
            to features, e.g. `lipdp.layers.DP_Scattering` behind a `DP_BoundedInput`,
            computed once here for every example, then bounded (``bound_clip_value`` /
            ``bound_normalize`` bound the *features*; ``metadata.input_shape`` is their
            shape). It must treat each example on its own and depend on no data: each
            feature vector is then a function of its example alone, and the privacy
            analysis of the model trained on the features is unchanged (a map whose
            features of one example change with another, or holding Keras layers adapted
            on data, is refused: `_check_per_example`; so is one giving a training example
            features that are not finite, with their indices).
        feature_cache_key: a hashable naming `feature_map` (e.g. its configuration). The
            features of the most recent call with the same key, dataset, ``data_dir``,
            ``nb_samples_train`` and data (a digest of the raw inputs) are reused (one entry,
            in this process): a sweep computes a fixed front end once. The caller vouches
            that equal keys mean equal maps.
        augmentation: training images only: ``"shift"``, ``"shift_flip"``
            (`lipdp.augmentation`, shifts of up to 2 pixels) or a function of a batch of
            images ``(B, H, W, C)`` in [0, 1] that transforms each image on its own
            (one that lets a NaN image of a probe batch reach the others is refused:
            `_check_augmentation_per_example`). A function of yours is called on each
            image alone, as a batch of one (`lipdp.augmentation.each_image_alone`), so
            that no view depends on another record. Applied before the input bound. Not
            with `feature_map`.
        augmentation_multiplicity: k augmented views of every sampled example (needs an
            `augmentation` when k > 1): ``ds_train`` then yields inputs of shape
            ``(batch, k) + input_shape`` and ``metadata.augmentation_multiplicity`` is k;
            a DP model averages each example's k view gradients (clipless mode).

    Returns:
        ``(ds_train, ds_test, metadata)``. Both datasets yield ``(x, y)`` with
        ``x`` float32 of shape ``(None,) + input_shape`` (bounded, in [0, 1]
        before bounding for images) and ``y`` one-hot float32 ``(None, K)``.
        ``ds_train`` has ``metadata.steps_per_epoch`` elements with Poisson
        sampling (batches of random size, possibly 0) and draws new batches each
        time it is iterated (Keras ``fit`` re-iterates every epoch);
        ``ds_train.lipdp_sampler`` is its `BatchSampler`.
    """
    if bound_clip_value is None and bound_normalize is None:
        raise ValueError(
            "Inputs must be bounded for differential privacy: give exactly one of "
            "`bound_clip_value=X0` or `bound_normalize=X0` (the L2 bound on each input)."
        )
    if bound_clip_value is not None and bound_normalize is not None:
        raise ValueError(
            "Give only one of `bound_clip_value` and `bound_normalize`, not both. "
            f"Received: bound_clip_value={bound_clip_value!r}, "
            f"bound_normalize={bound_normalize!r}"
        )
    if bound_clip_value is not None:
        bound = InputBound("clip", _check_max_norm(bound_clip_value, "bound_clip_value"))
    else:
        bound = InputBound("normalize", _check_max_norm(bound_normalize, "bound_normalize"))
    sampling = _parse_enum(Sampling, sampling, "sampling")
    batch_size = _check_positive_int(batch_size, "batch_size")
    if nb_samples_train is not None:
        nb_samples_train = _check_positive_int(nb_samples_train, "nb_samples_train")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, (int, np.integer))
                             or not 0 <= seed < 2**63):
        # "abc" raised int()'s error without the argument's name, 1.5 was taken as 1, 10**23
        # TensorFlow's "out-of-range integer" (audits)
        raise ValueError("Received an invalid value for `seed`, expected an integer in "
                         f"[0, 2**63) or None (a secret seed). Received: seed={seed!r}")
    if drop_remainder and sampling is Sampling.POISSON:
        raise ValueError("`drop_remainder` only applies to sampling='shuffle'; Poisson "
                         "batches have a random size and are never dropped.")

    augmentation_multiplicity = _check_positive_int(augmentation_multiplicity,
                                                    "augmentation_multiplicity")
    if isinstance(augmentation, str):
        if augmentation not in AUGMENTATIONS:
            raise ValueError(f"Unknown augmentation {augmentation!r}: expected one of "
                             f"{sorted(AUGMENTATIONS)} or a function of a batch of images.")
        augmentation = AUGMENTATIONS[augmentation]()
    if augmentation is not None and not callable(augmentation):
        raise TypeError(f"`augmentation` must be a name or a callable. Received: {augmentation!r}")
    if augmentation_multiplicity > 1 and augmentation is None:
        raise ValueError("augmentation_multiplicity > 1 needs an `augmentation`: k identical "
                         "views would only repeat the work.")
    if augmentation is not None and feature_map is not None:
        raise ValueError("`augmentation` acts on images, but `feature_map` precomputes fixed "
                         "features once: give one or the other.")

    raw = load_arrays(name, data_dir=data_dir, download=download)
    if augmentation is not None and len(raw.input_shape) != 3:
        raise ValueError(f"`augmentation` needs images (H, W, C); {name} has examples of shape "
                         f"{raw.input_shape}.")
    x_train, y_train = raw.x_train, raw.y_train
    if augmentation is not None:
        _refuse_state(augmentation, x_train.shape[1:], "augmentation")
        # Also at the batch size (up to 1024): an augmentation that mixes only batches above
        # 16 images passed the first probe alone (an audit).
        _check_augmentation_per_example(augmentation, x_train[:16])
        if batch_size > 16:
            _check_augmentation_per_example(augmentation, x_train[:min(batch_size, 1024)],
                                            tries=4)
    if nb_samples_train is not None:
        if nb_samples_train > len(y_train):
            raise ValueError(
                f"`nb_samples_train`={nb_samples_train} exceeds the {len(y_train)} training "
                f"examples of {name}."
            )
        x_train, y_train = x_train[:nb_samples_train], y_train[:nb_samples_train]

    x_test = raw.x_test
    if feature_map is not None:
        x_train, x_test = _features(feature_map, x_train, x_test,
                                    None if feature_cache_key is None else
                                    (feature_cache_key, name, data_dir, nb_samples_train))
    if len(x_train) != len(y_train) or len(x_test) != len(raw.y_test):
        raise ValueError(f"{name}: the feature map returned {len(x_train)} training and "
                         f"{len(x_test)} test rows for {len(y_train)} and {len(raw.y_test)} "
                         "labels: it must map each example to one row.")

    metadata = DatasetMetadata(
        input_shape=tuple(x_train.shape[1:]),
        nb_classes=raw.nb_classes,
        nb_samples_train=int(len(y_train)),
        nb_samples_test=int(len(raw.y_test)),
        batch_size=batch_size,
        max_norm=bound.max_norm,
        sampling=sampling,
        augmentation_multiplicity=augmentation_multiplicity,
    )
    transform = _make_transform(bound, raw.nb_classes,
                                None if augmentation is None else each_image_alone(augmentation),
                                augmentation_multiplicity)

    x_tr, y_tr = tf.constant(x_train), tf.constant(y_train)
    n = metadata.nb_samples_train
    sampler = BatchSampler(sampling, seed, nb_samples=n, batch_size=batch_size,
                           data_digest=None if seed is None else _fingerprint(x_train, y_train))
    if sampler.explicit_seed:
        warnings.warn(_KNOWN_SEED_WARNING.format(seed=seed), KnownSeedWarning, stacklevel=2)
    if sampling is Sampling.POISSON:
        ds_train = _poisson_pipeline(x_tr, y_tr, metadata.steps_per_epoch,
                                     metadata.sampling_rate, sampler, transform)
    else:
        warnings.warn(_SHUFFLE_WARNING, ShuffleSamplingWarning, stacklevel=2)
        ds_train = _shuffle_pipeline(x_tr, y_tr, batch_size, drop_remainder, sampler,
                                     transform)
    ds_train = _without_autotuning(ds_train.prefetch(tf.data.AUTOTUNE))
    ds_train.lipdp_sampler = sampler

    x_te, y_te = tf.constant(x_test), tf.constant(raw.y_test)
    test_indices = tf.data.Dataset.range(metadata.nb_samples_test).batch(batch_size)
    ds_test = _without_autotuning(_index_pipeline(
        x_te, y_te, test_indices, _make_transform(bound, raw.nb_classes)
    ).prefetch(tf.data.AUTOTUNE))
    return ds_train, ds_test, metadata


# ----------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------


def main(argv: Optional[Sequence[str]] = None, prog: str = "python -m lipdp.data") -> int:
    """``lipdp data NAME`` (or ``python -m lipdp.data NAME``): checks that a dataset can be
    loaded.

    Loads the arrays only (no pipeline), prints where they came from and
    returns 0; prints why not and returns 1 otherwise.
    """
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Check that a lipdp dataset can be found (or downloaded).",
    )
    parser.add_argument("name", choices=DATASET_NAMES)
    parser.add_argument("--data-dir", default=None, help="directory holding the files")
    parser.add_argument("--no-download", action="store_true",
                        help="only look for local files, never download")
    args = parser.parse_args(argv)
    try:
        raw = load_arrays(args.name, data_dir=args.data_dir, download=not args.no_download)
    except (FileNotFoundError, DatasetFormatError, ImportError) as e:
        print(f"lipdp: cannot load {args.name}: {e}", file=sys.stderr)
        return 1
    print(f"lipdp: {args.name} found: {raw.source}; {len(raw.y_train)} train / "
          f"{len(raw.y_test)} test examples of shape {raw.input_shape}, "
          f"{raw.nb_classes} classes.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
