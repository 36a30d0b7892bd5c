"""The contract every DP layer fulfils: backpropagation for bounds.

A DP layer is a Keras layer that also implements three pure functions of scalar
bounds (TF float32 scalars, evaluated at the layer's *current* weights so that
they run inside the compiled train step):

``propagate_inputs(X_in) -> X_out``
    an upper bound of ``||f(x)||_2`` over all ``||x||_2 <= X_in`` (one example).
``backpropagate_params(X_in, G) -> [(variable, bound), ...]``
    for every trainable variable ``v`` of the layer, an upper bound of
    ``||d<g, f(x)>/dv||_2`` over all inputs ``||x|| <= X_in`` and all cotangents
    ``||g|| <= G`` at the layer output: the per-example gradient bound of ``v``.
``backpropagate_inputs(X_in, G) -> G_in``
    an upper bound of ``||d<g, f(x)>/dx||_2`` (the cotangent at the input),
    i.e. ``G`` times the Lipschitz constant of the layer w.r.t. its input.

Bounds are with respect to the variable *itself*: when ``call`` multiplies a
variable by a constant, the bound carries that constant.

Layers whose weights are constrained also implement ``project()``, which applies
the projection in place (after each optimizer step, and once at build so that
the constraints hold from the first step on).
"""

from __future__ import annotations

import abc

import tensorflow as tf


class DPLayer(abc.ABC):
    """Mixin for Keras layers with analytic per-example gradient bounds.

    Inheriting from this class guarantees nothing by itself: each subclass must
    prove (in its docstring) and test (against exact per-example gradients) the
    bounds it returns.
    """

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

    def project(self):
        """Enforce the layer's weight constraints in place (no-op by default)."""
        return None

    def lipschitz_bound(self):
        """Certified Lipschitz constant w.r.t. the input (``G_in`` for ``G = 1``)."""
        return self.backpropagate_inputs(tf.constant(float("inf")), tf.constant(1.0))


def check_no_activation(layer_name, activation):
    """DP dense/conv layers are linear: activations must be separate DP layers."""
    if activation not in (None, "linear"):
        raise ValueError(
            f"{layer_name} does not take an `activation` (received activation="
            f"{activation!r}): add a DP activation layer after it instead, e.g. "
            "`lipdp.layers.DP_GroupSort(2)`."
        )
