"""Parameter-free DP layers: input bounding, flatten, GroupSort, L2-norm pooling."""

from __future__ import annotations

import math

import numpy as np
import tensorflow as tf
from deel.lip.layers import GroupSort, ScaledL2NormPooling2D

from lipdp import kernels
from lipdp.layers._pair_sort import PAIRINGS, sort_pairs
from lipdp.layers.base import (DPLayer, as_bound, check_eps_grad_sqrt, check_float32,
                               check_positive, pin_input_shape)
from lipdp.rounding import (UNDERFLOW, UNIT_ROUNDOFF, block_norm_error, comparison_error,
                            rescaling_error)

# Relative slack on the float64 arithmetic of `clip_target` itself (a handful of roundings).
_TARGET_SLACK = 2.0 ** -40


def clip_target(upper_bound, n) -> float:
    """The float32 radius t that `DP_BoundedInput` clips n-coordinate inputs to, so that the
    float32 output has norm <= `upper_bound` whatever the summation order: the largest float32
    with ``(1 + eps_n)(1 + u) t + 3 UNDERFLOW <= X0`` (the output is within
    ``(eps + u (1 + eps)) t + 3 UNDERFLOW`` of the exact projection onto the t-ball,
    `DP_BoundedInput.rounding_error`). About ``X0 (1 - n u / 2)``: 2.4e-5 below X0 for 784
    coordinates, 1.2e-4 for 4096.

    Raises:
        ValueError: n unknown, or too large (or X0 too small) for float32 to prove it.
    """
    eps = rescaling_error(n) if n is not None else math.inf
    t = ((float(upper_bound) - 3.0 * UNDERFLOW) / ((1.0 + eps) * (1.0 + UNIT_ROUNDOFF))
         * (1.0 - _TARGET_SLACK))
    if n is None or not (eps < 1.0 and t >= math.sqrt(n) * 2.0 ** -48):
        raise ValueError(
            f"DP_BoundedInput cannot clip {n} coordinates to the bound {upper_bound} provably "
            "in float32: it needs inputs of known size below 2^24 and a bound above "
            "sqrt(size) 2^-48.")
    rounded = np.float32(t)
    if float(rounded) > t:
        rounded = np.nextafter(rounded, np.float32(0.0))
    return float(rounded)


@tf.keras.utils.register_keras_serializable("lipdp")
class DP_BoundedInput(tf.keras.layers.Layer, DPLayer):
    """Clips every example to the declared L2 bound, in the forward pass.

    ``f(x) = x * min(1, t / ||x||_2)`` where the norm runs over all non-batch
    axes and t (`clip_target`) sits just below X0, by the most that float32 rounding of
    the norm and the rescaling can add (any summation order), so that the float32 output
    itself has norm <= X0. This is the projection onto the ball of radius t (1-Lipschitz), so

    - ``propagate_inputs(X) = min(X, X0)``: the bound every later layer starts from;
    - ``backpropagate_inputs(X, G) = G``.

    It must be the first layer of a DP model: without it the input norm, hence
    every gradient bound, is unbounded.

    Args:
        upper_bound: X0 > 0, the L2 bound declared on every input.
    """

    def __init__(self, upper_bound, **kwargs):
        super().__init__(**kwargs)
        if not isinstance(upper_bound, (int, float, np.floating)) or not np.isfinite(upper_bound) \
                or upper_bound <= 0:
            raise ValueError(
                "Received an invalid value for `upper_bound`, expected a finite positive "
                f"number. Received: upper_bound={upper_bound!r}"
            )
        self.upper_bound = float(upper_bound)

    def build(self, input_shape):
        check_float32([self])  # first layer of every DP model: before a projection fails
        shape = tf.TensorShape(input_shape)[1:]
        self._size = math.prod(shape.as_list()) if shape.is_fully_defined() else None
        clip_target(self.upper_bound, self._size)  # refuses a bound float32 cannot prove
        super().build(input_shape)
        pin_input_shape(self, input_shape)  # every bound of the model follows from this shape

    @property
    def target(self) -> float:
        """The float32 radius the inputs are clipped to (`clip_target`): just below X0, so
        that the float32 output's norm is at most X0. Read from `upper_bound` as it is now,
        as `propagate_inputs` reads it: the radius fixed at build let a bound lowered later
        shrink the bound pass 10x below the inputs' norms (an audit, 2026-12-05)."""
        return clip_target(self.upper_bound, self._size)

    def call(self, inputs):
        axes = list(range(1, inputs.shape.rank))
        norms = tf.sqrt(tf.reduce_sum(tf.square(inputs), axis=axes, keepdims=True))
        target = tf.constant(self.target, inputs.dtype)
        # min(1, t / ||x||) as t / max(||x||, t): the same float32 value (fl is monotone, and
        # t / t = 1), but inside the ball no gradient reaches the division, whose
        # derivative -t / ||x||^2 overflowed there: with X0 = 1e19 a record of norm 1e-16
        # gave NaN gradients to the kernel before a DP_BoundedActivation (an audit,
        # 2026-12-06), a record-dependent stop of the step.
        scale = target / tf.maximum(norms, target)
        return inputs * scale

    def propagate_inputs(self, input_bound):
        return tf.minimum(as_bound(input_bound), self.upper_bound)

    def backpropagate_inputs(self, input_bound, gradient_bound):
        return gradient_bound

    def rounding_error(self, input_bound):
        """``(eps + u (1 + eps)) t + 3 UNDERFLOW`` for every raw input of norm <= 2^62.

        f is the projection onto the ball of radius t, the float32 `clip_target` that
        `call` uses (``t + (eps + u (1 + eps)) t + 3 UNDERFLOW <= X0``, so ``X_out <= X0``
        holds for the float32 output, and Lip 1 for f);
        n is the number of coordinates, ``eps`` the relative error of the computed
        ratio ``t / ||z||`` below. `input_bound` is not needed: the bound holds for
        all inputs of norm <= 2^62 (`lipdp.rounding`, A4), raw inputs included.

        Proof (`lipdp.rounding`, A1). The sum of squares is ``s^ = s (1 + t1) + h``
        with ``s = ||z||^2``, ``|t1| <= gamma_n``, ``|h| <= 4 n mu`` (Lemma 5's argument).
        `call` computes the scale as ``c = fl(t / max(||z||^, t))``, which is
        ``min(1, fl(t / ||z||^))``: division is monotone and ``fl(t / t) = 1``.
        (i) If ``s >= 4 n mu / u``, then ``|h| <= u s``, ``s^ = s (1 + t1')`` with
        ``|t1'| <= gamma_{n+1}``, the computed norm (correctly rounded square root,
        when it exceeds t) is ``||z|| sqrt(1 + t1') (1 + d2)`` and the ratio
        ``q^ = t / ||z|| * (1 + d3) / (sqrt(1 + t1') (1 + d2))`` is within a relative
        ``eps = max((1 + u) / (sqrt(1 - gamma_{n+1}) (1 - u)) - 1,
        1 - (1 - u) / (sqrt(1 + gamma_{n+1}) (1 + u)))`` of ``q = t / ||z||`` (an
        overflow to inf only happens when q > 1 too). For ``eps < 1``,
        ``|min(1, q^) - min(1, q)| <= eps min(1, q)``; with ``c = min(1, q^)`` and the
        exact scale ``c* = min(1, q)``: ``||fl(z c) - z c*|| <= ||z|| |c - c*| + u ||z c||
        + (flushed z_i, flushed products) <= eps t + u (1 + eps) t + 3 UNDERFLOW``, since
        ``||z|| c* = min(||z||, t) <= t``.
        (ii) Otherwise ``||z|| < sqrt(n) 2^-50 <= t`` (c* = 1, as ``t >= sqrt(n) 2^-48``
        is required) and the computed norm is below ``sqrt(n) 2^-49``, so
        ``q^ >= 2 (1 - u) > 1``: c = 1, and only flushing moves the output (``<= mu``
        per coordinate). QED
        """
        del input_bound
        eps, target = rescaling_error(self._size), self.target
        return (eps + UNIT_ROUNDOFF * (1.0 + eps)) * target + 3.0 * UNDERFLOW

    def get_config(self):
        return {**super().get_config(), "upper_bound": self.upper_bound}


@tf.keras.utils.register_keras_serializable("lipdp")
class DP_BoundedActivation(DP_BoundedInput):
    """Clips every example's activations to an L2 ball, inside the network.

    The projection of `DP_BoundedInput` (``f(z) = z min(1, t / ||z||_2)``, 1-Lipschitz, the
    float32 output of norm <= `upper_bound`), placed after a layer instead of first:

    - ``propagate_inputs(X) = min(X, upper_bound)``: the bound pass restarts from
      `upper_bound`, whatever the layers before it propagate;
    - ``backpropagate_inputs(X, G) = G``.

    So the spectral norm of the first trainable layer's kernel enters no gradient bound
    when only parameter-free layers lie between it and this layer (nothing before it is
    trained, and its output's bound is replaced here): the private step then certifies no
    norm of that kernel (`lipdp.bounds.backpropagate_bounds`), and between two Björck
    refreshes (``compile(bjorck_every=k)``) the kernel is only spectrally normalised by its
    power-iteration estimate, an error this layer absorbs. The model's certified Lipschitz
    constant (`lipdp.certify`) still certifies every kernel.

    Choose `upper_bound` as the bound the layers before it have with kernels of norm 1
    (after a bias-free dense layer: the input bound X0): it then only moves an example whose
    activation an estimate below the true norm let past it.

    Args:
        upper_bound: the L2 radius (> 0) of every example's activations after this layer.
    """


@tf.keras.utils.register_keras_serializable("lipdp")
class DP_Flatten(tf.keras.layers.Flatten, DPLayer):
    """Flatten: a reshape, so norms and cotangent norms are unchanged (and no rounding)."""

    def propagate_inputs(self, input_bound):
        return input_bound

    def backpropagate_inputs(self, input_bound, gradient_bound):
        return gradient_bound

    def rounding_error(self, input_bound):
        return 0.0


@tf.keras.utils.register_keras_serializable("lipdp")
class DP_GroupSort(GroupSort, DPLayer):
    """GroupSort activation (deel-lip): sorts the channels within groups of size n.

    ``n=2`` is GroupSort2 (MaxMin), ``n=None`` sorts all channels (FullSort). A
    permutation of coordinates on each input, it is norm preserving and
    1-Lipschitz: ``X_out = X_in`` and ``G_in = G``.

    The bound ``G_in = G`` is on the cotangent *autodiff computes*, so the
    backward pass must be a permutation too. For ``n=2`` the layer runs
    `lipdp.layers._pair_sort.sort_pairs`: one shared comparison per pair decides
    both outputs and routes the cotangent back through the same permutation, also
    at ties (``tf.minimum`` / ``tf.maximum``, as in deel-lip's GroupSort2, send
    both cotangents of a tied pair to one input: norm up to ``sqrt(2) G``).
    (``tf.sort``, used for ``n > 2``, already backpropagates through a
    permutation of indices.)

    Args:
        n: group size (2, or None for FullSort, or any divisor of the channels).
        pairing: for ``n=2``, which channels form a pair: ``"halves"`` (channel c
            with ``c + C/2``, minima in the first half; the fast default) or
            ``"interleaved"`` (channels ``2i, 2i+1``, deel-lip's layout). Any fixed
            pairing is a GroupSort with the same bounds. Models saved before this
            argument existed load with ``"interleaved"``, hence the same outputs.
    """

    def __init__(self, n=2, pairing="halves", **kwargs):
        if n is not None and (not isinstance(n, (int, np.integer)) or n < 1):
            raise ValueError(
                "Received an invalid value for `n`, expected a positive integer or None. "
                f"Received: n={n!r}"
            )
        if pairing not in PAIRINGS:
            raise ValueError(f"Received an invalid value for `pairing`, expected one of "
                             f"{PAIRINGS}. Received: pairing={pairing!r}")
        if kwargs.get("k_coef_lip", 1.0) != 1.0:
            raise ValueError("DP_GroupSort is norm preserving; it does not take k_coef_lip. "
                             f"Received: k_coef_lip={kwargs['k_coef_lip']!r}")
        super().__init__(n=n, **kwargs)
        self.pairing = pairing

    def build(self, input_shape):
        channels = tf.TensorShape(input_shape)[-1]
        if self.n is not None and channels is not None and channels >= self.n \
                and channels % self.n:
            # deel-lip's RuntimeError named neither the layer nor the width (an audit)
            raise ValueError(f"Layer '{self.name}' (DP_GroupSort(n={self.n})) sorts groups of "
                             f"{self.n} channels, which do not divide its input's {channels}: "
                             "give the layer before it a multiple of n outputs.")
        super().build(input_shape)

    def call(self, x):
        if self.n != 2:
            return super().call(x)
        return sort_pairs(x, self.pairing)

    def propagate_inputs(self, input_bound):
        return input_bound

    def backpropagate_inputs(self, input_bound, gradient_bound):
        return gradient_bound

    def rounding_error(self, input_bound):
        """Comparisons and selections only: `lipdp.rounding.comparison_error`."""
        return comparison_error()

    def get_config(self):
        return {**super().get_config(), "pairing": self.pairing}

    @classmethod
    def from_config(cls, config):
        # Saved before `pairing` existed: GroupSort2 paired adjacent channels.
        return cls(**{"pairing": "interleaved", **config})


@tf.keras.utils.register_keras_serializable("lipdp")
class DP_ScaledL2NormPooling2D(ScaledL2NormPooling2D, DPLayer):
    """L2-norm pooling over non-overlapping windows (deel-lip), times ``k_coef_lip``.

    Each output is ``k * ||x_window||_2``; windows are disjoint (strides equal
    the pool size, 'valid' padding drops border pixels), so
    ``||f(x)||_2 <= k ||x||_2`` and each window map is k-Lipschitz on disjoint
    coordinates: ``X_out = k X_in`` and ``G_in = k G``. (deel-lip's custom
    gradient of the square root, ``dy / (2 (sqrt(u) + eps))``, only shrinks
    the true derivative, and with ``eps_grad_sqrt >= 1e-12`` it also covers the float32
    underflow of tiny windows' squares: `lipdp.layers.base.MIN_EPS_GRAD_SQRT`; so the
    computed cotangents obey the same bound, up to relative rounding.)
    Those bounds need ``k > 0``: a negative k (which deel-lip stores as given) entered them
    as k, not |k|, and cancelled a residual section's skip path (a Lipschitz bound of 0
    and an infinite certified radius on a 1-Lipschitz network): refused.
    """

    def __init__(self, *args, **kwargs):
        # deel-lip's square root backpropagates dy / (2 (sqrt(u) + eps)): with eps = 0 an
        # all-zero window gives 0 / 0, a NaN gradient from a finite record (an audit), and
        # below MIN_EPS_GRAD_SQRT underflowed squares break the gradient's bound.
        if "eps_grad_sqrt" in kwargs:  # before deel-lip's own check (a RuntimeError)
            check_eps_grad_sqrt(float(kwargs["eps_grad_sqrt"]))
        super().__init__(*args, **kwargs)
        check_positive(float(self.k_coef_lip), "k_coef_lip")
        check_eps_grad_sqrt(float(self.eps_grad_sqrt))
        if self.data_format != "channels_last":  # None resolved from keras.json by Keras
            raise ValueError(
                "DP_ScaledL2NormPooling2D only supports data_format='channels_last' (TensorFlow's "
                f"CPU average pooling runs NHWC only). Received: data_format={self.data_format!r}")

    def build(self, input_shape):
        shape = tf.TensorShape(input_shape)
        if shape.rank == 4 and any(d is not None and d < p
                                   for d, p in zip(shape[1:3], self.pool_size)):
            raise ValueError(
                f"DP_ScaledL2NormPooling2D '{self.name}': its pool {tuple(self.pool_size)} is "
                f"larger than its input's height and width {tuple(shape[1:3])}: no window fits "
                "('valid' padding), the output would be empty.")
        super().build(input_shape)

    def call(self, x):
        """deel-lip's computation; as one fused CPU kernel each way when
        `lipdp.kernels.usable_for` allows it (same order of operations, so the same
        rounding bound: `rounding_error`). When `x` is, in the graph being traced, the
        output of `DP_GroupSort`'s fused kernel (GroupSort2 of some ``z``), the two layers
        run as one kernel on ``z`` instead (``LipdpSortPool``: the same values bit for bit,
        without the sorted activations in memory; the sort's own op, then unused, is
        pruned from the graph)."""
        if self.data_format != "channels_last" or not kernels.usable_for(x):
            return super().call(x)
        pool_h, pool_w = self.pool_size
        attrs = dict(pool_h=pool_h, pool_w=pool_w, coef=float(self._get_coef()),
                     eps=float(self.eps_grad_sqrt))
        sorted_input = _fused_group_sort_input(x)
        if sorted_input is not None:
            z, interleaved = sorted_input
            return kernels.fused_ops().lipdp_sort_pool(z, interleaved=interleaved, **attrs)
        return kernels.fused_ops().lipdp_l2_norm_pool(x, **attrs)

    def _coef(self):
        return as_bound(float(self.k_coef_lip))

    def propagate_inputs(self, input_bound):
        return self._coef() * as_bound(input_bound)

    def backpropagate_inputs(self, input_bound, gradient_bound):
        return self._coef() * as_bound(gradient_bound)

    def rounding_error(self, input_bound):
        """`lipdp.rounding.block_norm_error` on windows of ``a = ph pw`` pixels: the
        average pooling of the squares divides by a, and ``call`` multiplies by
        ``k sqrt(a)``."""
        area = math.prod(self.pool_size)
        k = float(self.k_coef_lip)
        return block_norm_error(area, area, k, k * input_bound)

    def get_config(self):
        # deel-lip's leaves eps_grad_sqrt out: a saved or cloned layer came back at 1e-6
        # (an audit, 2026-12-07: the same weights then took gradients 1.66x larger).
        return {**super().get_config(), "eps_grad_sqrt": float(self.eps_grad_sqrt)}


def _fused_group_sort_input(x):
    """``(z, interleaved)`` when the symbolic tensor `x` is GroupSort2 of ``z`` computed by
    the fused kernel (``LipdpPairPermute(z, z)``: keys and values the same tensor, which
    only `lipdp.layers._pair_sort.sort_pairs` writes; its backward pass permutes another
    tensor), else None (eager tensors included, and inside `lipdp.kernels.separate_layers`)."""
    if (tf.executing_eagerly() or not kernels.layers_may_fuse() or not hasattr(x, "op")
            or x.op.type != "LipdpPairPermute"):
        return None
    keys, values = x.op.inputs
    if keys.name != values.name:
        return None
    return keys, x.op.get_attr("interleaved")
