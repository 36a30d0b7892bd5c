"""The contract every DP layer fulfils: backpropagation for bounds.

A DP layer is a Keras layer that also implements three pure functions of scalar
bounds (TF scalars, evaluated at the layer's *current* weights so that they run
inside the compiled train step; float64 in lipdp's passes, see "Precision" below):

``propagate_inputs(X_in) -> X_out``
    an upper bound of ``||f(x)||_2`` over all ``||x||_2 <= X_in`` (one example).
``backpropagate_params(X_in, G) -> [(variable, bound), ...]``
    for every trainable variable ``v`` of the layer, an upper bound of
    ``||d<g, f(x)>/dv||_2`` over all inputs ``||x|| <= X_in`` and all cotangents
    ``||g|| <= G`` at the layer output: the per-example gradient bound of ``v``.
``backpropagate_inputs(X_in, G) -> G_in``
    an upper bound of ``||d<g, f(x)>/dx||_2`` (the cotangent at the input),
    i.e. ``G`` times the Lipschitz constant of the layer w.r.t. its input.

A fourth one, used by certification only (python floats, at the current weights):

``rounding_error(X) -> e``
    an upper bound of the layer's own float32 rounding error,
    ``||f^(x) - f(x)||_2`` over the inputs of norm <= X it receives, where f^ is
    ``call`` under the arithmetic model of `lipdp.rounding` (which states the
    assumptions and the lemmas) and f the exact map the other methods bound.

Bounds are with respect to the variable *itself*: when ``call`` multiplies a
variable by a constant, the bound carries that constant.

Layers whose weights are constrained also implement ``project()``, which applies
the projection in place (after each optimizer step, and once at build so that
the constraints hold from the first step on).

**Precision.** The bound pass runs in float64 (`BOUND_DTYPE`): its inputs are exact
float64 values (float32 weights and certified norms, converted exactly) and float64
constants, and every bound is built from them by sums, products, quotients, square
roots and minima of non-negative numbers (no subtraction), so a computed bound is at
least ``(1 - gamma_K)`` times the exact value of the same formula, K the number of
roundings along its longest path (a few per layer, plus the terms of a bias norm:
far below 2^22, so ``gamma_K < 2^-30``). `lipdp.bounds` multiplies every bound it
returns by ``1 + BOUND_PASS_SLACK`` (2^-28) after its last operation, which covers
that, and the noise's standard deviation is rounded *up* to float32
(`round_up_to_float32`). Layers convert what they combine with their own float64
values through `as_bound`, so callers may pass python numbers or float32 tensors.
"""

from __future__ import annotations

import abc
import contextlib
import json
import math
import numbers
import types
from typing import List, Optional, Tuple

import numpy as np
import tensorflow as tf

from lipdp.operator_norms import certified_norms, without_projection_certificate
from lipdp.rounding import ACTIVATION_RANGE

#: Precision of the bound pass (module docstring, "Precision").
BOUND_DTYPE = tf.float64
#: Relative slack on every bound the pass returns: covers its float64 roundings.
BOUND_PASS_SLACK = 2.0 ** -28

# Certified operator norms computed during one pass of backpropagation for bounds,
# by layer: each is needed forward (propagate_inputs) and backward
# (backpropagate_inputs) at the same weights; the cache computes it once.
_NORM_CACHE = None


@contextlib.contextmanager
def operator_norm_cache():
    """Within this context, `cached_operator_norm` computes each layer's norm once.

    Only for passes during which the weights do not change (one bound pass).
    """
    global _NORM_CACHE
    outer, _NORM_CACHE = _NORM_CACHE, {}
    try:
        yield
    finally:
        _NORM_CACHE = outer


def cached_operator_norm(layer, compute):
    """``compute()`` (a certified norm of `layer` at its current weights), at most
    once per `operator_norm_cache` context."""
    if _NORM_CACHE is None:
        return compute()
    if id(layer) not in _NORM_CACHE:
        _NORM_CACHE[id(layer)] = (layer, compute())  # the layer is kept alive: ids stay unique
    return _NORM_CACHE[id(layer)][1]


def certified_operator_norm(layer):
    """The certified norm that ``layer.certified_norm_request()`` describes
    (`lipdp.operator_norms.certified_norms`), through `cached_operator_norm`; a float64
    scalar (the float32 bound, converted exactly). Outside a bound pass, certified from the
    kernel alone (`lipdp.operator_norms.without_projection_certificate`)."""
    return as_bound(cached_operator_norm(layer, lambda: certified_norms(
        [without_projection_certificate(layer.certified_norm_request())])[0]))


def as_bound(value):
    """`value` (a python number or a scalar tensor) as a `BOUND_DTYPE` scalar tensor. A python
    float converts exactly (``tf.cast`` would pass it through float32 first)."""
    if isinstance(value, (int, float)):
        return tf.constant(value, BOUND_DTYPE)
    return tf.cast(value, BOUND_DTYPE)


def weight_norm(variable):
    """``||variable||_2`` in float64, from its float32 values (converted exactly; the sum
    of squares' roundings are within the pass's slack for fewer than 2^22 entries)."""
    return tf.norm(tf.cast(variable, BOUND_DTYPE))


def bias_norm(layer):
    """``||layer.bias||_2`` in float64 (`weight_norm`), 0 for a layer built without bias."""
    return weight_norm(layer.bias) if layer.use_bias else as_bound(0.0)


def with_pass_slack(bound):
    """`bound` times ``1 + BOUND_PASS_SLACK`` (module docstring, "Precision")."""
    return as_bound(bound) * (1.0 + BOUND_PASS_SLACK)


def round_up_to_float32(value):
    """A float32 >= `value` (a non-negative float64 tensor), element-wise: the smallest one,
    or float32's smallest normal number where `value` lies below it (TensorFlow's cast
    flushes subnormals to zero, and the next float32 above zero, 1.4e-45, fell below a
    value of 1e-39: an audit)."""
    value = as_bound(value)
    rounded = tf.cast(value, tf.float32)
    below = tf.cast(rounded, BOUND_DTYPE) < value
    result = tf.where(below, tf.math.nextafter(rounded, tf.fill(tf.shape(rounded), float("inf"))),
                      rounded)
    smallest_normal = tf.constant(np.finfo(np.float32).tiny, tf.float32)
    return tf.where(tf.cast(result, BOUND_DTYPE) < value, smallest_normal, result)


class DPLayer(abc.ABC):
    """Mixin for Keras layers with analytic per-example gradient bounds.

    Inheriting from this class guarantees nothing by itself: each subclass must
    prove (in its docstring) and test (against exact per-example gradients) the
    bounds it returns.

    Every subclass's `get_weights` first has the values remembered, with their privacy
    ledger, by the DP model that trains them (`remembering_get_weights`), and its
    `set_weights` has that model look the new values up (`looked_up_set_weights`).
    """

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "get_weights" not in cls.__dict__:
            cls.get_weights = remembering_get_weights
        if "set_weights" not in cls.__dict__:
            cls.set_weights = looked_up_set_weights

    @abc.abstractmethod
    def propagate_inputs(self, input_bound):
        """Upper bound of the output norm for inputs of norm <= `input_bound`."""

    def backpropagate_params(self, input_bound, gradient_bound):
        """Per-example gradient bound of each trainable variable (none by default)."""
        del input_bound, gradient_bound
        return []

    @abc.abstractmethod
    def backpropagate_inputs(self, input_bound, gradient_bound):
        """Upper bound of the cotangent norm at the input."""

    def backpropagate_lipschitz(self, input_bound, gradient_bound):
        """Upper bound of ``||J_f(x)^T g||`` for the *true* Jacobian of the forward map.

        The same as `backpropagate_inputs` unless the layer alters its backward
        pass (`DP_ClipGradient`): this one certifies robustness, the other one
        calibrates noise.
        """
        return self.backpropagate_inputs(input_bound, gradient_bound)

    def rounding_error(self, input_bound):
        """Upper bound of the layer's own float32 rounding error (`lipdp.rounding`).

        ``sup ||f^(x) - f(x)||_2`` over the inputs x of norm ``<= input_bound`` (a
        python float; a pair of them inside residual sections) that the layer
        receives in float32, where f^ is `call` under the arithmetic model of
        `lipdp.rounding` and f the exact map the bound methods describe. The default,
        ``inf``, claims nothing: a model with such a layer certifies no radius.
        """
        del input_bound
        return math.inf

    def propagate_error(self, input_bound, input_error):
        """Upper bound of ``||f^(x^) - f(x)||_2`` over ``||x|| <= input_bound`` and
        ``||x^ - x|| <= input_error`` (x exact, x^ its float32 value).

        ``Lip * input_error + rounding_error(input_bound + input_error)``: f moves by at
        most ``Lip ||x^ - x||`` from x to x^, and ``||x^|| <= input_bound + input_error``.
        """
        moved = float(self.lipschitz_bound()) * input_error if input_error else 0.0
        own = self.rounding_error(float(input_bound) + input_error)
        return moved + own if own >= 0 else math.inf  # a negative (or NaN) one is wrong

    def project(self, orthogonalise=True):
        """Enforce the layer's weight constraints in place (no-op by default).

        `orthogonalise` (a Python bool or a boolean tensor) lets spectrally constrained
        layers skip their Björck iterations on a schedule; other layers ignore it."""
        return None

    def lipschitz_bound(self):
        """Certified Lipschitz constant w.r.t. the input (``G_in`` for ``G = 1``)."""
        return self.backpropagate_lipschitz(as_bound(float("inf")), as_bound(1.0))


def remembering_get_weights(layer):
    """Keras' `get_weights` of a DP layer, after the DP model that trains its variables (the
    last to take them, ``_lipdp_ledger_owner``) remembered its values with its ledger
    (`lipdp.weight_copies`): a copy of the layer into another model
    (``target.set_weights(layer.get_weights())``) brings that ledger, even when the model
    trains on (values between two `train_on_batch` calls were otherwise remembered only
    until the next: an audit, 2026-12-06, 0 steps reported for an evaluation copy taken
    after 3)."""
    for owner in ledger_owners(layer):
        owner._remember_trained_values()
    return tf.keras.layers.Layer.get_weights(layer)


def looked_up_set_weights(layer, weights):
    """Keras' `set_weights` of a DP layer, then the DP model that trains its variables looks
    the values up (`DP_Model._take_copied_values`): a copy from another run's layer is in
    its ledger at once, so a file written next by a path that does not read the ledger
    (``tf.train.Checkpoint(model=...).write``) holds it (an audit, 2026-12-06: 0 steps
    written for 8)."""
    tf.keras.layers.Layer.set_weights(layer, weights)
    for owner in ledger_owners(layer):
        owner._take_copied_values()


def ledger_owners(layer):
    """The DP models that last took the layer's variables (``_lipdp_ledger_owner``)."""
    owners = []
    for variable in layer.weights:
        owner = getattr(variable, "_lipdp_ledger_owner", None)
        if owner is not None and all(o is not owner for o in owners):
            owners.append(owner)
    return owners


def check_float32(layers):
    """Raise a ValueError naming the first of `layers` that computes or stores its weights in
    another dtype than float32: lipdp's bounds and their rounding proofs (`lipdp.rounding`,
    the clipping targets, the certified norms) are stated for float32 arithmetic, and a
    float16 or float64 policy breaks them or the step. Each layer's sub-layers are checked
    too, at any depth: a float16 layer inside a residual branch (`DP_WrappedResidual` of a
    list) passed when only the wrapper was, and rounding an audit made flip a prediction at
    0.06 of its certified radius."""
    for layer in (inner for outer in layers
                  for inner in outer._flatten_layers(include_self=True, recursive=True)):
        dtypes = {getattr(layer, "compute_dtype", "float32"), getattr(layer, "dtype", "float32")}
        if dtypes - {"float32", None}:
            policy = getattr(getattr(layer, "dtype_policy", None), "name", "?")
            raise ValueError(
                f"Layer '{layer.name}' computes in {layer.compute_dtype} with {layer.dtype} "
                f"weights (dtype policy {policy!r}), but lipdp's DP layers compute in float32: "
                "their bounds' rounding proofs are for float32 arithmetic. Use "
                "tf.keras.mixed_precision.set_global_policy('float32') (or dtype='float32') "
                "before building the model.")


def check_float32_inputs(model):
    """Raise a ValueError when an input of `model` is floating-point narrower than float32 (a
    float16 or bfloat16 ``tf.keras.Input``): Keras rounds every record to that dtype before
    the first layer. A finite float32 record beyond float16's range (1e5) became an infinity
    there, the private step stopped at the step that sampled it (`finite_rows` tests finiteness
    in float32), which tells when it was sampled (an audit, 2026-12-06); and the rounding is
    not covered by the certificates' rounding bound (a step of 2e-6 flipped a prediction whose
    margin that rounding made)."""
    for tensor in getattr(model, "inputs", None) or []:
        if tensor.dtype.is_floating and tensor.dtype.size < 4:
            raise ValueError(
                f"The model's input {tensor.name!r} is {tensor.dtype.name}: Keras rounds every "
                "record to it before the first layer, and lipdp's checks of finite records "
                "and rounding bounds are for float32. Declare the input float32 "
                "(tf.keras.Input(shape, dtype='float32'), the default).")


def check_no_activation(layer_name, activation):
    """DP dense/conv layers are linear: activations must be separate DP layers."""
    if activation not in (None, "linear"):
        raise ValueError(
            f"{layer_name} does not take an `activation` (received activation="
            f"{activation!r}): add a DP activation layer after it instead, e.g. "
            "`lipdp.layers.DP_GroupSort(2)`."
        )


def chain_backward(layers, input_bound, gradient_bound):
    """Backpropagation for bounds through a chain of DP layers.

    Input bounds are propagated forward from `input_bound`; then, from the
    cotangent bound `gradient_bound` at the chain's output, every layer reports
    its variables' bounds and passes the cotangent bound to its input. Every value
    a layer returns is recorded for `sign_checked` (inside a `recording_signs` context).

    Returns:
        ``([(variable, per-example gradient bound), ...], input cotangent bound)``.
    """
    input_bounds = _input_bounds(layers, input_bound)
    gradient_bound = _as_bounds(gradient_bound)
    bounds = []
    for layer, x_in in zip(reversed(layers), reversed(input_bounds)):
        params = layer.backpropagate_params(x_in, gradient_bound)
        for variable, bound in params:
            _record_sign(layer, f"backpropagate_params ({variable.name})", bound)
        bounds.extend(params)
        gradient_bound = _recorded(layer, "backpropagate_inputs",
                                   layer.backpropagate_inputs(x_in, gradient_bound))
    return bounds, gradient_bound


def chain_lipschitz(layers, input_bound, gradient_bound):
    """`gradient_bound` times the certified Lipschitz constant of the chain's forward map
    (`DPLayer.backpropagate_lipschitz`, layer by layer; each value recorded as in
    `chain_backward`)."""
    gradient_bound = _as_bounds(gradient_bound)
    for layer, x_in in zip(reversed(layers), reversed(_input_bounds(layers, input_bound))):
        gradient_bound = _recorded(layer, "backpropagate_lipschitz",
                                   layer.backpropagate_lipschitz(x_in, gradient_bound))
    return gradient_bound


# The values the layers of one bound pass returned, while `recording_signs` is active.
_SIGN_RECORD = None


@contextlib.contextmanager
def recording_signs():
    """Within this context, `chain_backward`, `chain_lipschitz` and `chain_forward` record
    every value a layer's bound method returns, as ``(description, float64 scalar)``; the
    context yields the list, for `sign_checked`."""
    global _SIGN_RECORD
    outer, _SIGN_RECORD = _SIGN_RECORD, []
    try:
        yield _SIGN_RECORD
    finally:
        _SIGN_RECORD = outer


def _record_sign(layer, method, value):
    if _SIGN_RECORD is not None:
        values = value if isinstance(value, tuple) else (value,)
        for i, v in enumerate(values):
            where = f"[{i}]" if isinstance(value, tuple) else ""
            _SIGN_RECORD.append((f"{layer.name}.{method}{where}", as_bound(v)))


def _recorded(layer, method, value):
    _record_sign(layer, method, value)
    return value


def sign_checked(record, values):
    """`values` (a list of tensors), computed after an assertion that every recorded bound
    is >= 0 (NaN fails it).

    The bound pass only multiplies, adds, divides and takes square roots and minima of
    non-negative numbers (module docstring, "Precision"): a negative or NaN value is a
    wrong bound method (e.g. a sign error that a second one cancels), and the step stops
    with ``InvalidArgumentError`` naming the layers instead of calibrating noise to it.
    """
    if not record:
        return values
    names = tf.constant([name for name, _ in record])
    stacked = tf.stack([value for _, value in record])
    valid = stacked >= 0.0
    check = tf.debugging.Assert(
        tf.reduce_all(valid),
        ["lipdp: negative or NaN bounds returned by DP layers (a layer's bound methods "
         "are wrong; no noise is calibrated to them):", tf.boolean_mask(names, ~valid),
         tf.boolean_mask(stacked, ~valid)], summarize=len(record))
    with tf.control_dependencies([check]):
        return [tf.identity(v) for v in values]


def chain_rounding_error(layers, input_bound, input_error):
    """Float32 error bound at the output of a chain of DP layers (python floats).

    `input_bound` bounds the norm of the chain's exact input and `input_error` the
    distance of its float32 value to it; each layer's `DPLayer.propagate_error`
    maps them to its output. Returns inf once a norm bound plus its error exceeds
    `lipdp.rounding.ACTIVATION_RANGE`, where overflow is no longer excluded, or once a
    layer's error bound is negative or NaN (a wrong `rounding_error`: a radius would grow).
    """
    for layer in layers:
        input_error = layer.propagate_error(input_bound, input_error)
        input_bound = layer.propagate_inputs(input_bound)
        bounds = input_bound if isinstance(input_bound, tuple) else (input_bound,)
        errors = input_error if isinstance(input_error, tuple) else (input_error,)
        if not all(e >= 0 for e in errors):  # a wrong rounding bound (NaN fails too)
            return math.inf
        if not all(float(x) + e <= ACTIVATION_RANGE for x, e in zip(bounds, errors)):
            return math.inf
    return input_error


def _as_bounds(value):
    """A bound, or the pair of a residual section, in `BOUND_DTYPE`."""
    if isinstance(value, tuple):
        return tuple(as_bound(v) for v in value)
    return as_bound(value)


def _input_bounds(layers, input_bound):
    bounds = [_as_bounds(input_bound)]
    for layer in layers[:-1]:
        bounds.append(_recorded(layer, "propagate_inputs", layer.propagate_inputs(bounds[-1])))
    return bounds


def chain_forward(layers, input_bound):
    """Output norm bound of a chain of DP layers for inputs of norm <= `input_bound`."""
    input_bound = _as_bounds(input_bound)
    for layer in layers:
        input_bound = _recorded(layer, "propagate_inputs", layer.propagate_inputs(input_bound))
    return input_bound


def pin_input_shape(layer, input_shape):
    """From now on `layer` refuses inputs of another shape than `input_shape` (the batch
    axis aside; Keras checks its ``input_spec`` at every call, with a ValueError), and
    `check_built_configuration` refuses a configuration changed since this build.

    Its bounds were computed at build for this shape (a convolution's certified norm on its
    H x W torus, the sqrt(P) of a bias shared by P positions, an input clip target): inputs
    of another size would break them silently (an audit trained a model built for 4 x 4
    images on 16 x 16 ones: a bias gradient 4x its bound). So would a configuration changed
    after build (a convolution's strides set from 2 to 1: its bias gradient 1.8x the bound
    computed for the outputs of stride 2)."""
    layer.input_spec = tf.keras.layers.InputSpec(
        shape=(None,) + tuple(tf.TensorShape(input_shape)[1:].as_list()))
    layer._built_configuration = plain_configuration(layer, leave_out=("trainable",))


# Attributes that `call` reads and `get_config` may not hold (a dense layer's `activation`,
# which lipdp's dense layers leave out of their configuration; deel-lip's `coef_lip`, set at
# build from the pool size; an audit changed each after compile, 5.8x to 100x the bound).
_CALL_ATTRIBUTES = ("activation", "coef_lip", "k_coef_lip", "eps_grad_sqrt", "pool_size",
                    "strides", "padding", "kernel_size", "dilation_rate", "groups", "n")


def _plain(value) -> bool:
    if isinstance(value, (list, tuple)):
        return all(_plain(v) for v in value)
    return value is None or isinstance(value, (bool, int, float, str, np.generic))


def plain_configuration(obj, leave_out: Tuple[str, ...] = ()) -> Optional[str]:
    """The entries of ``obj.get_config()`` that are numbers, strings or lists of them, but
    not those named in `leave_out`, and the attributes of `_CALL_ATTRIBUTES` it has (by
    value, a function by name and identity), as JSON (None when `obj` has no configuration).
    Nested objects (initializers, regularizers) are left out: they act at build, and Keras
    serialises them differently inside a legacy HDF5 load. Read eagerly, also while a
    function is traced."""
    try:
        with tf.init_scope():
            config = obj.get_config()
    except (AttributeError, NotImplementedError, TypeError):
        return None
    kept = {key: value for key, value in config.items()
            if _plain(value) and key not in leave_out}
    for name in _CALL_ATTRIBUTES:
        value = getattr(obj, name, None)
        if callable(value):
            kept["." + name] = f"{getattr(value, '__name__', type(value).__name__)}@{id(value)}"
        elif value is not None and _plain(value):
            kept["." + name] = value
    return json.dumps(kept, sort_keys=True, default=lambda v: v.item())


def replaced_call(obj) -> Optional[str]:
    """``'call'`` or ``'__call__'`` when `obj` has one set on the instance (patched), else
    None: a patched call computes what no bound method describes (an audit scaled a
    model's, a layer's and a loss's outputs by 100 this way, each trained at 100x the
    bound). The class's own method bound to `obj` is not a patch: Keras' SavedModel saving
    leaves each layer's ``call`` set so, and the saved model's bounds were refused (an
    audit, 2026-12-07)."""
    for name in ("call", "__call__"):
        value = vars(obj).get(name)
        if value is None:
            continue
        if isinstance(value, types.MethodType) and value.__self__ is obj and \
                value.__func__ is getattr(type(obj), name, None):
            continue
        return name
    return None


def changed_keys(before: str, after: str) -> List[str]:
    """The names (configuration keys and attributes) whose values differ between two
    `plain_configuration` strings."""
    old, new = json.loads(before), json.loads(after)
    return sorted({key.lstrip(".") for key in {*old, *new} if old.get(key) != new.get(key)})


def check_built_configuration(layer) -> None:
    """Raise ValueError when `layer` has a `call` patched on the instance, or when its
    configuration (`plain_configuration`, `trainable` aside) changed since it was recorded:
    by `pin_input_shape` at build, else here at the first check after build (a DP model
    checks its layers when it is made). The bounds cached at build, or computed from the
    configuration, no longer describe `call`."""
    patched = replaced_call(layer)
    if patched:
        raise ValueError(f"Layer '{layer.name}' ({type(layer).__name__}) has its `{patched}` "
                         "replaced on the instance: its bounds describe its class's call. "
                         "Subclass the layer and give it bounds that hold instead.")
    built = getattr(layer, "_built_configuration", None)
    now = plain_configuration(layer, leave_out=("trainable",))
    if built is None and layer.built:  # a layer that records nothing when it is built
        layer._built_configuration = now
    elif built is not None and now is not None and built != now:
        raise ValueError(
            f"Layer '{layer.name}' ({type(layer).__name__}) had its "
            f"{', '.join(changed_keys(built, now))} "
            "changed after it was built: its bounds were computed at build and `call` reads "
            "the new value. Make a new layer (and model) with that setting instead.")


_FLOAT32_NORMAL = (float(np.finfo(np.float32).tiny), float(np.finfo(np.float32).max))


#: The least ``eps_grad_sqrt`` of the L2-norm poolings. Their gradient is deel-lip's
#: ``k dy x / (sqrt(u) + eps)``, u the window's float32 sum of squares: it stays within the
#: bound k |dy| only while eps covers what float32 loses of u to underflow (squares and sums
#: flushed below 2^-126: ``sqrt(u) >= ||x|| (1 - t) - sqrt((6a + 1) mu)`` for a window of a
#: coordinates, `lipdp.rounding.block_norm_error`'s proof), which 1e-12 does for any window of
#: fewer than 10^13 coordinates. An audit (2026-12-06) reached 2.4 times the bound at eps =
#: 1e-20 and 1.5e8 at 1e-24 with records scaled to 1e-18.
MIN_EPS_GRAD_SQRT = 1e-12


def check_at_least(value, name, least, why) -> float:
    """``float(value)`` for a number in float32's normal range (`check_positive`) and at least
    `least`; a ValueError naming `name` and saying `why` the floor is there otherwise."""
    value = check_positive(value, name)
    if value < least:
        raise ValueError(f"Received {name}={value!r}, below {least:g}: {why}")
    return value


def check_eps_grad_sqrt(value) -> float:
    """``float(value)`` for an L2-norm pooling's ``eps_grad_sqrt`` of at least
    `MIN_EPS_GRAD_SQRT`; a ValueError otherwise."""
    return check_at_least(
        value, "eps_grad_sqrt", MIN_EPS_GRAD_SQRT,
        "the pooling's gradient k x / (sqrt(u) + eps) exceeds its bound k when the window's "
        "squares underflow in float32 (activations below 1e-19) and eps does not make up for "
        "them. Keep deel-lip's default, 1e-6.")


def check_positive(value, name) -> float:
    """``float(value)`` for a positive number in float32's normal range (``1.2e-38`` to
    ``3.4e38``: the step computes in float32); a ValueError naming `name` otherwise. Below
    it a temperature or a floor is flushed to 0 in the step (a temperature of 1e-39 gave NaN
    gradients on every record, a K-cosine floor of 1e-39 on the all-zero record only, which
    stopped the step that sampled it); above it, it is an infinity."""
    return _check_in_float32_normal_range(value, name, "a positive number")


def check_zero_or_positive(value, name) -> float:
    """``float(value)`` for 0 or a positive number in float32's normal range (as
    `check_positive`); a ValueError naming `name` otherwise."""
    if isinstance(value, numbers.Real) and not isinstance(value, bool) and value == 0:
        return 0.0
    return _check_in_float32_normal_range(value, name, "0 or a positive number")


def _check_in_float32_normal_range(value, name, expected) -> float:
    low, high = _FLOAT32_NORMAL
    if not isinstance(value, numbers.Real) or isinstance(value, bool) \
            or not math.isfinite(value) or not low <= value <= high:
        raise ValueError(f"Received an invalid value for `{name}`, expected {expected} "
                         f"in float32's normal range [{low:.3g}, {high:.3g}]. Received: "
                         f"{name}={value!r}")
    return float(value)
