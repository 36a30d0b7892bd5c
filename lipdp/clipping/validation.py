"""What classic DP-SGD needs from a model and a loss, checked at compile time.

Per-example clipping is only meaningful when example i's loss depends on
example i alone: then the gradient of the *sum* of losses splits into
per-example gradients, each of which is clipped. Layers that mix the examples
of a batch break this (and the sensitivity argument with it), and so do losses
that mix them (labels broadcast against the predictions of other examples, a
normalisation by counts over the batch): `per_example_loss` evaluates the loss
of each example as a batch of one. Training-mode state written from the data
(moving statistics) is released with the model without noise: refused too.
"""

from __future__ import annotations

import contextlib
import sys
import types
from typing import Callable, Dict, Iterator, List

import numpy as np
import tensorflow as tf

# Layers whose training-mode output for one example depends on the other
# examples of the batch (batch statistics).
_BATCH_COUPLED = ("BatchNormalization", "SyncBatchNormalization", "BatchCentering")

# The probe of `check_no_batch_coupling`: its batch size, and the relative tolerance of its
# comparisons (float32 rounding of a deterministic forward pass is reproduced bitwise on CPU;
# the tolerance absorbs non-deterministic GPU reductions, far below any coupling it looks for).
_PROBE_BATCH = 4
_PROBE_RTOL = 1e-5


class BatchCouplingError(ValueError):
    """Raised when a model contains a layer that mixes the examples of a batch, or that writes
    training data into its non-trainable variables."""


def leaf_layers(model: tf.keras.Model) -> Iterator[tf.keras.layers.Layer]:
    """Every layer of `model`, nested models expanded, in `model.layers` order."""
    for layer in model.layers:
        if isinstance(layer, tf.keras.Model):
            yield from leaf_layers(layer)
        elif not isinstance(layer, tf.keras.layers.InputLayer):
            yield layer


def _all_layers(model: tf.keras.Model) -> List[tf.keras.layers.Layer]:
    """Every layer inside `model` (not itself), parents before their sub-layers: nested
    models, sub-layers of custom layers and of wrappers (TimeDistributed, Bidirectional)."""
    return [layer for layer in model._flatten_layers(include_self=False, recursive=True)
            if not isinstance(layer, tf.keras.layers.InputLayer)]


def check_no_batch_coupling(model: tf.keras.Model) -> List[tf.Variable]:
    """Refuse models whose output for one example depends on the other examples, or whose
    variables record the training data in a forward or backward pass.

    Two checks, both at compile time:

    * by type: every layer, at any depth (`_all_layers`), that normalises with batch
      statistics (BatchNormalization and its variants);
    * by behaviour (`_probe`): a few eager forward passes of a small random batch shaped
      like the model's input, all variables restored afterwards (no side effect).
      (i) A variable (trainable or not) whose value after a training-mode pass differs
      between two input batches, or with the first example made NaN or moved beyond every
      value as in (ii), is refused (state updated the same way for every input, such as
      power-iteration vectors, passes); so is one whose value after the backward pass of
      (iii) depends on the batch (a custom gradient recording its cotangents). A trainable
      variable assigned a running mean of the inputs, or a non-trainable one the largest
      cotangent, passed when only non-trainable state after forward passes was compared
      (an audit: a weight within 0.2 of one training record). (ii) Replacing example 0 of the batch,
      making it NaN, or moving it beyond every value of the batch (float inputs; with
      integer inputs only, such as token ids, its first float activations) must
      leave the outputs of the other examples unchanged, in training mode (in inference
      mode when two training passes of one batch differ: random layers); a pass that
      fails on the NaN or the large example is not judged. (iii) The same changes must
      leave the gradient reaching every layer's output for the other examples unchanged
      (of ``sum_i ||f(x_i)||^2 / 2``): a custom gradient mixing the rows of the batch in
      the backward pass, which no forward pass shows.

    Preprocessing layers adapted on data (`adapt`: a Normalization's mean and variance) are
    refused too. Coupling that the random probe does not trigger (data-dependent branches)
    is not seen.

    Returns:
        The variables that no pass of the probe changed (the model's own included: the
        caller leaves out its bookkeeping), for `lipdp.state_guard.StateGuard` to keep
        unchanged by every step (state written only after some calls, which the probe's
        passes from the compiled state do not reach). A variable created by a pass (after
        build) is refused.

    Raises:
        BatchCouplingError: naming the layer (and variable) found, and what to use instead.
    """
    refuse_untracked_layers(model)
    for layer in _all_layers(model):
        names = {cls.__name__ for cls in type(layer).__mro__}
        coupled = names.intersection(_BATCH_COUPLED)
        if coupled:
            raise BatchCouplingError(
                f"Layer '{layer.name}' ({type(layer).__name__}) normalises with batch statistics: "
                "its output for one example depends on the other examples of the batch, so "
                "per-example gradients (and their clipping) are undefined and the sensitivity "
                "bound fails; its moving statistics are written from the training data and "
                "released without noise (engine='vectorized' does not change that). Remove it, "
                "or use a per-example normalisation such as LayerNormalization or "
                "GroupNormalization."
            )
        if getattr(layer, "is_adapted", False):
            raise BatchCouplingError(
                f"Layer '{layer.name}' ({type(layer).__name__}) was adapted on data "
                "(`adapt`): its statistics were computed without noise and are released with "
                "the model, outside the privacy guarantee (an audit told two datasets "
                "differing in one record apart from the saved means). Give it public "
                "statistics instead (e.g. Normalization(mean=..., variance=...)).")
    return _probe(model)


def refuse_untracked_layers(model: tf.keras.Model) -> None:
    """Raise `BatchCouplingError` for a layer, or a `tf.Module` with variables the model does
    not list, held in an attribute of the model or of a model inside it (directly, or in a
    list, tuple, set, dict or ``SimpleNamespace``) that Keras does not list among the
    model's layers: a Sequential or functional model (a subclass of `DP_Sequential` setting
    ``self.extra = Layer()`` in its ``__init__`` and calling it in its ``call``) does not
    track the layers set on it. Such a layer's variables are not in ``model.variables``:
    neither trained nor seen by the probe and the step's guard (a review, 2026-12-07: a
    running maximum in one kept a record's value through `fit`). Run at compile
    (`check_no_batch_coupling`) and at every call of `fit`, `evaluate` and `predict` of a
    probed model (a layer set after compile)."""
    layers = list(model._flatten_layers(include_self=True, recursive=True))
    tracked = {id(layer) for layer in layers}
    listed = {v.ref() for v in model.variables}
    optimizer = getattr(model, "optimizer", None)
    # Other layers track what they hold (a Bidirectional's template `layer`, untracked on
    # purpose, is not called).
    for holder in (layer for layer in layers if isinstance(layer, tf.keras.Model)):
        # Public attributes first: Keras' checkpoint bookkeeping holds the same layer too.
        for attribute, value in sorted(vars(holder).items(), key=lambda a: a[0].startswith("_")):
            for module in _modules_held(value):
                if isinstance(module, tf.keras.layers.Layer):
                    untracked = id(module) not in tracked and not isinstance(
                        module, tf.keras.layers.InputLayer)
                else:
                    untracked = module is not optimizer and any(
                        v.ref() not in listed for v in module.variables)
                if untracked:
                    raise BatchCouplingError(
                        f"'{module.name}' ({type(module).__name__}), held in attribute "
                        f"'{attribute}' of '{holder.name}', is not one of the model's layers: "
                        "Keras does not track the layers set on a Sequential or functional "
                        "model, so its variables are neither trained nor checked for state "
                        "written from the training data. Make it one of the model's layers "
                        "(in the list given to DP_Sequential, or in the graph of a DP_Model).")


def _modules_held(value, depth=0) -> Iterator[tf.Module]:
    """The `tf.Module`s (Keras layers among them) `value` is or holds in lists, tuples, sets,
    dicts and ``SimpleNamespace``s (a few levels)."""
    if isinstance(value, tf.Module):
        yield value
        return
    if depth >= 4:
        return
    if isinstance(value, types.SimpleNamespace):
        value = vars(value)
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple, set, frozenset)):
        for item in value:
            yield from _modules_held(item, depth + 1)


def check_per_example_gradients_run(model: tf.keras.Model) -> None:
    """Refuse layers whose per-example gradients TensorFlow cannot take: a convolution with
    ``groups`` > 1, whose gradient under `tf.vectorized_map` (every engine's exact
    per-example gradients; the ghost rules leave grouped convolutions to them) fails in
    TensorFlow 2.15 ("filter_size does not have enough elements"). Such a model compiled,
    and every step then failed (a review, 2026-12-07).

    Raises:
        ValueError: naming the layer.
    """
    for layer in _all_layers(model):
        if getattr(layer, "groups", 1) != 1 and hasattr(layer, "kernel_size"):
            raise ValueError(
                f"Layer '{layer.name}' ({type(layer).__name__}) is a grouped convolution "
                f"(groups={layer.groups}): classic DP-SGD takes its per-example gradients with "
                "tf.vectorized_map, which fails on it in TensorFlow 2.15 at every step. Use "
                "groups=1, or one convolution per group concatenated.")


def _probe_batches(model: tf.keras.Model):
    """Two independent random batches ``(a, b)`` shaped like the model's inputs (or, without
    them, its build input shape, float32): float inputs standard normal, integer inputs
    (token ids) 0 or 1, a size unknown other than the batch's 8."""
    specs = getattr(model, "inputs", None)
    if specs is not None and len(specs) == 1:
        specs = specs[0]
    if specs is None:
        shape = getattr(model, "_build_input_shape", None)
        if shape is None:
            raise BatchCouplingError(
                f"Model '{model.name}' has no known input shape: the batch-coupling check of "
                "classic DP-SGD needs one. Give it an Input or build it before compile.")
        specs = tf.nest.map_structure(lambda s: tf.TensorSpec(s, tf.float32), shape,
                                      check_types=False)
    rng = np.random.default_rng(0)

    def draw(spec):
        shape = [_PROBE_BATCH] + [8 if d is None else int(d) for d in spec.shape[1:]]
        dtype = tf.as_dtype(spec.dtype)
        if dtype.is_integer or dtype.is_bool:
            return tf.constant(rng.integers(0, 2, shape), dtype)
        return tf.constant(rng.normal(size=shape), dtype)

    return (tf.nest.map_structure(draw, specs), tf.nest.map_structure(draw, specs))


def _differs(a: np.ndarray, b: np.ndarray) -> bool:
    """Beyond `_PROBE_RTOL` times the larger finite magnitude of the two (exact for
    non-floats); an entry finite in one and not in the other (NaN, inf) differs."""
    if a.shape != b.shape:
        return True
    if not np.issubdtype(a.dtype, np.floating):
        return not np.array_equal(a, b)
    finite = np.isfinite(a)
    if np.any(finite != np.isfinite(b)):
        return True
    a, b = a[finite].astype(np.float64), b[finite].astype(np.float64)
    scale = max(float(np.max(np.abs(a), initial=0.0)), float(np.max(np.abs(b), initial=0.0)))
    return bool(np.any(np.abs(a - b) > _PROBE_RTOL * scale))


#: What the marked probes of `_probe` do to the first example of a float tensor.
_MARKS = (("making one example NaN", lambda t: float("nan")),
          ("moving one example beyond every value",  # 1000 times the largest magnitude + 1000
           lambda t: 1e3 * (1.0 + tf.reduce_max(tf.abs(t)))))


def _marked_first_row(t, mark):
    first = tf.fill(tf.shape(t[:1]), tf.cast(mark(t), t.dtype))
    return tf.concat([first, t[1:]], 0)


def _marked_batches(batch):
    """``[(what was done, batch)]``: `batch` with its first example changed in each float
    input by each of `_MARKS`; empty without a float input."""
    flat = tf.nest.flatten(batch)
    floats = [tf.as_dtype(t.dtype).is_floating for t in flat]
    if not any(floats):
        return []
    return [(what, tf.nest.pack_sequence_as(batch, [
        _marked_first_row(t, mark) if is_float else t for t, is_float in zip(flat, floats)]))
        for what, mark in _MARKS]


@contextlib.contextmanager
def _first_float_output_marked(layers, mark):
    """Within this context the first layer call to return a float tensor of the probe's
    batch (eagerly: an Embedding's vectors, say) returns it with its first row changed by
    `mark` (one of `_MARKS`): the marked probes of a model whose inputs are integers."""
    marked = []

    def wrap(layer, original):
        def wrapper(*args, **kwargs):
            outputs = original(*args, **kwargs)
            if not marked and tf.executing_eagerly() and tf.is_tensor(outputs) and \
                    outputs.dtype.is_floating and outputs.shape.rank and \
                    outputs.shape[0] == _PROBE_BATCH:
                marked.append(layer)
                outputs = _marked_first_row(outputs, mark)
            return outputs
        return wrapper

    with wrapped_calls(layers, wrap):
        yield


@contextlib.contextmanager
def wrapped_calls(layers, wrap):
    """Within this context each layer's ``call`` is ``wrap(layer, call)`` (set on the
    instance, so Keras' ``__call__`` runs it); on exit the layer's own ``call`` is back, an
    instance attribute if it had one, else the class' method."""
    saved = []
    for layer in layers:
        original, instance = layer.call, "call" in layer.__dict__
        object.__setattr__(layer, "call", wrap(layer, original))
        saved.append((layer, instance, original))
    try:
        yield
    finally:
        for layer, instance, original in saved:
            if instance:
                object.__setattr__(layer, "call", original)
            else:
                object.__delattr__(layer, "call")


@contextlib.contextmanager
def _recorded_outputs(layers, held=()):
    """Wrap each layer's ``call`` to append ``(layer, outputs)`` to the yielded list when an
    eager call returns (sub-layers before the layer containing them); restored on exit. The
    layers of `held` run in inference mode (``training=False``): their random draws held."""
    records = []
    held = {id(layer) for layer in held}

    def wrap(layer, original):
        def wrapper(*args, **kwargs):
            if id(layer) in held and "training" in kwargs:
                kwargs["training"] = False
            outputs = original(*args, **kwargs)
            if tf.executing_eagerly():  # not inside a call its layer traces
                records.append((layer, outputs))
            return outputs
        return wrapper

    with wrapped_calls(layers, wrap):
        yield records


def _training_mode_without_draws(model, batch, forward):
    """``(training, held)`` for the row comparison of `_probe`: training mode with the random
    layers `held` in inference mode, found one at a time (the first layer whose outputs differ
    between two training passes of `batch`); ``(False, ())`` when that does not make the passes
    agree (a layer drawing whatever its mode).

    Comparing the rows of a random model in inference mode (the first version) skipped
    coupling that only runs in training: a batch-mean layer behind a GaussianNoise passed,
    2.5x the sensitivity through the ghost engine (found by an audit)."""
    layers = _all_layers(model)
    held = []
    for _ in range(len(layers) + 1):
        with _recorded_outputs(layers, held) as first:
            outputs, _ = forward(batch, True)
        with _recorded_outputs(layers, held) as second:
            again, _ = forward(batch, True)
        if not any(_differs(o, p) for o, p in zip(outputs, again)):
            return True, held
        random = next((layer for (layer, x), (_, y) in zip(first, second)
                       if layer not in held and any(
                           _differs(np.array(o), np.array(p))
                           for o, p in zip(tf.nest.flatten(x), tf.nest.flatten(y)))), None)
        if random is None:
            break
        held.append(random)
    return False, ()


def _probe(model: tf.keras.Model) -> List[tf.Variable]:
    """The behavioural half of `check_no_batch_coupling` (its docstring, and its return)."""
    a, b = _probe_batches(model)
    layers = _all_layers(model)
    built = {id(layer) for layer in layers if layer.built}
    existing = _unique_variables(model)
    if len(built) < len(layers):
        # Layers a subclass' call builds (their variables, created during the passes below,
        # went uncompared and unguarded): built by one pass first, its writes undone.
        with _restored(existing):
            model(a, training=True)
    # Every variable is compared, trainable ones too: a layer may assign its weights from
    # the batch.
    variables = _unique_variables(model)
    existed = {v.ref() for v in existing}
    _refuse_created_variables(model, [v for v in variables if v.ref() not in existed], built)
    owner = variable_owners(model)
    initial = [v.numpy() for v in variables]
    moved = set()

    def noted(values):
        """`values` (the variables' after a pass), noting which differ from `initial`."""
        moved.update(i for i, (first, now) in enumerate(zip(initial, values))
                     if not _same(first, now))
        return values

    def forward(inputs, training):
        """Outputs (flattened, numpy) and the variables' values after one pass; every
        variable is restored afterwards."""
        with _restored(variables):
            outputs = [np.array(t) for t in tf.nest.flatten(model(inputs, training=training))]
            return outputs, noted([v.numpy() for v in variables])

    outputs_a, state_a = forward(a, True)
    # The marked probes: the first example made NaN, and beyond every value. Integer inputs
    # (token ids) cannot be marked: their first float activations are (`mark`).
    marked = [(what, batch, None) for what, batch in _marked_batches(a)] or [
        (f"{what} (in its first float activations)", a, mark) for what, mark in _MARKS]

    def marking(mark):
        return (_first_float_output_marked(_all_layers(model), mark) if mark is not None
                else contextlib.nullcontext())

    states = [forward(b, True)[1]]
    if variables:  # also a state written only from unusual records (NaN seen, a largest value)
        for _, changed, mark in marked:
            try:
                with marking(mark):
                    states.append(forward(changed, True)[1])
            except Exception:  # pylint: disable=broad-except  (a layer refusing NaN)
                continue
    for v, value_a, *values in zip(variables, state_a, *states):
        if any(_differs(value_a, value) for value in values):
            raise BatchCouplingError(
                f"The variable '{v.name}' of {_holder(owner, v)} takes a value that depends "
                "on the input data in a training-mode forward pass (moving statistics, a "
                "running average of the inputs): the training data is written into it "
                "without noise and released with the model, outside the privacy guarantee. "
                "engine='vectorized' does not help (it runs the same update). Remove that "
                "state, or compute the statistic per example (LayerNormalization, "
                "GroupNormalization instead of BatchNormalization).")
    training, held = _training_mode_without_draws(model, a, forward)
    replaced = tf.nest.map_structure(lambda t, u: tf.concat([u[:1], t[1:]], 0), a, b)
    with _recorded_outputs(_all_layers(model), held) as records_a:
        outputs_a, _ = forward(a, training)
    # Replacing an example moves means and deviations; a NaN example reaches every reduction
    # over the batch that propagates NaN (a maximum, a median), and an example beyond every
    # value the extremes that ignore NaN: the replacement alone let a division by the
    # batch's largest magnitude through in 20 of 20 random models (rarely the replaced one).
    probes = [("replacing one example", replaced, None)] + marked
    for probe, changed, mark in probes:
        with marking(mark), _recorded_outputs(_all_layers(model), held) as records_p:
            try:
                outputs_p, _ = forward(changed, training)
            except Exception:  # pylint: disable=broad-except  (a layer refusing NaN)
                if changed is replaced:
                    raise
                continue
        if any(_differs(o[1:], p[1:]) for o, p in zip(outputs_a, outputs_p)):
            _refuse_coupling(probe, training, records_a, records_p)
    # The backward pass: with the forward rows of the other examples unchanged, the gradient
    # reaching each layer's output for them must be too (a custom gradient may mix the rows).
    backward_a, state_a = _output_cotangents(model, a, training, held, variables)
    noted(state_a)
    for probe, changed, mark in probes:
        try:
            with marking(mark):
                backward_p, state_p = _output_cotangents(model, changed, training, held,
                                                         variables)
        except Exception:  # pylint: disable=broad-except  (a layer refusing NaN)
            continue
        _refuse_backward_coupling(probe, training, backward_a, backward_p)
        _refuse_backward_state(probe, variables, state_a, noted(state_p), owner)
    known = {v.ref() for v in variables}
    _refuse_created_variables(model, [v for v in model.variables if v.ref() not in known])
    return [v for i, v in enumerate(variables) if i not in moved]


def defined_in_lipdp(cls) -> bool:
    """Whether the class `cls` is one of lipdp's own: found under its name in a lipdp module
    (a class whose ``__module__`` merely says ``lipdp.``, as a user's may, is not)."""
    module = sys.modules.get(getattr(cls, "__module__", ""))
    if module is None or not module.__name__.startswith("lipdp."):
        return False
    found = module
    for part in cls.__qualname__.split("."):
        found = getattr(found, part, None)
    return found is cls


def _unique_variables(model) -> List[tf.Variable]:
    return list({v.ref(): v for v in model.variables}.values())


def variable_owners(model) -> Dict[object, tf.keras.layers.Layer]:
    """``variable.ref() -> layer``: the deepest layer holding each variable (parents come
    first in `_all_layers`)."""
    return {v.ref(): layer for layer in _all_layers(model) for v in layer.weights}


def _refuse_created_variables(model, created, built_before=None):
    """Raise `BatchCouplingError` for a variable of `created` (variables a forward pass
    created), but for those of layers a pass built (not in `built_before`, ids of the
    layers built before it; all counted when None): a layer adding a weight in its call,
    after build, kept the largest training input in it, unjudged by the probe and the
    step's guard (an audit, 2026-12-07)."""
    owner = variable_owners(model)
    created = [v for v in created if built_before is None or v.ref() not in owner
               or id(owner[v.ref()]) in built_before]
    if created:
        raise BatchCouplingError(
            f"The variable '{created[0].name}' of {_holder(owner, created[0])} was created by "
            "a forward pass, after the model was built: what a pass writes into state "
            "created so cannot be checked (the probe and every step compare the variables "
            "that exist at compile), and it may be the training data, released with the "
            "model without noise. Create the variable in the layer's build().")


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal in shape and every entry (NaN equal to NaN)."""
    return a.shape == b.shape and np.array_equal(
        a, b, equal_nan=bool(np.issubdtype(a.dtype, np.inexact)))


def _refuse_backward_state(probe, variables, state_a, state_p, owner):
    """Raise `BatchCouplingError` when a variable's value after the probe's backward pass
    differs from its value after the first batch's: the backward pass writes the data."""
    for v, value_a, value_p in zip(variables, state_a, state_p):
        if _differs(value_a, value_p):
            raise BatchCouplingError(
                f"The variable '{v.name}' of {_holder(owner, v)} takes a value that depends on "
                f"the input data in a training-mode backward pass ({probe}): a custom gradient "
                "records its cotangents (a running maximum, a norm) into it, writing the "
                "training data into the model without noise, outside the privacy guarantee. "
                "Remove that state.")


def _holder(owner, variable) -> str:
    """``layer 'name' (Class)`` of the layer `owner` (``variable.ref() -> layer``) names for
    `variable`, or ``the model``."""
    layer = owner.get(variable.ref())
    return f"layer '{layer.name}' ({type(layer).__name__})" if layer else "the model"


def _output_cotangents(model, batch, training, held, variables):
    """``([(layer, cotangent)], values)``: the gradient of ``sum_i ||f(x_i)||^2 / 2`` (row i
    depends on example i alone) with respect to every float output of every layer call of
    one eager forward pass, in call order, and the values of `variables` after that
    backward pass; every variable is restored afterwards."""
    with _restored(variables):
        with _recorded_outputs(_all_layers(model), held) as records, tf.GradientTape() as tape:
            for t in tf.nest.flatten(batch):
                if t.dtype.is_floating:
                    tape.watch(t)
            outputs = [t for t in tf.nest.flatten(model(batch, training=training))
                       if t.dtype.is_floating]
            total = tf.add_n([0.5 * tf.reduce_sum(tf.square(tf.cast(t, tf.float32)))
                              for t in outputs])
        targets = [(layer, t) for layer, out in records for t in tf.nest.flatten(out)
                   if tf.is_tensor(t) and t.dtype.is_floating and t.shape.rank
                   and t.shape[0] == _PROBE_BATCH]
        gradients = tape.gradient(total, [t for _, t in targets],
                                  unconnected_gradients=tf.UnconnectedGradients.ZERO)
        values = [v.numpy() for v in variables]
    return [(layer, np.array(g)) for (layer, _), g in zip(targets, gradients)], values


@contextlib.contextmanager
def _restored(variables):
    """Every variable of `variables` back to its value at entry when the block exits (the
    probes' passes leave no trace in the model)."""
    snapshot = [tf.identity(v) for v in variables]  # resource variables copy on write
    try:
        yield
    finally:
        for v, value in zip(variables, snapshot):
            v.assign(value)


def _refuse_backward_coupling(probe, training, backward_a, backward_p):
    """Raise `BatchCouplingError` when the gradient reaching some layer's output for the
    examples the `probe` left alone changed, naming the last such layer in call order (the
    mixing happens in the backward pass of a layer after it)."""
    changed = [layer for (layer, g_a), (_, g_p) in zip(backward_a, backward_p)
               if _differs(g_a[1:], g_p[1:])]
    if not changed:
        return
    raise BatchCouplingError(
        f"{probe[0].upper() + probe[1:]} in a batch changed the gradient reaching the output "
        f"of layer '{changed[-1].name}' ({type(changed[-1]).__name__}) for the other examples "
        f"({'training' if training else 'inference'}-mode backward pass of a random probe "
        "batch), while their forward values stayed the same: a layer after it mixes the "
        "examples of a batch in its backward pass (a custom gradient over the batch axis). "
        "Per-example gradients are then undefined, and one example can move the update "
        "beyond its sensitivity (a custom gradient rolling the rows along the batch moved "
        "the ghost engine's clipped sum by 92 C). Compute the gradient example by example.")


def _refuse_coupling(probe, training, records_a, records_p):
    """Raise `BatchCouplingError`, naming the first layer whose outputs for the examples the
    `probe` left alone changed (`records_*`: each layer's outputs, `_recorded_outputs`)."""
    culprit = None
    for (layer, out_a), (_, out_p) in zip(records_a, records_p):
        flat_a, flat_p = tf.nest.flatten(out_a), tf.nest.flatten(out_p)
        if all(tf.is_tensor(t) and t.shape.rank and t.shape[0] == _PROBE_BATCH
               for t in flat_a + flat_p) and any(
                   _differs(np.array(o[1:]), np.array(p[1:])) for o, p in zip(flat_a, flat_p)):
            culprit = layer
            break
    where = (f"layer '{culprit.name}' ({type(culprit).__name__})" if culprit is not None
             else "a layer")
    raise BatchCouplingError(
        f"{probe[0].upper() + probe[1:]} in a batch changed the model's outputs for the other "
        f"examples ({'training' if training else 'inference'}-mode forward pass of a random "
        f"probe batch): {where} mixes the examples of a batch (batch statistics, or a "
        "reduction over the batch axis in a Lambda or custom layer). Per-example gradients "
        "are then undefined, and one example can move the update beyond its sensitivity. "
        "Compute it per example (reduce over the feature axes only; "
        "LayerNormalization or GroupNormalization instead of batch statistics).")


def per_example_loss(loss) -> Callable[[tf.Tensor, tf.Tensor], tf.Tensor]:
    """A function ``(y_true, y_pred) -> (batch,)`` whose entry i depends on
    ``(y_true[i], y_pred[i])`` only, by construction: the loss is evaluated on each example
    as a batch of one (inside `tf.vectorized_map`; directly when the batch is statically
    one). Broadcasting (labels of shape ``(B,)`` against predictions ``(B, 1)``) and losses
    normalised over the batch (class counts) therefore stay within one example.

    Accepted: a `tf.keras.losses.Loss` (its ``call``, which skips the batch
    reduction; DP losses included), a loss name or function resolved with
    `tf.keras.losses.get`. As in Keras' ``compile``, labels of shape ``(B,)`` against
    predictions ``(B, d)`` are given to the loss as ``(B, 1)``. Values with
    more than one axis (e.g. per-token losses) are averaged over the non-batch axes, as
    Keras' own reduction would do within an example.

    Raises:
        TypeError: no loss, or an object that is neither.
        ValueError: (when called) the loss returns a scalar for a batch of one.
    """
    if loss is None:
        raise TypeError("A clipped DP model must be compiled with a loss that gives per-example "
                        "values (a tf.keras.losses.Loss, a Keras loss name or a function "
                        "(y_true, y_pred) -> (batch,)). Received: loss=None")
    given = loss
    if isinstance(loss, (str, dict)):
        loss = tf.keras.losses.get(loss)
    if isinstance(loss, tf.keras.losses.Loss):
        function = loss.call
    elif callable(loss):
        function = loss
    else:
        raise TypeError("Received an invalid value for `loss`, expected a tf.keras.losses.Loss, "
                        f"a loss name or a function. Received: loss={loss!r}")

    def batch_of_one(y_true, y_pred):
        if tf.is_tensor(y_true) and tf.is_tensor(y_pred) and y_true.shape.rank == 1 \
                and y_pred.shape.rank == 2:
            y_true = tf.expand_dims(y_true, -1)  # Keras' compile: match_dtype_and_rank
        values = function(y_true, y_pred)
        rank = values.shape.rank
        if rank == 0:
            raise ValueError(
                f"The loss {given!r} returned a scalar: classic DP-SGD needs one value per "
                "example. Pass a tf.keras.losses.Loss (its `call` is per example) or a function "
                "returning shape (batch,).")
        if rank is not None and rank > 1:
            values = tf.reduce_mean(values, axis=list(range(1, rank)))
        return values

    def per_example(y_true, y_pred):
        if tf.nest.flatten(y_pred)[0].shape[:1] == [1]:
            return batch_of_one(y_true, y_pred)

        def one(example):
            y_true_i, y_pred_i = tf.nest.map_structure(lambda t: tf.expand_dims(t, 0), example)
            return tf.reshape(batch_of_one(y_true_i, y_pred_i), [])

        return tf.vectorized_map(one, (y_true, y_pred))

    return per_example
