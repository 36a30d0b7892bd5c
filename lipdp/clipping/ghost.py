"""The ghost engine: Lee & Kifer's Algorithm 1 (fast per-example gradient clipping).

One private step:

1. forward pass under a persistent tape, recording the input ``a`` and the
   pre-activation output ``z`` of every layer that has a ghost rule
   (`lipdp.clipping.ghost_norms`: Dense, Conv2D, Embedding and lipdp's dense and
   RKO-conv layers) -- their ``call`` is wrapped for the duration of the pass;
2. first backward pass: ``g = d(sum_i loss_i)/dz``. Row i of ``g`` is example i's
   own cotangent since examples do not interact: batch-coupled layers are
   refused at compile time, and each ``loss_i`` is computed from example i's
   label and output alone (`lipdp.clipping.validation.per_example_loss`);
3. per-example squared norms: from ``(a, g)`` for those layers (no per-example
   gradient is formed); every other layer with trainable variables (the
   *fallback*) is recorded too, and its exact per-example gradients are
   replayed from its own input and output cotangent, vectorised over the batch;
4. clipping factors ``nu`` from the rule;
5. clipped sum: every variable whose per-example gradients were materialised
   in step 3 (replayed fallback layers, whole-model fallbacks) gets
   ``sum_i nu_{i,v} G_{i,v}`` from those very tensors ``G``. Ghost-rule
   variables get the local vector-Jacobian product of their layer's ``z`` with
   the reweighted cotangents ``nu_{i,v} g_i``: the very ``(a_i, g_i)`` whose
   norms were clipped. (Algorithm 1's second backward pass of the reweighted
   loss ``sum_i nu_i loss_i``, which lipdp took for flat and global clipping
   until 2026-12-05, equals that sum only when every backward step between the
   losses and ``z`` is linear in its cotangent: a custom gradient that clips or
   renormalises the cotangent rows, lipdp's own `DP_ClipGradient` among them,
   undid the factors, and one example moved the clipped sum by 24 C.)

The result equals clipping exact per-example gradients (`vectorized`), up to
float rounding, for every layer that is a deterministic function of its inputs
and variables in training mode, provided row i of every recorded layer's input
belongs to example i. A layer that folds an example's positions into the batch
axis (a ``Lambda`` reshaping ``(B, T, d)`` to ``(B T, d)`` before a Dense) breaks
that: each row would be clipped on its own, and one example could contribute T
times the threshold. The engine checks every recorded layer's row count against
the batch's (at trace time where both are static, else at run time) and fails
with an error naming the layer; a layer that reorders the rows of the batch
cannot be seen, and needs engine ``"vectorized"``, which differentiates each
example's own loss. Layers computing in float16 or bfloat16 (a mixed-precision
policy) are refused: squared activations and cotangents underflow there (a
norm of 0 leaves an example unclipped); engine ``"vectorized"`` takes norms of
the float32 variables' gradients and accepts them. Which layers are handled by ghost rules and
which fall back is decided at compile time (`ghost_plan`) and announced with a
warning.

Randomness inside layers. Layers with training-mode randomness (dropout, noise)
are fine where the forward pass runs them once: their draw is on the tape, and
the norms and the sums of step 5 both come from it. A fallback layer, however,
is called again in step 3, and draws again there. Two consequences:

* privacy holds whatever a layer hides: the vectors summed for a fallback
  variable are the vectors whose norms the rule saw (step 5), so each
  example's clipped gradient obeys the rule's bound;
* the gradient of such a layer is taken under a fresh draw, not the one that
  produced the loss. Layers whose randomness Keras declares (subclasses of
  ``BaseRandomLayer`` -- Dropout and its spatial variants, GaussianNoise,
  GaussianDropout, AlphaDropout, RNN cells and LSTM/GRU/SimpleRNN with
  ``dropout`` or ``recurrent_dropout``, attention with ``dropout``,
  augmentation layers -- alone or as sub-layers) are therefore refused inside
  a fallback layer at compile time (`GhostRandomnessError`); randomness drawn
  with bare ``tf.random`` calls in a custom ``call`` cannot be seen and gives
  a private but perturbed gradient. Engine ``"vectorized"`` computes each
  example's gradient, loss and norm in one pass, with one draw, and is correct
  with any such layer.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import numbers
import warnings
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import tensorflow as tf

from lipdp import kernels
from lipdp.clipping.engine import (ClippedBatch, factors_in, rows_of_a_usable_example,
                                   squared_norms_of, usable_examples, weighted_sum,
                                   without_unusable)
from lipdp.clipping.ghost_norms import ghost_rule, uses_gram
from lipdp.clipping.rules import ClippingRule
from lipdp.clipping.validation import leaf_layers, wrapped_calls
from lipdp.per_example import loops_over_time, map_examples, per_example_gradients
from lipdp.variable_reads import (describe_reads, reads_outside_owners,
                                   traced_reads_outside_owners)


_LOGGER = logging.getLogger("lipdp")


class GhostFallbackWarning(UserWarning):
    """Some trainable variables get exact per-example gradients in the ghost engine."""


class GhostRandomnessError(ValueError):
    """A layer the ghost engine calls a second time draws random numbers in training."""


class GhostRowsError(ValueError):
    """A layer recorded by the ghost engine does not see one row per example."""


def check_float32_compute(model: tf.keras.Model) -> None:
    """Refuse layers computing in float16 or bfloat16 (the module docstring).

    Raises:
        ValueError: naming the first such layer.
    """
    for layer in leaf_layers(model):
        dtype = tf.as_dtype(getattr(layer, "compute_dtype", None) or "float32")
        if dtype.is_floating and dtype.size < 4:
            raise ValueError(
                f"Layer '{layer.name}' computes in {dtype.name}: ghost norms are formed from "
                "its squared activations and cotangents, which underflow in that precision (a "
                "per-example norm of 0 leaves the example unclipped). Use engine='vectorized', "
                "or a float32 policy (tf.keras.mixed_precision.set_global_policy('float32')).")


def _rows_checked(layer, tensor, losses):
    """`tensor` (a recorded output cotangent of `layer`), checked to hold one row per example,
    as the per-example `losses` do: at trace time when both row counts are static, else by an
    assertion the returned tensor depends on.

    Raises:
        GhostRowsError: the static row counts differ.
    """
    rows = tensor.shape[0] if tensor.shape.rank else None
    message = (f"Ghost clipping: layer '{layer.name}' sees {{}} rows for a batch of {{}} "
               "examples. Ghost norms need row i of a layer's input to be example i's: a layer "
               "before it folds or splits the batch axis, and each row would be clipped on "
               "its own. Use engine='vectorized'.")
    if rows is not None and losses.shape[0] is not None:
        if rows != losses.shape[0]:
            raise GhostRowsError(message.format(rows, losses.shape[0]))
        return tensor
    check = tf.debugging.assert_equal(tf.shape(tensor)[0], tf.shape(losses)[0],
                                      message=message.format("x", "y"))
    with tf.control_dependencies([check]):
        return tf.identity(tensor)


@dataclasses.dataclass(frozen=True)
class GhostPlan:
    """Which layers the ghost engine handles with ghost norms, and which fall back.

    Attributes:
        ghost: layers whose per-example norms come from their ghost rule.
        fallback_layers: layers with trainable variables but no usable ghost
            rule: their per-example gradients are computed exactly, from the
            layer's own recorded input and output cotangent.
        fallback: ``(layer name, reason)`` for every fallback, including
            trainable variables owned by no layer (``"<model>"``).
    """

    ghost: Tuple[tf.keras.layers.Layer, ...]
    fallback_layers: Tuple[tf.keras.layers.Layer, ...]
    fallback: Tuple[Tuple[str, str], ...]

    def describe(self) -> str:
        """One line per layer: ``name (Type): ghost norm`` or ``name: exact ... (reason)``."""
        lines = [f"{layer.name} ({type(layer).__name__}): ghost norm" for layer in self.ghost]
        lines += [f"{name}: exact per-example gradients ({reason})"
                  for name, reason in self.fallback]
        return "\n".join(lines)


def ghost_plan(model: tf.keras.Model) -> GhostPlan:
    """Decide, for every layer with trainable variables, ghost norm or exact fallback.

    A layer gets ghost norms when its exact type has a registered rule, the rule
    supports its configuration, the rule covers all its trainable variables, and
    none of those variables is shared with another layer. Trainable variables
    owned by no layer (model-level weights) fall back too.
    """
    layers = list(leaf_layers(model))
    owners: Dict[object, List[str]] = {}
    for layer in layers:
        for v in layer.trainable_weights:
            owners.setdefault(v.ref(), []).append(layer.name)
    ghost, fallback_layers, fallback = [], [], []
    for layer in layers:
        if not layer.trainable_weights:
            continue
        shared = [v.name for v in layer.trainable_weights if len(owners[v.ref()]) > 1]
        rule = ghost_rule(layer)
        if shared:
            fallback.append((layer.name, f"variables shared with other layers: {shared}"))
            continue  # exact gradients of the whole model for those (see _NormPass)
        if rule is None:
            reason = f"no ghost rule for {type(layer).__name__}"
        else:
            reason = rule.unsupported(layer)
            covered = {v.ref() for v in rule.variables(layer)}
            if reason is None and covered != {v.ref() for v in layer.trainable_weights}:
                reason = "trainable variables outside its ghost rule"
        if reason is None:
            ghost.append(layer)
        else:
            fallback_layers.append(layer)
            fallback.append((layer.name, reason))
    orphans = [v.name for v in model.trainable_variables if v.ref() not in owners]
    if orphans:
        fallback.append(("<model>", f"variables owned by no layer: {orphans}"))
    return GhostPlan(tuple(ghost), tuple(fallback_layers), tuple(fallback))


# How Keras' random layers set the amount of their randomness; zero means none.
_RANDOMNESS_AMOUNTS = ("rate", "stddev", "dropout", "recurrent_dropout")


def _declared_randomness(layer: tf.keras.layers.Layer) -> Optional[str]:
    """``"'name' (Type): setting"`` for the first of `layer` and its sub-layers that
    declares training-mode randomness, None when none does.

    A Keras layer declares randomness by deriving from ``BaseRandomLayer``; one whose
    amounts (`_RANDOMNESS_AMOUNTS`: Dropout's ``rate``, GaussianNoise's ``stddev``,
    an RNN cell's ``dropout`` and ``recurrent_dropout``) are all the number zero is
    deterministic. One with none of these attributes (augmentation layers) counts as
    random.
    """
    # Keras' own walk over tracked sub-layers (`submodules` also walks the dropout-mask
    # caches of RNN cells, keyed by graphs, and fails on them once the layer was traced).
    for module in layer._flatten_layers(include_self=True, recursive=True):
        if "BaseRandomLayer" not in {cls.__name__ for cls in type(module).__mro__}:
            continue
        amounts = {name: getattr(module, name) for name in _RANDOMNESS_AMOUNTS
                   if hasattr(module, name)}
        random = {name: value for name, value in amounts.items()
                  if not (isinstance(value, numbers.Real) and value == 0)}
        if random or not amounts:
            setting = ", ".join(f"{name}={value!r}" for name, value in random.items())
            described = f"'{module.name}' ({type(module).__name__})"
            return f"{described}: {setting}" if setting else described
    return None


def check_no_replayed_randomness(plan: GhostPlan) -> None:
    """Refuse fallback layers that declare training-mode randomness (`_declared_randomness`).

    A fallback layer is called again to get its per-example gradients (see the module
    docstring); a random layer would draw again there, so its gradient would not be the
    gradient of the loss computed in the forward pass. Randomness outside fallback
    layers (a Dropout layer between two Dense layers) is drawn once and is fine. The
    check runs before any call, so it also refuses a random layer that a trace would
    send to the whole-model fallback instead (called twice, or with tensor arguments).

    Raises:
        GhostRandomnessError: naming the first such layer and its random sub-layer.
    """
    for layer in plan.fallback_layers:
        randomness = _declared_randomness(layer)
        if randomness is not None:
            raise GhostRandomnessError(
                f"Ghost clipping: layer '{layer.name}' ({type(layer).__name__}) has no ghost "
                "rule, so its per-example gradients are computed by calling it a second time, "
                f"and it draws random numbers in training ({randomness}): that second call "
                "would use other random values than the forward pass that computed the loss, "
                "and give the wrong gradient. Use engine='vectorized' (each example's gradient "
                "comes from one forward pass), or remove the randomness from this layer (for "
                "instance a Dropout layer after it instead of inside it)."
            )


_MISSING = object()


@dataclasses.dataclass
class _Call:
    inputs: object
    args: tuple
    kwargs: dict
    outputs: object  # the pre-activation for ghost layers


@contextlib.contextmanager
def _recording(ghost_layers: Sequence[tf.keras.layers.Layer],
               other_layers: Sequence[tf.keras.layers.Layer]):
    """Wrap each layer's ``call`` to record every call (`_Call`); restored on exit.

    For `ghost_layers` the activation (Dense/Conv2D ``activation=``) is switched
    off inside the original ``call`` and applied by the wrapper, so that the
    recorded output is the pre-activation ``z`` the ghost rules need. Calls of
    `other_layers` are recorded as they are.
    """
    records: Dict[int, List[_Call]] = {id(layer): [] for layer in [*ghost_layers, *other_layers]}

    def wrap(layer, original):
        split = any(layer is g for g in ghost_layers)

        def wrapper(inputs, *args, **kwargs):
            activation = layer.__dict__.get("activation", _MISSING) if split else _MISSING
            if activation is not _MISSING:
                object.__setattr__(layer, "activation", None)
            try:
                outputs = original(inputs, *args, **kwargs)
            finally:
                if activation is not _MISSING:
                    object.__setattr__(layer, "activation", activation)
            records[id(layer)].append(_Call(inputs, args, kwargs, outputs))
            return outputs if activation in (_MISSING, None) else activation(outputs)

        return tf.autograph.experimental.do_not_convert(wrapper)

    with wrapped_calls([*ghost_layers, *other_layers], wrap):
        yield records


def _replayable(call: _Call) -> bool:
    """A recorded call can be replayed example by example if only its input is a tensor."""
    return not any(tf.is_tensor(t) for t in tf.nest.flatten((call.args, call.kwargs)))


def _replayed_gradients(layer, call: _Call, cotangents: List[tf.Tensor],
                        variables: List[tf.Variable]) -> List[tf.Tensor]:
    """Per-example gradients of `variables` from one layer's recorded input and output
    cotangent: ``grad_v <g_i, layer(a_i)>`` for each example i, vectorised over i.

    Exact (the same input and cotangent as the batch pass), local to the layer,
    and linear in the batch size.
    """
    def one(example):
        inputs, cts = example
        inputs = tf.nest.map_structure(lambda t: tf.expand_dims(t, 0), inputs)
        with tf.GradientTape() as tape, tf.name_scope(layer.name):  # names it in errors
            outputs = tf.nest.flatten(layer.call(inputs, *call.args, **call.kwargs))
        grads = tape.gradient(outputs, variables,
                              output_gradients=[tf.expand_dims(c, 0) for c in cts],
                              unconnected_gradients=tf.UnconnectedGradients.ZERO)
        return [tf.convert_to_tensor(g) for g in grads]

    return list(map_examples(one, (call.inputs, list(cotangents)), loops_over_time([layer])))


def _every_row(structure) -> tf.Tensor:
    """``(batch,)`` True, the batch size read from the first tensor of `structure` (labels,
    batch first)."""
    first = tf.convert_to_tensor(tf.nest.flatten(structure)[0])
    return tf.ones(tf.shape(first)[:1], tf.bool)


@dataclasses.dataclass
class _NormPass:
    tape: tf.GradientTape
    variables: List[tf.Variable]
    squared: List[tf.Tensor]
    local: Dict[object, Tuple[tf.Tensor, tf.Tensor]]  # var ref -> (z, cotangent) of its layer
    exact: Dict[object, tf.Tensor]  # var ref -> per-example gradients (fallback)
    losses: tf.Tensor
    y_pred: tf.Tensor


class GhostEngine:
    """Ghost-norm clipping for one model (see the module docstring).

    Fallbacks, all exact: a fallback layer's per-example gradients are replayed
    from its recorded input and output cotangent (`_replayed_gradients`);
    variables that cannot be attributed to a single call of one layer (shared
    variables, model-level variables, a layer called several times or with
    tensor arguments, a variable that the forward pass also reads outside its
    layer's call: tied weights, `lipdp.variable_reads`, whose ghost norm would miss
    that use) get exact per-example gradients with each example alone
    through the model (`lipdp.per_example.per_example_gradients`): row i depends on
    example i only, also when another row is NaN or inf (the Jacobian of the batch's
    losses, which this engine took before 2026-12-05, summed ``0 x NaN`` over the
    other rows: one NaN record turned every example's norm NaN). Such a variable's
    gradient is taken under a draw of its own when the model has random layers.

    Args:
        model: the Keras model; its plan is computed here.
        warn: emit a `GhostFallbackWarning` naming the layers that fall back.
        norm_method: how Conv2D and rank > 2 Dense norms are computed
            (`lipdp.clipping.ghost_norms`): ``"gram"`` (default, engine
            ``"ghost"``: Gram identities only, no per-example gradient of a ghost
            layer is formed) or ``"auto"`` (engine ``"mixed-ghost"``: per layer,
            the smaller of the Gram matrices and the transient per-example gradient).

    Raises:
        GhostRandomnessError: a fallback layer declares training-mode randomness
            (`check_no_replayed_randomness`).
    """

    def __init__(self, model: tf.keras.Model, warn: bool = True, norm_method: str = "gram"):
        uses_gram(1, 1, 1, norm_method)  # validates the value
        self.norm_method = norm_method
        self.name = "ghost" if norm_method == "gram" else "mixed-ghost"
        self.plan = ghost_plan(model)
        self._eager_reads = None
        check_no_replayed_randomness(self.plan)
        check_float32_compute(model)
        _LOGGER.info("Ghost clipping plan:\n%s", self.plan.describe())
        if warn and self.plan.fallback:
            warnings.warn(
                "Ghost clipping: these layers have no ghost norm and get exact per-example "
                "gradients instead: "
                + "; ".join(f"'{name}' ({reason})" for name, reason in self.plan.fallback),
                GhostFallbackWarning, stacklevel=3)

    def _norms(self, model, loss_fn: Callable, x, y) -> _NormPass:
        plan = self.plan
        # Layers traced separately: a fused pair would leave a recorded output out of the
        # autodiff graph, and its layer with a zero cotangent (`lipdp.kernels.separate_layers`).
        with reads_outside_owners(model) as outside, kernels.separate_layers(), \
                _recording(plan.ghost, plan.fallback_layers) as records:
            with tf.GradientTape(persistent=True) as tape:
                y_pred = model(x, training=True)
                losses = loss_fn(y, y_pred)
                total = tf.reduce_sum(losses)
        if tf.executing_eagerly():
            outside = self._eager_reads_outside(model, loss_fn, x, y)
        variables = list(model.trainable_variables)
        for layer in plan.ghost + plan.fallback_layers:
            if len(records[id(layer)]) != 1:
                warnings.warn(f"Ghost clipping: layer '{layer.name}' was called "
                              f"{len(records[id(layer)])} times in one forward pass; its "
                              "variables get exact per-example gradients (whole model).",
                              GhostFallbackWarning, stacklevel=4)
        read_elsewhere = {variable.ref() for variable, _ in outside}
        if outside:
            warnings.warn("Ghost clipping: variables read outside their own layer's call in "
                          f"the forward pass ({describe_reads(outside)}; tied weights?): their "
                          "layers get exact per-example gradients (whole model), which sum "
                          "every use.", GhostFallbackWarning, stacklevel=4)

        def alone(layer):  # called once, none of its variables read elsewhere
            return len(records[id(layer)]) == 1 and not any(
                v.ref() in read_elsewhere for v in layer.trainable_weights)

        ghost = [layer for layer in plan.ghost if alone(layer)]
        replay = [layer for layer in plan.fallback_layers
                  if alone(layer) and _replayable(records[id(layer)][0])]
        # First backward pass: the cotangent of every recorded output.
        targets = [records[id(layer)][0].outputs for layer in ghost]
        targets += [tf.nest.flatten(records[id(layer)][0].outputs) for layer in replay]
        cotangents = tape.gradient(total, targets) if targets else []
        cotangents = tf.nest.map_structure(
            lambda ct, t: tf.zeros_like(t) if ct is None else tf.convert_to_tensor(ct),
            cotangents, targets) if targets else []
        cotangents = [tf.nest.map_structure(
            lambda t, layer=layer: _rows_checked(layer, t, losses), cts)
            for layer, cts in zip(ghost + replay, cotangents)]
        squared, local, exact = {}, {}, {}
        for layer, g in zip(ghost, cotangents[:len(ghost)]):
            call, rule = records[id(layer)][0], ghost_rule(layer)
            norms_of = rule.squared_norms(layer, call.inputs, g, self.norm_method)
            for v, norms in zip(rule.variables(layer), norms_of):
                squared[v.ref()] = norms
                local[v.ref()] = (call.outputs, g)
        for layer, cts in zip(replay, cotangents[len(ghost):]):
            layer_vars = list(layer.trainable_weights)
            grads = _replayed_gradients(layer, records[id(layer)][0], cts, layer_vars)
            for v, jac in zip(layer_vars, grads):
                exact[v.ref()] = jac
        rest = [v for v in variables if v.ref() not in squared and v.ref() not in exact]
        if rest:
            # Each example alone through the model: the Jacobian of the batch's losses on the
            # tape summed 0 x NaN over the other rows, so one NaN record made every row NaN.
            gradients, _, _ = per_example_gradients(model, loss_fn, x, y, rest)
            exact.update({v.ref(): g for v, g in zip(rest, gradients)})
        for ref, jac in exact.items():
            squared[ref] = squared_norms_of([jac])[0]
        return _NormPass(tape, variables, [squared[v.ref()] for v in variables], local, exact,
                         losses, y_pred)

    def _eager_reads_outside(self, model, loss_fn, x, y):
        """`reads_outside_owners` of the forward pass, for a pass run eagerly: traced once
        in a scratch graph (the reads do not change between calls), with the layers wrapped
        as `_norms` wraps them. Traced unwrapped, a ghost layer's activation ran inside its
        call, so its reads of the layer's variables passed as the layer's own: the eager
        step dropped their part of the gradient (an audit, 2026-12-07: an activation adding
        the kernel's sum, a kernel gradient 15% off; traced steps were right)."""
        plan = self.plan

        def forward():
            with kernels.separate_layers(), _recording(plan.ghost, plan.fallback_layers):
                return loss_fn(y, model(x, training=True))

        if self._eager_reads is None:
            self._eager_reads = traced_reads_outside_owners(model, forward)
        return self._eager_reads

    def per_example_squared_norms(self, model, loss_fn: Callable, x, y) -> List[tf.Tensor]:
        """``||grad_v loss_i||^2``, ``(batch,)`` per trainable variable: upper bounds that
        cover their rounding for ghost-rule variables (`lipdp.clipping.ghost_norms`,
        "Rounding"), the norms of the exact per-example gradients for the others."""
        result = self._norms(model, loss_fn, x, y)
        del result.tape
        return result.squared

    def clipped_sum(self, model, loss_fn: Callable, x, y, rule: ClippingRule) -> ClippedBatch:
        """Formal guarantee: ``gradient_sums[v] = sum_i nu[v][i] G_{i,v}`` with
        ``nu = rule.factors(||G_{i,v}||^2)``, where ``G_{i,v}`` is, for every variable,
        the very per-example gradient whose squared norm the rule received:

        * ghost-rule variables: ``grad_v loss_i`` of the forward pass on the tape.
          Their norms come from that pass's ``(a_i, g_i)``, and their sums from the
          same tape (``z`` with cotangents ``nu g``);
        * materialised variables (`_NormPass.exact`): the per-example tensors
          themselves, summed with `weighted_sum` -- never a second backward pass,
          since a replayed layer may have drawn other random values than the tape.

        Hence example i contributes exactly ``(nu[v][i] G_{i,v})_v`` to the sums, and
        the rule's bound (``||.|| <= C`` for flat and global clipping, ``<= C_v`` per
        variable for per-layer clipping) holds for that contribution whatever
        randomness the layers hide. ``G = grad loss_i`` exactly when every fallback
        layer is deterministic in training (see the module docstring).

        An example whose loss or norms are not finite (`usable_examples`) contributes
        zero: the batch is then passed again with that example's inputs and labels
        replaced by a usable example's and its factors set to 0 (a zero factor alone would
        leave its NaN or inf activations in the cotangents of the other examples;
        `rows_of_a_usable_example`), or, with no usable example, the sums are 0. The
        losses, norms and outputs returned are the first pass's.
        """
        def one_pass(x, y, usable):
            return self._clipped_sums(model, loss_fn, x, y, rule, usable)

        if not tf.executing_eagerly():  # one traced body for both passes (half the graph);
            # AutoGraph on, as in fit's own function: Keras converts a user layer's `call`
            # (Python control flow on tensors) only then (lipdp's code never: `_autograph`).
            one_pass = tf.function(one_pass)
        first = one_pass(x, y, _every_row(y))
        usable = usable_examples(first.losses, first.squared_norms)
        def usable_ones_again():
            return one_pass(rows_of_a_usable_example(x, usable),
                            rows_of_a_usable_example(y, usable), usable).gradient_sums

        sums = tf.cond(tf.reduce_all(usable), lambda: first.gradient_sums,
                       lambda: tf.cond(tf.reduce_any(usable), usable_ones_again,
                                       lambda: [tf.zeros_like(g) for g in first.gradient_sums]))
        return first._replace(gradient_sums=list(sums))

    def _clipped_sums(self, model, loss_fn, x, y, rule, usable) -> ClippedBatch:
        """One pass of `clipped_sum`, the factors of examples outside `usable` set to 0."""
        result = self._norms(model, loss_fn, x, y)
        factors = without_unusable(rule.factors(result.squared), usable)
        sums = [self._per_variable_sum(result, v, nu)
                for v, nu in zip(result.variables, factors)]
        del result.tape
        sums = [tf.convert_to_tensor(g) for g in sums]
        return ClippedBatch(sums, result.squared, result.losses, result.y_pred)

    @staticmethod
    def _per_variable_sum(result: _NormPass, variable, nu):
        if variable.ref() in result.exact:
            return weighted_sum(nu, result.exact[variable.ref()])
        z, g = result.local[variable.ref()]
        weights = tf.reshape(tf.stop_gradient(factors_in(nu, g.dtype)),
                             [-1] + [1] * (g.shape.rank - 1))
        return result.tape.gradient(z, variable, output_gradients=weights * g,
                                    unconnected_gradients=tf.UnconnectedGradients.ZERO)
