"""Dense layers with analytic gradient bounds: spectral (projected or reparametrised)
and Frobenius-normalised."""

from __future__ import annotations

import math

import numpy as np
import tensorflow as tf

from lipdp.layers._projection import (ProjectedKernelMixin, ReparametrizedKernelMixin,
                                      projection_config)
from lipdp.layers.base import (DPLayer, as_bound, bias_norm, certified_operator_norm,
                               check_no_activation, pin_input_shape)
from lipdp.rounding import addition_error, product_error

_FORBIDDEN = ("kernel_constraint", "kernel_regularizer", "bias_regularizer", "activity_regularizer")


class _BoundedDense(tf.keras.layers.Dense, DPLayer):
    """``y = x W + b`` and the bounds every dense DP layer shares.

    With ``T`` the number of positions the kernel is applied to (``T = 1`` for
    2D inputs, the product of the middle dimensions otherwise) and ``S`` a
    certified upper bound of the spectral norm of the kernel the forward pass
    uses, recomputed from the current weights
    (`lipdp.operator_norms.dense_spectral_norm_upper`, never a power iteration):

    - ``propagate_inputs(X) = S X + sqrt(T) ||b||``
    - kernel: ``||sum_t x_t g_t^T||_F <= sum_t ||x_t|| ||g_t|| <= X G``
      (Cauchy-Schwarz, the token/channel-mixing argument of appendix C.2.4)
    - bias: ``||sum_t g_t|| <= sqrt(T) G``
    - ``backpropagate_inputs(X, G) = S G``
    - ``rounding_error(X)``: Lemma 1 of `lipdp.rounding` for ``x W`` (n = input
      width products per output, ``||W_S|| <= S`` for every row subset, ``||W||_F``),
      then Lemma 2 for the bias add on outputs of norm ``<= S X + sqrt(T) ||b||``.
    """

    def __init__(self, units, use_bias=True, kernel_initializer="orthogonal", activation=None,
                 **kwargs):
        check_no_activation(type(self).__name__, activation)
        for key in _FORBIDDEN:
            if kwargs.pop(key, None) is not None:
                raise ValueError(f"{type(self).__name__} does not accept `{key}`.")
        if not isinstance(units, int) or isinstance(units, bool) or units < 1:
            raise ValueError(
                "Received an invalid value for `units`, expected a positive integer. "
                f"Received: units={units!r}"
            )
        super().__init__(units, use_bias=use_bias, kernel_initializer=kernel_initializer, **kwargs)

    def build(self, input_shape):
        super().build(input_shape)
        input_shape = tf.TensorShape(input_shape)
        if any(d is None for d in input_shape[1:]):
            raise ValueError(
                f"{type(self).__name__} needs a fully known input shape (got {input_shape}) "
                "to bound its bias contribution."
            )
        self._positions = int(math.prod(input_shape[1:-1])) if input_shape.rank > 2 else 1
        pin_input_shape(self, input_shape)

    def bounded_kernel(self):
        """The kernel the forward pass multiplies by (what S bounds)."""
        return self.kernel

    def certified_norm_request(self):
        """What `lipdp.operator_norms.certified_norms` needs to certify S (with the
        power-iteration vector of a projected layer as a hint for its estimate, and the
        certificate its last projection left, valid while the kernel is unchanged)."""
        hint = getattr(self, "u", None)
        cache = self.certificate_cache() if hasattr(self, "certificate_cache") else None
        request = ("dense", self.bounded_kernel(), None)
        if cache is not None:
            request = ("cached-dense", self.bounded_kernel(), None) + tuple(cache)
        return request if hint is None else request + (hint,)

    def _spectral_bound(self):
        return certified_operator_norm(self)

    def propagate_inputs(self, input_bound):
        return (self._spectral_bound() * as_bound(input_bound)
                + math.sqrt(self._positions) * bias_norm(self))

    def backpropagate_params(self, input_bound, gradient_bound):
        gradient_bound = as_bound(gradient_bound)
        bounds = [(self.kernel, as_bound(input_bound) * gradient_bound)]
        if self.use_bias:
            bounds.append((self.bias, math.sqrt(self._positions) * gradient_bound))
        return bounds

    def backpropagate_inputs(self, input_bound, gradient_bound):
        return self._spectral_bound() * as_bound(gradient_bound)

    def rounding_error(self, input_bound):
        kernel = np.asarray(self.bounded_kernel(), np.float64)
        spectral = float(self._spectral_bound())
        error = product_error(kernel.shape[0], spectral, np.linalg.norm(kernel), input_bound,
                              np.max(np.abs(kernel)))
        if not self.use_bias:
            return error
        bias_norm = np.linalg.norm(np.asarray(self.bias, np.float64))
        return addition_error(error, spectral * input_bound
                              + math.sqrt(self._positions) * bias_norm)

    def get_config(self):
        config = super().get_config()
        for key in _FORBIDDEN + ("activation", "bias_constraint"):
            config.pop(key, None)
        return config


@tf.keras.utils.register_keras_serializable("lipdp")
class DP_QuickSpectralDense(ProjectedKernelMixin, _BoundedDense):
    """Dense layer whose kernel variable is projected after every step.

    The projection (deel-lip's spectral normalisation with a cached power
    iteration vector ``u``, then Björck orthogonalisation) keeps ``||W||_2 ~ 1``.
    The stored variable *is* the kernel used in the forward pass. Bounds: see
    `_BoundedDense` (kernel ``X G``, bias ``sqrt(T) G``, Lipschitz ``S``).

    Args:
        units: number of outputs.
        use_bias: whether to add a (trainable, unconstrained) bias.
        kernel_initializer: defaults to "orthogonal".
        eps_spectral, maxiter_spectral, eps_bjorck, beta_bjorck, maxiter_bjorck:
            see `ProjectionConfig`. ``eps_bjorck=None`` disables Björck.
    """

    _keeps_projection_certificate = True

    def __init__(self, units, use_bias=True, kernel_initializer="orthogonal", activation=None,
                 eps_spectral=None, maxiter_spectral=None, eps_bjorck="default",
                 beta_bjorck=None, maxiter_bjorck=None, **kwargs):
        super().__init__(units, use_bias=use_bias, kernel_initializer=kernel_initializer,
                         activation=activation, **kwargs)
        self.projection = projection_config(eps_spectral, maxiter_spectral, eps_bjorck,
                                            beta_bjorck, maxiter_bjorck)

    def build(self, input_shape):
        super().build(input_shape)
        self._build_projection(self.units)

    def get_config(self):
        return self._projected_config(super().get_config())


@tf.keras.utils.register_keras_serializable("lipdp")
class DP_SpectralDense(ReparametrizedKernelMixin, DP_QuickSpectralDense):
    """Reparametrised spectral dense layer: the forward pass uses ``Wbar = Pi(V)``.

    As deel-lip's SpectralDense, the kernel the forward pass uses is the
    orthogonalised (spectral normalisation + Björck) version of a free variable
    V; unlike it, the gradient w.r.t. V is taken straight through the projection
    (`ReparametrizedKernelMixin`), so the bounds of `_BoundedDense` hold for V
    with ``S`` certified on ``Wbar``. Same arguments as `DP_QuickSpectralDense`.
    """

    def build(self, input_shape):
        _BoundedDense.build(self, input_shape)
        self._build_reparametrization()
        self._build_projection(self.units)

    def call(self, inputs):
        outputs = tf.tensordot(inputs, self.forward_kernel(), [[inputs.shape.rank - 1], [0]])
        if self.use_bias:
            outputs = tf.nn.bias_add(outputs, self.bias)
        return outputs


@tf.keras.utils.register_keras_serializable("lipdp")
class DP_QuickFrobeniusDense(_BoundedDense):
    """Dense layer whose kernel is divided by its Frobenius norm after every step.

    ``||W||_2 <= ||W||_F = 1``: cheaper than the spectral projection (no power
    iteration, no Björck) and exactly norm preserving for a single output. The
    bounds are those of `_BoundedDense`, with ``S`` certified on the current
    kernel (so they hold before the first projection too).

    Args:
        units: number of outputs.
        use_bias: whether to add a (trainable, unconstrained) bias.
        kernel_initializer: defaults to "orthogonal".
    """

    def build(self, input_shape):
        super().build(input_shape)
        with tf.init_scope():
            self.project()

    def project(self, orthogonalise=True):
        del orthogonalise  # no Björck here
        self.kernel.assign(self.kernel / tf.maximum(tf.norm(self.kernel), 1e-12))
