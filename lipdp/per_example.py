"""Exact per-example gradients, vectorised over the batch.

Used where the gradients themselves are wanted, not only their bound: the
tightness report (`lipdp.bounds.tightness`) and classic clipped DP-SGD.
"""

from __future__ import annotations

from typing import Callable, List, Sequence

import tensorflow as tf


def per_example_gradients(model: tf.keras.Model, per_example_loss: Callable, x, y,
                          variables: Sequence[tf.Variable] = None) -> List[tf.Tensor]:
    """``grad_v loss(f(x_i), y_i)`` for every example i, one tensor per variable.

    The Jacobian of the vector of per-example losses w.r.t. each variable is
    computed with TensorFlow's vectorised Jacobian (pfor). Row i of that
    Jacobian only depends on example i as long as the model has no batch
    coupling (DP layers have none); in the backward pass every cotangent is then
    the one of example i alone.

    Args:
        model: a Keras model (called with ``training=True``).
        per_example_loss: ``(y_true, y_pred) -> (batch,)`` losses.
        x, y: a batch.
        variables: defaults to ``model.trainable_variables``.

    Returns:
        A list aligned with `variables` of tensors of shape ``(batch,) + v.shape``
        (zeros for a variable the loss does not depend on).
    """
    variables = list(model.trainable_variables if variables is None else variables)
    with tf.GradientTape(persistent=False) as tape:
        losses = per_example_loss(y, model(x, training=True))
    jacobians = tape.jacobian(losses, variables,
                              unconnected_gradients=tf.UnconnectedGradients.ZERO,
                              experimental_use_pfor=True)
    return list(jacobians)


def per_example_gradient_norms(gradients: Sequence[tf.Tensor]) -> List[tf.Tensor]:
    """The ``(batch,)`` L2 norm of each per-example gradient tensor."""
    return [tf.sqrt(tf.reduce_sum(tf.square(tf.reshape(g, (tf.shape(g)[0], -1))), axis=1))
            for g in gradients]
