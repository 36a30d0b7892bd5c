"""DP_Sequential and DP_Model: Keras models whose `fit` runs Clipless DP-SGD.

One private step (`train_step`):

1. forward pass and per-example losses; the batch loss is their **sum divided by
   the public denominator D** (`DatasetMetadata.batch_size`), never by the
   realised batch size (with augmentation multiplicity k, each example's k views
   are inputs of their own and the sum is divided by k D: an example contributes
   the average of its views' gradients, `lipdp.augmentation`);
2. gradient of that loss;
3. per-example gradient bounds of every variable at the *current* weights
   (`lipdp.bounds`), divided by D: the sensitivities Delta_v of the averaged
   gradient under add/remove-one;
4. Gaussian noise: std ``sigma * sqrt(sum_v Delta_v^2)`` on every coordinate
   ("global") or ``sigma * Delta_v`` on variable v ("per-layer");
5. optimizer step (any Keras optimizer), then projection of every constrained
   layer, so that the next step's weights satisfy their constraints (Björck
   orthogonalisation every ``compile(bjorck_every=k)`` steps, spectral
   normalisation alone in between; the bounds never assume either);
6. the step is recorded in the model's privacy ledger (`lipdp.ledger`: the
   step count and, per segment, the mechanism that ran; variables saved with the
   weights, so that resuming continues the epsilon count).

The mechanism (noise multiplier, strategy, denominator, trainable variables,
sampling) is fixed by `compile`: a change to `dp_parameters`,
`dataset_metadata` or to which variables are trainable needs a new `compile`
(`fit` says so), and the first step after it opens a new ledger segment, so
epsilon is always the composition of what actually ran.

Not private: Keras' training loss and metrics (``History``, the progress bar)
are computed on the training data outside the noisy gradient and are *not*
covered by epsilon. ``compile(..., private_logs_only=True)`` omits them.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import itertools
import math
import secrets
import warnings
from typing import Optional, Tuple

import numpy as np
import tensorflow as tf

from lipdp.bounds import (backpropagate_bounds, certified_norm_requests, check_residual_sections,
                          dp_layers, require_built)
from lipdp.clipping import ClippedDPSGD
from lipdp.clipping.engine import finite_rows, zero_rows
from lipdp.clipping.validation import (_probe_batches, check_no_batch_coupling, defined_in_lipdp,
                                       leaf_layers, refuse_untracked_layers)
from lipdp.data import (ShuffleSamplingWarning, batches_in_repeated_pass, batches_made_unseen,
                        cached_sampler, derived_from, holds_repeat, own_sampler, pipeline_sampler,
                        repeat_inside_batches, repeated_pass, reserved_draws,
                        seeded_samplers, unshuffled_batching)
from lipdp.host_blas import limit_pays, with_limited_blas_threads
from lipdp.kernels import in_xla_context
from lipdp.layers._projection import uncertified
from lipdp.layers.base import (DPLayer, as_bound, changed_keys, check_built_configuration,
                               check_float32, check_float32_inputs, ledger_owners,
                               plain_configuration, replaced_call, round_up_to_float32,
                               with_pass_slack)
from lipdp.layers.basic import DP_BoundedInput
from lipdp.layers.gradient_clipping import clip_gradient_rows, clipped_norm_bound
from lipdp.ledger import (EMPTY_STORAGE, ROW_SIZE, RUN_MARK, PrivacyLedger, StepMechanism,
                          concatenated, continues, includes, run_row, stored_rows)
from lipdp.legacy_files import hdf5_with_draw_mark
from lipdp.losses import DP_Loss, check_outputs
from lipdp.metadata import DatasetMetadata, DPMode, DPParameters, NoiseStrategy, Sampling
from lipdp.noise import add_gaussian_noise, drawing_at_step, gaussian_noise, warn_if_seeded
from lipdp.operator_norms import host_work
from lipdp.records import (aligned, check_finite_arrays, check_finite_dataset,
                           check_finite_epochs, check_ids_in_range, check_label_domain,
                           check_sparse_labels, class_index_classes, embedding_id_limits,
                           input_norms_beyond, into_range, realigned, records_in_arrays,
                           row_fingerprints, sparse_label_classes)
from lipdp.state_guard import StateGuard, run_guarded
from lipdp.variable_reads import describe_reads, traced_reads_outside_owners
from lipdp.weight_copies import (TrainedBy, forget_loaded, keys_of, loaded_models, note_loaded,
                                  origins, remember)


def _batch_size(x) -> tf.Tensor:
    """Number of examples in a batch of inputs (a tensor or a structure of them), int64."""
    return tf.shape(tf.nest.flatten(x)[0], out_type=tf.int64)[0]


def _global_batch_size(x) -> tf.Tensor:
    """Number of examples in the global batch of which `x` is this replica's share (under a
    `tf.distribute` strategy, the replicas' counts summed; else `_batch_size`), int64."""
    batch = _batch_size(x)
    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync == 1:
        return batch
    total = context.all_reduce(tf.distribute.ReduceOp.SUM, tf.cast(batch, tf.float64))
    return tf.cast(total, tf.int64)


def _refuse_regularization(model):
    """Refuse layers' regularizers and losses added with ``add_loss``: the private step
    differentiates the per-example losses only, so Keras would log these terms in the loss
    while they never reach the weights (a kernel_regularizer of L2(10) left the kernel as
    without it, in both modes, until 2026-12-05).

    Raises:
        ValueError: naming the regularizers, or the number of added losses.
    """
    named = [f"{layer.name}.{name}" for layer in leaf_layers(model)
             for name, value in [*vars(layer).items(),
                                 ("activity_regularizer", layer.activity_regularizer)]
             if name.endswith("_regularizer") and not name.startswith("_")
             and value is not None]
    if named or model.losses:
        found = ", ".join(named) if named else f"{len(model.losses)} losses added by add_loss"
        raise ValueError(
            f"DP models train on the per-example losses only: regularization terms ({found}) "
            "would be logged in the loss but never reach the weights. Remove them; for weight "
            "decay, give the optimizer a `weight_decay` (applied to the weights after the noisy "
            "gradient, it uses no data).")


def _refuse_batch_iterators(x):
    """`fit` takes arrays (cut into batches of the declared size) or a `tf.data.Dataset`
    (checked batch by batch); a `keras.utils.Sequence` or an iterator yields batches whose
    number and size lipdp cannot check against the metadata before training."""
    if isinstance(x, tf.distribute.DistributedDataset):
        raise ValueError(
            "DP models train on the tf.data.Dataset itself (fit distributes it over the "
            "strategy's replicas); a DistributedDataset hides the pipeline and its sampler, "
            "which lipdp checks against dataset_metadata. Pass the dataset you distributed.")
    if isinstance(x, tf.keras.utils.Sequence) or (
            hasattr(x, "__next__") and not hasattr(x, "__len__")):
        raise ValueError(
            f"DP models train on arrays or a tf.data.Dataset; received a {type(x).__name__}, "
            "whose batches lipdp cannot check against dataset_metadata (their number, their "
            "size, the sampling the accountant assumes). Use lipdp.data.load_dataset, or wrap "
            "the batches in tf.data.Dataset.from_generator(...).")


def _examples_shared(x, y, data, with_labels: bool = True) -> Optional[Tuple[int, int]]:
    """``(shared, n)``: how many of the n examples of `data` are, inputs and label (inputs
    alone without `with_labels`), examples of the training arrays `x, y` (row fingerprints,
    `lipdp.records.row_fingerprints`).
    `data` is ``(inputs, labels, ...)`` arrays or a finite `tf.data.Dataset` of such batches
    (read once); an array of another numeric dtype than its training
    counterpart is compared by value (both in float64: a float64 copy of float32 inputs, or
    labels of another dtype, are the same examples). None when they cannot be compared
    (training from a dataset, an infinite or unreadable dataset, other shapes)."""
    if x is None or y is None or isinstance(x, tf.data.Dataset):
        return None
    if isinstance(data, tf.data.Dataset):
        data = _dataset_arrays(data)
    if not isinstance(data, (tuple, list)) or len(data) < 2:
        return None

    def arrays(structure):
        flat = [np.asarray(a) for a in tf.nest.flatten(structure)]
        if not flat or any(a.ndim == 0 or len(a) != len(flat[0]) for a in flat):
            return None
        return flat

    training, held = (arrays((x, y)), arrays(tuple(data[:2]))) if with_labels else \
        (arrays(x), arrays(data[0]))
    if training is None or held is None or len(training) != len(held) or \
            [a.shape[1:] for a in training] != [a.shape[1:] for a in held]:
        return None
    by_value = [a.dtype != b.dtype for a, b in zip(training, held)]
    if any(flag and not (_numeric(a) and _numeric(b))
           for flag, a, b in zip(by_value, training, held)):
        return None

    def digests(flat):  # one per example, of its bytes in every array
        return row_fingerprints([tf.constant(a.astype(np.float64) if cast else a)
                                 for a, cast in zip(flat, by_value)]).numpy()

    return int(np.isin(digests(held), digests(training)).sum()), len(held[0])


def _training_arrays(x, y) -> Tuple[object, object]:
    """``(x, y)``, or for a finite dataset of batches not made by `lipdp.data.load_dataset`
    (whose training pipelines are told apart by their sampler), its arrays read once
    (`_dataset_arrays`); ``(None, None)`` when they cannot be read."""
    if isinstance(x, tf.data.Dataset):
        arrays = _dataset_arrays(x) if own_sampler(x) is None else None
        return arrays if arrays is not None else (None, None)
    return x, y


def _numeric(array) -> bool:
    return np.issubdtype(array.dtype, np.number) or array.dtype == bool


def _check_steps_per_epoch(steps_per_epoch, metadata: DatasetMetadata) -> None:
    """A DP model's epochs are counted steps: Keras' ``steps_per_epoch=-1`` (one epoch
    until the data runs out) let an epoch hold any number of records, and made the checks
    before the first step read nothing (a review, 2026-12-07: copies and a NaN record
    trained unseen)."""
    if steps_per_epoch is None:
        return
    if isinstance(steps_per_epoch, (bool, np.bool_)) or \
            not isinstance(steps_per_epoch, (int, np.integer)) or steps_per_epoch < 1:
        raise ValueError(
            f"steps_per_epoch={steps_per_epoch!r}: a DP model trains epochs of a given "
            f"number of steps ({metadata.steps_per_epoch} for one pass over the declared "
            "nb_samples_train records), which lipdp checks against the data before the first "
            "step. Pass a positive integer, or leave it out for one pass of a finite dataset.")


def _read_as_one_stream(dataset: tf.data.Dataset, steps_per_epoch: Optional[int]) -> bool:
    """Whether Keras' `fit` reads `dataset` from one iterator across epochs while no
    ``repeat`` on it makes its passes (`lipdp.data.repeat_inside_batches` checks those):
    given a ``steps_per_epoch`` other than its length, Keras does not start a new pass at
    each epoch (its DataHandler's ``should_recreate_iterator``). A `load_dataset` pipeline
    draws its own batches."""
    return steps_per_epoch is not None and not holds_repeat(dataset) and \
        own_sampler(dataset) is None and \
        int(dataset.cardinality()) != steps_per_epoch


_MAX_VALIDATION_ROWS = 1_000_000  # read to compare with the training arrays, at most


def _dataset_arrays(dataset: tf.data.Dataset):
    """The ``(inputs, labels)`` arrays of a finite dataset of batches, read once (a dataset
    of unknown length too: a ``filter`` hid the training arrays, an audit); None for an
    infinite one, one of more than `_MAX_VALIDATION_ROWS` rows, or elements that are not
    such batches."""
    if int(dataset.cardinality()) == tf.data.INFINITE_CARDINALITY:
        return None
    try:
        batches, rows = [], 0
        for element in dataset.as_numpy_iterator():
            batches.append(tuple(element)[:2])
            rows += len(tf.nest.flatten(batches[-1])[0])
            if rows > _MAX_VALIDATION_ROWS:
                return None
        if not batches:
            return None
        return tuple(tf.nest.map_structure(lambda *parts: np.concatenate(parts), *batches))
    except (TypeError, ValueError):
        return None


def _validates_on_training_data(x, y, data, shared=None) -> bool:
    """Whether `data` (validation data, a monitor's examples) holds only training records: the
    very dataset `fit` trains on or one made from it alone by tf.data transformations
    (`lipdp.data.derived_from`: ``ds.take(2)`` and ``ds.map(...)`` passed until 2026-12-07,
    an audit), a training pipeline of `lipdp.data.load_dataset` (it carries a Poisson
    sampler; its test pipeline does not), or arrays (or a finite dataset) every example of
    which is a training example (`_examples_shared`, or its result `shared`)."""
    if data is None:
        return False
    if isinstance(data, tf.data.Dataset) and (
            own_sampler(data) is not None or (
                isinstance(x, tf.data.Dataset) and derived_from(data, x) is True)):
        return True
    shared = shared if shared is not None else _examples_shared(x, y, data)
    return shared is not None and shared[1] > 0 and shared[0] == shared[1]


def _warn_if_shared(x, y, data, what: str, logs: str, shared=None, stacklevel=3) -> None:
    """A warning when `data` holds some training records but not only those: arrays sharing
    examples with the training arrays (`_examples_shared`, or its result `shared`), a
    dataset made from the training dataset and others, or one the training dataset is made
    from (`lipdp.data.derived_from`)."""
    if isinstance(data, tf.data.Dataset) and isinstance(x, tf.data.Dataset) and (
            derived_from(data, x) is None or derived_from(x, data) is not False):
        count = "examples of the training dataset"
    else:
        shared = shared if shared is not None else _examples_shared(x, y, data)
        if shared is None or not 0 < shared[0] < shared[1]:
            return
        count = f"{shared[0]} of its {shared[1]} examples with the training arrays"
    warnings.warn(f"{what} shares {count}: its {logs} depend on those training records "
                  "outside the noisy gradient (not private), and so would anything decided "
                  "from them.", stacklevel=stacklevel)


def _refuse_training_metric_feedback(model, callbacks, logs_training_metrics: bool,
                                     validation_is_training: bool = False, x=None, y=None):
    """Refuse callbacks that act on the model or its training from Keras' training loss and
    metrics: computed on the training records outside the noisy gradient, they are not
    private (`fit`), so a decision taken on them -- stopping (EarlyStopping), the learning
    rate (ReduceLROnPlateau), which weights are kept (ModelCheckpoint with
    ``save_best_only``), ending the run at a NaN loss (TerminateOnNaN) -- makes the model
    depend on the data beyond what epsilon covers. Validation metrics, epsilon and C_t
    (``logit_clip``) are allowed, as is any value a callback writes itself -- but not the
    validation metrics when `validation_is_training` (`_validates_on_training_data`), nor
    the logs a `BoundMonitor` or `SignalToNoise` computes from training records `x, y`
    (their ``data_log_prefixes``). Under ``private_logs_only`` (`logs_training_metrics`
    False), such a monitor on training records is refused whatever acts on its logs: they
    would enter the History that option keeps private."""
    if not logs_training_metrics:  # private_logs_only: History holds what epsilon covers
        training = None
        for callback in callbacks:
            prefixes = getattr(callback, "data_log_prefixes", ())
            if not prefixes:
                continue
            # By inputs alone (a monitor's logs are gradients at training inputs whatever
            # the labels), and a training dataset's records read once: the training arrays
            # with class indices for labels, or the arrays a training dataset was made from,
            # passed in silence (an audit, 2026-12-07).
            training = training or _training_arrays(x, y)
            shared = _examples_shared(*training, callback.data, with_labels=False)
            # Some training records among others: warned, as validation data (an audit,
            # 2026-12-07: a superset of the training arrays passed in silence).
            _warn_if_shared(x, y, callback.data, f"The data given to {type(callback).__name__}",
                            f"logs {', '.join(prefixes)}", shared, stacklevel=4)
            if _validates_on_training_data(x, y, callback.data, shared):
                raise ValueError(
                    f"{type(callback).__name__} computes its logs {', '.join(prefixes)} from "
                    "the training records it was given, outside the noisy gradient, while "
                    "compile(private_logs_only=True) promises logs that epsilon covers. Give "
                    "it held-out data (within the input bound), or compile with "
                    "private_logs_only=False and keep its logs to yourself.")
    training = {"loss"} | set(model.metrics_names)
    if validation_is_training:
        training |= {f"val_{name}" for name in training}
    monitored = [m for m in (getattr(c, "monitor", None) for c in callbacks) if isinstance(m, str)]
    # A monitor's data is compared with the training records (a pass over them) only when
    # some callback acts on one of its logs.
    prefixes = tuple(prefix for callback in callbacks
                     for prefix in getattr(callback, "data_log_prefixes", ())
                     if any(m.startswith(prefix) for m in monitored)
                     and _validates_on_training_data(x, y, callback.data))

    def from_training(monitor):
        return monitor in training or any(monitor.startswith(p) for p in prefixes)

    for callback in callbacks:
        name = type(callback).__name__
        if isinstance(callback, tf.keras.callbacks.TerminateOnNaN) and logs_training_metrics:
            raise ValueError(
                "TerminateOnNaN stops training on the training loss, which Keras computes on "
                "the training records outside the noisy gradient: when the run ends would "
                "depend on the data beyond what epsilon covers (lipdp's private step already "
                "gives records with NaN or inf values a zero contribution, and stops itself "
                "before a non-finite update). Remove it, or compile with "
                "private_logs_only=True.")
        monitor = getattr(callback, "monitor", None)
        if not isinstance(monitor, str) or not from_training(monitor):
            continue
        if isinstance(callback, tf.keras.callbacks.ModelCheckpoint) and \
                not callback.save_best_only:
            continue  # saves every time: the monitored value is not used
        if monitor not in training:  # a monitor callback's log
            what, fix = ("a value computed from training records (the data given to "
                         "BoundMonitor / SignalToNoise)", "give the monitor held-out data")
        elif monitor.startswith("val_") and validation_is_training:
            what, fix = ("a training metric (validation_data holds the training records)",
                         "monitor a validation metric, with validation_data held out of the "
                         "training set")
        else:
            what, fix = ("a training metric", f"monitor a validation metric ('val_{monitor}', "
                         "with validation_data held out of the training set)")
        raise ValueError(
            f"{name} monitors '{monitor}', {what}: it is computed on the training records "
            "outside the noisy gradient, so what the callback decides from it (when to stop, "
            "the learning rate, which weights are kept) depends on the data beyond what the "
            f"reported epsilon covers. Instead, {fix}, or a private value ('epsilon' of "
            "DP_Accountant).")


#: A Poisson batch exceeds `largest_poisson_batch` with probability below 2^-POISSON_TAIL_BITS.
POISSON_TAIL_BITS = 40


def largest_poisson_batch(expected_size: int) -> int:
    """A size that a Poisson-sampled batch of expected size D exceeds with probability below
    ``2^-40``: ``D + ceil(L / 3 + sqrt(L^2 / 9 + 2 D L))`` with ``L = 40 ln 2``.

    The batch size is a sum of N independent Bernoulli(q) draws, mean ``D = q N``, variance
    ``N q (1 - q) <= D``; Bernstein's inequality gives ``P(size - D >= t) <= exp(-t^2 / (2 (D
    + t / 3)))``, at most ``exp(-L)`` for the t above (the root of ``t^2 = 2 L (D + t / 3)``).
    A larger batch is evidence that the data is not Poisson-sampled at rate D / N, as the
    accountant assumes (fixed batches of another size, a pipeline that concatenates batches),
    never a property of the data's values: refusing it reveals nothing about an example."""
    tail = POISSON_TAIL_BITS * np.log(2.0)
    return int(expected_size + np.ceil(tail / 3 + np.sqrt(tail * tail / 9
                                                          + 2 * expected_size * tail)))


def _once_per_global_batch(noised, otherwise):
    """``noised()`` (tensors that carry this step's noise) on one replica only,
    ``otherwise()`` (the same tensors without it) on the others.

    Under a `tf.distribute` strategy every replica runs the train step on its share
    of the global batch, and the optimizer *sums* the replicas' gradients (each
    already divided by the global denominator D). The noise is added once, by the
    first replica in sync, and the others add none: the aggregated update then
    carries exactly the calibrated noise, whatever the replicas' random streams are
    (noise added on every replica would carry sqrt(R) times it; noise split as
    1/sqrt(R) per replica would be exact only if the replicas' draws were
    independent, which seeded random ops do not promise). Outside a strategy (one
    replica) this is ``noised()``.
    """
    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync == 1:
        return noised()
    return tf.cond(tf.equal(context.replica_id_in_sync_group, 0), noised, otherwise)


_LEDGER_TOKENS = itertools.count()


def _restored_every_object(status, by_name: bool) -> bool:
    """Whether a Keras `load_weights` set every variable of the model: an HDF5 file read in
    order (`by_name` skips the layers the file lacks), or a TensorFlow checkpoint whose load
    `status` matched every object of the model (frozen layers and optimizer included)."""
    if status is None:
        return not by_name
    try:
        status.assert_existing_objects_matched()
    except (AssertionError, AttributeError):
        return False
    return True


def _weights_digest(weights) -> str:
    """A digest of a list of weight arrays: their dtypes, shapes and bytes."""
    digest = hashlib.blake2b(digest_size=16)
    for array in weights:
        array = np.ascontiguousarray(array)
        digest.update(f"{array.dtype.str}{array.shape}".encode())
        digest.update(array.tobytes())
    return digest.hexdigest()


def _same_values(arrays, others) -> bool:
    """Whether two lists of arrays hold the same values (NaNs equal)."""
    return len(arrays) == len(others) and all(
        a.shape == b.shape and np.array_equal(a, b, equal_nan=a.dtype.kind in "fc")
        for a, b in zip(arrays, others))


@contextlib.contextmanager
def _metric_state_left_out(model):
    """Within this context the model's metrics hold their initial state; their values are put
    back on exit.

    Keras' `.keras` and `.weights.h5` files (and SavedModels) carry the state of
    ``model.metrics``: after a `fit` whose last epoch was not validated, the training loss
    and metric totals, computed on the training data without noise (an audit told two
    datasets differing in one label apart from the saved file alone, every other value of it
    identical). A model saved within this context holds none of it."""
    # Under tf.distribute a metric variable is one per replica (synced on read): each
    # replica's own value is kept and put back.
    variables = [component for metric in model.metrics for v in metric.variables
                 for component in (v.values if isinstance(v, tf.distribute.DistributedValues)
                                   else (v,))]
    values = [v.numpy() for v in variables]
    for metric in model.metrics:
        metric.reset_state()
    try:
        yield
    finally:
        for variable, value in zip(variables, values):
            variable.assign(value)


_XLA_REFUSAL = (
    "jit_compile=True is not supported by DP models: XLA drops the private step's run-time "
    "checks (TensorFlow assertions: a batch larger than the sampling the accountant assumes, "
    "the ledger's segment, non-finite gradients; an audit trained 64-example batches under "
    "Poisson metadata of 2, epsilon 1.52 accounted for 10.8), and in clipless mode the "
    "certified operator norms are computed on the host (tf.numpy_function), which XLA cannot "
    "compile. (On CPU XLA does not speed up lipdp's layers anyway: benchmarks/results.md, "
    "breakdown tables.)")


#: The methods lipdp's private step is made of: the noise, the bounds and the privacy ledger
#: are those of these methods as lipdp defines them.
_PRIVATE_STEP_METHODS = ("train_step", "make_train_function", "private_gradients",
                         "per_example_step_loss", "sensitivities", "top_gradient_bound")
#: And what the step reads, which a subclass's class body must not define either (a review,
#: 2026-12-07: a `layers` property showing a bounded input the forward pass never ran gave
#: per-example gradients 100x the bound, a `dp_loss` property returning another loss while
#: the step was traced 25.5x, a descriptor returning lipdp's `train_step` on the class and
#: another on the instance passed a check made with `getattr`).
_PRIVATE_STEP_READS = ("layers", "dp_loss", "trainable_variables", "trainable_weights",
                       "__getattribute__", "__getattr__")


def _refuse_replaced_step_methods(model) -> None:
    """Raise ValueError when a class of `model` above lipdp's (a subclass, or a mixin listed
    before lipdp's class) defines a method of the private step (`_PRIVATE_STEP_METHODS`) or
    what it reads (`_PRIVATE_STEP_READS`), or when the model object holds such a method of
    its own. Whatever a replacement does is outside the epsilon reported: an audit
    (2026-12-07) took ``super().train_step`` twice per Poisson batch (92 steps recorded for 46
    samples: epsilon 3.52 reported for 6.40), modified the batch before it (one record's swap
    moved the update by 5.35x the sensitivity), and scaled `per_example_step_loss` by 10
    (per-example gradients 9.5x their bound). Class bodies are read directly (``vars``), so a
    descriptor cannot show lipdp's method to the check and another to the step."""
    mro = type(model).__mro__
    user_classes = mro[:next(i for i, cls in enumerate(mro)
                             if cls in (DP_Sequential, DP_Model, _DPModelMixin))]
    names = _PRIVATE_STEP_METHODS + _PRIVATE_STEP_READS
    replaced = [name for name in names if any(name in vars(cls) for cls in user_classes)]
    replaced += [name for name in _PRIVATE_STEP_METHODS
                 if name in vars(model) and name not in replaced]
    if replaced:
        raise ValueError(
            f"Model '{model.name}' ({type(model).__name__}) replaces "
            f"{', '.join('`' + name + '`' for name in replaced)} of lipdp's private step: the "
            "noise, the bounds and the privacy ledger are those of lipdp's step, so whatever "
            "a replacement changes (a batch taken twice or modified, another loss, layers "
            "the step does not see) is outside the epsilon reported. Customise training with "
            "callbacks, metrics, DP layers and DP losses instead.")


class _DPModelMixin:
    """Private training shared by `DP_Sequential` and `DP_Model`."""

    def _init_dp(self, dp_parameters, dataset_metadata):
        self.dp_loss = None
        self._step_mechanism = None  # set by compile
        self._step_views = 1  # augmentation multiplicity, set by compile
        self._private_logs_only = False
        self._bjorck_every = 1  # set by compile
        self.dp_parameters = dp_parameters
        self.dataset_metadata = dataset_metadata
        # Under tf.distribute every replica runs the step: the step count is taken from the
        # first replica, the examples seen are summed over replicas.
        self._dp_steps = tf.Variable(0, dtype=tf.int64, trainable=False, name="dp_steps_taken",
                                     aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
        self._dp_ledger = tf.Variable(EMPTY_STORAGE, dtype=tf.float64, trainable=False,
                                      shape=tf.TensorShape([None, ROW_SIZE]), name="dp_ledger")
        self._examples_seen = tf.Variable(0, dtype=tf.int64, trainable=False, name="examples_seen",
                                          aggregation=tf.VariableAggregation.SUM)
        self._set_high_water((0, EMPTY_STORAGE))
        self._set_fit_accountants(())
        self._set_fit_sampler_seeds(())
        # Digests of the weights (ledger included) this model handed out: get_weights,
        # save_weights, save. A state set back from one of them is its own (`_foreign`).
        self._exported_states = set()
        # Private steps this object took since its optimizer's state was last replaced
        # (`_optimizer_holds_state`), and the step counts of the other models' ledgers its
        # own ledger includes, by token (`_take_variables`).
        self._own_steps = 0
        self._ledger_token = next(_LEDGER_TOKENS)
        self._lineage = ()  # (token, steps) pairs: a dict attribute would be tracked by Keras
        self._run_name = None  # the name of the steps this object takes (`_open_segment`)
        # The values before the current fit or train_on_batch call's steps (`_resume_ledger`):
        # still held after them, no step of this model produced them.
        self._untrained_values = None
        # Ids of the Poisson samplers this model looked at (`_warn_if_a_seeded_pipeline_is_
        # behind`) or that `fit` started at its step.
        self._samplers_seen = set()
        # C_t of lipdp.AdaptiveClipping, saved with the model (0: not set yet).
        self._logit_clip = tf.Variable(0.0, trainable=False, name="loss_gradient_clip",
                                       aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
        # The Poisson draws this model's history may have used end below it
        # (`poisson_draws_until`), saved with the weights; `_draws_high`, what this object
        # raised it to, is kept when a load sets the variable lower. Created last: the
        # model's last weight, which files and lists saved before it lack
        # (`load_own_variables`, `set_weights`).
        self._draws_until = tf.Variable(
            0, dtype=tf.int64, trainable=False, name="poisson_draws_until",
            aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
        self._draws_high = 0
        # The configuration of each built DP layer, from now on (`check_built_configuration`):
        # a layer that records none at its build is recorded here.
        for layer in self._flatten_layers(include_self=False, recursive=True):
            if isinstance(layer, DPLayer):
                check_built_configuration(layer)

    @property
    def dp_parameters(self):
        """The `DPParameters`; a new value takes effect at the next `compile`."""
        return self._dp_parameters

    @dp_parameters.setter
    def dp_parameters(self, parameters):
        if not isinstance(parameters, DPParameters):
            raise TypeError("`dp_parameters` must be a lipdp.DPParameters. "
                            f"Received: {type(parameters).__name__}")
        self._dp_parameters = parameters

    @property
    def dataset_metadata(self):
        """The `DatasetMetadata` of the training set (may be set after construction,
        e.g. on a `lipdp.zoo` model; required before `compile`). A new value (another
        batch size or sampling) takes effect at the next `compile`, and the ledger
        then records a new segment."""
        return self._dataset_metadata

    @dataset_metadata.setter
    def dataset_metadata(self, metadata):
        if metadata is not None and not isinstance(metadata, DatasetMetadata):
            raise TypeError("`dataset_metadata` must be a lipdp.DatasetMetadata. "
                            f"Received: {type(metadata).__name__}")
        self._dataset_metadata = metadata

    def _require_metadata(self):
        if self._dataset_metadata is None:
            raise ValueError("This model has no dataset_metadata: set `model.dataset_metadata = "
                             "lipdp.DatasetMetadata(...)` (or use the one returned by "
                             "lipdp.data.load_dataset) before compiling.")
        return self._dataset_metadata

    # ------------------------------------------------------------------ ledger
    @property
    def dp_steps_taken(self) -> int:
        """Number of private steps in this model's ledger as `privacy_ledger` reads it: kept
        at its high-water mark (`_keep_ledger`; it read the rolled-back count after a
        checkpoint restored mid-`fit`, which `privacy_ledger` did not: an audit,
        2026-12-06), then composed with the ledgers of the models that trained its
        variables (`_take_variables`: a model whose layers another model trained read its
        own count until its ledger was read: an audit, 2026-12-06)."""
        return self._ledger_reading()[0]

    @property
    def poisson_draws_until(self) -> int:
        """Every draw (`lipdp.data.BatchSampler`: a Poisson batch, or a shuffled pass's
        batch) this model's private steps may have trained on has a step index below this:
        `fit` starts a `lipdp.data.load_dataset` pipeline there (or further), and raises it
        past each pass's draws before the pass begins; `train_on_batch` raises it past every
        draw the pipelines this process built reserved (`lipdp.data.reserved_draws`). Saved
        with the weights, so a run continued in another process (a checkpoint, a saved
        model) draws on. Never below ``dp_steps_taken`` (a model saved before it was kept
        drew step t's batch from draw t). A custom loop over a new pipeline continues a model with
        ``ds_train.lipdp_sampler.start_at(model.poisson_draws_until)``."""
        return max(self._draws_mark(), self.dp_steps_taken)

    def _draws_mark(self) -> int:
        """The mark itself, without the step count `poisson_draws_until` also reads (which a
        copy's ledger brings along): what copies of this model's values carry."""
        return max(int(self._draws_until.numpy()), self._draws_high)

    def _raise_draws_until(self, end: int) -> None:
        """`poisson_draws_until` raised to `end` (and the variable to the object's mark)."""
        saved = int(self._draws_until.numpy())
        high = max(int(end), self._draws_high, saved)
        object.__setattr__(self, "_draws_high", high)
        if saved != high:
            self._draws_until.assign(high)

    @property
    def _recorded_steps(self) -> int:
        """The ledger's step counter as it stands (`dp_steps_taken` composes first)."""
        return int(self._dp_steps.value().numpy())

    def _update_counts(self) -> Tuple[int, int]:
        """``(optimizer.iterations, dp_steps_taken)``: the baseline of
        `_check_updates_recorded` (iterations 0 without an optimizer)."""
        iterations = getattr(getattr(self, "optimizer", None), "iterations", None)
        return (0 if iterations is None else int(iterations.numpy())), self._recorded_steps

    def _check_updates_recorded(self, baseline: Tuple[int, int], when: str):
        """Raise a RuntimeError when, since `baseline` (`_update_counts` taken when `fit` or
        `train_on_batch` began), the optimizer applied more updates than the ledger recorded
        private steps: each private step applies exactly one update, after its noisy
        gradients, so any other came from outside it -- an audit's `train_step` override
        taking plain steps trained 30 of them under a Poisson pipeline with an epsilon of 0
        reported, and one calling ``super().train_step`` then applying its own gradients
        had half its updates un-noised. Counted from the baseline, not from zero: an
        optimizer may arrive with updates of its own (public pretraining, a reused
        optimizer), which are not this model's private steps."""
        iterations, steps = self._update_counts()
        outside = (iterations - baseline[0]) - (steps - baseline[1])
        if outside > 0:
            raise RuntimeError(
                f"{when}, the optimizer applied {outside} more updates than the privacy ledger "
                f"recorded private steps ({steps - baseline[1]}): gradients were applied "
                "outside lipdp's private step (a train_step override that applies its own "
                "gradients or skips super().train_step). Epsilon does not cover them. "
                "Override train_step only around super().train_step(data).")

    @property
    def privacy_ledger(self) -> PrivacyLedger:
        """Every segment of training: its steps and the mechanism they ran (`lipdp.ledger`).

        Never fewer steps than the model's ledger held after any step of `fit` or
        `train_on_batch` call: variables restored behind its back
        (``tf.train.Checkpoint(model=...).restore`` of an older checkpoint, in `fit`'s
        callbacks too) do not roll the count back (`_keep_ledger`)."""
        steps, rows = self._ledger_reading()
        return PrivacyLedger.from_rows(rows, steps)

    def _ledger_reading(self) -> Tuple[int, np.ndarray]:
        """``(steps, stored rows)`` of the ledger as `privacy_ledger` reads it, not decoded:
        kept at its high-water mark (`_keep_ledger`), then composed with the ledgers of the
        models that trained its variables (`_take_variables`). `lipdp.DP_Accountant` reads
        it around every step and decodes it only when it changed."""
        self._keep_high_water()
        self._take_variables()
        return self._ledger_state()

    @property
    def step_mechanism(self) -> StepMechanism:
        """The mechanism the compiled train step runs (None before `compile`)."""
        return self._step_mechanism

    # ---------------------------------------------------------------- weights
    def get_weights(self):
        """Keras `get_weights`; the state returned is remembered as this model's own
        (`_keep_ledger`: Keras' EarlyStopping restores it with ``restore_best_weights``)."""
        return self._handed_out_weights()

    def _handed_out_weights(self):
        """The weights, the ledger composed first (`_take_variables`), remembered as a
        state this model handed out (`_foreign`)."""
        self._take_variables()
        self._raise_draws_until(0)  # never handed out below what this object drew
        weights = super().get_weights()
        self._exported_states.add(_weights_digest(weights))
        self._remember_trained_values(look_up=False)  # `_take_variables` looked them up
        return weights

    def set_weights(self, weights):
        """Keras `set_weights`; the privacy ledger never loses steps (`_keep_ledger`), and
        the model takes its variables over first (`_take_variables`): set on a model sharing
        layers with another, the weights reach the other's ledger when it is read."""
        kept, holds_state, before = self._state_before_load()
        super().set_weights(self._with_draws_until(weights))
        self._keep_ledger(kept, "set_weights", foreign_over=holds_state and self._foreign(),
                          state_kept=self._optimizer_holds_any_state(),
                          wholesale=self._replaced_every_weight(before))
        self._name_next_steps()

    def _lacks_draws_until(self, count: int, weights) -> bool:
        """Whether `count` saved values are `weights` (the model's, or its own variables)
        but the last, ``poisson_draws_until``: a list or file saved before lipdp kept it
        (2026-12-06)."""
        return count == len(weights) - 1 and weights[-1] is self._draws_until

    def _with_draws_until(self, weights):
        """`weights`, with a list saved before ``poisson_draws_until`` given 0 for it: such a
        model drew step t's batch from draw t (`poisson_draws_until` then reads its step
        count, and this object's own mark stays)."""
        weights = list(weights)
        if self._lacks_draws_until(len(weights), self.weights):
            weights.append(np.zeros((), np.int64))
        return weights

    def load_own_variables(self, store):
        """Keras' loading of the model's own variables (`.keras` and `.weights.h5` files);
        a file saved before ``poisson_draws_until`` existed, without it, loads the others
        and sets it to 0 (`_with_draws_until`)."""
        own = self._trainable_weights + self._non_trainable_weights
        if self._lacks_draws_until(len(store.keys()), own):
            for index, variable in enumerate(own[:-1]):
                variable.assign(store[f"{index}"])
            self._draws_until.assign(0)
            return
        super().load_own_variables(store)

    def load_weights(self, *args, **kwargs):
        """Keras `load_weights`; the privacy ledger never loses steps (`_keep_ledger`).

        The step counter and the ledger's rows must come from the same file: a load that
        sets one of them without the other (``by_name=True, skip_mismatch=True`` on an HDF5
        file skips the ledger, whose stored shape differs from its declared one, and loads
        the counter) is undone and refused; it used to stretch the model's own mechanism
        over the loaded step count (an epsilon of 0.81 reported for weights that had cost
        68.9). A file holding neither leaves the ledger as it was."""
        kept, holds_state, before = self._state_before_load()
        optimizer_before = self._optimizer_values()
        self._dp_steps.assign(-1)  # sentinels: what the file sets is what changes
        self._dp_ledger.assign(np.full((1, ROW_SIZE), np.nan))
        try:
            status = self._load_weights_file(*args, **kwargs)
        except BaseException:
            self._set_ledger(kept)
            raise
        steps_loaded = self._recorded_steps != -1
        rows_loaded = not np.isnan(self._dp_ledger.numpy()).any()
        if steps_loaded != rows_loaded:
            super().set_weights(before)
            self._set_ledger(kept)
            raise ValueError(
                "load_weights set the privacy ledger's step counter without its segments (or "
                "the segments without the counter): a partial load (by_name=True with "
                "skip_mismatch=True skips the ledger of an HDF5 file) would attach the loaded "
                "steps to another mechanism. Nothing was loaded. Load the whole file, or load "
                "the layers' weights with layer.set_weights and account for their origin.")
        if not steps_loaded:
            self._set_ledger(kept)
        else:
            note_loaded(self)
        optimizer_after = self._optimizer_values()
        if not _same_values(optimizer_before, optimizer_after):
            holds_state = False  # the file's optimizer state replaced the model's
            self._own_steps = 0
        # The state the optimizer held is gone only if the file set every slot (the
        # iteration count aside: two runs of as many steps hold the same one).
        state_replaced = len(optimizer_before) != len(optimizer_after) or all(
            not np.array_equal(a, b) for a, b, v in
            zip(optimizer_before, optimizer_after, self._optimizer_variables())
            if v is not getattr(self.optimizer, "iterations", None))
        by_name = args[2] if len(args) > 2 else kwargs.get("by_name", False)
        self._keep_ledger(
            kept, "load_weights", foreign_over=holds_state and self._foreign(),
            state_kept=not state_replaced and self._optimizer_holds_any_state(),
            wholesale=_restored_every_object(status, by_name)
            and self._replaced_every_weight(before))
        self._name_next_steps()
        return status

    def _load_weights_file(self, filepath, *args, **kwargs):
        """Keras `load_weights`; a legacy HDF5 file saved before ``poisson_draws_until``
        existed loads with it at 0 (`lipdp.legacy_files.hdf5_with_draw_mark`)."""
        with hdf5_with_draw_mark(filepath) as readable:
            return super().load_weights(readable, *args, **kwargs)

    def _state_before_load(self):
        """Before `set_weights` or `load_weights`: the optimizer built (its slots exist, so a
        file's state for them is set, not left pending) and the variables taken over (they
        may be shared with their owner, `_take_variables`); then ``(ledger state, whether
        the optimizer holds a state of this object's steps, the weights)``."""
        self._build_optimizer()
        self._take_variables()
        return self._ledger_state(), self._optimizer_holds_state(), super().get_weights()

    def _name_next_steps(self):
        """After a load: the steps to come are this object's, named so in the ledger
        (`_open_segment`) now, not when `fit` next begins. A load inside training (a callback
        restoring a checkpoint, a custom loop over a step traced before) filed the steps
        that followed under the loaded run's name, and a model given that branch's weights
        over the run's later optimizer state reported 16 steps for 20 (an audit,
        2026-12-06)."""
        if self._step_mechanism is not None:
            self._open_segment()

    def _ledger_counters(self) -> tuple:
        """The variables that count this model's private training (step count, ledger,
        examples seen, Poisson draw mark): the step writes them, loads carry them."""
        return self._dp_steps, self._dp_ledger, self._examples_seen, self._draws_until

    def _replaced_every_weight(self, before) -> bool:
        """Whether every weight holds another value than `before` (``get_weights()`` taken
        before a load), the ledger's own counters aside and the loss-gradient clip of
        `lipdp.AdaptiveClipping` when neither run set it: weights that keep some of the
        model's own leave the model's run in it. Audits found a model's trained kernel put
        back into another run's list (4 steps reported for 12) and a layer the model
        trained, then froze, kept (4 for 12). Weights that no run trained and that both
        hold alike (a public frozen base) make the load a partial one too: both ledgers are
        then composed (safe)."""
        counters = self._ledger_counters()
        for variable, old in zip(self.weights, before):
            new = variable.numpy()
            if any(variable is c for c in counters) or (
                    variable is self._logit_clip and float(old) == float(new) == 0.0):
                continue
            if np.array_equal(old, new):
                return False
        return True

    def _optimizer_variables(self):
        """The optimizer's variables (none before it is built)."""
        variables = getattr(getattr(self, "optimizer", None), "variables", None)
        return variables() if callable(variables) else list(variables or [])

    def _optimizer_values(self):
        """The optimizer's variables, as numpy arrays."""
        return [np.array(v.numpy()) for v in self._optimizer_variables()]

    def _optimizer_holds_state(self) -> bool:
        """Whether the optimizer holds a state that this object's own private steps built
        and its next updates read (`_optimizer_reads_state`): steps taken by this object's
        `fit` or `train_on_batch` since that state was last replaced (a state restored with
        the model, by `tf.keras.models.load_model` or a TensorFlow-format `load_weights`, is
        the loaded run's, which its ledger counts). `set_weights` and an HDF5 `load_weights`
        leave that state as it was."""
        return bool(self._own_steps) and self._optimizer_reads_state()

    def _optimizer_holds_any_state(self) -> bool:
        """Whether the optimizer holds a state its next updates read, whoever built it (its
        iteration count above 0: this object's steps, a file's or another run's restored
        state, public pretraining)."""
        iterations = getattr(getattr(self, "optimizer", None), "iterations", None)
        return (self._optimizer_reads_state() and iterations is not None
                and int(iterations.numpy()) > 0)

    def _optimizer_reads_state(self) -> bool:
        """Whether the optimizer's updates read a state of its own (momentum, Adam's moments,
        EMA weights): variables besides its iteration count. Keras' SGD keeps its last
        update in a slot that a momentum of 0 never reads."""
        optimizer = getattr(self, "optimizer", None)
        if optimizer is None or len(self._optimizer_variables()) < 2:
            return False
        return not (isinstance(optimizer, tf.keras.optimizers.SGD) and not optimizer.use_ema
                    and float(optimizer.momentum) == 0.0)

    def _count_own_steps(self, steps_before: int):
        """After `fit` or `train_on_batch`: the steps they took are this object's own."""
        self._own_steps += max(0, self._recorded_steps - steps_before)

    def _foreign(self) -> bool:
        """Whether the weights the model holds now are not a state it handed out
        (`get_weights`, `save_weights`, `save`): weights of another run."""
        return _weights_digest(super().get_weights()) not in self._exported_states

    def _set_ledger(self, state):
        """The step counter and the ledger's rows set to ``state = (steps, rows)``."""
        steps, rows = state
        self._dp_steps.assign(steps)
        self._dp_ledger.assign(rows)

    def _refuse_several_steps_per_batch(self, call, whole):
        """`call` (a ``*_on_batch`` method) runs one batch: under ``steps_per_execution``
        above 1 Keras' function would draw that many batches from it and fail on the second
        (``OutOfRangeError``); refused first, naming `whole` (the call that uses the value)."""
        steps = getattr(self, "_steps_per_execution", None)
        if steps is not None and int(steps.numpy()) > 1:
            raise ValueError(
                f"{call} runs one batch, but the model was compiled with "
                f"steps_per_execution={int(steps.numpy())}: Keras' function would draw "
                f"that many batches from it. Compile with steps_per_execution=1 for {call} "
                f"({whole} uses the value you compile with).")

    def test_on_batch(self, *args, **kwargs):
        """Keras `test_on_batch`; refuses ``steps_per_execution`` above 1 as `train_on_batch`
        does (Keras failed with an ``OutOfRangeError``: a review, 2026-12-07)."""
        self._refuse_several_steps_per_batch("test_on_batch", "evaluate")
        return super().test_on_batch(*args, **kwargs)

    def predict_on_batch(self, *args, **kwargs):
        """Keras `predict_on_batch`, refusing ``steps_per_execution`` above 1 as
        `test_on_batch`."""
        self._refuse_several_steps_per_batch("predict_on_batch", "predict")
        return super().predict_on_batch(*args, **kwargs)

    def train_on_batch(self, *args, **kwargs):
        """Keras `train_on_batch` (one private step, recorded in the ledger).

        Raises:
            ValueError: the model was compiled with ``steps_per_execution`` above 1: Keras'
                train function would take that many batches from the one given, take one
                private step and fail on the second draw (``OutOfRangeError``), with
                ``optimizer.iterations`` advanced twice.
        """
        self._refuse_several_steps_per_batch("train_on_batch", "fit")
        self._build_optimizer()
        x = args[0] if args else kwargs.get("x")
        y = args[1] if len(args) > 1 else kwargs.get("y")
        self._build_metrics(x, y)
        self._check_batch_size(x)
        self._retrace_for_label_rank(_label_spec(x, y))
        if self._step_mechanism is not None:  # compiled (the step checks the rest)
            # Here, where the layers' trainable flags are the user's: Keras' train_on_batch
            # puts back those of the last compile while it runs, so a layer frozen since
            # trained on, and one unfrozen did not train, without a word (an audit,
            # 2026-12-07; `fit` refused both).
            self._check_compiled()
            warn_if_seeded()
            self._resume_ledger()
            for accountant in self._fit_accountants:
                accountant.check_next_call()
            self._warn_if_a_seeded_pipeline_is_behind()
            self._warn_once_that_batches_are_unchecked()
        baseline = self._update_counts()
        steps_before = self._recorded_steps
        result = super().train_on_batch(*args, **kwargs)
        if self._step_mechanism is not None:  # its batch may be any pipeline's draw
            self._raise_draws_until(reserved_draws())
        self._count_own_steps(steps_before)
        self._note_ledger()
        self._remember_trained_values(transient=True, look_up=False)
        self._check_updates_recorded(baseline, "In this train_on_batch")
        if kwargs.get("reset_metrics", args[4] if len(args) > 4 else True):
            # The returned values are this batch's; the state left would be saved by
            # `tf.keras.models.save_model` (which does not call `save`): training totals.
            self.reset_metrics()
        return result

    def _check_batch_size(self, x):
        """A batch larger than the step allows (`train_step`'s assertion) refused before the
        step, with the step's reason: from inside the graph it came as an
        InvalidArgumentError whose message held lipdp's (an audit)."""
        mechanism = self._step_mechanism
        arrays = [a for a in tf.nest.flatten(x) if getattr(a, "shape", None) is not None]
        if mechanism is None or not arrays or len(arrays[0].shape) == 0 \
                or arrays[0].shape[0] is None:
            return
        batch, expected = int(arrays[0].shape[0]), mechanism.batch_size
        limit = expected if mechanism.sampling == Sampling.SHUFFLE \
            else largest_poisson_batch(expected)
        if batch > limit:
            raise ValueError(
                f"train_on_batch received a batch of {batch} examples, more than "
                f"{'dataset_metadata.batch_size' if limit == expected else 'a Poisson sample'}"
                f" allows ({limit}; batch_size {expected}, {mechanism.sampling.value} "
                "sampling): the accountant's sampling rate would under-state the privacy loss.")

    def evaluate(self, x=None, y=None, *args, **kwargs):
        """Keras `evaluate`, its compiled metrics built before Keras traces its step
        (`_build_metrics`: the step is then traced once, not twice), inputs of another
        shape than the model's refused first (`_check_input_shape`)."""
        self._check_input_shape(x, "evaluate")
        self._build_metrics(x, y)
        return super().evaluate(x, y, *args, **kwargs)

    def predict(self, x, *args, **kwargs):
        """Keras `predict`, inputs of another shape than the model's refused first
        (`_check_input_shape`)."""
        self._check_input_shape(x, "predict")
        return super().predict(x, *args, **kwargs)

    def _warn_once_that_batches_are_unchecked(self):
        """`fit` checks the pipeline it trains on against the metadata and warns about any
        other (`_check_pipeline_sampler`); `train_on_batch` sees single batches, so it warns
        once per model that the reported epsilon rests on how the loop draws them (an audit's
        loop over 32 records under Poisson metadata of 64 ran silently, epsilon 7.39 reported
        for 13.16; under shuffle metadata, 16 steps on the same 50 records of 400 reported
        4.70 for 25.9, 2026-12-07)."""
        if getattr(self, "_warned_unchecked_batches", False):
            return
        self._warned_unchecked_batches = True
        if self.dataset_metadata.sampling == Sampling.POISSON:
            holds = ("each one holds every one of the dataset_metadata's nb_samples_train "
                     "examples independently with probability q = batch_size / "
                     "nb_samples_train (iterate lipdp.data.load_dataset's Poisson pipeline, "
                     "untransformed, to draw them so)")
        else:
            holds = ("each epoch's batches of batch_size examples split a fresh random "
                     "permutation of the dataset_metadata's nb_samples_train distinct "
                     "examples, each example in one batch per epoch (and shuffle sampling's "
                     "epsilon is itself the heuristic of Poisson subsampling at that rate); a "
                     "loop that trains on one batch again, or on records more often than once "
                     "an epoch, spends more")
        warnings.warn(ShuffleSamplingWarning(
            "train_on_batch trains on the batches your loop gives it, which lipdp cannot "
            f"check: the reported epsilon holds only if {holds}."), stacklevel=3)

    def _warn_if_a_seeded_pipeline_is_behind(self):
        """`fit` starts a `lipdp.data.load_dataset` pipeline at the model's step;
        `train_on_batch` cannot see the pipeline its batches come from. Each pipeline of this
        process with an explicit seed is looked at once per model, the first time this model
        trains after it appeared (`fit` marks the one it starts): warn when its last pass
        began below the draws the model's history may have used
        (`BatchSampler.last_pass_start`, `poisson_draws_until`). A resumed custom loop on a
        new pipeline of the first run's seed replays that run's draws, which the accountant
        counts as fresh samples."""
        seen = self._samplers_seen
        for sampler in seeded_samplers():
            if id(sampler) in seen:
                continue
            seen.add(id(sampler))
            start, used = sampler.last_pass_start(), self.poisson_draws_until
            if start < used:
                warnings.warn(
                    f"A lipdp.data.load_dataset {sampler.sampling.value} pipeline of seed "
                    f"{sampler.seed} draws from step {start}, while this model's steps may "
                    f"have used its draws up to step {used - 1}: if its batches feed "
                    "train_on_batch, they are the "
                    "draws of earlier steps again (replayed samples are not the independent "
                    "subsampling the accountant assumes). Call "
                    "`ds_train.lipdp_sampler.start_at(model.poisson_draws_until)` before "
                    "iterating it (fit does).", stacklevel=3)

    def _build_optimizer(self):
        """Create the optimizer's variables before Keras traces the training step. Keras
        builds them inside the step's first call, and a `tf.function` that creates variables
        is traced a second time: the private step (bound pass, noise, projections) would be
        traced twice per `fit` (measured: 2 traces before, 1 after)."""
        optimizer = getattr(self, "optimizer", None)
        if (self.built and isinstance(optimizer, tf.keras.optimizers.Optimizer)
                and not getattr(optimizer, "_built", False)):
            with self.distribute_strategy.scope():
                optimizer.build(self.trainable_variables)

    def _build_metrics(self, x, y):
        """Create the compiled metrics' variables before Keras traces the training step, for
        the reason `_build_optimizer` gives: Keras builds them at the step's first call, and
        with ``metrics=[...]`` the private step was traced twice per `fit` (measured: 2
        traces before, 1 after). Keras picks each metric's form ('accuracy': binary,
        categorical or sparse) from the shapes of the labels and outputs; a one-example
        batch of zeros of those shapes gets the same form. Labels or outputs whose shape is
        not known before the first batch (nested, ragged, unknown dimensions) are left to
        Keras' own build."""
        metrics = getattr(self, "compiled_metrics", None)
        if metrics is None or metrics.built or not self.built:
            return
        labels = _label_spec(x, y)
        try:
            outputs = tf.TensorShape(self.output_shape)
        except (AttributeError, TypeError, ValueError):  # not built, or several outputs
            return
        if labels is None or not outputs[1:].is_fully_defined():
            return
        with self.distribute_strategy.scope():
            metrics.build(tf.zeros([1] + outputs[1:].as_list(), self.compute_dtype),
                          tf.zeros([1] + labels.shape[1:].as_list(), labels.dtype))

    def _ledger_state(self):
        """``(steps, stored rows)`` as the variables hold them now. Read with ``value()``:
        ``numpy()`` adds `read_value`'s identity op, 70 against 30 us a read, and the ledger is
        read several times around every step (`lipdp.DP_Accountant`, the copies' bookkeeping)."""
        return int(self._dp_steps.value().numpy()), self._dp_ledger.value().numpy()

    def _note_ledger(self, state=None):
        """Remember the ledger (`state`, default: the current one) if it holds the most steps
        seen so far (the high-water mark `privacy_ledger` never goes below)."""
        state = self._ledger_state() if state is None else state
        if state[0] >= self._ledger_high_water[0]:
            self._set_high_water(state)

    def _set_fit_accountants(self, accountants):
        """The `DP_Accountant`s of the `fit` calls running, whose budgets `train_on_batch`
        honours too: called from a callback, it ran 8 steps of 6 allowed (an audit,
        2026-12-06). Not tracked by Keras (callbacks hold the model)."""
        object.__setattr__(self, "_fit_accountants", tuple(accountants))

    def _set_fit_sampler_seeds(self, seeds):
        """The seeds of the Poisson pipelines the `fit` calls running draw from: a fit run
        from a callback of another, on a pipeline of the same seed, draws steps the outer
        one's pass already reserved (an audit, 2026-12-06: 4 of 18 draws trained twice)."""
        object.__setattr__(self, "_fit_sampler_seeds", tuple(seeds))

    def _set_high_water(self, state):
        """The mark set past Keras' attribute tracking, which wrapped the tuple in 0.15 ms
        (the mark is noted after every step): it holds no variable or layer to track."""
        object.__setattr__(self, "_ledger_high_water", state)

    def _keep_high_water(self):
        """The ledger back to its high-water mark (`_note_ledger`) if variables restored
        behind its back rolled it back (`_keep_ledger`: the steps taken since count, whatever
        the weights)."""
        self._keep_ledger(self._ledger_high_water, "restoring an older checkpoint")

    def _keep_ledger(self, kept, how: str, foreign_over: bool = False, state_kept: bool = True,
                     wholesale: bool = False):
        """The ledger and step counter are among the model's weights (so checkpoints and
        saved models carry them). After weights were loaded over the ledger `kept`, the
        model's ledger is:

        * both, one after the other (`lipdp.ledger.concatenated`), when `foreign_over`:
          weights the model did not hand out, set over an optimizer state built by its own
          steps (Adam's moments, momentum), whatever the two ledgers hold: its next updates
          read both (two objects that resumed one checkpoint and trained apart hold ledgers
          that seem to continue each other);
        * the loaded one when it continues `kept` (`lipdp.ledger.continues`: a fresh model
          loading trained weights, a run resumed from its last checkpoint);
        * `kept` when it continues the loaded one: an earlier checkpoint of the same run
          (Keras' EarlyStopping with ``restore_best_weights=True`` restores an earlier
          epoch's weights after later epochs ran, and those epochs were released to choose
          them, so the count is never rolled back);
        * when neither continues the other (another run: each run's segments follow a row
          naming it, `lipdp.ledger.run_row`):

          - the loaded one alone when the load replaced every trainable variable
            (`wholesale`) and the optimizer holds no state that its updates read and the
            file did not replace (`state_kept`): nothing of the model's run is left in it;
          - both, one after the other, otherwise: weights of another run set over an
            optimizer state (a model of 4 Adam steps given the weights of another run of 8
            reported 8 steps, then 12 after 4 more, for an update that read 16; one whose
            Adam state was loaded from a run of 8 steps, given another's 8, reported 8 for
            16: audits, 2026-12-06), or over some variables only (before runs were named,
            a run of one mechanism seemed to continue another of as many steps or fewer,
            and its ledger replaced the model's).
        """
        current = self._ledger_state()
        if foreign_over and kept[0] and current[0]:
            self._set_ledger(concatenated(kept, current))
            self._note_ledger()
            warnings.warn(
                f"{how}: weights that this model did not hand out (get_weights, save_weights, "
                f"save) were set while its optimizer holds the state of its own {kept[0]} "
                "private steps (momentum, moments): its next updates read both runs, so the "
                f"ledger now holds both, the model's {kept[0]} steps then the loaded "
                f"{current[0]}. To train on the loaded weights alone, compile with a new optimizer "
                "before setting them.", stacklevel=3)
            return
        if continues(kept, current):
            self._note_ledger(current)
            return
        if continues(current, kept):
            steps, rows = kept
            message = (f"the weights loaded record {current[0]} private steps in their ledger, "
                       f"but the model took {steps}: the ledger keeps the {steps} steps "
                       "(weights chosen among the iterates of a run cost the whole run's "
                       "epsilon)")
        elif wholesale and not state_kept:
            # The model's run is gone from its state, with the ledgers it had absorbed: a
            # model sharing its variables composes this one with its own (`_absorb`).
            self._set_high_water(current)
            self._lineage = ()
            # A new token too: a model that absorbed this one's ledger before remembers its
            # step count under the old token, and would take the new ledger, of as many
            # steps or fewer, for one it already counts.
            self._ledger_token = next(_LEDGER_TOKENS)
            return
        else:
            steps, rows = concatenated(kept, current)
            held = ("its optimizer's state (momentum, moments) of that run" if state_kept
                    else "variables the load did not replace")
            message = ("the weights loaded come from another run than the model's ledger "
                       f"records, and the model keeps {held}: the ledger now holds both, the "
                       f"model's {kept[0]} steps then the loaded {current[0]} (to hold the "
                       "loaded run alone, load it into a new model or compile with a new "
                       "optimizer first)")
        self._set_ledger((steps, rows))
        warnings.warn(f"{how}: {message}.", stacklevel=3)

    def _resume_ledger(self):
        """Before steps run (`fit`, `train_on_batch`): the ledger back to its high-water mark
        if variables restored behind its back rolled it back (a ``tf.train.Checkpoint``
        restore of an older checkpoint: the steps taken since count, whatever the weights),
        then a segment for the compiled mechanism. The train step is traced once per
        `compile`, so the segment it opens when traced would not follow a ledger replaced
        since (weights and ledger restored from a run of another mechanism); the step
        checks it (`_ledger_guard`)."""
        self._keep_high_water()
        self._take_variables()
        self._open_segment()
        self._untrained_values = keys_of(self.trainable_variables)

    def _take_variables(self):
        """Make this model the ledger owner of its trainable variables, its ledger composed
        with the ledger of every other DP model that owned one of its variables (layers
        shared between models, trainable here or frozen). Runs at `compile`, before steps
        run, when the ledger is read and before the weights are handed out (`get_weights`,
        `save_weights`, `save`): a model built on a trained model's layers
        (``DP_Sequential(a.layers[:-1] + [head])``) reported only its own steps, and the
        first model, trained on by the second, only its own (an audit, 2026-12-06). The
        owner is held by the variable (a strong reference: its ledger outlives it).

        Two runs of one mechanism record the same segments, so whether one ledger continues
        the other is read from the models' lineage (`_absorb`), not from the segments. The
        values copied into the model are looked up too (`_take_copied_values`)."""
        for owner in ledger_owners(self):
            if owner is not self:
                self._absorb(owner)
        for variable in self.trainable_variables:
            variable._lipdp_ledger_owner = self
        self._take_copied_values()

    def _take_copied_values(self):
        """Compose into this model's ledger the ledger of every other model object whose
        private steps produced a value one of its variables holds (`lipdp.weight_copies`):
        weights copied layer by layer (``layer.set_weights``, ``variable.assign``) carried
        no ledger, and a new model given every layer of a run of 8 steps reported 0, then 4
        after its own 4 (the README's pitfalls listed it). A ledger that holds the copied
        run's steps already (`lipdp.ledger.includes`: the whole weights loaded, then
        layers copied again) adds nothing. Runs wherever `_take_variables` does, before each
        step of `fit` (a callback copying at a step's end) and before the model's values are
        remembered as its own (`_remember_trained_values`). The steps to come are then named
        as the model's own (`_open_segment`), as after a load."""
        _remember_loaded_values(self)
        changed = False
        for trained_by in origins(self.weights, self._ledger_token):
            steps = self._recorded_steps
            self._compose_with(trained_by.token, trained_by.state, dict(trained_by.lineage),
                               copied=True)
            # The copied run's draws are this history's too (a review, 2026-12-06: a model
            # given a run's layers one by one, saved, drew 4 of its draws again).
            self._raise_draws_until(trained_by.draws_until)
            if self._recorded_steps != steps:
                changed = True
                warnings.warn(
                    f"weights of this model hold values copied from another model, trained by "
                    f"{trained_by.state[0]} private steps (layer.set_weights, "
                    f"variable.assign): its ledger now holds them, {self._recorded_steps} "
                    "steps in all.", stacklevel=4)
        if changed:
            self._name_next_steps()

    def _trained_by(self) -> TrainedBy:
        """This model's ledger as `lipdp.weight_copies` remembers it with its values."""
        return TrainedBy(self._ledger_token, self._ledger_state(),
                         tuple(self._lineage_now().items()), self._draws_mark())

    def _remember_trained_values(self, transient: bool = False, look_up: bool = True):
        """Remember the values of the trainable variables with this model's ledger
        (`lipdp.weight_copies.remember`): right after each of its steps (`transient`:
        replaced after the next), after every epoch and `fit`, and whenever the weights are
        handed out (`get_weights`, `save_weights`, `save`, a DP layer's
        `get_weights`). Values remembered as the model's own are never looked up as copies,
        so the values are looked up first (`_take_copied_values`) unless nothing but the
        model's own steps or a lookup ran since (``look_up=False``): a callback of the
        model's `fit` copying another run's layers at an epoch's end had them remembered as
        the model's own (an audit, 2026-12-06: 4 steps reported for 12), and a seeded
        program training two models to the same values has each keep its own."""
        forget_loaded(self)
        if look_up:
            self._take_copied_values()
        remember(self.trainable_variables, self._trained_by(), transient,
                 self._untrained_values)

    def _lineage_now(self):
        """``{model token: its step count}`` of every ledger this model's ledger includes, its
        own at its current count."""
        return {**dict(self._lineage), self._ledger_token: self._recorded_steps}

    def _absorb(self, owner):
        """This model's ledger composed with `owner`'s (which trained some of its variables):
        kept when it includes `owner`'s steps, replaced by `owner`'s when that one includes
        this model's current steps (a model built on our layers after our last step),
        both counted one after the other (`lipdp.ledger.concatenated`) otherwise: two
        independent runs (a model built on the layers of two runs counted the longer one)."""
        owner._keep_high_water()
        self._compose_with(owner._ledger_token, owner._ledger_state(), owner._lineage_now())
        self._raise_draws_until(owner._draws_mark())  # its draws are ours too

    def _compose_with(self, token, theirs, their_lineage, copied=False):
        """This model's ledger composed with ``theirs = (steps, rows)``, the ledger of the
        model of `token` (whose lineage is `their_lineage`), as `_absorb` states. For values
        `copied` from that model (`_take_copied_values`): kept as it is when it includes
        ``theirs`` already (`lipdp.ledger.includes`), replaced by ``theirs`` when that
        continues it (`lipdp.ledger.continues`; a model synchronised with a training one
        after each epoch counted 4, 12, then 24 steps for 12, and a best checkpoint loaded,
        then the run's last layers copied, 24 for 16: an audit, 2026-12-06)."""
        ours, mine = self._ledger_state(), self._lineage_now()
        if not theirs[0] or mine.get(token, -1) >= theirs[0]:
            return
        if copied and includes(ours, theirs):
            pass
        elif (not ours[0] or their_lineage.get(self._ledger_token, -1) == ours[0]
              or copied and continues(ours, theirs)):
            self._set_ledger(theirs)
        else:
            self._set_ledger(concatenated(ours, theirs))
        self._note_ledger()
        for included, steps in {**their_lineage, token: theirs[0]}.items():
            mine[included] = max(steps, mine.get(included, -1))
        mine.pop(self._ledger_token, None)
        self._lineage = tuple(mine.items())

    def _ledger_guard(self):
        """An assertion, in the traced step, that the ledger's last segment is the compiled
        mechanism: the steps counted next are recorded under it. Fails when the ledger
        variables were replaced since `fit` or `train_on_batch` began (a restore inside a
        custom loop or a callback), instead of counting steps under another mechanism."""
        row = tf.constant(self._step_mechanism.to_row(), tf.float64)
        return tf.debugging.assert_equal(
            self._dp_ledger[-1, 1:], row,
            message="The privacy ledger's last segment is not the mechanism this step runs: "
                    "the model's weights and ledger were replaced since training began "
                    "(a checkpoint restored, load_weights?). Call fit or train_on_batch again "
                    "(they record the mechanism before the first step).")

    def _open_segment(self):
        """Record that the next steps run the compiled mechanism (a new ledger segment
        unless the last one has it), after a row naming this object's steps
        (`lipdp.ledger.run_row`) unless the last steps recorded are already its own. Two
        objects that resume one checkpoint and train apart record each its own name after
        the common steps, so neither ledger seems to continue the other (an audit of the
        first version, 2026-12-06: both kept the checkpoint's name, and a model given one
        branch's weights over the other's Adam state reported 12 steps for 16). Steps and
        names recorded before a ledger holds any step are dropped: a saved ledger of 0 steps
        names no run. Runs eagerly, when the step is traced and before steps run
        (`_resume_ledger`)."""
        with tf.init_scope():
            stored = self._dp_ledger.numpy()
            rows = stored_rows(stored)
            steps = float(self._dp_steps.numpy())
            row = np.array(self._step_mechanism.to_row(), np.float64)
            if len(rows) and rows[-1, 0] == steps:
                rows = rows[:-1]  # the last segment ran no step
            while len(rows) and rows[-1, 0] == RUN_MARK:
                rows = rows[:-1]  # a name followed by no step
            if steps == 0:
                rows = rows[:0]
            names = rows[rows[:, 0] == RUN_MARK, 1]
            if self._run_name is None:
                self._run_name = self._new_run_id()
            if not len(names) or names[-1] != self._run_name:
                rows = np.concatenate([rows, run_row(self._run_name)[None]])
            if not (rows[-1, 0] != RUN_MARK and np.array_equal(rows[-1, 1:], row)):
                rows = np.concatenate([rows, [[steps, *row]]])
            if not np.array_equal(rows, stored):
                self._dp_ledger.assign(rows)

    def _new_run_id(self) -> int:
        """A number naming the steps this object takes (`lipdp.ledger.run_row`): 52 random
        bits. The workers of a multi-worker strategy each run this and must agree without a
        collective (it runs while the step is traced), so there it is a digest of the
        trainable weights, which the strategy keeps equal on every worker: two
        multi-worker runs from the same weights and of one mechanism get one name, and
        `continues` then tells them apart by their segments only, as it did every run
        before runs were named."""
        resolver = getattr(self.distribute_strategy, "cluster_resolver", None)
        tasks = (sum(len(t) for t in resolver.cluster_spec().as_dict().values())
                 if resolver is not None else 1)
        if tasks <= 1:
            return 1 + secrets.randbits(52)
        digest = hashlib.blake2b(digest_size=8)
        for variable in self.trainable_variables:
            digest.update(np.ascontiguousarray(variable.numpy()).tobytes())
        return 1 + (int.from_bytes(digest.digest(), "big") >> 12)

    def _check_compiled(self):
        """The compiled mechanism must still be the model's: parameters, metadata, trainable
        variables and every layer's configuration unchanged since `compile`, and in clipless
        mode a DP loss whose constant L is at most the one compiled. The layers' and the
        loss's attributes are read when the step is traced, L at compile: a DP_BoundedInput's
        `upper_bound` lowered after build shrank the bound 10x while inputs were still
        clipped at the old radius, a DP_MulticlassHKR's alpha raised from 1 to 50 or
        `model.dp_loss` replaced trained under the compiled L (exact per-example norms 8.7x
        to 25x the bound; an audit, 2026-12-05). A loss parameter that leaves L as it was
        (the temperature of the tau cross-entropy, which a schedule may move) passes."""
        if self._step_mechanism is None:
            raise RuntimeError("Compile the model with a DP loss before training.")
        _refuse_replaced_step_methods(self)
        parameters, metadata, variables, configuration = self._compiled_state
        changed = [name for name, now, then in [
            ("dp_parameters", self.dp_parameters, parameters),
            ("dataset_metadata", self.dataset_metadata, metadata),
            ("trainable variables", [v.ref() for v in self.trainable_variables], variables)]
            if now != then]
        changed += _changed_configuration(configuration, _configuration(self))
        if parameters.mode is DPMode.CLIPLESS:
            changed += self._raised_loss_constant()
        if changed:
            raise RuntimeError(
                f"Changed since the model was compiled: {'; '.join(changed)}. Call "
                "`compile` again before training, so that the train step and the privacy "
                "ledger use the new mechanism (the steps already taken stay accounted with "
                "the mechanism they ran).")

    def _raised_loss_constant(self) -> list:
        """``["the DP loss's constant L (...)"]`` when `dp_loss` is no longer a DP loss or its
        L (read eagerly, also while the step is traced) exceeds the one compiled."""
        if not isinstance(self.dp_loss, DP_Loss):
            return [f"the DP loss (now {type(self.dp_loss).__name__}, not a lipdp DP loss)"]
        patched = replaced_call(self.dp_loss)
        if patched:
            return [f"the DP loss (its `{patched}` replaced on the instance)"]
        with tf.init_scope():
            now = float(self.dp_loss.lipschitz(int(self.output_shape[-1])))
        # A negative L (alpha set to -30 after compile) passed a plain comparison (an audit).
        if 0.0 <= now <= self._loss_lipschitz:
            return []
        return [f"the DP loss's constant L ({now:.6g}, {self._loss_lipschitz:.6g} at compile)"]

    @property
    def nb_noised_variables(self) -> int:
        """Number of noised variables (one Gaussian mechanism each, per-layer strategy)."""
        return len(self.trainable_variables)

    # ----------------------------------------------------------------- compile
    def compile(self, optimizer="rmsprop", loss=None, metrics=None, loss_weights=None,
                private_logs_only=None, bjorck_every=None, **kwargs):
        """Keras `compile`, fixing the private mechanism of the train step.

        The noise multiplier, strategy, denominator, sampling and the trainable
        variables are read here; changing any of them later needs a new `compile`.

        Args:
            private_logs_only: if True, the train step returns no loss or metric
                computed on the training data (they are not covered by epsilon):
                ``History`` and the progress bar then only hold what callbacks add
                (epsilon) and validation results (and, with ``steps_per_execution``
                above 1, ``dp_steps_taken``: Keras' loop needs an output).
            bjorck_every: the projection after a step orthogonalises the spectrally
                constrained kernels (Björck iterations) every `bjorck_every` steps
                (the steps whose count ``dp_steps_taken`` is a multiple of it) and only
                spectrally normalises them (cached power iteration) in between:
                cheaper steps, kernels less orthogonal between refreshes; `fit` ends
                with a refresh. Neither epsilon nor the bounds depend on it (norms are
                certified on the kernels the forward pass uses); utility may (README,
                Speed). Behind a `lipdp.layers.DP_BoundedActivation` the first kernel is
                not certified at all by the steps between refreshes.
            Other arguments: as for `tf.keras.Model.compile`; ``loss`` must be a DP
                loss (`lipdp.losses`) in clipless mode.

        Unless given, ``private_logs_only`` and ``bjorck_every`` are False and 1, or, at
        the first `compile` of a model made from a config (a saved file of any format,
        `clone_model`), the values the model was compiled with when its config was taken.

        Raises:
            ValueError: a subclass (or the model object) replaces a method of the private
                step (`train_step`, `per_example_step_loss`, ...: `_PRIVATE_STEP_METHODS`),
                or a subclass defines what the step reads (`layers`, `dp_loss`, ...:
                `_PRIVATE_STEP_READS`); also checked before every `fit` and `train_on_batch`.
        """
        _refuse_replaced_step_methods(self)
        saved = self.__dict__.get("_loaded_compile_settings") or {}
        if private_logs_only is None:
            private_logs_only = saved.get("private_logs_only", False)
        if bjorck_every is None:
            bjorck_every = saved.get("bjorck_every", 1)
        if not isinstance(private_logs_only, bool):
            raise TypeError("`private_logs_only` must be a bool. "
                            f"Received: private_logs_only={private_logs_only!r}")
        if not isinstance(bjorck_every, int) or isinstance(bjorck_every, bool) \
                or bjorck_every < 1:
            raise ValueError("`bjorck_every` must be a positive integer. "
                             f"Received: bjorck_every={bjorck_every!r}")
        require_built(self, "its bounds and clipping need every layer's input shape at "
                            "compile time (build it before `compile`)")
        if kwargs.get("jit_compile"):
            raise ValueError(_XLA_REFUSAL)
        if isinstance(kwargs.get("steps_per_execution"), str):
            raise ValueError(
                f"steps_per_execution={kwargs['steps_per_execution']!r}: Keras' tuner would "
                "change the number of private steps a call of the train function runs from its "
                "own thread, at any time, while DP_Accountant's budget stop reads that number "
                "before each call. Give an integer.")
        previous_optimizer = getattr(self, "optimizer", None)
        self._compile_dp(optimizer, loss, metrics, loss_weights, **kwargs)
        if self.optimizer is not previous_optimizer:
            self._own_steps = 0  # a new optimizer holds no state of the steps taken
        self._bind_certifiable_metrics(metrics)
        if not self.trainable_variables:
            raise ValueError("The model has no trainable variables to train privately (is it "
                             "built? give its first layer an input shape or an Input).")
        self._private_logs_only = private_logs_only
        self._bjorck_every = bjorck_every
        object.__setattr__(self, "_loaded_compile_settings", None)  # its first compile done
        self._compiled_state = (self.dp_parameters, self.dataset_metadata,
                                [v.ref() for v in self.trainable_variables],
                                _configuration(self))
        self._step_mechanism = StepMechanism.of(self.dp_parameters, self.dataset_metadata,
                                                len(self.trainable_variables))
        self._step_views = self.dataset_metadata.augmentation_multiplicity
        self._take_variables()

    def _bind_certifiable_metrics(self, metrics):
        """`lipdp.certify.CertifiableAccuracy` metrics given without a model certify with this
        one (also when `load_model` re-compiles from a saved config)."""
        from lipdp.certify import CertifiableAccuracy

        for metric in tf.nest.flatten(metrics or []):
            if isinstance(metric, CertifiableAccuracy) and metric.bound_model is None:
                metric.bind(self)

    def get_compile_config(self):
        config = super().get_compile_config()
        if config is not None:
            config["private_logs_only"] = self._private_logs_only
            config["bjorck_every"] = self._bjorck_every
        return config

    def _warn_if_delta_allows_a_record(self, metadata):
        """A delta of at least 1 / N admits mechanisms that publish a whole training record
        (release one record at random: (0, 1/N)-DP); the epsilon reported with it then
        promises little. Warned at compile, as the mechanism is fixed there."""
        delta, n = float(self.dp_parameters.delta), metadata.nb_samples_train
        if n and delta >= 1.0 / n:
            warnings.warn(
                f"delta={delta:g} is at least 1 / nb_samples_train = 1/{n}: an (epsilon, "
                "delta) guarantee with such a delta allows publishing a whole training record "
                f"(e.g. one chosen at random). Choose delta well below 1/{n} (a common choice: "
                "1 / N^1.1, or 1e-5 for N = 60000).", stacklevel=5)

    def _one_input_shape(self) -> Optional[tf.TensorShape]:
        """The example shape of the model's input (batch axis dropped); None for a model of
        several inputs or of no known input yet."""
        inputs = getattr(self, "inputs", None)
        if not inputs or len(inputs) != 1 or inputs[0].shape.rank is None:
            return None
        return inputs[0].shape[1:]

    def _check_metadata_input_shape(self, metadata):
        """A model of one input must take the examples the metadata declares: one of another
        shape compiled and trained (a usability audit), as long as the data had the model's
        shape, while its number of outputs was checked."""
        shape = self._one_input_shape()
        if shape is not None and not shape.is_compatible_with(tuple(metadata.input_shape)):
            raise ValueError(
                f"The model takes inputs of shape {tuple(shape.as_list())} but dataset_metadata "
                f"declares input_shape={tuple(metadata.input_shape)}. Build the model for the "
                "examples the metadata describes (lipdp.data.load_dataset returns both).")

    def _check_input_shape(self, x, call: str):
        """Inputs of another example shape than the model's refused before ``call`` (`fit`,
        `evaluate`, `predict`) traces its step, naming both: Keras' error came when the step
        was traced, the last line of a 24-line traceback through lipdp's step (usability
        audits). Views stacked by ``augmentation_multiplicity`` are checked by the training
        step (`_flatten_views`)."""
        expected, shape = self._one_input_shape(), _input_shape(x)
        if expected is None or shape is None or (call == "fit" and self._step_views > 1):
            return
        if shape.rank == 1 and expected.as_list() == [1]:
            return  # Keras expands a vector of scalars to a column
        if not shape[1:].is_compatible_with(expected):
            what = "training inputs" if call == "fit" else "inputs"
            # A dataset of single examples: its elements are examples, not batches (the
            # message named two equal shapes: a usability audit, 2026-12-07).
            unbatched = isinstance(x, tf.data.Dataset) and shape.is_compatible_with(expected)
            raise ValueError(
                f"{call} received {what} of shape {tuple(shape.as_list())}: the model "
                f"takes examples of shape {tuple(expected.as_list())} (inputs of shape "
                f"(batch,) + {tuple(expected.as_list())})."
                + (" The dataset yields single examples: batch it (dataset.batch(...)), or "
                   "use lipdp.data.load_dataset." if unbatched else ""))

    def _warn_if_no_noise(self):
        """``noise_multiplier=0`` trains without noise: no epsilon holds (the accountant
        reports inf). Allowed, for debugging and for checking updates, and warned at compile
        (it passed silently: a usability audit)."""
        if float(self.dp_parameters.noise_multiplier) == 0:
            warnings.warn(
                "noise_multiplier=0: the steps add no noise, so the training is not "
                "differentially private (epsilon = inf, and get_max_epochs allows 0 epochs). "
                "Use it only to debug; set a noise multiplier for private training.",
                stacklevel=5)

    def _checked_metadata(self) -> DatasetMetadata:
        """The metadata compile fixes the mechanism with, after the checks of both modes."""
        metadata = self._require_metadata()
        self._warn_if_delta_allows_a_record(metadata)
        self._warn_if_no_noise()
        self._check_metadata_input_shape(metadata)
        return metadata

    def _compile_dp(self, optimizer, loss, metrics, loss_weights, **kwargs):
        _refuse_regularization(self)
        outputs = getattr(self, "outputs", None)
        if outputs is not None and len(outputs) != 1:
            raise ValueError(
                f"The model has {len(outputs)} output tensors, a DP model one: the logits of "
                "its loss (the bound, or the clipping, covers one loss per example). "
                "Concatenate the heads into one output, or train one model per head.")
        if self.dp_parameters.mode is DPMode.CLIPPED:
            # Classic DP-SGD (lipdp.clipping): any loss with per-example values, any layer
            # without batch coupling; no bounds to check.
            if loss_weights is not None:
                raise ValueError("`loss_weights` is not supported by DP models: it rescales the "
                                 "gradients behind the clipping's back.")
            metadata = self._checked_metadata()
            nb_outputs = int(self.output_shape[-1])
            if nb_outputs != metadata.nb_classes:
                raise ValueError(f"The model has {nb_outputs} outputs but dataset_metadata "
                                 f"declares nb_classes={metadata.nb_classes}.")
            check_outputs(loss, nb_outputs)
            if metadata.augmentation_multiplicity > 1:
                raise ValueError(
                    "Augmentation multiplicity is supported in clipless mode only: classic "
                    "DP-SGD must clip the average of an example's views, which its per-example "
                    "norm engines do not group.")
            self._clipped_dpsgd = ClippedDPSGD(self, loss, self.dp_parameters, metadata)
            self._state_guard = self._guard(self._clipped_dpsgd.unwritten,
                                            self._clipped_dpsgd.probed)
            self.dp_loss = loss
            super().compile(optimizer=optimizer, loss=loss, metrics=metrics, **kwargs)
            return
        if not isinstance(loss, DP_Loss):
            raise TypeError(
                "A DP model must be compiled with a DP loss from lipdp.losses (e.g. "
                "DP_TauCategoricalCrossentropy), whose Lipschitz constant w.r.t. the logits is "
                f"known. Received: loss={loss!r}"
            )
        if loss_weights is not None:
            raise ValueError("`loss_weights` is not supported by DP models: it rescales the "
                             "gradients behind the bounds' back.")
        metadata = self._checked_metadata()
        layers = dp_layers(self)
        if len(self.output_shape) != 2:
            raise ValueError(
                f"The model's output has shape {self.output_shape}, but Clipless DP-SGD needs one "
                "loss per example, (batch, K) logits: the bound covers one loss, the step would "
                "sum one per position. Flatten per-position outputs (lipdp.layers.DP_Flatten) "
                "before the last dense layer.")
        nb_outputs = int(self.output_shape[-1])
        if nb_outputs != metadata.nb_classes:
            raise ValueError(f"The model has {nb_outputs} outputs but dataset_metadata declares "
                             f"nb_classes={self.dataset_metadata.nb_classes}.")
        check_outputs(loss, nb_outputs)
        check_float32(leaf_layers(self))
        check_float32_inputs(self)
        self._state_guard = self._guard(*self._check_user_layers_per_example())
        self.dp_loss = loss
        self._loss_lipschitz = float(loss.lipschitz(nb_outputs))
        self._check_every_variable_bounded(layers)
        self._init_adaptive_clipping()
        super().compile(optimizer=optimizer, loss=loss, metrics=metrics, **kwargs)

    def _guard(self, unwritten, probed) -> StateGuard:
        """The guard every step runs (`lipdp.state_guard`) over the variables the probe saw
        no pass write (`unwritten`; None: no probe ran, nothing guarded), but for the model's
        own bookkeeping, which the step writes; `probed`, the variables the model held at
        the probe's end, are all it may hold. A variable of a subclass' own (a running
        maximum in its ``call``) is guarded (an audit, 2026-12-07: only layers' variables
        were, and it kept a record's value)."""
        if unwritten is None:
            return StateGuard()
        bookkeeping = {v.ref() for v in self._ledger_counters() + (self._logit_clip,)}
        return StateGuard([v for v in unwritten if v.ref() not in bookkeeping], self, probed)

    def _check_user_layers_per_example(self):
        """A DP layer defined outside lipdp (the `DPLayer` extension point) is probed as
        classic DP-SGD probes every layer (`check_no_batch_coupling`): the bounds are
        per-example bounds, and the step sums the batch's losses before differentiating, so a
        layer mixing the examples of a batch, or writing the training data into its state,
        escapes them whatever its bound methods say. Its bound methods also speak of its own
        variables' use by its own call: a forward pass that reads a variable elsewhere (a
        layer holding another layer's kernel in a closure: tied weights) is refused
        (`lipdp.variable_reads`). lipdp's own layers are per-example and read only their own
        variables by construction (and tested so): not probed, no compile-time cost. A user
        layer's `project` runs once first, as lipdp's layers project at build.

        Returns ``(unwritten, probed)``: the variables that the probe saw no pass change,
        which every step must leave as it found them (`lipdp.state_guard`), and those the
        model held at the probe's end (a variable the traced read check below creates is not
        one of them); ``(None, None)`` without user layers (no probe)."""
        user_layers = [layer for layer in self._flatten_layers(include_self=False, recursive=True)
                       if isinstance(layer, DPLayer) and not defined_in_lipdp(type(layer))]
        for layer in user_layers:
            # lipdp's own layers project at build; a user layer's constraint held only after
            # the first step (a Frobenius-normalised kernel trained its first step at norm
            # 5.08 under bounds for norm 1: an audit). Its projection runs once here.
            layer.project(True)
        if user_layers:
            unwritten, probed = check_no_batch_coupling(self), list(self.variables)
            probe = _probe_batches(self)[0]
            reads = traced_reads_outside_owners(self, lambda: self(probe, training=True))
            if reads:
                raise ValueError(
                    "Variables are read outside their own layer's call in the forward pass "
                    f"({describe_reads(reads)}): the gradient of such a variable sums every "
                    "use, while its bound covers its own layer's (tied weights). Clipless "
                    "DP-SGD cannot bound it; classic DP-SGD (mode='clipped') takes exact "
                    "per-example gradients of such variables.")
            return unwritten, probed
        return None, None

    def _init_adaptive_clipping(self):
        clipping = self.dp_parameters.loss_gradient_clipping
        if clipping is None:
            return
        if float(self._logit_clip.numpy()) == 0.0:  # a fresh model; a trained one keeps its C_t
            self._logit_clip.assign(clipping.initial_clip if clipping.initial_clip is not None
                                    else self._loss_lipschitz)

    def compile_from_config(self, config):
        """Re-compile after `tf.keras.models.load_model` (loss, optimizer, metrics)."""
        config = tf.keras.saving.deserialize_keras_object(config)
        self.compile(**config)
        if getattr(self, "optimizer", None) is not None and self.built:
            self.optimizer.build(self.trainable_variables)

    def save(self, *args, **kwargs):
        """`tf.keras.Model.save`, with the metrics' state left out of the file (saved at its
        initial values, and put back in the model after): it holds totals computed on the
        training data outside the noisy gradient (`_metric_state_left_out`). The state
        saved is remembered as this model's own (`_keep_ledger`)."""
        self._handed_out_weights()
        with _metric_state_left_out(self):
            return super().save(*args, **kwargs)

    def save_own_variables(self, store):
        """Keras' hook writing the model's own variables (the ledger's) into a `.keras` file,
        after the copies are looked up (`_take_variables`): ``tf.keras.models.save_model``
        does not call `save`, and a model given another run's layers one by one, saved so
        right after, wrote 0 steps for 8 (an audit, 2026-12-06)."""
        self._take_variables()
        self._raise_draws_until(0)
        return super().save_own_variables(store)

    def save_weights(self, *args, **kwargs):
        """`tf.keras.Model.save_weights` (which `ModelCheckpoint` calls too), with the
        metrics' state left out as in `save`, and the state remembered as in `save`."""
        self._handed_out_weights()
        with _metric_state_left_out(self):
            return super().save_weights(*args, **kwargs)

    def _check_every_variable_bounded(self, layers):
        """Every trainable variable has exactly one bound: a user layer listing its kernel
        twice (the second time with a bound 10x smaller) trained under the last one, which
        every pass keeps (an audit, 2026-12-05)."""
        listed = [v for v, _ in backpropagate_bounds(layers, self._loss_lipschitz)]
        counts = collections.Counter(v.ref() for v in listed)
        twice = sorted({v.name for v in listed if counts[v.ref()] > 1})
        if twice:
            raise ValueError(f"Trainable variables {twice} have more than one gradient bound "
                             "(a layer's `backpropagate_params` lists them twice): give each "
                             "variable once, with the bound of all its uses.")
        missing = [v.name for v in self.trainable_variables if v.ref() not in counts]
        if missing:
            raise ValueError(f"No gradient bound for trainable variables {missing}: freeze them "
                             "or use DP layers that bound them.")

    # --------------------------------------------------------------- the step
    def sensitivities(self):
        """Sensitivity Delta_v of the averaged gradient of every trainable variable.

        ``Delta_v = bound(v) / D``: adding or removing one example changes the sum
        of per-example gradients by at most ``bound(v)``, and the sum is divided
        by the public denominator D. In clipless mode ``bound(v)`` is the
        analytic gradient bound at the current weights (`lipdp.bounds`); in
        clipped mode it is the clipping rule's (C for flat and global clipping,
        ``C_v`` per layer). Aligned with `trainable_variables`; float64 scalars in clipless
        mode (the bound pass's precision), float32 in clipped mode.
        """
        if self.dp_loss is None:
            raise RuntimeError("Compile the model first: the sensitivities depend on the loss "
                               "(clipless) or on the clipping rule (clipped).")
        if self.dp_parameters.mode is DPMode.CLIPPED:
            return self._clipped_dpsgd.variable_sensitivities()
        bounds = {v.ref(): b for v, b in backpropagate_bounds(dp_layers(self),
                                                              self.top_gradient_bound())}
        denominator = float(self._step_mechanism.batch_size)
        return [bounds[v.ref()] / denominator for v in self.trainable_variables]

    def top_gradient_bound(self):
        """Bound on each example's gradient of the loss w.r.t. the logits, where the bound
        pass starts: the loss constant L, or with `AdaptiveClipping` the bound of an
        example's logit gradient clipped at C_t in float32, about ``min(L, C_t)``
        (`lipdp.layers.gradient_clipping.clipped_norm_bound`; float64)."""
        if self.dp_parameters.loss_gradient_clipping is None:
            return self._loss_lipschitz
        return clipped_norm_bound(self._loss_lipschitz, self._logit_clip.read_value())

    def per_example_step_loss(self, y_true, y_pred):
        """The per-example losses the private step differentiates: the DP loss, behind the
        logit-gradient clipping of `AdaptiveClipping` (identity forward; backward, each
        example's logit gradient clipped to norm C_t) when the parameters have one."""
        if self.dp_parameters.loss_gradient_clipping is not None:
            clip = self._logit_clip.read_value()
            # C_t is a weight of the model (set_weights, a file): a value no update makes
            # stops the step, which depends on no record (an audit, 2026-12-07).
            usable = tf.debugging.Assert(
                tf.math.is_finite(clip) & (clip > 0),
                ["lipdp: the adaptive clip C_t (the model's weight loss_gradient_clip) is not a "
                 "positive finite number; was it set by set_weights or a file? C_t:", clip])
            with tf.control_dependencies([usable]):
                y_pred = clip_gradient_rows(y_pred, tf.identity(clip))
        return self.dp_loss.call(y_true, y_pred)

    def _update_logit_clip(self, y, y_pred):
        """The private count of `AdaptiveClipping` and the geometric update of C_t."""
        clipping = self.dp_parameters.loss_gradient_clipping
        clip = self._logit_clip.read_value()
        logits = tf.stop_gradient(y_pred)
        with tf.GradientTape() as tape:
            tape.watch(logits)
            loss = tf.reduce_sum(self.dp_loss.call(y, logits))
        norms = tf.norm(tf.reshape(tape.gradient(loss, logits), [tf.shape(logits)[0], -1]),
                        axis=1)
        below = tf.cast(norms <= clip, tf.float32)
        if self._step_views > 1:  # an example's bit: the mean of its views' (in [0, 1])
            below = tf.reduce_mean(tf.reshape(below, [-1, self._step_views]), axis=1)
        # Sum of bits - 1/2: sensitivity 1/2 under adding or removing one example. Under a
        # strategy: the replicas' sums are added, with the noise drawn once.
        local = tf.reduce_sum(below - 0.5)
        with drawing_at_step(self._dp_steps):
            count_stddev = round_up_to_float32(self._step_mechanism.quantile_noise_multiplier)
            noisy = _once_per_global_batch(lambda: local + gaussian_noise(
                [local], [count_stddev], salt=self._noise_salt())[0], lambda: local)
        context = tf.distribute.get_replica_context()
        if context is not None and context.num_replicas_in_sync > 1:
            noisy = context.all_reduce(tf.distribute.ReduceOp.SUM, noisy)
        fraction = noisy / float(self._step_mechanism.batch_size) + 0.5
        # In the log domain, kept within [2^-120, 2^120] (inside float32's normal range with
        # room for exp's rounding): the product in float32 went to 0 or inf for values that
        # fit (1e38 e^-100 = 3.7e-6 gave 0), where it stayed, and then to NaN (0 * inf),
        # which stopped a later step with a message about the layers (an audit).
        # Post-processing of the noisy count: no privacy cost.
        log_clip = tf.math.log(clip) - clipping.learning_rate * (
            fraction - clipping.target_quantile)
        self._logit_clip.assign(tf.exp(tf.clip_by_value(
            log_clip, -120.0 * math.log(2.0), 120.0 * math.log(2.0))))

    def _noise_salt(self) -> int:
        """The private step count when the step is traced: the salt of its noise draws'
        seeds in a seeded program (`lipdp.noise.salted_seeds`, which gives every salted draw
        of the process seeds of its own), so that a step traced again after a new `compile`
        (another ledger segment), or another model's step, does not draw the noise of an
        earlier trace."""
        with tf.init_scope():
            return int(self._dp_steps.numpy())

    def _noise_stddevs(self, sensitivities):
        """Standard deviation of each variable's noise: ``sigma`` times its sensitivity (per
        layer) or the global one, computed in float64 with the bound pass's slack after the
        last operation, then rounded *up* to float32 (`lipdp.layers.base`, "Precision")."""
        mechanism = self._step_mechanism
        if mechanism.mode is DPMode.CLIPPED:
            stddevs = [as_bound(self._clipped_dpsgd.noise_stddev) for _ in sensitivities]
        else:
            sigma = mechanism.noise_multiplier
            sensitivities = [as_bound(s) for s in sensitivities]
            if mechanism.noisify_strategy == NoiseStrategy.GLOBAL:
                global_sensitivity = tf.sqrt(tf.add_n([tf.square(s) for s in sensitivities]))
                stddevs = [sigma * global_sensitivity for _ in sensitivities]
            else:
                stddevs = [sigma * s for s in sensitivities]
        stddevs = [round_up_to_float32(with_pass_slack(s)) for s in stddevs]
        stacked = tf.stack(stddevs)
        # An infinite bound (or a std overflowing float32) would be noise that destroys every
        # weight: the step stops before the update instead. So does a std whose draws float32
        # cannot hold: above FLT_MAX / 8, std * z overflowed to inf in the released gradient
        # (|z| reaches 5.8); below 2^-64, TensorFlow flushes the subnormal products std * z
        # to zero (all of them below 1.2e-38, 9% at 1e-37: a step released without its noise,
        # an audit), here with probability under 2^-60 per coordinate. A zero std (a zero
        # bound: the gradient is zero) adds no noise and needs none.
        largest = float(np.finfo(np.float32).max) / 8.0
        check = tf.debugging.Assert(
            tf.reduce_all(tf.math.is_finite(stacked)),
            ["lipdp: a per-example gradient bound is infinite, or sigma times it overflows "
             "float32: no finite noise covers it, so the step stops. Noise stddevs:",
             stacked], summarize=len(stddevs))
        drawable = tf.debugging.Assert(
            tf.reduce_all((stacked == 0.0) | ((stacked >= 2.0 ** -64) & (stacked <= largest))),
            ["lipdp: a noise stddev (sigma times a sensitivity) lies outside [2^-64, FLT_MAX/8], "
             "where float32 draws of the noise flush to zero or overflow, so the step stops. "
             "Noise stddevs:", stacked], summarize=len(stddevs))
        with tf.control_dependencies([check, drawable]):
            return [tf.identity(s) for s in stddevs]

    def private_gradients(self, x, y):
        """Averaged gradient of the batch, its noisy version, and the sensitivities.

        The gradient is ``sum_i grad loss_i / D`` (clipless) or ``sum_i clip(grad
        loss_i) / D`` (clipped), D the public denominator (``/ (k D)`` over the
        flattened views when ``dataset_metadata.augmentation_multiplicity`` is k > 1:
        x then holds k consecutive views per example); the noise is Gaussian
        with std ``sigma`` times the sensitivity (global or per variable, see
        `DPParameters`). An empty batch (Poisson sampling) gives a zero gradient
        plus the same noise, without running the model on it.

        Under a `tf.distribute` strategy (replica context) the noise is added by the
        first replica only: the sum over replicas carries it once.

        Not a training step: nothing is applied and nothing is recorded in the
        privacy ledger. Noisy gradients released from here (applied by your own
        loop) are outside the epsilon lipdp reports; train with `fit`,
        `train_on_batch` or `train_step`, which record every step.

        Returns:
            ``(gradients, noisy_gradients, sensitivities, per_example_losses, y_pred)``,
            lists aligned with `trainable_variables`.

        Raises:
            InvalidArgumentError: (at run time) a non-finite gradient or noise standard
                deviation (an infinite bound). An example with a NaN or inf feature or
                label (`_clipless_sums`; in clipped mode, whose loss or gradient norm is
                not finite: `lipdp.clipping.engine.usable_examples`) contributes zero
                instead: no error depends on one record.
        """
        if self._step_mechanism is None:
            raise RuntimeError("Compile the model with a DP loss before training.")
        with drawing_at_step(self._dp_steps):  # the step's draws under XLA (lipdp.noise)
            gradients, per_example, y_pred = tf.cond(
                _batch_size(x) > 0, lambda: self._averaged_gradients(x, y),
                self._empty_batch_gradients)
            # A non-finite gradient (from a finite loss) would turn every weight into NaN:
            # the step fails instead, checked where the noise is added (one pass for both).
            messages = [f"Non-finite gradient of {v.name} in a private step"
                        for v in self.trainable_variables]
            sensitivities = self.sensitivities()
            noisy = _once_per_global_batch(
                lambda: add_gaussian_noise(gradients, self._noise_stddevs(sensitivities),
                                           non_finite_messages=messages,
                                           salt=self._noise_salt()),
                otherwise=lambda: [tf.debugging.check_numerics(g, m)
                                   for g, m in zip(gradients, messages)])
        return gradients, noisy, sensitivities, per_example, y_pred

    def _averaged_gradients(self, x, y):
        """``(gradients / D, per-example losses, y_pred)`` of a non-empty batch."""
        # Each example's gradient is the average of its k views' (k = 1 without augmentation
        # multiplicity): the sum over views is divided by k D.
        denominator = float(self._step_mechanism.batch_size * self._step_views)
        if self.dp_parameters.mode is DPMode.CLIPPED:
            batch = self._clipped_dpsgd.clipped_batch(self, x, y)
            return ([g / denominator for g in batch.gradient_sums], batch.losses, batch.y_pred)
        gradients, per_example, y_pred = self._clipless_sums(x, y)
        return [g / denominator for g in gradients], per_example, y_pred

    def _ids_into_range(self, x, y):
        """Classic DP-SGD: the ids a model input feeds to an Embedding, and the class indices
        of Keras' sparse cross-entropy, mapped into their ranges record by record
        (`lipdp.records.into_range`; the identity on valid records). `fit` refuses the
        records it sees holding others before the first step; a record it does not see (a
        Poisson pipeline's checking pass samples about 63% of them) stopped the step that
        sampled it, on TensorFlow's failing lookup, which tells when it was sampled."""
        limits, names = embedding_id_limits(self), list(self.input_names or [])
        inputs = aligned(x, names) if any(n is not None for n in limits) else None
        if inputs is not None:
            mapped = [t if n is None else into_range(t, n) for t, n in zip(inputs, limits)]
            x = realigned(x, mapped, names)
        classes = sparse_label_classes(self, self.dp_loss)
        if classes is not None and not isinstance(y, (dict, list, tuple)):
            y = into_range(y, classes)
        return x, y

    def _clipless_sums(self, x, y):
        """``(sum_i w_i grad loss_i, per-example losses, y_pred)``: ``w_i = 1`` for every
        example whose features and labels are finite, 0 for the others.

        The gradient of the *sum* is taken (divided by D by the caller): every cotangent in
        the backward pass is then one example's own (what `DP_ClipGradient` clips). An
        example with a NaN or inf feature or label (one that `fit`'s check did not see: a
        Poisson pipeline's checking pass samples about 63% of the records) is passed with
        its inputs and labels zeroed, and weighted 0: it contributes zero, an allowed
        contribution, as in clipped mode. The step used to stop at the step that sampled
        such a record, which tells when it was sampled. (Finite records give finite
        losses: the input clipping maps any finite input into its ball, and lipdp's losses
        map labels into their domain and cap what could overflow.) The losses and outputs
        returned are those of the zeroed batch.
        """
        finite = finite_rows((x, y))
        if finite is not None:
            x, y = tf.cond(tf.reduce_all(finite), lambda: (x, y),
                           lambda: (zero_rows(x, finite), zero_rows(y, finite)))
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            per_example = self.per_example_step_loss(y, y_pred)
        weights = None if finite is None else tf.cast(finite, per_example.dtype)
        gradients = tape.gradient(per_example, self.trainable_variables,
                                  output_gradients=weights,
                                  unconnected_gradients=tf.UnconnectedGradients.ZERO)
        return gradients, per_example, y_pred

    def _empty_batch_gradients(self):
        """What `_averaged_gradients` returns on an empty batch, without calling the model
        (some TensorFlow builds mis-shape convolutions of empty batches)."""
        gradients = [tf.zeros_like(v) for v in self.trainable_variables]
        outputs = getattr(self, "outputs", None)
        dtype = outputs[0].dtype if outputs else self.compute_dtype
        y_pred = tf.zeros([0] + [int(d) for d in self.output_shape[1:]], dtype)
        return gradients, tf.zeros([0], y_pred.dtype), y_pred

    def project(self, orthogonalise=True):
        """Apply every layer's projection (after each step; idempotent up to numerics).

        In clipped mode the model need not be a chain of DP layers: every layer that
        has a ``project`` method is projected.

        Args:
            orthogonalise: run the Björck iterations of spectrally constrained layers
                (a Python bool or a boolean tensor); without them their kernels are only
                spectrally normalised. The train step passes the ``bjorck_every``
                schedule of `compile`. Privacy never depends on it: bounds use the norms
                certified on whatever kernel the forward pass uses.
        """
        clipped = self.dp_parameters.mode is DPMode.CLIPPED
        if clipped:
            layers = [layer for layer in leaf_layers(self)
                      if callable(getattr(layer, "project", None))]
        else:
            layers = dp_layers(self)
        # Classic DP-SGD needs no certified norms (and may be compiled with XLA, which has no
        # host calls): its projections leave the certificates to the bound pass.
        with uncertified() if clipped else contextlib.nullcontext():
            for layer in layers:
                if isinstance(layer, DPLayer):
                    layer.project(orthogonalise)
                else:
                    layer.project()

    def _bjorck_due(self):
        """Whether this step's projection runs Björck: every step (``bjorck_every=1``),
        else the steps whose ledger count ``dp_steps_taken`` is a multiple of it."""
        if self._bjorck_every == 1:
            return True
        return tf.equal(self._dp_steps % self._bjorck_every, 0)

    def limits_host_blas(self) -> bool:
        """Whether `fit` and `train_on_batch` run this model's steps with numpy's BLAS on one
        thread (`make_train_function`): clipless, and every certificate's largest float64
        product on the host small (`lipdp.host_blas.limit_pays`)."""
        if self.dp_parameters.mode is not DPMode.CLIPLESS:
            return False
        return limit_pays(host_work(request)
                          for request in certified_norm_requests(dp_layers(self)))

    def make_train_function(self, force=False):
        """Keras' train function (`fit`, `train_on_batch`). In clipless mode, when every
        certificate's host products are small, each call of it runs with numpy's BLAS on one
        thread: the step's certificates run in numpy on one of TensorFlow's threads while
        TensorFlow's own hold the cores (`lipdp.host_blas`). The traced function itself is
        ``train_tf_function``, as Keras keeps it. A variable the model holds that the probe
        did not see fails here too, not only when the step is traced
        (`_refuse_unprobed_variables`)."""
        self._check_compiled()
        self._refuse_unprobed_variables("training")
        train_function = super().make_train_function(force)
        if getattr(train_function, "limits_blas_threads", False) or not self.limits_host_blas():
            return train_function
        self.train_function = with_limited_blas_threads(train_function)
        return self.train_function

    def _refuse_unprobed_variables(self, step):
        """`lipdp.state_guard.StateGuard.refuse_created` at each call of `fit`, `evaluate`,
        `predict` and their ``*_on_batch``: a variable set on a layer after the step was
        traced (one a layer wrote while it was held outside the model) reached the weights
        through the cached step (a review, 2026-12-07); so did a layer set on the model after
        compile (`refuse_untracked_layers`)."""
        guard = getattr(self, "_state_guard", None)
        if guard is not None:
            guard.refuse_created(step)
            if guard.model is not None:  # probed: so are the layers it holds
                refuse_untracked_layers(self)

    def make_test_function(self, force=False):
        self._refuse_unprobed_variables("evaluation")
        return super().make_test_function(force)

    def make_predict_function(self, force=False):
        self._refuse_unprobed_variables("prediction")
        return super().make_predict_function(force)

    def test_step(self, data):
        """Keras' evaluation step under the step's state guard (`lipdp.state_guard`): a layer
        writing what it evaluates into its state (in inference mode, which the compile-time
        probe does not run) is stopped, the values put back (an audit, 2026-12-07:
        ``evaluate`` on the training records left one in the weights)."""
        step = super().test_step
        return run_guarded(self, "evaluation", lambda: step(data))

    def predict_step(self, data):
        """Keras' prediction step under the state guard, as `test_step`."""
        step = super().predict_step
        return run_guarded(self, "prediction", lambda: step(data))

    def train_step(self, data):
        if in_xla_context():  # compile refuses jit_compile; Keras' setter or a user's jit not
            raise ValueError(_XLA_REFUSAL)
        self._check_compiled()
        self._open_segment()
        x, y, sample_weight = tf.keras.utils.unpack_x_y_sample_weight(data)
        if sample_weight is not None:
            raise ValueError("Sample weights are not supported by DP models: they rescale "
                             "per-example gradients beyond their bounds.")
        if y is None:
            raise ValueError("DP models need labels: the dataset must yield (x, y) pairs.")
        # The global batch: each replica's share is within the limits whatever the global
        # batch (two replicas ran batches of 2 D unchecked).
        expected, global_batch = self._step_mechanism.batch_size, _global_batch_size(x)
        if self._step_mechanism.sampling == Sampling.SHUFFLE:
            too_large = tf.debugging.assert_less_equal(
                global_batch, tf.constant(expected, tf.int64),
                message="A batch is larger than dataset_metadata.batch_size: the accountant's "
                        "sampling rate would under-state the privacy loss.")
        else:
            too_large = tf.debugging.assert_less_equal(
                global_batch, tf.constant(largest_poisson_batch(expected), tf.int64),
                message=f"A batch holds more examples than a Poisson sample of expected size "
                        f"{expected} (dataset_metadata.batch_size) holds with probability "
                        f"2^-{POISSON_TAIL_BITS}: the dataset is not Poisson-sampled at the "
                        "rate the accountant assumes, and the reported epsilon would "
                        "under-state the privacy loss. Train on lipdp.data.load_dataset(..., "
                        "sampling='poisson').")
        with tf.control_dependencies([too_large, self._ledger_guard()]):  # before anything
            x = tf.nest.map_structure(tf.identity, x)                    # uses the batch
            state = self._state_guard.read()
        batch = _batch_size(x)
        x, y = self._flatten_views(x, y)
        if self.dp_parameters.mode is DPMode.CLIPPED:
            x, y = self._ids_into_range(x, y)  # for the step and for the logged loss
        _, noisy, _, _, y_pred = self.private_gradients(x, y)
        noisy, y_pred = self._state_guard.checked(state, (noisy, y_pred))  # before any update
        if self.dp_parameters.loss_gradient_clipping is not None:
            with tf.control_dependencies(noisy):  # C_t served this step's bounds first
                self._update_logit_clip(y, y_pred)
        # After the noisy gradients: a call that finds the iterator exhausted (a dataset of
        # unknown length) no longer counts an update, so optimizer.iterations follows the
        # ledger step for step (`_check_updates_recorded`).
        with tf.control_dependencies(noisy):
            self.optimizer.apply_gradients(zip(noisy, self.trainable_variables))
        self.project(self._bjorck_due())
        # The ledger depends on the released gradients: in a compiled `fit` over a dataset of
        # unknown length, the call that finds the iterator exhausted must not count a step.
        with tf.control_dependencies(noisy):
            self._dp_steps.assign_add(1)
            self._examples_seen.assign_add(batch)
        # C_t of AdaptiveClipping is computed from noisy counts only: private to log.
        clip = ({} if self.dp_parameters.loss_gradient_clipping is None
                else {"logit_clip": self._logit_clip.read_value()})
        if self._private_logs_only:
            with tf.init_scope():  # compile fixes it; a new value retraces
                several = int(self._steps_per_execution.numpy()) > 1
            if several and not clip:
                # Keras' loop of several steps per execution needs an output to carry
                # (an empty dict failed to trace, an audit): the step count, public.
                return {"dp_steps_taken": self._dp_steps.read_value()}
            return clip
        self.compiled_loss(y, y_pred, regularization_losses=self.losses)
        self.compiled_metrics.update_state(y, y_pred)
        return {**self.get_metrics_result(), **clip}

    def _flatten_views(self, x, y):
        """``(B, k) + input_shape`` views of B examples -> ``(B k) + input_shape`` inputs
        (example b's views in rows b k ... b k + k - 1) and each label repeated k times.
        k is `DatasetMetadata.augmentation_multiplicity`, checked against the batch's
        static shape, so a pipeline and metadata that disagree fail at trace time."""
        views = self._step_views
        if views == 1:
            return x, y
        shape = tuple(self.dataset_metadata.input_shape)
        if not isinstance(x, tf.Tensor) or x.shape.rank != len(shape) + 2 or \
                x.shape[1] != views or not x.shape[2:].is_compatible_with(shape):
            raise ValueError(
                f"dataset_metadata.augmentation_multiplicity={views}: the training batches "
                f"must hold inputs of shape (batch, {views}) + {shape} (k views per example, "
                f"lipdp.data.load_dataset(..., augmentation_multiplicity={views})); received "
                f"{getattr(x, 'shape', type(x).__name__)}.")
        return tf.reshape(x, (-1,) + shape), tf.repeat(y, views, axis=0)

    # --------------------------------------------------------------------- fit
    def fit(self, x=None, y=None, batch_size=None, epochs=1, verbose="auto", callbacks=None,
            validation_split=0.0, validation_data=None, shuffle=True, class_weight=None,
            sample_weight=None, validate_data=True, **kwargs):
        """Keras `fit`, refusing what would silently break the privacy accounting.

        Refused: `validation_split` (it carves examples out of the declared
        training set), `class_weight` / `sample_weight` (they rescale per-example
        gradients), array inputs whose length or batch size disagree with the
        metadata, datasets whose number of batches per epoch (or repeated pass) disagrees
        with it, parameters changed since `compile`, and (with ``validate_data``) training
        records holding NaN or inf (`lipdp.records`), all before the first step;
        and, at the step that meets it, a batch larger than the metadata's batch size
        (shuffled batches) or than a Poisson sample of that expected size holds with
        probability 2^-40 (`largest_poisson_batch`). Inputs given as arrays are cut
        into shuffled fixed batches, not Poisson samples, and a dataset that is not
        `lipdp.data.load_dataset`'s Poisson pipeline cannot be checked to be one:
        with metadata declaring Poisson sampling, which the reported epsilon assumes,
        lipdp warns (`lipdp.data.ShuffleSamplingWarning`).

        **Not private:** the ``loss`` and metrics Keras logs for training (progress
        bar, ``History``) are computed on the training data outside the noisy
        gradient; epsilon does not cover them. Compile with
        ``private_logs_only=True`` to omit them. Callbacks that would act on them
        (EarlyStopping, ReduceLROnPlateau or a best-only ModelCheckpoint monitoring
        them, TerminateOnNaN) are refused before the first step. Validation metrics are computed
        on `validation_data`, which must be held out: validation data holding only training
        records (the training dataset or arrays, a slice of them, a `load_dataset` training
        pipeline) makes its ``val_`` metrics training metrics for that check, and is refused
        under ``private_logs_only``; arrays sharing only some examples with the training
        arrays warn, with the count.

        Args:
            validate_data: check every training record for NaN/inf, token ids for
                the vocabulary of the Embedding layers that model inputs feed, and
                class indices for a Keras sparse cross-entropy, before the first step
                (one pass over a dataset, at most one epoch of batches;
                `lipdp.records`). Without it, a bad record aborts training at the step
                that samples it, which reveals when it was sampled (in clipped mode, an
                example whose loss or norm is not finite contributes zero instead; an
                id or class index out of range still aborts). The same pass also counts,
                under shuffle sampling, the records of a pass whose size tf.data does not
                know (a ``filter``: other than ``nb_samples_train`` is refused before the
                first step; without the pass, at the epoch's end, after its steps ran at
                another rate than the accountant's) and byte-identical copies of a record
                (a warning; without the pass, not counted: copies raise the rate at which
                their record is drawn, an audit, 2026-12-07), in one pass of a repeat for a
                repeated dataset. A dataset without a repeat given a ``steps_per_epoch``
                other than its length, which Keras reads as one stream across epochs, is
                read for every epoch of the fit, each epoch's records counted apart (each
                must hold ``nb_samples_train``). Whatever it is, `fit` refuses a dataset
                whose repeat can put a record twice in one batch
                (`lipdp.data.repeat_inside_batches`).
            Other arguments: as for `tf.keras.Model.fit`.
        """
        self._check_compiled()
        warn_if_seeded()
        md = self.dataset_metadata
        if validation_split:
            raise ValueError(
                f"validation_split={validation_split!r} would train on fewer examples than the "
                f"declared nb_samples_train={md.nb_samples_train}, so the sampling rate used by "
                "the accountant would be wrong. Split the data before building the metadata and "
                "pass `validation_data` instead.")
        if class_weight is not None or sample_weight is not None:
            raise ValueError("class_weight / sample_weight are not supported by DP models: they "
                             "rescale per-example gradients beyond their bounds.")
        if isinstance(x, tf.data.Dataset) and isinstance(x.element_spec, tuple) and \
                len(x.element_spec) == 3:  # the step refused them when traced, the message
            # last in a traceback "in user code" (a usability audit, 2026-12-07)
            raise ValueError("The training dataset yields (inputs, labels, sample weights): "
                             "sample weights are not supported by DP models, they rescale "
                             "per-example gradients beyond their bounds. Map the dataset to "
                             "(inputs, labels) pairs.")
        _check_steps_per_epoch(kwargs.get("steps_per_epoch"), md)
        for name, value in (("epochs", epochs), ("initial_epoch", kwargs.get("initial_epoch", 0))):
            if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) \
                    or value < 0:  # 1.5 failed inside Keras' loop, -1 trained nothing silently
                # (a usability audit, 2026-12-07)
                raise ValueError(f"{name}={value!r}: give a whole number of epochs, 0 or more.")
        start_sampler = _StartSampler(
            pipeline_sampler(x) if isinstance(x, tf.data.Dataset) else None)
        self._check_workers_agree(x)
        labels = _label_spec(x, y)
        self._check_input_shape(x, "fit")
        self._check_label_shape(labels)
        self._retrace_for_label_rank(labels)
        if isinstance(x, tf.data.Dataset):
            self._check_dataset(x, kwargs.get("steps_per_epoch"))
            self._check_pipeline_sampler(x)
            if validate_data:
                self._validate_dataset(x, labels, kwargs.get("steps_per_epoch"),
                                       range(kwargs.get("initial_epoch", 0), epochs))
        elif x is not None:
            _refuse_batch_iterators(x)
            if shuffle is not True:
                raise ValueError(
                    f"fit(shuffle={shuffle!r}) on arrays: Keras would cut them into the same "
                    "batches every epoch ('batch' only reorders fixed chunks), so a record's "
                    "batch is known in advance, while the accountant's epsilon assumes random "
                    "batches (a proven one for lipdp.data.load_dataset's Poisson sampling). "
                    "Leave shuffle=True.")
            batch_size = self._check_arrays(x, y, batch_size)
            self._check_array_epochs(kwargs.get("steps_per_epoch"))
            if validate_data:
                check_finite_arrays(x, y, dtype=self.compute_dtype)
                self._warn_on_repeated_records(records_in_arrays(x, y), "The training arrays")
                self._warn_if_inputs_mostly_clipped(x)
                check_ids_in_range(x, embedding_id_limits(self), self.input_names)
                check_sparse_labels(x, y, sparse_label_classes(self, self.dp_loss))
                check_sparse_labels(x, y, class_index_classes(self, self.dp_loss, labels),
                                    dp_loss=True)
                check_label_domain(y, self.dp_loss, int(self.output_shape[-1]))
        # Last, so that they run after a BackupAndRestore restored the model.
        given = list(callbacks or [])
        accountants = [c for c in given if isinstance(c, DP_Accountant)]
        callbacks = [_MarkTrainedDraws(start_sampler), _RememberTrainedValues()] + \
            given + [_EpochSizeCheck(), _NoteLedger(accountants), start_sampler]
        self._build_optimizer()
        self._build_metrics(x, y)
        shared = _examples_shared(x, y, validation_data)
        on_training = _validates_on_training_data(x, y, validation_data, shared)
        _warn_if_shared(x, y, validation_data, "validation_data", "val_ metrics", shared)
        if on_training and self._private_logs_only:
            raise ValueError(
                "validation_data holds the training records (the training dataset or arrays, "
                "or a load_dataset training pipeline): its val_ metrics would be computed on "
                "them outside the noisy gradient, while compile(private_logs_only=True) "
                "promises logs that epsilon covers. Validate on held-out data (load_dataset's "
                "test pipeline).")
        _refuse_training_metric_feedback(self, callbacks, not self._private_logs_only,
                                         on_training, x, y)
        steps_before, finished = self._recorded_steps, False
        sampler = start_sampler.sampler
        seeds = (sampler.seed,) if sampler is not None else ()
        outer_accountants, outer_seeds = self._fit_accountants, self._fit_sampler_seeds
        if set(seeds) & set(outer_seeds):
            raise ValueError(
                "fit was called, on a lipdp.data.load_dataset Poisson pipeline, from inside "
                "another fit of this model on a pipeline of the same seed: the outer fit's "
                "pass already reserved the draws of the steps this fit would take, and both "
                "would train on them (replayed samples are not the independent subsampling "
                "the accountant assumes). Train from the outer fit itself, or on a pipeline "
                "of another (secret) seed.")
        self._set_fit_accountants(outer_accountants + tuple(accountants))
        self._set_fit_sampler_seeds(outer_seeds + seeds)
        start_sampler.checks_ended()
        try:
            history = super().fit(x, y, batch_size=batch_size, epochs=epochs, verbose=verbose,
                                  callbacks=callbacks, validation_data=validation_data,
                                  shuffle=shuffle, **kwargs)
            self._take_copied_values()  # a callback's copy at the end, before the refresh
            self._final_refresh()
            finished = True
            return history
        finally:
            self._set_fit_accountants(outer_accountants)
            self._set_fit_sampler_seeds(outer_seeds)
            # The variable back up (EarlyStopping sets weights), and past the draws of a step
            # that ended no batch (an exception, or data run out inside a multi-step call).
            self._raise_draws_until(start_sampler.draws_reserved() or 0)
            # The History holds the epochs' values; the state left is the last epoch's
            # training totals (without validation), which any saving path would write
            # (`tf.keras.models.save_model` does not call `save`).
            self.reset_metrics()
            # A fit stopped by an exception ends no epoch: its steps are noted here, so that
            # a checkpoint restored next (BackupAndRestore) does not roll them back.
            self._note_ledger()
            self._count_own_steps(steps_before)
            self._remember_trained_values(look_up=not finished)

    def _final_refresh(self):
        """With ``bjorck_every > 1``, the weights `fit` returns get a Björck projection, as if
        the last step had been a refresh: the steps between refreshes leave kernels only
        spectrally normalised by a power-iteration estimate, which on a near-orthogonal
        kernel (a flat spectrum) falls short of the norm (the main job ended at a certified
        Lipschitz constant of 1.016 without this). So do they with an optimizer keeping a
        moving average (``use_ema=True``): Keras ends `fit` by writing the average into the
        weights, and an average of projected kernels is not projected (an audit, 2026-12-07:
        `fit` returned kernels of spectral norm 20.6 and 16.7 from Adam's EMA, a Lipschitz
        bound of 534.5; the certified radii were small, not wrong). A function of the
        weights alone, so no privacy cost; the last epoch's validation metrics are those of
        the weights before it. Under a tf.distribute strategy the weights are left as the
        last step (or Keras' average) left them."""
        averaged = bool(getattr(self.optimizer, "use_ema", False))
        if ((self._bjorck_every == 1 and not averaged)
                or getattr(self, "_distribution_strategy", None) is not None):
            return
        self.project(True)

    def _check_workers_agree(self, x):
        """Under a multi-worker strategy, every worker must draw the same global batch and
        train on its share of it: only a `lipdp.data.load_dataset` pipeline with an explicit
        seed, sharded by tf.distribute (not ``AutoShardPolicy.OFF``), guarantees that."""
        resolver = getattr(self.distribute_strategy, "cluster_resolver", None)
        spec = resolver.cluster_spec() if resolver is not None else None
        if spec is None or sum(spec.num_tasks(job) for job in ("chief", "worker")
                               if job in spec.jobs) <= 1:
            return
        sampler = own_sampler(x)
        # Every worker's sampler, compared through a digest gathered from all workers before
        # any worker can refuse (a worker refusing alone would leave the others waiting in
        # the collective): workers seeded 3 and 4 trained on halves of two different draws,
        # one example in both in 5% of the steps (found by an audit).
        digests = self._workers_sampler_digests(sampler)
        if 0 in digests:
            raise ValueError(
                "Multi-worker training needs every worker to draw the same global batch (each "
                "example's inclusion decided once per step), so that tf.distribute gives each "
                "replica its share of it: train on lipdp.data.load_dataset(..., seed=S) with "
                "the same S on every worker. Other pipelines (arrays, your own datasets, a seed "
                "drawn per process) could put one example in two workers' batches and double "
                "its contribution to the step.")
        if len(set(digests)) > 1:
            raise ValueError(
                "The workers' lipdp.data.load_dataset pipelines differ (seed, training set "
                "size, batch size, sampling or the training examples themselves): each would "
                "draw its own global batch, or index other records, and an "
                "example could enter the step through two workers' shares. Give every worker "
                "the same pipeline and seed (a secret shared outside the code).")
        policy = x.options().experimental_distribute.auto_shard_policy
        if policy == tf.data.experimental.AutoShardPolicy.OFF:
            raise ValueError("AutoShardPolicy.OFF gives every worker the whole global batch: "
                             "each example would count once per worker.")

    def _workers_sampler_digests(self, sampler):
        """One 56-bit BLAKE2b digest of each worker replica's sampler (seed, N, D, sampling, the
        training data's digest; 0 for no sampler or a seed drawn per process), gathered across
        the cluster: the seed and the data themselves do not travel."""
        digest = 0
        if sampler is not None and sampler.explicit_seed:
            key = (sampler.seed, sampler.nb_samples, sampler.batch_size, sampler.sampling.value,
                   sampler.data_digest)
            digest = 1 + int.from_bytes(
                hashlib.blake2b(repr(key).encode(), digest_size=7).digest(), "big")
        strategy = self.distribute_strategy
        gathered = strategy.gather(strategy.run(lambda: tf.constant([digest], tf.int64)), axis=0)
        return [int(d) for d in gathered.numpy()]

    def _validate_dataset(self, dataset, labels, steps_per_epoch, epochs: range):
        """`fit`'s ``validate_data`` pass over a dataset (its docstring), for the `epochs`
        it trains. Copies are counted under shuffle sampling, in the same pass: for a
        repeated pipeline, in the pass its repeat goes through (an epoch's steps may take
        the end of one pass and the start of the next); for a dataset Keras reads as one
        stream (`_read_as_one_stream`), epoch by epoch over every epoch of the fit."""
        md = self.dataset_metadata
        batches = steps_per_epoch or md.steps_per_epoch
        shuffled = md.sampling == Sampling.SHUFFLE and \
            own_sampler(dataset) is None
        if _read_as_one_stream(dataset, steps_per_epoch):
            batches = steps_per_epoch * len(epochs)
            self._check_stream_epochs(check_finite_epochs(
                dataset, steps_per_epoch, len(epochs), dtype=self.compute_dtype,
                count_records=shuffled), epochs, steps_per_epoch)
        else:
            repeated = shuffled and holds_repeat(dataset)
            passes = batches_in_repeated_pass(dataset, md.nb_samples_train) if repeated \
                else None
            counted = check_finite_dataset(
                dataset, batches, dtype=self.compute_dtype,
                count_records=shuffled and (not repeated or passes == batches))
            self._warn_on_repeated_records(counted, (
                f"One pass of the repeated dataset ({batches} batches)" if repeated else
                f"One epoch of the dataset ({batches} batches)"), stacklevel=4)
            if passes is not None and passes != batches:
                self._warn_on_repeated_records(check_finite_dataset(
                    dataset, passes, dtype=self.compute_dtype, count_records=True),
                    f"One pass of the repeated dataset ({passes} batches)", stacklevel=4)
            if counted is not None and counted.complete:
                self._check_records_in_pass(counted.records)
        check_ids_in_range(dataset, embedding_id_limits(self), self.input_names, batches)
        check_sparse_labels(dataset, None, sparse_label_classes(self, self.dp_loss), batches)
        check_sparse_labels(dataset, None, class_index_classes(self, self.dp_loss, labels),
                            batches, dp_loss=True)

    def _check_stream_epochs(self, counts, epochs: range, steps_per_epoch: int):
        """The epochs of a dataset read as one stream (`lipdp.records.check_finite_epochs`'
        `counts`, None when not counted): each one must hold the declared records, also
        one the data runs out in (Keras trains its batches, then `_EpochSizeCheck` stopped
        the fit at its end: a review, 2026-12-07; Keras trains no epoch after it), and the
        first holding copies of a record warns. Such a stream's epochs were checked as its
        first: a second epoch of 32 records twice, or passes of 60 records cut into epochs of
        56 (a batch straddling two passes held a record twice in 23% of draws), trained
        silently (an audit, 2026-12-07)."""
        if counts is None:
            return
        source = (f"the dataset read as one stream ({steps_per_epoch} batches an epoch: "
                  "steps_per_epoch without a repeat)")
        for index, epoch in enumerate(epochs):
            if index == len(counts):  # the data ended with the epoch before
                raise ValueError(
                    f"Epoch {epoch + 1} of {source} holds no records: the data runs out "
                    f"after {index} of this fit's {len(epochs)} epochs (Keras would train an "
                    "empty epoch). Repeat the dataset (dataset.shuffle(nb_samples_train)"
                    ".batch(batch_size).repeat()) or train fewer epochs.")
            self._check_records_in_pass(counts[index].records, f"Epoch {epoch + 1} of {source}")
            if not counts[index].complete:
                break  # the data runs out in this epoch: Keras ends the fit with it
        for epoch, count in zip(epochs, counts):
            if count.distinct < count.records:
                self._warn_on_repeated_records(count, f"Epoch {epoch + 1} of {source}",
                                               stacklevel=5)
                return

    def _warn_if_inputs_mostly_clipped(self, x):
        """Warn when most training arrays' inputs have an L2 norm above twice the model's
        input bound: `DP_BoundedInput` shrinks each to the bound, silently, and inputs never
        scaled (pixels in 0-255 against a bound of 1) lose most of their signal (a usability
        audit, 2026-12-07). Said to the one who trains, as the other checks of the records."""
        bounded = [layer for layer in leaf_layers(self) if isinstance(layer, DP_BoundedInput)]
        found = input_norms_beyond(x, bounded[0].upper_bound) if bounded else None
        if found is not None and 2 * found[0] > found[1]:
            beyond, total, median = found
            warnings.warn(
                f"{beyond} of {total} training inputs have an L2 norm above twice "
                f"DP_BoundedInput's bound {bounded[0].upper_bound:g} (median norm "
                f"{median:.4g}): the model clips each to norm {bounded[0].upper_bound:g}, "
                "shrinking most of them. Scale the inputs (pixels in 0-255 to [0, 1]?), or "
                "raise the bound (the noise grows with it).", stacklevel=4)

    def _check_array_epochs(self, steps_per_epoch):
        """Shuffled batches of arrays: ``steps_per_epoch`` one pass over them, or none. Another
        count trained its steps and was refused at the epoch's end (`_EpochSizeCheck`: an
        epoch must see the declared examples), after steps that a check here would have
        spared (a usability audit, 2026-12-07)."""
        md = self.dataset_metadata
        passes = {md.steps_per_epoch, md.nb_samples_train // md.batch_size}
        if steps_per_epoch is not None and md.sampling == Sampling.SHUFFLE and \
                steps_per_epoch not in passes:
            raise ValueError(
                f"steps_per_epoch={steps_per_epoch} on arrays of nb_samples_train="
                f"{md.nb_samples_train} examples in batches of {md.batch_size}: one pass over "
                f"them is {md.steps_per_epoch} steps, and with shuffled batches the accountant "
                "counts every example once an epoch. Leave steps_per_epoch out (one pass an "
                "epoch), or give more epochs.")

    def _check_dataset(self, dataset, steps_per_epoch):
        md = self.dataset_metadata
        spec = tf.nest.flatten(dataset.element_spec)[0]
        static_batch = spec.shape[0] if spec.shape.rank else None
        if static_batch is not None and static_batch > md.batch_size:
            raise ValueError(f"The dataset yields batches of {static_batch} examples but "
                             f"dataset_metadata.batch_size={md.batch_size}.")
        cardinality = int(dataset.cardinality())
        allowed = {md.steps_per_epoch, md.nb_samples_train // md.batch_size}
        if cardinality >= 0 and steps_per_epoch is None and cardinality not in allowed:
            raise ValueError(
                f"The dataset yields {cardinality} batches per epoch, but the metadata "
                f"(nb_samples_train={md.nb_samples_train}, batch_size={md.batch_size}) implies "
                f"{md.steps_per_epoch}. Build the metadata from the data actually used "
                "(lipdp.data.load_dataset does).")
        sampler = own_sampler(dataset)
        if getattr(sampler, "sampling", None) is Sampling.SHUFFLE and \
                steps_per_epoch not in (None, cardinality):
            # Keras reads it as one stream (`_read_as_one_stream`): `_EpochSizeCheck` stopped
            # the fit after the first epoch's steps (a review, 2026-12-07).
            raise ValueError(
                f"steps_per_epoch={steps_per_epoch} for a load_dataset pipeline of shuffled "
                f"batches, which makes one pass of {cardinality} batches over the "
                f"{md.nb_samples_train} training records an epoch: each epoch must be one "
                "pass. Leave steps_per_epoch out.")
        cached = cached_sampler(dataset)
        if cached is not None:
            raise ValueError(
                f"fit received a lipdp.data.load_dataset pipeline ({cached.sampling.value} "
                "sampling) followed by a cache or snapshot, which stores its first pass and "
                "replays those batches every epoch: the accountant counts fresh batches each "
                "step. Remove the cache (load_dataset's pipelines hold their records in "
                "memory already).")
        self._check_repeated_pass(dataset, allowed)
        flaw = repeat_inside_batches(dataset, md.nb_samples_train)
        if flaw is not None:
            raise ValueError(
                f"The dataset {flaw}, while the sensitivity the noise is calibrated to counts "
                "each record once in a batch. Shuffle, batch, then repeat "
                "(dataset.shuffle(nb_samples_train).batch(batch_size).repeat()), or train on "
                "lipdp.data.load_dataset's pipeline.")

    def _check_repeated_pass(self, dataset, allowed_batches):
        """A repeated pipeline (``.repeat()``, trained with ``steps_per_epoch``) must go
        through the declared training set: one of 64 records repeated under metadata of 128
        ran silently, each record drawn twice as often as the accountant assumed (an epsilon
        of 5.50 reported for 3 epochs of a set half the declared size). Read from the
        pipeline (`lipdp.data.repeated_pass`). Under shuffle sampling, a pass whose record
        count is not known is read once and its records counted: a ``filter`` keeping half
        of 64 declared records, or 4 batches of 8 repeated where batches of 16 were declared,
        ran silently at twice the accountant's rate (audits: epsilon 1.67 reported for
        3.40, 7.39 for 13.16); the pass must hold N records (or ``floor(N / D) D``, the last
        partial batch dropped)."""
        if own_sampler(dataset) is not None:
            return
        md = self.dataset_metadata
        inputs = getattr(self, "inputs", None) or []
        counted = md.sampling == Sampling.SHUFFLE and len(inputs) == 1 and \
            inputs[0].shape.rank is not None
        repeated = repeated_pass(
            dataset, example_rank=inputs[0].shape.rank - 1 if counted else None,
            count_limit=md.nb_samples_train if counted else None)
        if repeated is None:
            return
        what, size = repeated
        allowed_records = {md.nb_samples_train, md.nb_samples_train // md.batch_size
                           * md.batch_size}
        if (what == "records" and size not in allowed_records) or \
                (what == "batches" and size not in allowed_batches):
            expected = (md.nb_samples_train if what == "records" else md.steps_per_epoch)
            shown = f"more than {md.nb_samples_train}" if size is None else size
            raise ValueError(
                f"The dataset repeats a pass of {shown} {what}, where the metadata "
                f"(nb_samples_train={md.nb_samples_train}, batch_size={md.batch_size}) "
                f"implies {expected}: each record would be drawn at another rate than the "
                "accountant's q = batch_size / nb_samples_train. Build the metadata from the "
                "data actually used (lipdp.data.load_dataset does).")

    def _retrace_for_label_rank(self, labels):
        """A new train function when the labels' rank differs from the last `fit`'s or
        `train_on_batch`'s: Keras would retrace its function for both ranks at once, with the
        labels' rank unknown, which the losses refuse (labels (N, 1) after (N,) stopped the
        second fit inside its step)."""
        rank = None if labels is None else labels.shape.rank
        if rank is None:
            return
        if self.__dict__.get("_fit_label_rank", rank) != rank:
            self.train_function = None
        object.__setattr__(self, "_fit_label_rank", rank)

    def _check_label_shape(self, labels):
        """Labels (`labels`, their `_label_spec`) that the DP loss cannot take (clipless mode)
        refused before training, with the loss's own message: it came as the last line of
        Keras' traceback when the step was traced, string labels as an UnimplementedError
        from a Cast (an audit). Probed as `_build_metrics` builds the metrics: on one
        example of zeros."""
        if labels is None or self.dp_parameters.mode is not DPMode.CLIPLESS \
                or not isinstance(self.dp_loss, DP_Loss):
            return
        dtype = labels.dtype
        if not (dtype.is_floating or dtype.is_integer or dtype.is_bool):
            raise ValueError(f"The training labels are of dtype {dtype.name}: a DP loss takes "
                             "numbers (one-hot rows, class indices or targets).")
        outputs = tf.TensorShape(self.output_shape)
        if not outputs[1:].is_fully_defined():
            return
        try:  # `call`: per-example values, without Keras' reduction (refused under tf.distribute)
            self.dp_loss.call(tf.zeros([1] + labels.shape[1:].as_list(), dtype),
                              tf.zeros([1] + outputs[1:].as_list(), self.compute_dtype))
        except ValueError as error:
            raise ValueError(f"The training labels (shape {labels.shape}) do not fit the "
                             f"model's outputs ({outputs}) under its DP loss: {error}") from None

    def _check_records_in_pass(self, records: int, source: str = "One pass over the dataset"):
        """Under shuffle sampling one pass over the dataset is an epoch, which must hold the
        declared N records (or ``floor(N / D) D``), as `_EpochSizeCheck` checks at each
        epoch's end. A pass whose size tf.data does not know (a ``filter``, a generator)
        was only caught there, after an epoch of steps at another rate than the
        accountant's (an audit: a filter keeping 200 of 400 declared records); its size,
        read before training (`check_finite_dataset`), is checked before the first step."""
        md = self.dataset_metadata
        if records not in (md.nb_samples_train, md.nb_samples_train // md.batch_size
                           * md.batch_size):
            raise ValueError(
                f"{source} holds {records} records, but dataset_metadata "
                f"declares nb_samples_train={md.nb_samples_train}: each record would be drawn "
                "at another rate than the accountant's q = batch_size / nb_samples_train. "
                "Build the metadata from the data actually used (lipdp.data.load_dataset "
                "does).")

    def _warn_on_repeated_records(self, counted, source: str, stacklevel: int = 3):
        """Each record enters one batch an epoch under shuffle sampling (and Keras' cut of
        arrays), which the accountant assumes: warn when one epoch holds some record more
        than once (``counted = (records, distinct)``: `lipdp.records.check_finite_dataset`,
        `records_in_arrays`). ``h.concatenate(h)`` of 32 records under metadata of 64, or the
        arrays concatenated with themselves, ran silently at twice the accountant's rate
        (audits: epsilon 1.67 reported for 3.40, 7.39 for 13.16). A warning, not a refusal:
        identical records of different people are each their own record. Copies that differ
        (augmented views) are not seen."""
        if counted is None or counted[1] == counted[0]:
            return
        records, distinct = counted[:2]
        warnings.warn(ShuffleSamplingWarning(
            f"{source} holds {records} records but only {distinct} distinct ones: the "
            "accountant counts each record once an epoch. If these are copies of one record "
            "(the data concatenated with itself, oversampled classes, a flat_map emitting "
            "copies, a repeat before the shuffle), it is drawn more often than q = "
            "batch_size / nb_samples_train and the reported epsilon under-states its privacy "
            "loss. Identical records of different people are each their own record: then "
            "nothing is wrong."), stacklevel=stacklevel)

    def _check_pipeline_sampler(self, dataset):
        """Refuse a `lipdp.data.load_dataset` pipeline (its ``lipdp_sampler`` attribute) that
        samples another training set size or batch size than the metadata declares; warn
        when another pipeline's graph shows batches that are not random
        (`lipdp.data.unshuffled_batching`), and when the metadata declares Poisson sampling,
        which the accountant assumes, and the dataset is not such a Poisson pipeline, which
        lipdp cannot check.

        A pipeline over N' < N examples passed the count of batches (ceil or floor of N / D)
        for N' down to about N - 2D: an audit's 201-example pipeline ran under metadata of
        456 at 0.995 against the declared 0.44, epsilon 3.05 reported for 5.5-6.0."""
        sampler = own_sampler(dataset)
        md = self.dataset_metadata
        sampled = (getattr(sampler, "nb_samples", None), getattr(sampler, "batch_size", None))
        if sampled != (None, None) and sampled != (md.nb_samples_train, md.batch_size):
            raise ValueError(
                f"fit received a load_dataset pipeline over {sampled[0]} training examples in "
                f"batches of {sampled[1]}, but dataset_metadata declares nb_samples_train="
                f"{md.nb_samples_train} and batch_size={md.batch_size}: the accountant's "
                f"sampling rate q = {md.batch_size}/{md.nb_samples_train} would not be the "
                "pipeline's. Build the model with the metadata load_dataset returned with it.")
        flaw = unshuffled_batching(dataset, md.nb_samples_train) if sampler is None else None
        if flaw is not None:
            warnings.warn(ShuffleSamplingWarning(
                f"fit received a tf.data.Dataset that {flaw}: a record's batch is not random, "
                "while the accountant's epsilon assumes random batches. Shuffle every record "
                "afresh each epoch before .batch() (dataset.shuffle(nb_samples_train)), or "
                "train on lipdp.data.load_dataset's pipeline."), stacklevel=3)
        elif sampler is None and md.sampling == Sampling.SHUFFLE and \
                batches_made_unseen(dataset):
            warnings.warn(ShuffleSamplingWarning(
                "fit received a tf.data.Dataset whose batches no batching step makes (a map, "
                "a generator or pre-batched tensors yield them): lipdp cannot see whether they "
                "are random batches, which the accountant's epsilon assumes (a map cutting the "
                "same rows every epoch trained silently: an audit). Batch shuffled records "
                "with .batch() (dataset.shuffle(nb_samples_train).batch(batch_size)), or "
                "train on lipdp.data.load_dataset's pipeline."), stacklevel=3)
        if md.sampling != Sampling.POISSON or \
                getattr(sampler, "sampling", None) is Sampling.POISSON:
            return
        warnings.warn(ShuffleSamplingWarning(
            "fit received a tf.data.Dataset that is not lipdp.data.load_dataset's Poisson "
            "pipeline, while dataset_metadata declares sampling='poisson', which the accountant "
            "assumes: the reported epsilon holds only if every batch holds each training "
            "example independently with probability q = batch_size / nb_samples_train. "
            "Shuffled fixed-size batches do not (declare sampling='shuffle' for them: the "
            "literature's heuristic epsilon). A tf.data transformation of that pipeline drops "
            "its sampler: give per-example transformations to load_dataset (`augmentation`, "
            "`feature_map`)."), stacklevel=3)

    def _check_arrays(self, x, y, batch_size):
        md = self.dataset_metadata
        arrays = tf.nest.flatten(x) + ([] if y is None else tf.nest.flatten(y))
        if not all(hasattr(a, "shape") and len(a.shape) for a in arrays):
            raise TypeError(
                "fit takes arrays or tensors with one row per training example (a NumPy array "
                "per model input, and one of labels); received "
                f"{sorted({type(a).__name__ for a in arrays})} (a nested list is taken as "
                "one input per entry: pass np.asarray(...)).")
        if len({len(a) for a in arrays}) != 1:  # numpy's error named neither (an audit)
            raise ValueError(
                "fit received inputs and labels of different lengths, "
                f"{[len(a) for a in arrays]}: they must hold one row per training example.")
        n = len(arrays[0])
        if n != md.nb_samples_train:
            raise ValueError(f"fit received {n} training examples but dataset_metadata declares "
                             f"nb_samples_train={md.nb_samples_train}.")
        if batch_size is not None and batch_size != md.batch_size:
            raise ValueError(f"batch_size={batch_size} disagrees with dataset_metadata.batch_size="
                             f"{md.batch_size}, the denominator the bounds are divided by.")
        if md.sampling == Sampling.POISSON:
            warnings.warn(ShuffleSamplingWarning(
                "fit received arrays: Keras cuts them into shuffled fixed-size batches, not Poisson "
                "samples, while the accountant assumes Poisson sampling. Use "
                "lipdp.data.load_dataset(..., sampling='poisson') for a proven epsilon."),
                stacklevel=3)
        return md.batch_size

    # ------------------------------------------------------------ serialization
    def _dp_config(self):
        metadata = self.dataset_metadata
        config = {"dp_parameters": self.dp_parameters.get_config(),
                  "dataset_metadata": None if metadata is None else metadata.get_config()}
        if getattr(self, "_compiled_state", None) is not None:
            # Keras' HDF5 and SavedModel files compile a loaded model from the loss,
            # optimizer and metrics alone: a model compiled with private_logs_only=True came
            # back logging training-set losses (an audit, 2026-12-07). Its config carries
            # lipdp's own compile arguments to its first compile (`_loaded_compile_settings`).
            config["compile_settings"] = {"private_logs_only": self._private_logs_only,
                                          "bjorck_every": self._bjorck_every}
        elif self.__dict__.get("_loaded_compile_settings"):  # loaded, not compiled yet: saved
            # or cloned again, it passes them on (a review: they were lost)
            config["compile_settings"] = dict(self.__dict__["_loaded_compile_settings"])
        return config

    @classmethod
    def _from_dp_config(cls, config, build):
        """The model of `config` (`get_config`'s), its DP arguments given to
        ``build(config_left, dp_parameters, metadata)``, its compile settings kept for its
        first `compile`, its weights noted as a saved model's (they are loaded next)."""
        config = dict(config)
        metadata = config.pop("dataset_metadata", None)
        settings = config.pop("compile_settings", None)
        model = build(config, DPParameters.from_config(config.pop("dp_parameters")),
                      None if metadata is None else DatasetMetadata.from_config(metadata))
        object.__setattr__(model, "_loaded_compile_settings", dict(settings or {}))
        note_loaded(model)
        return model


def _input_shape(x) -> Optional[tf.TensorShape]:
    """The shape of the inputs `fit`, `evaluate` or `predict` will see (``x`` a dataset of
    ``(inputs, labels)`` pairs or of inputs, or one array), batch axis included; None for
    several inputs or an unknown rank."""
    if isinstance(x, tf.data.Dataset):
        spec = x.element_spec
        spec = spec[0] if isinstance(spec, tuple) and spec else spec
        shape = spec.shape if isinstance(spec, tf.TensorSpec) else None
    else:
        flat = tf.nest.flatten(x)
        shape = tf.TensorShape(flat[0].shape) if len(flat) == 1 and \
            hasattr(flat[0], "shape") else None
    return shape if shape is not None and shape.rank is not None else None


def _label_spec(x, y):
    """The `tf.TensorSpec` of the training labels `fit` will see (``x`` a dataset of
    ``(inputs, labels)`` pairs, or ``y`` one array), with a known shape after the batch
    dimension; None otherwise."""
    if isinstance(x, tf.data.Dataset):
        element = x.element_spec
        spec = element[1] if isinstance(element, tuple) and len(element) > 1 else None
    elif isinstance(y, (np.ndarray, tf.Tensor)):
        dtype = tf.as_dtype(y.dtype)
        spec = tf.TensorSpec(y.shape, tf.keras.backend.floatx() if dtype.is_floating else dtype)
    else:
        return None
    if not isinstance(spec, tf.TensorSpec) or spec.shape.rank is None or spec.shape.rank < 1 \
            or not spec.shape[1:].is_fully_defined():
        return None
    return spec


def _configuration(model) -> dict:
    """``{what: (identity, configuration)}`` of what else fixes the traced step: every layer
    at any depth (``configuration``: `lipdp.layers.base.plain_configuration`, without
    `trainable`, which the trainable variables tell)."""
    def described(obj):
        return id(obj), plain_configuration(obj, leave_out=("trainable",))

    return {f"the configuration of layer '{layer.name}'": described(layer)
            for layer in model._flatten_layers(include_self=False, recursive=True)
            if not isinstance(layer, tf.keras.layers.InputLayer)}  # Sequential remakes it


def _changed_configuration(then: dict, now: dict) -> list:
    """What of `_configuration` differs, each with the configuration keys that changed."""
    changed = []
    for what in sorted(set(then) | set(now)):
        before, after = then.get(what), now.get(what)
        if before == after:
            continue
        detail = ""
        if before is None or after is None or before[0] != after[0]:
            detail = " (another object)"
        elif None not in (before[1], after[1]):
            detail = f" ({', '.join(changed_keys(before[1], after[1]))})"
        changed.append(what + detail)
    return changed


def _resumed_step(model, epoch: int) -> int:
    """The step of `epoch` a `fit` resumed from Keras' `BackupAndRestore` starts at (0 when
    it starts the epoch), as Keras' `fit` reads it from the backup's counters."""
    if getattr(model, "_training_state", None) is None:
        return 0
    steps = model.dataset_metadata.steps_per_epoch
    resumed_epoch, step = model._maybe_load_initial_counters_from_ckpt(steps, epoch)
    return int(step) if int(resumed_epoch) == epoch else 0


class _EpochSizeCheck(tf.keras.callbacks.Callback):
    """With shuffled fixed batches, an epoch must see exactly the declared examples.

    Fewer examples than declared with the same batch size means each example is
    sampled more often than the accountant assumes (epsilon under-reported).

    With Poisson sampling, the examples of the t steps of this `fit` are a Binomial(t N, q)
    count (mean t D): more than `largest_poisson_batch` (t D), which a Poisson pipeline exceeds
    with probability below 2^-40, means the data is drawn at a higher rate than the
    accountant's q = D / N (a pipeline of its own at another rate, larger fixed batches
    repeated, an augmentation that adds copies of examples). A count, not any record's
    value, decides: the check reveals nothing about an example.
    """

    def on_train_begin(self, logs=None):
        self._start_step = self.model.dp_steps_taken
        self._poisson_examples = 0
        self._resumed_at = None

    def on_epoch_begin(self, epoch, logs=None):
        self.model._examples_seen.assign(0)
        if self._resumed_at is None:  # the fit's first epoch
            self._resumed_at = _resumed_step(self.model, epoch)

    def on_epoch_end(self, epoch, logs=None):
        md = self.model.dataset_metadata
        if md.sampling == Sampling.POISSON:
            self._check_poisson_count(md)
            return
        if self.model.stop_training:
            return
        seen = int(self.model._examples_seen.numpy())
        full = md.nb_samples_train // md.batch_size * md.batch_size
        skipped, self._resumed_at = self._resumed_at, 0
        if skipped:
            # Resumed mid-epoch (BackupAndRestore with an integer save_freq): Keras runs the
            # epoch's remaining calls on the first batches of a new pass (an audit's resumed
            # epoch of 3 of 4 steps stopped here after its steps, 2026-12-06).
            full = (md.steps_per_epoch - skipped) * md.batch_size
        if seen not in (md.nb_samples_train, full):
            raise RuntimeError(
                f"Epoch {epoch + 1} trained on {seen} examples, but dataset_metadata declares "
                f"nb_samples_train={md.nb_samples_train}: the reported epsilon would be wrong.")

    def _check_poisson_count(self, md):
        self._poisson_examples += int(self.model._examples_seen.numpy())
        steps = self.model.dp_steps_taken - self._start_step
        limit = largest_poisson_batch(steps * md.batch_size)
        if self._poisson_examples > limit:
            raise RuntimeError(
                f"The {steps} steps of this fit trained on {self._poisson_examples} examples; "
                f"Poisson samples of expected size {md.batch_size} (dataset_metadata) hold "
                f"more than {limit} with probability below 2^-{POISSON_TAIL_BITS}: the data is "
                "drawn at a higher rate than the accountant assumes, and the reported epsilon "
                "under-states the privacy loss. Train on lipdp.data.load_dataset(..., "
                "sampling='poisson'), and give per-example augmentations to it "
                "(`augmentation`) rather than adding examples to its batches.")


class _MarkTrainedDraws(tf.keras.callbacks.Callback):
    """After every step (each call of the train function), the model's
    ``poisson_draws_until`` raised to where the draws of `start`'s sampler stand
    (`_StartSampler.draws_reserved`): every pass that gave a batch to the steps so far
    began, and reserved its draws, before the batch came. First of `fit`'s callbacks, so
    that the values remembered (`_RememberTrainedValues`) and any checkpoint saved after the
    step carry it. `_StartSampler` raises the mark only by the pass each epoch begins: a
    pipeline repeated within an epoch (``ds.repeat()`` with a larger ``steps_per_epoch``,
    ``ds.take(k).repeat()``) trained on draws of later passes above the saved mark, and a
    run continued in another process trained on 3 of them again (an audit, 2026-12-07).
    Also at each epoch's and training's end: steps of a multi-step call that ran out of
    data end no batch (a review replayed 3 draws; `fit` raises the mark once more when it
    returns or raises)."""

    def __init__(self, start: "_StartSampler"):
        super().__init__()
        self._supports_tf_logs = True  # the logs are not read: Keras need not convert them
        self.start = start

    def _raise(self):
        reserved = self.start.draws_reserved()
        if reserved is not None:  # also back up after a callback's restore lowered it
            self.model._raise_draws_until(reserved)

    def on_train_batch_end(self, batch, logs=None):
        self._raise()

    def on_epoch_end(self, epoch, logs=None):
        self._raise()

    def on_train_end(self, logs=None):
        self._raise()


class _RememberTrainedValues(tf.keras.callbacks.Callback):
    """First of `fit`'s callbacks after `_MarkTrainedDraws`, so that no other callback copies
    values in or out before (`_remember_trained_values`) or rolls the ledger back before its
    high-water mark is noted after each step and epoch (`_note_ledger`: noted only at
    epochs' ends, a callback restoring weights and ledger of the last epoch's start in its
    ``on_epoch_end``, the momentum left as it was, dropped 4 of 12 steps without a word: an
    audit, 2026-12-06; `_NoteLedger` puts such a ledger back): the values of each step
    remembered as the model's own right after it, those of an epoch's end kept for the
    process (a callback copying them into another model at the epoch's end and saving it
    there wrote a ledger of 0 steps: an audit, 2026-12-06). Not only beside callbacks that
    run the user's code: a training or validation pipeline (``tf.py_function``) or a
    compiled metric runs it too (an audit of a version that skipped both hooks without such
    callbacks: 4 steps reported for 12, and budgets overrun)."""

    def __init__(self):
        super().__init__()
        self._supports_tf_logs = True  # the logs are not read: Keras need not convert them

    def on_train_batch_end(self, batch, logs=None):
        self.model._note_ledger()
        self.model._remember_trained_values(transient=True, look_up=False)

    def on_epoch_end(self, epoch, logs=None):
        self.model._note_ledger()
        self.model._remember_trained_values()


class _NoteLedger(tf.keras.callbacks.Callback):
    """The ledger resumed before training (`_resume_ledger`: after any checkpoint was
    restored by a callback listed before), put back to its high-water mark before every
    step, after every epoch and at the end of training (`_keep_high_water`: a callback
    restored an older ledger mid-`fit`), its mark then noted; after every epoch and at the
    end, no update applied outside the ledger since training began
    (`_check_updates_recorded`); before every step, the values copied into the model
    looked up (`_take_copied_values`: a callback copying another
    run's layers at a step's end), then the `accountants`' budgets checked again: a
    callback listed after a `DP_Accountant` that set another run's weights before a step
    (its ledger composed with the model's) had that step run past the budget; and enforced
    (`DP_Accountant.check_next_call`: the call raises instead of running past it). At
    the end, after the other callbacks, the accountants log the steps their last epoch's
    epsilon missed (`DP_Accountant.after_training`)."""

    def __init__(self, accountants=()):
        super().__init__()
        self._supports_tf_logs = True  # the logs are not read: Keras need not convert them
        self._accountants = list(accountants)

    def on_train_begin(self, logs=None):
        self.model._resume_ledger()
        self._baseline = self.model._update_counts()

    def on_train_batch_begin(self, batch, logs=None):
        self.model._keep_high_water()
        self.model._take_copied_values()
        for accountant in self._accountants:
            accountant.on_train_batch_begin(batch, logs)  # plans again if the ledger changed
        # This fit's and those of the fits it runs in (a fit called from a callback of
        # another, without an accountant, ran 8 steps past the outer one's budget: an audit).
        for accountant in self.model._fit_accountants:
            accountant.check_next_call()

    def on_epoch_end(self, epoch, logs=None):
        self.model._keep_high_water()
        self.model._note_ledger()
        self.model._check_updates_recorded(self._baseline, f"By the end of epoch {epoch + 1}")

    def on_train_end(self, logs=None):
        self.model._keep_high_water()
        self.model._note_ledger()
        self.model._check_updates_recorded(self._baseline, "In this fit")
        for accountant in self._accountants:
            accountant.after_training()  # steps taken from the callbacks' on_train_end


class _StartSampler(tf.keras.callbacks.Callback):
    """A `lipdp.data.BatchSampler`'s next pass draws from the model's
    ``poisson_draws_until`` on (read after any checkpoint was restored), before
    every epoch's pass (listed last, after every callback's ``on_epoch_begin``, and so
    after any restore), and the model's mark is raised past the draws that pass reserves
    before any step of it, so that a checkpoint saved during the epoch holds them: a run
    resumed mid-epoch, in this process or another, draws on. A second model fitted on
    the pipeline draws on too: set back to that model's step, the sampler replayed the
    first one's batches exactly (an audit).

    Built when `fit` begins, before `fit` checks the data: the passes those checks read
    (``validate_data``) train nothing, and their draws are given back when training begins
    if nothing drew since (`checks_ended`)."""

    def __init__(self, sampler):
        super().__init__()
        self.sampler = sampler
        self._before_checks = self.draws_reserved()
        self._after_checks = None

    def draws_reserved(self) -> Optional[int]:
        """Where the sampler's draws stand (its counter; None without a sampler)."""
        return None if self.sampler is None else int(self.sampler.next_step.numpy())

    def checks_ended(self):
        """`fit`'s checks of the data are over: what they reserved is known."""
        self._after_checks = self.draws_reserved()

    def _start(self):
        self.sampler.start_at(self.model.poisson_draws_until)
        self.model._raise_draws_until(self.sampler.started_at + self.sampler.pass_steps)

    def on_train_begin(self, logs=None):
        if self.sampler is None:
            return
        if self._after_checks is not None and self.draws_reserved() == self._after_checks:
            self.sampler.next_step.assign(self._before_checks)
        self.model._samplers_seen.add(id(self.sampler))

    def on_epoch_begin(self, epoch, logs=None):
        if self.sampler is not None:
            self._start()


def _remember_loaded_values(looking_up):
    """Before a model looks its values up (`_take_copied_values`): the trainable values of
    every model loaded from a file since (`load_weights`, Keras' loading of a saved model)
    that holds steps and whose values no model of this process produced are remembered with
    its ledger (`lipdp.weight_copies`). A loaded model remembered them only when it handed
    them out, so variables read from it directly (``variable.assign``, a
    `tf.train.Checkpoint` of its layers) brought no ledger: a fresh model given a loaded
    run's 8 steps reported its own 4 for 12 (an audit, 2026-12-07). Values found under a
    model of this process are left to it (a second ledger for them, naming the loading
    model's own segment, counted the run twice). The model `looking_up` is not: Keras' loading
    of a saved model looks the model's values up before every layer's are loaded."""
    for model in loaded_models():
        if model is looking_up or not model._recorded_steps:  # (made from a config, its
            continue  # weights not loaded yet)
        forget_loaded(model)
        if not origins(model.trainable_variables, model._ledger_token):
            model._remember_trained_values(look_up=False)


@tf.keras.utils.register_keras_serializable("lipdp")
class DP_Sequential(_DPModelMixin, tf.keras.Sequential):
    """A `tf.keras.Sequential` of DP layers trained with Clipless DP-SGD.

    Args:
        layers: DP layers, the first being `lipdp.layers.DP_BoundedInput`.
        dp_parameters: `lipdp.DPParameters`.
        dataset_metadata: `lipdp.DatasetMetadata` of the training set.
    """

    def __init__(self, layers=None, dp_parameters=None, dataset_metadata=None, name=None, **kwargs):
        if layers:  # clear errors on malformed residual sections, before any shape error
            check_residual_sections([layer for layer in layers
                                     if not isinstance(layer, tf.keras.layers.InputLayer)])
        super().__init__(layers=layers, name=name, **kwargs)
        self._init_dp(dp_parameters, dataset_metadata)

    def get_config(self):
        return {**super().get_config(), **self._dp_config()}

    @classmethod
    def from_config(cls, config, custom_objects=None):
        def build(config, dp_parameters, metadata):
            layers = [tf.keras.layers.deserialize(layer, custom_objects=custom_objects)
                      for layer in config["layers"]]
            return cls(layers=layers, dp_parameters=dp_parameters, dataset_metadata=metadata,
                       name=config.get("name"))

        return cls._from_dp_config(config, build)


@tf.keras.utils.register_keras_serializable("lipdp")
class DP_Model(_DPModelMixin, tf.keras.Model):
    """A functional Keras model of DP layers trained with Clipless DP-SGD.

    Args:
        inputs, outputs: as for `tf.keras.Model`; the layers must form a chain
            starting with `lipdp.layers.DP_BoundedInput`.
        dp_parameters: `lipdp.DPParameters`.
        dataset_metadata: `lipdp.DatasetMetadata` of the training set.
    """

    def __init__(self, inputs, outputs, dp_parameters=None, dataset_metadata=None, name=None,
                 **kwargs):
        super().__init__(inputs=inputs, outputs=outputs, name=name, **kwargs)
        self._init_dp(dp_parameters, dataset_metadata)
        if self.dp_parameters.mode is not DPMode.CLIPPED:  # clipped mode allows any layer
            dp_layers(self)

    def get_config(self):
        # Keras only writes the graph for constructors identical to Functional's;
        # DP_Model adds its DP arguments, so the graph is written explicitly.
        from keras.src.engine.functional import get_network_config

        config = get_network_config(self, config={"name": self.name, "trainable": self.trainable})
        return {**config, **self._dp_config()}

    @classmethod
    def from_config(cls, config, custom_objects=None):
        def build(config, dp_parameters, metadata):
            functional = tf.keras.Model.from_config(config, custom_objects=custom_objects)
            return cls(functional.inputs, functional.outputs, dp_parameters=dp_parameters,
                       dataset_metadata=metadata, name=functional.name)

        return cls._from_dp_config(config, build)


# --------------------------------------------------------------------------- #
# The paper library's import path (lip-dp: `from lipdp.model import DP_Accountant,
# DP_Sequential, DPParameters`): the names live in lipdp.callbacks and lipdp.metadata
# (imported above) and are re-exported here unchanged. lipdp.callbacks does not import
# this module, so the import below is not circular.
# --------------------------------------------------------------------------- #
from lipdp.callbacks import DP_Accountant  # noqa: E402

__all__ = ["DP_Accountant", "DP_Model", "DP_Sequential", "DPParameters"]
