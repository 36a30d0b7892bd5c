"""Wavelet scattering front end (kymatio), with its Lipschitz constant computed.

`DP_Scattering` runs kymatio's 2D scattering transform (Morlet wavelets, J scales, L angles,
orders 0 to ``max_order``; Tramèr & Boneh's ScatterNet features) on every channel of an
image, in float64, multiplies the coefficients of order m by a fixed weight ``w_m``, and
returns them channels-last in float32. It has no variables and depends on no data, so it
costs no privacy: place it after `DP_BoundedInput` and follow it by a second
`DP_BoundedInput` (the bound the head's gradients use) and a Lipschitz head.

**The Lipschitz constant is computed for the operator the code runs** (`scattering_lipschitz`),
from kymatio's own filter arrays, in exact arithmetic:

1. Padding P: kymatio's reflection padding copies each input pixel to at most m positions
   of the padded grid, ``||P x|| <= sqrt(m) ||x||`` with m counted on the actual padding
   (m = 4 on 28 x 28 with J = 2: a factor 2 on the constant); zero padding
   (``padding="zero"``) places the image in a grid of zeros, m = 1.
2. On the padded (periodic) grid every filtering is a circular convolution computed as a
   pointwise product in the Fourier domain, so by Parseval the map
   ``u -> (h_1 * u, ..., h_k * u)`` has squared norm ``max_w sum_i |h_i(w)|^2`` (the
   Littlewood–Paley sum of the arrays kymatio multiplies by, at the resolution it uses them).
3. kymatio subsamples in the Fourier domain (the mean over the k x k aliases), which is
   exactly the spatial decimation ``y[k n]``. Filtering by h then decimating by k has, per
   frequency, the squared-norm multiplier ``Q_h,k(w) = k^-2 sum_a |h(w + a N/k)|^2`` (sum over
   the aliases; Cauchy–Schwarz on each alias class, equality reachable): for a low-pass
   filter about ``|h(w)|^2 / k^2``, far below the ``|h(w)|^2`` of step 2 alone. The final
   crop is a selection of coordinates (norm <= 1); the complex modulus is 1-Lipschitz
   pointwise.
4. **Every filtered signal is real** (the input differences, then the moduli's), and a real
   signal's spectrum has ``|u(-w)| = |u(w)|``: ``sum_w Q(w) |u(w)|^2`` equals
   ``sum_w Q_s(w) |u(w)|^2`` with the mirror average ``Q_s(w) = (Q(w) + Q(-w)) / 2``. kymatio's
   Morlet wavelets cover one half of the frequency plane each (L angles in [0, pi)), so their
   mirror averages peak about half as high: the weighted J = 2 constant drops from 7.32 to 4.29
   on 28 x 28. Without decimation the real-signal norm is exactly ``max_w Q_s(w)``.
5. Walking the tree from the leaves (``Q_s`` of each filter at the resolution and decimation
   kymatio uses it with): a second-order path's S2 output is its U2 signal low-passed and
   decimated, squared norm at most ``b_j2 = max_w Q_phi_j2(w)``; a first-order node at scale
   j1 (signal ``U1 = |decimated psi_n1 * u|``) maps differences to its S1 and S2 outputs by
   at most ``c(j1) = max_w (w_1^2 Q_phi_j1(w) + sum_{n2: j2 > j1} w_2^2 b_j2 Q_psi_n2,j1(w))``
   in squared norm; the root by ``A = max_w (w_0^2 Q_phi_0(w) + sum_n1 c(j1) Q_psi_n1(w))``.
   So ``||S x - S y|| <= sqrt(m A) ||x - y||`` and, since ``S(0) = 0``,
   ``||S x|| <= sqrt(m A) ||x||``.

A test holds this constant against power iteration on the Jacobian and gradient ascent on
``||S x - S y|| / ||x - y||`` (`tests/test_scattering.py`). Channels are scattered
independently (disjoint blocks): the constant is the same for any number of channels.

**Rounding**: the float64 evaluation is taken to be within ``2^-30 Lip ||x||``
of the exact operator (a stated arithmetic model, like lipdp's accuracy of tanh: each path
runs about 15 FFT, product, mean and modulus stages, each within ``2^-45`` normwise for
float64 FFTs of these sizes by Higham's Theorem 24.2, amplified by stage constants of order
1), and the cast to float32 adds at most ``2^-24`` of the output's norm. Certified radii use
this bound (`rounding_error`), and so does the output-norm bound (`propagate_inputs` adds it),
which gradient bounds use when no `DP_BoundedInput` follows; the configs put one after the
front end, and then privacy does not depend on the arithmetic model at all.

kymatio is an optional dependency (``pip install lipdp[scatternet]``; kymatio 0.3 needs
``scipy<1.15``).
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import tensorflow as tf

from lipdp.layers.base import DPLayer
from lipdp.rounding import UNIT_ROUNDOFF

__all__ = ["DP_MultiscaleScattering", "DP_Scattering", "scattering_lipschitz"]

# Relative error of the float64 evaluation (module docstring, "Rounding").
_FLOAT64_EVALUATION_ERROR = 2.0 ** -30
# Relative slack covering the float64 arithmetic of `scattering_lipschitz` itself (sums of
# a few hundred non-negative terms, one square root: far below 2^-40 relative).
_CONSTANT_SLACK = 2.0 ** -40


PADDINGS = ("reflect", "zero")


def _kymatio_scattering(shape, J, angles, max_order, padding="reflect"):
    """kymatio's TensorFlow Scattering2D computing in float64 (complex128), its input padded
    by reflection (kymatio's) or with zeros."""
    try:
        from kymatio.scattering2d.backend.tensorflow_backend import Pad, TensorFlowBackend2D
        from kymatio.tensorflow import Scattering2D
    except ImportError as e:
        raise ImportError(
            "DP_Scattering needs kymatio: pip install 'lipdp[scatternet]' (kymatio 0.3 with "
            f"scipy<1.15). Import failed with: {e}") from e

    class Float64Backend(TensorFlowBackend2D):
        """kymatio's TensorFlow backend with a complex128 Fourier transform (kymatio's own
        casts to complex64): the filters, float64 arrays, then multiply in complex128. The
        real input enters as ``tf.complex(x, 0)``, the same value as a cast, whose gradient
        takes the real part without the cast's complex-to-real warning (one per transform,
        hundreds per traced gradient)."""

        @classmethod
        def rfft(cls, x):
            cls.real_check(x)
            return tf.signal.fft2d(tf.complex(x, tf.zeros_like(x)))

    class ZeroPad(Pad):
        """kymatio's padding (same sizes), with zeros instead of reflections."""

        def __call__(self, x):
            top, bottom, left, right = self.pad_size
            paddings = [[0, 0]] * (x.shape.rank - 2) + [[top, bottom], [left, right]]
            return tf.pad(x, paddings)

    if padding == "zero":
        Float64Backend.Pad = ZeroPad
    return Scattering2D(J=J, shape=tuple(shape), L=angles, max_order=max_order,
                        backend=Float64Backend)


@tf.autograph.experimental.do_not_convert
def _scatter(scattering, x):
    """kymatio's transform as plain TensorFlow ops: its Python loops run over fixed lists of
    filters, so AutoGraph has nothing to convert (converting them took most of a trace)."""
    return scattering.scattering(x)


def _padding_multiplicity(scattering, shape) -> int:
    """The most positions of the padded grid one input pixel is copied to, on the padding the
    transform runs (its own pad object applied to the pixels' indices)."""
    index = tf.constant(np.arange(1, shape[0] * shape[1] + 1, dtype=np.float64).reshape(shape))
    padded = np.asarray(scattering.pad(index)).astype(np.int64).ravel()
    return int(np.bincount(padded[padded > 0]).max())


def _order_of_paths(J, angles, max_order):
    """Order (0, 1 or 2) of each of kymatio's output channels, in its output order."""
    orders = [0] + [1] * (J * angles)
    if max_order >= 2:
        orders += [2] * (angles * angles * J * (J - 1) // 2)
    return np.asarray(orders)


def _decimated_power(level, k) -> np.ndarray:
    """Per-frequency multiplier of the squared norm of ``u -> (h * u) decimated by k``:
    ``Q(w) = k^-2 sum_a |h(w + a N / k)|^2`` over the k x k aliases (module docstring, step 3),
    on the filter's own grid."""
    power = np.abs(np.asarray(level)).astype(np.float64) ** 2
    if k == 1:
        return power
    rows, cols = power.shape
    folded = power.reshape(k, rows // k, k, cols // k).sum(axis=(0, 2)) / (k * k)
    return np.tile(folded, (k, k))


def _real_input_power(power) -> np.ndarray:
    """The mirror average ``(Q(w) + Q(-w)) / 2`` of a multiplier on a DFT grid: the multiplier
    of the same squared norm on real signals (module docstring, step 4)."""
    mirrored = np.roll(np.flip(power, axis=(0, 1)), 1, axis=(0, 1))  # index w -> -w mod N
    return 0.5 * (power + mirrored)


def scattering_lipschitz(scattering, shape, order_weights: Sequence[float]) -> float:
    """Upper bound of the L2 Lipschitz constant of the weighted scattering transform of one
    ``shape`` channel, from kymatio's filter arrays (module docstring, steps 1-5)."""
    w = [float(v) ** 2 for v in order_weights]
    J = scattering.J
    phi = scattering.phi["levels"]

    def power(level, k):  # filtering a real signal, then decimating by k
        return _real_input_power(_decimated_power(level, k))

    def low_pass(j):  # averaging of a scale-j signal and decimation to scale J
        return power(phi[j], 2 ** (J - j))

    root = w[0] * low_pass(0)
    for first in scattering.psi:
        j1 = first["j"]
        node = w[1] * low_pass(j1)
        if scattering.max_order >= 2:
            for second in scattering.psi:
                j2 = second["j"]
                if j2 > j1:
                    node = node + (w[2] * float(low_pass(j2).max())
                                   * power(second["levels"][j1], 2 ** (j2 - j1)))
        root = root + float(node.max()) * power(first["levels"][0], 2 ** j1)
    squared = float(root.max()) * _padding_multiplicity(scattering, shape)
    return math.sqrt(squared) * (1.0 + _CONSTANT_SLACK)


class _ComputedLipschitzMap(DPLayer):
    """The bounds of a fixed map without variables whose Lipschitz constant ``self._lipschitz``
    (set at build) is computed, evaluated in float64 and cast to float32: ``X_out = (1 + r)
    Lip X_in``, ``G_in = Lip G``, rounding error ``r Lip X`` with ``r = 2^-30 + 2^-24 (1 +
    2^-30)``: the float64 evaluation (arithmetic model of the module docstring), then the
    cast to float32 of an output of norm ``<= (1 + 2^-30) Lip X``."""

    _RELATIVE_ROUNDING = (_FLOAT64_EVALUATION_ERROR
                          + UNIT_ROUNDOFF * (1.0 + _FLOAT64_EVALUATION_ERROR))

    @property
    def lipschitz_constant(self) -> float:
        """The computed Lipschitz constant (a python float)."""
        return self._lipschitz

    def propagate_inputs(self, input_bound):
        """``Lip X`` plus the rounding bound: the norm of the float32 output."""
        return self._lipschitz * input_bound * (1.0 + self._RELATIVE_ROUNDING)

    def backpropagate_inputs(self, input_bound, gradient_bound):
        return self._lipschitz * gradient_bound

    def rounding_error(self, input_bound):
        return self._RELATIVE_ROUNDING * self._lipschitz * float(input_bound)


@tf.keras.utils.register_keras_serializable("lipdp")
class DP_Scattering(tf.keras.layers.Layer, _ComputedLipschitzMap):
    """Fixed ScatterNet features of images (kymatio), order-weighted, Lipschitz constant computed.

    Input ``(batch, H, W, C)`` (H and W multiples of ``2^J``); output ``(batch, H / 2^J,
    W / 2^J, C K)`` with ``K = 1 + J L + L^2 J (J - 1) / 2`` paths per channel (``max_order=2``;
    ``1 + J L`` for 1), the coefficients of order m multiplied by ``order_weights[m]``
    (fixed rescalings: order-2 coefficients are about 10x smaller than order-0 ones on
    images, and a linear head sees them better scaled up; any weights keep the constant
    computed). ``X_out = (1 + r) Lip X_in`` (r the relative rounding bound),
    ``G_in = Lip G``, with Lip from `scattering_lipschitz` (module docstring); no variables.

    Args:
        J: number of scales (subsampling ``2^J``).
        angles: number of orientations L.
        max_order: 1 or 2.
        order_weights: weights of the orders 0 to ``max_order``, positive (default: all 1).
        padding: ``"reflect"`` (kymatio's) or ``"zero"``: the image in a grid of zeros,
            which halves the constant on 28 x 28 (module docstring, step 1; the same
            features on images whose borders are zero, Fashion-MNIST's nearly so).
    """

    def __init__(self, J=2, angles=8, max_order=2, order_weights=None, padding="reflect",
                 **kwargs):
        kwargs.setdefault("trainable", False)
        super().__init__(**kwargs)
        if not isinstance(J, int) or J < 1:
            raise ValueError(f"Received an invalid value for `J`, expected a positive integer. "
                             f"Received: J={J!r}")
        if not isinstance(angles, int) or angles < 1:
            raise ValueError("Received an invalid value for `angles`, expected a positive "
                             f"integer. Received: angles={angles!r}")
        if max_order not in (1, 2):
            raise ValueError(f"`max_order` must be 1 or 2. Received: max_order={max_order!r}")
        if order_weights is None:
            order_weights = (1.0,) * (max_order + 1)
        weights = tuple(float(v) for v in order_weights)
        if len(weights) != max_order + 1 or not all(v > 0 and math.isfinite(v) for v in weights):
            raise ValueError(f"`order_weights` needs {max_order + 1} finite positive numbers "
                             f"(orders 0..{max_order}). Received: order_weights={order_weights!r}")
        if padding not in PADDINGS:
            raise ValueError(f"`padding` must be one of {PADDINGS}. Received: padding={padding!r}")
        self.J, self.angles, self.max_order, self.order_weights = J, angles, max_order, weights
        self.padding = padding

    def build(self, input_shape):
        shape = tf.TensorShape(input_shape)
        if shape.rank != 4 or not shape[1:].is_fully_defined():
            raise ValueError("DP_Scattering needs inputs (batch, H, W, C) of known H, W, C. "
                             f"Received: input_shape={input_shape}")
        height, width, channels = shape[1:].as_list()
        step = 2 ** self.J
        if height % step or width % step or min(height, width) < step:
            raise ValueError(f"DP_Scattering with J={self.J} needs H and W multiples of "
                             f"{step}. Received: input_shape={input_shape}")
        self._scattering = _kymatio_scattering((height, width), self.J, self.angles,
                                               self.max_order, self.padding)
        top, bottom, left, right = self._scattering.pad.pad_size
        if self.padding == "reflect" and max(top, bottom) >= height or \
                self.padding == "reflect" and max(left, right) >= width:
            # TensorFlow's MirrorPad failed at the first call (an audit, 2026-12-07).
            raise ValueError(
                f"DP_Scattering with J={self.J} pads each side of a {height}x{width} image by "
                f"({top}, {bottom}, {left}, {right}) pixels, more than a reflection can fill: "
                "use padding='zero' or a smaller J.")
        orders = _order_of_paths(self.J, self.angles, self.max_order)
        self._weights = tf.constant(np.asarray(self.order_weights)[orders], tf.float64)
        self._paths = len(orders)
        self._out_shape = (height // step, width // step, channels * self._paths)
        self._lipschitz = scattering_lipschitz(self._scattering, (height, width),
                                               self.order_weights)
        super().build(input_shape)

    def call(self, inputs):
        x = tf.transpose(tf.cast(inputs, tf.float64), [0, 3, 1, 2])  # (B, C, H, W)
        paths = _scatter(self._scattering, x)  # (B, C, K, H', W')
        paths = paths * self._weights[:, None, None]
        features = tf.transpose(paths, [0, 3, 4, 1, 2])  # (B, H', W', C, K)
        features = tf.reshape(features, (-1,) + self._out_shape)
        return tf.cast(features, tf.float32)

    def compute_output_shape(self, input_shape):
        return tf.TensorShape([input_shape[0]] + list(self._out_shape))

    def get_config(self):
        config = super().get_config()
        config.update(J=self.J, angles=self.angles, max_order=self.max_order,
                      order_weights=list(self.order_weights), padding=self.padding)
        return config


@tf.keras.utils.register_keras_serializable("lipdp")
class DP_MultiscaleScattering(tf.keras.layers.Layer, _ComputedLipschitzMap):
    """`DP_Scattering` of the same images at several scales J, flattened and concatenated.

    Output ``(batch, sum_j F_j)``: the features of each scale (``F_j`` of them) one after
    the other. The scales fill disjoint coordinates, so for inputs x, y
    ``||F x - F y||^2 = sum_j ||S_j x - S_j y||^2 <= (sum_j L_j^2) ||x - y||^2``: the
    Lipschitz constant is ``Lip = sqrt(sum_j L_j^2)`` (each ``L_j`` computed as
    `DP_Scattering`'s, plus a float64 slack), ``X_out = (1 + r) Lip X_in`` and
    ``G_in = Lip G``; the rounding error of each scale is within ``r L_j X`` (its own
    bound), hence of the whole within ``r Lip X`` (the same r). No variables, no data.

    Args:
        scales: the J of each scale, distinct positive integers (``(2, 1)``: 81 paths of
            7 x 7 and 9 of 14 x 14 on 28 x 28 images).
        angles: number of orientations L.
        order_weights: weights of orders 0, 1 (and 2); scale J uses orders up to
            ``min(len(order_weights) - 1, J)`` and the first weights.
        scale_weights: one positive factor per scale, multiplying its order weights
            (how much each scale weighs against the others); all 1 by default.
        padding: ``"reflect"`` or ``"zero"``, as `DP_Scattering`'s.
    """

    def __init__(self, scales=(2, 1), angles=8, order_weights=(1.0, 1.0, 1.0),
                 scale_weights=None, padding="reflect", **kwargs):
        kwargs.setdefault("trainable", False)
        super().__init__(**kwargs)
        scales = tuple(scales)
        if not scales or len(set(scales)) != len(scales) or not all(
                isinstance(J, int) and J >= 1 for J in scales):
            raise ValueError("Received an invalid value for `scales`, expected distinct "
                             f"positive integers. Received: scales={scales!r}")
        scale_weights = (1.0,) * len(scales) if scale_weights is None else tuple(scale_weights)
        if len(scale_weights) != len(scales) or not all(
                isinstance(v, (int, float)) and math.isfinite(v) and v > 0
                for v in scale_weights):
            raise ValueError(f"`scale_weights` needs {len(scales)} finite positive numbers. "
                             f"Received: scale_weights={scale_weights!r}")
        self.scales, self.angles, self.padding = scales, angles, padding
        self.order_weights = tuple(float(v) for v in order_weights)
        self.scale_weights = tuple(float(v) for v in scale_weights)
        self.scatterings = []
        for J, factor in zip(scales, self.scale_weights):
            max_order = min(len(self.order_weights) - 1, J)
            self.scatterings.append(DP_Scattering(
                J=J, angles=angles, max_order=max_order, padding=padding,
                order_weights=[factor * v for v in self.order_weights[:max_order + 1]],
                name=f"scattering_J{J}"))

    def build(self, input_shape):
        for scattering in self.scatterings:
            scattering.build(input_shape)
        self._lipschitz = math.sqrt(sum(s.lipschitz_constant ** 2 for s in self.scatterings)) \
            * (1.0 + _CONSTANT_SLACK)
        self._sizes = [math.prod(s.compute_output_shape(input_shape)[1:])
                       for s in self.scatterings]
        self._features = sum(self._sizes)
        super().build(input_shape)

    def call(self, inputs):
        flat = [tf.reshape(s(inputs), [-1, size])
                for s, size in zip(self.scatterings, self._sizes)]
        return tf.concat(flat, axis=-1)

    def compute_output_shape(self, input_shape):
        return tf.TensorShape([input_shape[0], self._features])

    def get_config(self):
        config = super().get_config()
        config.update(scales=list(self.scales), angles=self.angles,
                      order_weights=list(self.order_weights),
                      scale_weights=list(self.scale_weights), padding=self.padding)
        return config
