"""RKO convolution with analytic gradient bounds."""

from __future__ import annotations

import math

import numpy as np
import tensorflow as tf
from deel.lip.layers.convolutional import _compute_conv_lip_factor

from lipdp.layers._projection import (ProjectedKernelMixin, ReparametrizedKernelMixin,
                                      projection_config)
from lipdp.layers.base import (DPLayer, as_bound, bias_norm, certified_operator_norm,
                               check_no_activation, pin_input_shape)
from lipdp.operator_norms import conv_frequency_grid, dense_spectral_norm_upper
from lipdp.rounding import SMALLEST_NORMAL, addition_error, product_error


def patch_multiplicity(kernel_size, strides):
    """Max number of convolution windows that contain one input pixel.

    Along an axis with window k and stride t, windows start every t pixels, so a
    pixel lies in at most ceil(k / t) of them (zero padding only removes windows).
    """
    return int(np.prod([math.ceil(k / t) for k, t in zip(kernel_size, strides)]))


@tf.keras.utils.register_keras_serializable("lipdp")
class DP_QuickSpectralConv2D(ProjectedKernelMixin, tf.keras.layers.Conv2D, DPLayer):
    """2D convolution ``y = conv(x, N * Psi) + b`` with an RKO-projected variable Psi.

    The trainable variable ``Psi`` (shape ``(kh, kw, C, F)``) is kept, after every
    step, with its ``(kh kw C) x F`` reshaping orthonormalised by deel-lip's RKO
    projection (cached power iteration + Björck). ``call`` multiplies it by the
    constant ``N`` of deel-lip (`_compute_conv_lip_factor`, ~ 1/sqrt(kh kw)) so
    that the operator is approximately 1-Lipschitz.

    Bounds (``m = ceil(kh/sh) ceil(kw/sw)``, the most windows a pixel belongs to;
    ``P`` the number of output pixels; ``S`` a certified upper bound of the
    operator norm of ``x -> conv(x, N Psi)`` recomputed from the current weights,
    `lipdp.operator_norms.conv_operator_norm_upper`):

    - kernel: ``d<g, y>/dPsi = N sum_p patch_p(x) g_p^T``, whose norm is at most
      ``N sqrt(sum_p ||patch_p(x)||^2) ||g|| <= N sqrt(m) X G`` (Cauchy-Schwarz;
      each pixel appears in at most m patches). Independent of Psi: the bound
      holds whatever the projection did.
    - bias (broadcast to every output pixel): ``||sum_p g_p|| <= sqrt(P) G``.
    - ``propagate_inputs(X) = S X + sqrt(P) ||b||``; ``backpropagate_inputs = S G``.
    - ``rounding_error(X)``: Lemma 1 of `lipdp.rounding` on the im2col rows
      (``kh kw C`` products per output; with ``K`` the ``(kh kw C) x F`` reshaping
      of ``N Psi``, ``sqrt(m) ||K||_2`` for every subset of the products, a certified
      norm, and ``sqrt(m) ||K||_F``), then Lemma 2 for the bias add. The exact map
      convolves with the float32 tensor ``N * Psi`` itself (the one the operator
      norm is certified on), so rounding that product is not an error; ``call``
      recomputes it, identically but for flushing (``|dK| <= mu`` entry-wise), hence
      the extra ``sqrt(m) sqrt(#K) mu X``.

    Padding 'same' and 'valid' and any strides are supported; dilation, groups
    and channels_first are rejected.
    """

    def __init__(self, filters, kernel_size, strides=(1, 1), padding="same", use_bias=True,
                 kernel_initializer="orthogonal", activation=None, eps_spectral=None,
                 maxiter_spectral=None, eps_bjorck="default", beta_bjorck=None,
                 maxiter_bjorck=None, **kwargs):
        check_no_activation(type(self).__name__, activation)
        name = type(self).__name__
        if str(padding).lower() not in ("same", "valid"):
            raise ValueError(
                f"{name} supports padding 'same' or 'valid'. Received: padding={padding!r}"
            )
        if kwargs.get("data_format", "channels_last") not in (None, "channels_last"):
            raise ValueError(f"{name} only supports data_format='channels_last'. "
                             f"Received: data_format={kwargs['data_format']!r}")
        if tuple(np.atleast_1d(kwargs.get("dilation_rate", 1))) not in ((1,), (1, 1)):
            raise ValueError(f"{name} does not support dilation. "
                             f"Received: dilation_rate={kwargs['dilation_rate']!r}")
        if kwargs.get("groups", 1) != 1:
            raise ValueError(f"{name} does not support groups. Received: groups={kwargs['groups']!r}")
        # None would resolve to Keras' global image data format, channels_first where a user's
        # keras.json says so: the bounds would count channels and pixels on the wrong axes.
        kwargs["data_format"] = "channels_last"
        self._pop_forbidden_kwargs(name, kwargs)
        if not isinstance(filters, int) or filters < 1:
            raise ValueError(
                "Received an invalid value for `filters`, expected a positive integer. "
                f"Received: filters={filters!r}"
            )
        super().__init__(filters, kernel_size, strides=strides, padding=padding,
                         use_bias=use_bias, kernel_initializer=kernel_initializer, **kwargs)
        self.projection = projection_config(eps_spectral, maxiter_spectral, eps_bjorck,
                                            beta_bjorck, maxiter_bjorck)

    def build(self, input_shape):
        input_shape = tf.TensorShape(input_shape)
        if input_shape.rank != 4 or any(d is None for d in input_shape[1:]):
            raise ValueError(
                f"{type(self).__name__} needs a fully known (H, W, C) input shape to bound its "
                f"operator norm. Received: input_shape={input_shape}"
            )
        super().build(input_shape)
        pin_input_shape(self, input_shape)
        self._input_hw = (int(input_shape[1]), int(input_shape[2]))
        out_shape = self.compute_output_shape(input_shape)
        self._output_pixels = int(out_shape[1]) * int(out_shape[2])
        self._multiplicity = patch_multiplicity(self.kernel_size, self.strides)
        self.coef = float(_compute_conv_lip_factor(self.kernel_size, self.strides,
                                                   input_shape, "channels_last"))
        self._build_kernel_constraint()

    def _build_kernel_constraint(self):
        # RKO: the projection orthonormalises the (kh kw C) x F reshaping of Psi.
        self._build_projection(self.filters)

    def bounded_kernel(self):
        """The value of the variable the forward pass convolves with (times N)."""
        return self.kernel

    def forward_kernel(self):
        """That variable as the forward pass differentiates it."""
        return self.kernel

    def effective_kernel(self):
        """The kernel the forward pass convolves with: ``N * Psi``."""
        return self.coef * self.bounded_kernel()

    def call(self, inputs):
        outputs = tf.nn.conv2d(inputs, self.coef * self.forward_kernel(), strides=self.strides,
                               padding=self.padding.upper())
        if self.use_bias:
            outputs = tf.nn.bias_add(outputs, self.bias)
        return outputs

    def certified_norm_request(self):
        """What `lipdp.operator_norms.certified_norms` needs to certify S."""
        return ("conv", self.effective_kernel(),
                conv_frequency_grid(self._input_hw, self.kernel_size))

    def _operator_bound(self):
        return certified_operator_norm(self)

    def propagate_inputs(self, input_bound):
        return (self._operator_bound() * as_bound(input_bound)
                + math.sqrt(self._output_pixels) * bias_norm(self))

    def backpropagate_params(self, input_bound, gradient_bound):
        kernel_factor = self.coef * math.sqrt(self._multiplicity)
        gradient_bound = as_bound(gradient_bound)
        bounds = [(self.kernel, kernel_factor * as_bound(input_bound) * gradient_bound)]
        if self.use_bias:
            bounds.append((self.bias, math.sqrt(self._output_pixels) * gradient_bound))
        return bounds

    def backpropagate_inputs(self, input_bound, gradient_bound):
        return self._operator_bound() * as_bound(gradient_bound)

    def rounding_error(self, input_bound):
        effective = self.effective_kernel()
        kernel = np.asarray(effective, np.float64)
        root_m = math.sqrt(self._multiplicity)
        error = product_error(math.prod(kernel.shape[:3]),
                              root_m * float(dense_spectral_norm_upper(effective)),
                              root_m * np.linalg.norm(kernel), input_bound,
                              np.max(np.abs(kernel)))
        error += root_m * math.sqrt(kernel.size) * SMALLEST_NORMAL * input_bound
        if not self.use_bias:
            return error
        bias_norm = np.linalg.norm(np.asarray(self.bias, np.float64))
        return addition_error(error, float(self._operator_bound()) * input_bound
                              + math.sqrt(self._output_pixels) * bias_norm)

    def get_config(self):
        return self._projected_config(super().get_config(),
                                      hidden=("groups", "dilation_rate", "data_format"))


@tf.keras.utils.register_keras_serializable("lipdp")
class DP_SpectralConv2D(ReparametrizedKernelMixin, DP_QuickSpectralConv2D):
    """Reparametrised RKO convolution: the forward pass convolves with ``N * Pi(V)``.

    As deel-lip's SpectralConv2D, the convolution uses the RKO-orthogonalised
    version ``Psibar = Pi(V)`` of a free variable V; the gradient w.r.t. V is
    taken straight through the projection (`ReparametrizedKernelMixin`), so the
    bounds of `DP_QuickSpectralConv2D` hold for V (kernel ``N sqrt(m) X G``),
    with the operator norm certified on ``N * Psibar``. Same arguments.
    """

    def _build_kernel_constraint(self):
        self._build_reparametrization()
        self._build_projection(self.filters)
