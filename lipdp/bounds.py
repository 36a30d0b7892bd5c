"""Backpropagation for bounds (Algorithm 1 of the Clipless DP-SGD paper).

Forward: starting from the declared input bound, each layer maps the bound on
its input norm to a bound on its output norm (``propagate_inputs``).
Backward: starting from ``G = L`` (the loss' Lipschitz constant w.r.t. the
logits), each layer reports the per-example gradient bound of its variables
(``backpropagate_params``) and passes the cotangent bound to its input
(``backpropagate_inputs``).

The result is, for every trainable variable ``v`` and every example ``(x, y)``
with ``x`` inside the input bound, ``||grad_v loss(f(x), y)||_2 <= bound(v)``, at
the current weights. These are *per-example* bounds: the train step divides them
by its public batch denominator.
"""

from __future__ import annotations

import contextlib
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

from lipdp.layers.base import (DPLayer, as_bound, cached_operator_norm, chain_backward,
                               chain_lipschitz, check_built_configuration, check_positive,
                               operator_norm_cache, recording_signs, replaced_call,
                               sign_checked, with_pass_slack)
from lipdp.layers.basic import DP_BoundedActivation, DP_BoundedInput
from lipdp.layers.residual import DP_MergeResidual, DP_SplitResidual, DP_WrappedResidual
from lipdp.metadata import DPMode
from lipdp.operator_norms import certified_norms, without_projection_certificate

# Non-DP layers users commonly reach for, and what to use instead (a sentence where nothing
# replaces them).
_REMOVALS = {
    "Dropout": "Remove it: its 1/(1-rate) rescaling at train time is not bounded.",
}
_REPLACEMENTS = {
    "Dense": "lipdp.layers.DP_QuickSpectralDense",
    "Conv2D": "lipdp.layers.DP_QuickSpectralConv2D",
    "Flatten": "lipdp.layers.DP_Flatten",
    "MaxPooling2D": "lipdp.layers.DP_MaxPool2D or lipdp.layers.DP_ScaledL2NormPooling2D",
    "AveragePooling2D": "lipdp.layers.DP_ScaledL2NormPooling2D",
    "GlobalAveragePooling2D": "lipdp.layers.DP_GlobalL2NormPooling2D",
    "GlobalMaxPooling2D": "lipdp.layers.DP_GlobalL2NormPooling2D",
    "ReLU": "lipdp.layers.DP_ReLU (or DP_GroupSort(2), which preserves gradient norms)",
    "Activation": "lipdp.layers.DP_GroupSort(2), DP_ReLU, DP_Tanh, DP_Sigmoid or DP_Softplus",
    "Reshape": "lipdp.layers.DP_Reshape",
    "Permute": "lipdp.layers.DP_Permute",
    "Add": "lipdp.layers.make_residuals (DP_SplitResidual / DP_WrappedResidual / "
           "DP_MergeResidual)",
    "BatchNormalization": "lipdp.layers.DP_LayerCentering (BatchNormalization's running "
                          "statistics leak and its scale is unbounded)",
    "LayerNormalization": "lipdp.layers.DP_LayerCentering (the division by the norm is "
                          "unbounded)",
    "Lambda": "a DP layer implementing the three bound methods (lipdp.layers.DPLayer): an "
              "arbitrary function has no known bound",
}


class NonDPLayerError(TypeError):
    """Raised when a model contains a layer without gradient bounds."""


def _check_dp_layer(layer):
    if isinstance(layer, DPLayer):
        return
    name = type(layer).__name__
    advice = _REMOVALS.get(name) or \
        f"Use {_REPLACEMENTS.get(name, 'a DP layer from lipdp.layers')} instead."
    raise NonDPLayerError(
        f"Layer '{layer.name}' ({name}) is not a DP layer: lipdp has no bound for it, neither "
        f"for the gradients flowing through it (Clipless noise) nor for its Lipschitz constant "
        f"(certified radii). {advice}"
    )


def dp_layers(model) -> List[DPLayer]:
    """The model's DP layers in forward order, after checking the model is boundable.

    Raises:
        NonDPLayerError: a layer does not implement the bound methods.
        ValueError: the model is not built, the first layer is not `DP_BoundedInput` (inputs
            unbounded) or the layers do not form a chain.
    """
    _check_graph_call(model)
    # certify raised AttributeError 'kernel' on an unbuilt model (an audit)
    require_built(model, "its bounds and certificates need every layer's weights and input "
                         "shape")
    layers = [layer for layer in model.layers if not isinstance(layer, tf.keras.layers.InputLayer)]
    if not layers:
        raise ValueError("The model has no layers.")
    for layer in layers:
        _check_dp_layer(layer)
        for part in layer._flatten_layers(include_self=True, recursive=True):
            check_built_configuration(part)
    if not isinstance(layers[0], DP_BoundedInput):
        raise ValueError(
            f"The first layer of a DP model must be lipdp.layers.DP_BoundedInput (got "
            f"'{layers[0].name}', {type(layers[0]).__name__}): without it the input norm is "
            "unbounded, and so is every gradient."
        )
    if not isinstance(model, tf.keras.Sequential):
        _check_chain(layers)
    check_residual_sections(layers)
    _check_called_once(model, layers)
    check_single_use(layers)
    return layers


def require_built(model, why: str) -> None:
    """Raise ValueError, saying `why` and how to build it, when `model` is not built."""
    if not getattr(model, "built", True):
        raise ValueError(
            f"Model '{model.name}' is not built: {why}. Give its first layer an input shape "
            "(e.g. DP_BoundedInput(bound, input_shape=(28, 28, 1))) or an Input, or call "
            "`model.build((None, ...))`.")


def _check_graph_call(model):
    """The bounds and certificates follow the model's layer graph: its `call` must be Keras'
    functional or Sequential call, which computes that graph and nothing else. A subclass
    whose own `call` divided the output by 0.01 compiled and trained with exact per-example
    gradients 100x the bound (an audit, 2026-12-05). The class bodies above Keras' graph class
    are read too (``vars``): a descriptor shows a class look-up Keras' `call` and the model
    another (as one hid a replaced `train_step`: `lipdp.model._refuse_replaced_step_methods`)."""
    from keras.src.engine.functional import Functional

    mro = type(model).__mro__
    graph = next((i for i, cls in enumerate(mro) if cls in (Functional, tf.keras.Sequential)),
                 len(mro))
    if type(model).call not in (Functional.call, tf.keras.Sequential.call) \
            or type(model).__call__ is not tf.keras.Model.__call__ or replaced_call(model) \
            or any(name in vars(cls) for cls in mro[:graph] for name in ("call", "__call__")):
        raise ValueError(
            f"Model '{model.name}' ({type(model).__name__}) computes its outputs with a `call` "
            "of its own, but the bounds and certificates follow its layer graph (inputs to "
            "outputs, as Keras' functional and Sequential models call it): whatever that "
            "`call` adds is outside every bound. Build the computation from DP layers in the "
            "graph instead.")


def _check_called_once(model, layers):
    """Keras lists a layer once in ``model.layers`` even when the model calls it twice
    (``Sequential([d, act, d])``): count the calls in the model's own graph."""
    if getattr(model, "_is_graph_network", False):
        nodes = model._network_nodes  # keys "<layer name>_ib-<node index>" (Keras 2)
        calls = {id(layer): sum(f"{layer.name}_ib-{i}" in nodes
                                for i in range(len(layer.inbound_nodes))) for layer in layers}
    else:  # a Sequential built lazily keeps one entry per `add`
        tracked = [t for t in getattr(model, "_self_tracked_trackables", layers)
                   if not isinstance(t, tf.keras.layers.InputLayer)]
        calls = {id(layer): sum(t is layer for t in tracked) for layer in layers}
    for layer in layers:
        if calls[id(layer)] > 1:
            raise _used_twice(f"Layer '{layer.name}'", f"{calls[id(layer)]} calls")


def _used_twice(what, where) -> ValueError:
    return ValueError(
        f"{what} is used more than once in the model ({where}): its gradient sums every use, "
        "while its bound covers one. Use a new layer instance for each use (weights cannot "
        "be shared in a DP model).")


def _leaves(layers):
    """The layers of a chain with every residual branch expanded, one entry per use."""
    for layer in layers:
        if isinstance(layer, DP_WrappedResidual):
            yield from _leaves(layer.branch)
        else:
            yield layer


def _certified_leaves(layers, excluded=()):
    """The certified layers of the chain, branches expanded, but for those in `excluded`."""
    return [layer for layer in _leaves(layers) if hasattr(layer, "certified_norm_request")
            and not any(layer is other for other in excluded)]


def certified_norm_requests(layers):
    """What the private step's bound pass asks `lipdp.operator_norms.certified_norms` to
    certify for the chain `layers`, one request per certified layer whose norm a gradient
    bound reads (`norms_no_gradient_bound_reads`)."""
    unread = norms_no_gradient_bound_reads(list(layers))
    return [layer.certified_norm_request() for layer in _certified_leaves(layers, unread)]


def check_single_use(layers: Sequence[tf.keras.layers.Layer]):
    """Every layer instance, and every trainable variable, is used once in the chain.

    Backpropagation for bounds gives each variable the bound of *one* use, while
    the gradient of a variable used k times is the sum of k terms (up to k times
    the bound). Using a layer twice (in a chain, in a residual branch, in two
    sections, inside and outside one) is therefore refused, as is a variable
    owned by two layers.

    Raises:
        ValueError: naming the layer (or variable) used more than once.
    """
    seen_layers, seen_variables = set(), {}
    for layer in _leaves(layers):
        if id(layer) in seen_layers:
            raise _used_twice(f"Layer '{layer.name}'", "twice in the chain or its branches")
        seen_layers.add(id(layer))
        for v in layer.trainable_weights:
            if v.ref() in seen_variables:
                raise _used_twice(f"Variable '{v.name}'", f"by layers "
                                  f"'{seen_variables[v.ref()]}' and '{layer.name}'")
            seen_variables[v.ref()] = layer.name


def check_residual_sections(layers: Sequence[tf.keras.layers.Layer]):
    """Split / wrapped / merge layers must form closed, non-nested sections."""
    inside = False
    for layer in layers:
        if isinstance(layer, DP_SplitResidual):
            if inside:
                raise ValueError(f"'{layer.name}' opens a residual section inside another one: "
                                 "sections do not nest.")
            inside = True
        elif isinstance(layer, DP_MergeResidual):
            if not inside:
                raise ValueError(f"'{layer.name}' closes a residual section that was never "
                                 "opened by a DP_SplitResidual.")
            inside = False
        elif inside != isinstance(layer, DP_WrappedResidual):
            where = "inside" if inside else "outside"
            raise ValueError(
                f"Layer '{layer.name}' ({type(layer).__name__}) is {where} a residual section: "
                "between DP_SplitResidual and DP_MergeResidual every layer must be wrapped in "
                "DP_WrappedResidual, and only there (use lipdp.layers.make_residuals).")
    if inside:
        raise ValueError("The model ends inside a residual section: close it with "
                         "DP_MergeResidual.")


def _check_chain(layers: Sequence[tf.keras.layers.Layer]):
    for previous, layer in zip(layers, layers[1:]):
        nodes = layer.inbound_nodes
        if len(nodes) != 1 or nodes[0].input_tensors is not previous.output:
            raise ValueError(
                f"Layer '{layer.name}' does not take the output of '{previous.name}' as its only "
                "input: this release bounds chains of layers only."
            )


def norms_no_gradient_bound_reads(layers) -> List[DPLayer]:
    """The certified layers of the chain `layers` whose operator norm enters no per-example
    gradient bound: at most one, the first layer with trainable variables, when only layers
    without variables or certified norms (activations, reshapes) lie between it and a
    `DP_BoundedActivation` after it.

    Its norm would enter (i) the input bounds of the layers after it, which the
    `DP_BoundedActivation` replaces by its own radius before any layer with variables
    reads them, and (ii) the cotangent bound passed to the layers before it, none of which
    has variables. So its norm may be taken as +inf in `backpropagate_bounds` without
    changing a bound. Were this wrong, some bound would be inf or NaN: the step stops (it
    calibrates noise to finite bounds only), and a test says so."""
    sections = (DP_SplitResidual, DP_WrappedResidual, DP_MergeResidual)
    for i, layer in enumerate(layers):
        if isinstance(layer, sections):
            return []
        if layer.trainable_weights:
            if not hasattr(layer, "certified_norm_request"):
                return []
            for later in layers[i + 1:]:
                if isinstance(later, DP_BoundedActivation):
                    return [layer]
                if (later.weights or hasattr(later, "certified_norm_request")
                        or isinstance(later, sections)):
                    return []
            return []
    return []


@contextlib.contextmanager
def _bound_pass(layers, projection_certificates=False, unread_norms=()):
    """One pass over `layers` at fixed weights: each certified operator norm is computed
    once, and all of them in one host call (`lipdp.operator_norms.certified_norms`).

    With `projection_certificates`, a dense kernel still exactly as its last projection left
    it takes the certificate that projection computed (`lipdp.layers._bjorck.
    certifying_bjorck`: no Gram matrix in the step, up to 0.35% looser); without, every norm
    is certified from the kernel alone, so that what is reported for a trained model (its
    Lipschitz constant, its certified radii) depends on its weights only and is the same
    after it is saved and loaded. The layers in `unread_norms` (`norms_no_gradient_bound_reads`)
    are not certified: their norm is +inf in this pass."""
    with operator_norm_cache():
        for layer in unread_norms:
            cached_operator_norm(layer, lambda: as_bound(float("inf")))
        certified = _certified_leaves(layers, unread_norms)
        if certified:
            requests = [layer.certified_norm_request() for layer in certified]
            if not projection_certificates:
                requests = [without_projection_certificate(r) for r in requests]
            norms = certified_norms(requests)
            for layer, norm in zip(certified, norms):
                cached_operator_norm(layer, lambda norm=norm: norm)
        yield


def backpropagate_bounds(layers: Sequence[DPLayer], loss_lipschitz) -> List[Tuple[tf.Variable, tf.Tensor]]:
    """Per-example gradient bound of every trainable variable of `layers` (float64 TF
    scalars, with the pass's rounding slack: `lipdp.layers.base`, "Precision").

    Inputs are unbounded here: the first layer, `DP_BoundedInput`, bounds them.
    """
    unread = norms_no_gradient_bound_reads(list(layers))
    with _bound_pass(layers, projection_certificates=True, unread_norms=unread), \
            recording_signs() as record:
        bounds = chain_backward(list(layers), as_bound(float("inf")),
                                as_bound(loss_lipschitz))[0]
    checked = sign_checked(record, [b for _, b in bounds])
    return [(v, with_pass_slack(b)) for (v, _), b in zip(bounds, checked)]


def lipschitz_bound(model) -> tf.Tensor:
    """Certified Lipschitz constant of the model w.r.t. its input (product over layers,
    with the two paths of residual sections added); a float64 scalar, with the pass's
    rounding slack."""
    layers = dp_layers(model)
    with _bound_pass(layers), recording_signs() as record:
        bound = chain_lipschitz(layers, as_bound(float("inf")), as_bound(1.0))
    return with_pass_slack(sign_checked(record, [bound])[0])


def _is_step_loss(model, loss) -> bool:
    """`loss` is None or the model's compiled DP loss, and the model is compiled for
    Clipless DP-SGD, whose step states what it differentiates (`per_example_step_loss`,
    `top_gradient_bound`: AdaptiveClipping). A model compiled for classic DP-SGD still has
    the analytic bounds of its loss (its step clips instead of using them)."""
    compiled = getattr(model, "dp_loss", None)
    mechanism = getattr(model, "step_mechanism", None)
    return (compiled is not None and (loss is None or loss is compiled)
            and getattr(mechanism, "mode", None) is DPMode.CLIPLESS
            and callable(getattr(model, "top_gradient_bound", None)))


def per_example_loss_of(model, loss=None):
    """The per-example loss function whose gradients the bounds cover: the step's (the
    logit-gradient clipping of `AdaptiveClipping` included) for the compiled loss."""
    if _is_step_loss(model, loss):
        return model.per_example_step_loss
    return (loss if loss is not None else model.dp_loss).call


def _loss_lipschitz(model, loss):
    if _is_step_loss(model, loss):
        return model.top_gradient_bound()  # the compiled step's (AdaptiveClipping included)
    loss = loss if loss is not None else getattr(model, "dp_loss", None)
    if loss is None:
        raise ValueError("Pass `loss=` or compile the model with a DP loss first.")
    from lipdp.losses import DP_Loss  # local import: losses depend on nothing here

    if not isinstance(loss, DP_Loss):
        raise TypeError(f"{type(loss).__name__} is not a DP loss (lipdp.losses.DP_*).")
    return loss.lipschitz(int(model.output_shape[-1]))


def variable_names(model) -> Dict[object, str]:
    """A readable name, unique within the model, for each trainable variable (by ``ref()``).

    ``"<layer>/<variable>"``, or ``"<wrapper>/<layer>/<variable>"`` inside residual
    sections. Built from layer names (unique in a Keras model and saved with it),
    so they survive a `.keras` round trip, unlike TensorFlow variable names.
    """
    names = {}
    for layer in dp_layers(model):
        owners = [(layer.name, layer)]
        if isinstance(layer, DP_WrappedResidual):
            owners = [(f"{layer.name}/{inner.name}", inner) for inner in layer.branch]
        for prefix, owner in owners:
            for v in owner.trainable_variables:
                names[v.ref()] = f"{prefix}/{v.name.split('/')[-1].split(':')[0]}"
    return names


def gradient_bounds(model, loss=None) -> Dict[str, float]:
    """Per-example gradient norm bound of every trainable variable, at the current weights.

    Args:
        model: a built DP model (`DP_Sequential`, `DP_Model`, or any Keras model
            made of DP layers starting with `DP_BoundedInput`).
        loss: a DP loss; defaults to the loss the model was compiled with.

    Returns:
        ``{name: bound}`` (names from `variable_names`, in the order of
        ``model.trainable_variables``) where, for every example ``(x, y)``,
        ``||grad_v loss(f(x), y)||_2 <= bound`` (not divided by the batch size).
    """
    bounds = {v.ref(): float(b) for v, b in
              backpropagate_bounds(dp_layers(model), _loss_lipschitz(model, loss))}
    names = variable_names(model)
    return {names[v.ref()]: bounds[v.ref()] for v in model.trainable_variables}


def bound_fraction_thresholds(model, fraction: float, loss=None) -> Tuple[float, ...]:
    """Per-variable clipping thresholds ``C_v = fraction * bound(v)``, the analytic bounds
    of `gradient_bounds` at the current weights, for classic DP-SGD with per-layer
    clipping: ``DPParameters(mode="clipped", clipping="per-layer", l2_norm_clip=...)``.

    Where the analytic bounds are loose (the gradients of a Lipschitz network's deeper
    variables reach a few percent of them: `tightness`), Clipless DP-SGD spends its noise
    on norms no example reaches. Clipping each variable's per-example gradient at a
    fraction of its bound divides the sensitivity, and the noise, by ``1 / fraction``;
    examples whose gradient of a variable exceeds its threshold are clipped there (the
    bias of classic DP-SGD). The thresholds are computed once, from the weights alone
    (before training they depend on no data), so they cost no privacy; privacy then rests
    on the clipping (`lipdp.clipping.rules.PerLayerClipping`), not on the bounds.

    Args:
        model: a built DP model (as `gradient_bounds`).
        fraction: the fraction f > 0 of each bound.
        loss: a DP loss; defaults to the compiled one.

    Returns:
        ``C_v`` aligned with ``model.trainable_variables``.
    """
    fraction = check_positive(fraction, "fraction")
    return tuple(fraction * b for b in gradient_bounds(model, loss).values())


def tightness(model, dataset, loss=None, max_batches=None, chunk_size: int = 64,
              function_cache: Optional[dict] = None) -> Dict[str, Dict[str, float]]:
    """How close the observed per-example gradient norms come to their bounds.

    For every trainable variable v, the exact per-example gradient norms
    ``||grad_v loss(f(x_i), y_i)||`` over the examples of `dataset` (vectorised
    Jacobians, `lipdp.per_example`) are divided by the bound used to calibrate
    the noise, at the current weights (the paper's Figures 11-12). A ratio far
    below 1 is noise wasted on that variable; a ratio above 1 would be a broken
    invariant.

    **Not private** when `dataset` is training data: the ratios are computed from
    the exact gradients of those records, outside the noisy gradient, and epsilon
    does not cover them. Use public or held-out data for anything you share.

    Args:
        model: a built DP model.
        dataset: a `tf.data.Dataset` of ``(x, y)`` batches, or a pair of arrays.
        loss: a DP loss; defaults to the loss the model was compiled with.
        max_batches: stop after this many batches (default: the whole dataset).
        chunk_size: examples whose gradients are held in memory at once.
        function_cache: a dict keeping the traced per-example gradient function between
            calls (`lipdp.per_example.chunked_gradient_norms`): repeated calls on the same
            model then trace once.

    Returns:
        ``{name: {"bound", "max_ratio", "mean_ratio", "examples"}}`` with the names
        of `variable_names`.
    """
    from lipdp.per_example import chunked_gradient_norms
    from lipdp.state_guard import run_guarded

    bound_by_ref = {v.ref(): float(b) for v, b in
                    backpropagate_bounds(dp_layers(model), _loss_lipschitz(model, loss))}
    variables = model.trainable_variables
    if isinstance(dataset, (tuple, list)):
        dataset = tf.data.Dataset.from_tensor_slices(tuple(dataset)).batch(256)
    if max_batches is not None:
        dataset = dataset.take(max_batches)
    # Training-mode passes on records, outside a step: under the model's state guard.
    norms = run_guarded(model, "per-example gradients", lambda: chunked_gradient_norms(
        model, per_example_loss_of(model, loss), dataset, chunk_size, variables,
        function_cache))
    if not norms or not norms[0].size:
        raise ValueError("The dataset yielded no examples.")
    names = variable_names(model)
    return {names[v.ref()]: tightness_summary(bound_by_ref[v.ref()], n)
            for v, n in zip(variables, norms)}


def tightness_summary(bound: float, norms) -> Dict[str, float]:
    """``{"bound", "max_ratio", "mean_ratio", "examples"}`` of per-example gradient norms
    against their bound (the rows of `tightness`)."""
    ratios = np.asarray(norms, np.float64) / bound
    return {"bound": float(bound), "max_ratio": float(ratios.max()),
            "mean_ratio": float(ratios.mean()), "examples": int(ratios.size)}
