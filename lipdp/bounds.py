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

from typing import Dict, List, Sequence, Tuple

import tensorflow as tf

from lipdp.layers.base import DPLayer
from lipdp.layers.basic import DP_BoundedInput

# Non-DP layers users commonly reach for, and what to use instead.
_REPLACEMENTS = {
    "Dense": "lipdp.layers.DP_QuickSpectralDense",
    "Conv2D": "lipdp.layers.DP_QuickSpectralConv2D",
    "Flatten": "lipdp.layers.DP_Flatten",
    "MaxPooling2D": "lipdp.layers.DP_ScaledL2NormPooling2D",
    "AveragePooling2D": "lipdp.layers.DP_ScaledL2NormPooling2D",
    "ReLU": "lipdp.layers.DP_GroupSort(2)",
    "Activation": "lipdp.layers.DP_GroupSort(2)",
    "BatchNormalization": "nothing: its running statistics leak and its scale is unbounded; "
                          "remove it (Lipschitz networks train without it)",
    "LayerNormalization": "nothing in this release (its division by the norm is unbounded)",
    "Dropout": "nothing: remove it (its 1/(1-rate) rescaling is not bounded by the DP layers)",
    "Lambda": "a DP layer implementing the three bound methods (lipdp.layers.DPLayer)",
}


class NonDPLayerError(TypeError):
    """Raised when a model contains a layer without gradient bounds."""


def _check_dp_layer(layer):
    if isinstance(layer, DPLayer):
        return
    name = type(layer).__name__
    hint = _REPLACEMENTS.get(name, "a DP layer from lipdp.layers")
    raise NonDPLayerError(
        f"Layer '{layer.name}' ({name}) is not a DP layer: lipdp cannot bound the gradients "
        f"flowing through it, so noise could not be calibrated. Use {hint} instead."
    )


def dp_layers(model) -> List[DPLayer]:
    """The model's DP layers in forward order, after checking the model is boundable.

    Raises:
        NonDPLayerError: a layer does not implement the bound methods.
        ValueError: the first layer is not `DP_BoundedInput` (inputs unbounded) or
            the layers do not form a chain.
    """
    layers = [layer for layer in model.layers if not isinstance(layer, tf.keras.layers.InputLayer)]
    if not layers:
        raise ValueError("The model has no layers.")
    for layer in layers:
        _check_dp_layer(layer)
    if not isinstance(layers[0], DP_BoundedInput):
        raise ValueError(
            f"The first layer of a DP model must be lipdp.layers.DP_BoundedInput (got "
            f"'{layers[0].name}', {type(layers[0]).__name__}): without it the input norm is "
            "unbounded, and so is every gradient."
        )
    if not isinstance(model, tf.keras.Sequential):
        _check_chain(layers)
    return layers


def _check_chain(layers: Sequence[tf.keras.layers.Layer]):
    for previous, layer in zip(layers, layers[1:]):
        nodes = layer.inbound_nodes
        if len(nodes) != 1 or nodes[0].input_tensors is not previous.output:
            raise ValueError(
                f"Layer '{layer.name}' does not take the output of '{previous.name}' as its only "
                "input: this release bounds chains of layers only."
            )


def backpropagate_bounds(layers: Sequence[DPLayer], loss_lipschitz) -> List[Tuple[tf.Variable, tf.Tensor]]:
    """Per-example gradient bound of every trainable variable of `layers` (TF scalars)."""
    input_bounds = [tf.constant(float("inf"))]
    for layer in layers:
        input_bounds.append(layer.propagate_inputs(input_bounds[-1]))
    gradient_bound = tf.constant(float(loss_lipschitz), tf.float32)
    bounds = []
    for layer, x_in in zip(reversed(layers), reversed(input_bounds[:-1])):
        bounds.extend(layer.backpropagate_params(x_in, gradient_bound))
        gradient_bound = layer.backpropagate_inputs(x_in, gradient_bound)
    return bounds


def lipschitz_bound(model) -> tf.Tensor:
    """Certified Lipschitz constant of the model w.r.t. its input (product over layers)."""
    constant = tf.constant(1.0)
    for layer in reversed(dp_layers(model)):
        constant = layer.backpropagate_inputs(tf.constant(float("inf")), constant)
    return constant


def _loss_lipschitz(model, loss):
    loss = loss if loss is not None else getattr(model, "dp_loss", None)
    if loss is None:
        raise ValueError("Pass `loss=` or compile the model with a DP loss first.")
    from lipdp.losses import DP_Loss  # local import: losses depend on nothing here

    if not isinstance(loss, DP_Loss):
        raise TypeError(f"{type(loss).__name__} is not a DP loss (lipdp.losses.DP_*).")
    return loss.lipschitz(int(model.output_shape[-1]))


def gradient_bounds(model, loss=None) -> Dict[str, float]:
    """Per-example gradient norm bound of every trainable variable, at the current weights.

    Args:
        model: a built DP model (`DP_Sequential`, `DP_Model`, or any Keras model
            made of DP layers starting with `DP_BoundedInput`).
        loss: a DP loss; defaults to the loss the model was compiled with.

    Returns:
        ``{variable.name: bound}`` where, for every example ``(x, y)``,
        ``||grad_v loss(f(x), y)||_2 <= bound`` (not divided by the batch size).
    """
    bounds = backpropagate_bounds(dp_layers(model), _loss_lipschitz(model, loss))
    return {variable.name: float(bound) for variable, bound in bounds}
