"""Spectrally normalised dense layer with analytic gradient bounds."""

from __future__ import annotations

import math

import tensorflow as tf

from lipdp.layers._projection import ProjectedKernelMixin, projection_config
from lipdp.layers.base import DPLayer, check_no_activation
from lipdp.operator_norms import dense_spectral_norm_upper


@tf.keras.utils.register_keras_serializable("lipdp")
class DP_QuickSpectralDense(ProjectedKernelMixin, tf.keras.layers.Dense, DPLayer):
    """Dense layer ``y = x W + b`` whose kernel is projected after every step.

    The projection (deel-lip's spectral normalisation with a cached power
    iteration vector ``u``, then Björck orthogonalisation) keeps ``||W||_2 ~ 1``.
    The stored variable *is* the kernel used in the forward pass.

    Bounds, with ``T`` the number of positions the kernel is applied to
    (``T = 1`` for 2D inputs, the product of the middle dimensions otherwise) and
    ``S`` a certified upper bound of ``||W||_2`` recomputed from the current weights
    (`lipdp.operator_norms.dense_spectral_norm_upper`, never the power iteration):

    - ``propagate_inputs(X) = S X + sqrt(T) ||b||``
    - kernel: ``||sum_t x_t g_t^T||_F <= sum_t ||x_t|| ||g_t|| <= X G``
    - bias: ``||sum_t g_t|| <= sqrt(T) G``
    - ``backpropagate_inputs(X, G) = S G``

    Args:
        units: number of outputs.
        use_bias: whether to add a (trainable, unconstrained) bias.
        kernel_initializer: defaults to "orthogonal".
        eps_spectral, maxiter_spectral, eps_bjorck, beta_bjorck, maxiter_bjorck:
            see `ProjectionConfig`. ``eps_bjorck=None`` disables Björck.
    """

    def __init__(self, units, use_bias=True, kernel_initializer="orthogonal", activation=None,
                 eps_spectral=None, maxiter_spectral=None, eps_bjorck="default",
                 beta_bjorck=None, maxiter_bjorck=None, **kwargs):
        check_no_activation(type(self).__name__, activation)
        self._pop_forbidden_kwargs(type(self).__name__, kwargs)
        if not isinstance(units, int) or units < 1:
            raise ValueError(
                "Received an invalid value for `units`, expected a positive integer. "
                f"Received: units={units!r}"
            )
        super().__init__(units, use_bias=use_bias, kernel_initializer=kernel_initializer, **kwargs)
        self.projection = projection_config(eps_spectral, maxiter_spectral, eps_bjorck,
                                            beta_bjorck, maxiter_bjorck)

    def build(self, input_shape):
        super().build(input_shape)
        input_shape = tf.TensorShape(input_shape)
        if any(d is None for d in input_shape[1:]):
            raise ValueError(
                f"{type(self).__name__} needs a fully known input shape (got {input_shape}) "
                "to bound its bias contribution."
            )
        self._positions = int(math.prod(input_shape[1:-1])) if input_shape.rank > 2 else 1
        self._build_projection(self.units)

    def _spectral_bound(self):
        return dense_spectral_norm_upper(self.kernel)

    def propagate_inputs(self, input_bound):
        return (self._spectral_bound() * input_bound
                + math.sqrt(self._positions) * self._bias_norm())

    def backpropagate_params(self, input_bound, gradient_bound):
        bounds = [(self.kernel, input_bound * gradient_bound)]
        if self.use_bias:
            bounds.append((self.bias, math.sqrt(self._positions) * gradient_bound))
        return bounds

    def backpropagate_inputs(self, input_bound, gradient_bound):
        return self._spectral_bound() * gradient_bound

    def get_config(self):
        return self._projected_config(super().get_config())

