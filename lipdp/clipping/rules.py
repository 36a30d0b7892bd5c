"""Clipping rules of classic DP-SGD: per-example factors and the sensitivity they give.

A rule turns the per-example, per-variable squared gradient norms
``s[v][i] = ||g_{i,v}||^2`` of a batch into factors ``nu[v][i]`` in ``[0, 1]``;
the clipped gradient of example i is ``(nu[v][i] g_{i,v})_v``. Each rule
guarantees a bound on the L2 norm of every clipped per-example gradient, hence
on the L2 sensitivity of their **sum** under add/remove-one (`sensitivity`).
The train step divides the sum by the public denominator D, so the averaged
gradient has sensitivity ``sensitivity / D``.

Norms are those computed in float32 by an engine: a gradient whose computed norm
is within float rounding (~1e-6 relative) of the threshold may exceed it by that
much, as in every DP-SGD implementation.
"""

from __future__ import annotations

import abc
import math
from typing import List, Sequence

import tensorflow as tf

from lipdp.metadata import Clipping, DPParameters


def _total_norm(squared_norms: Sequence[tf.Tensor]) -> tf.Tensor:
    """``||g_i||`` over all variables, shape ``(batch,)``; in float64 when the squared norms'
    dtypes differ (float32 and float64 variables in one model, or float32 ghost norms of
    float64 variables: the casts to float64 are exact)."""
    squared_norms = list(squared_norms)
    if len({s.dtype for s in squared_norms}) > 1:
        squared_norms = [tf.cast(s, tf.float64) for s in squared_norms]
    return tf.sqrt(tf.add_n(squared_norms))


class ClippingRule(abc.ABC):
    """Maps per-example squared norms to clipping factors."""

    @abc.abstractmethod
    def factors(self, squared_norms: Sequence[tf.Tensor]) -> List[tf.Tensor]:
        """Factors ``nu[v]`` of shape ``(batch,)``, aligned with `squared_norms`."""

    @abc.abstractmethod
    def sensitivity(self) -> float:
        """Bound on ``||clip(g_i)||_2`` over all variables: the L2 sensitivity of the sum."""

    @abc.abstractmethod
    def variable_sensitivities(self) -> List[float]:
        """Bound on ``||clip(g_i)_v||_2`` for each variable v alone."""


class FlatClipping(ClippingRule):
    """``nu_i = min(1, C / ||g_i||)`` on the whole per-example gradient (Abadi et al.).

    Formal guarantee: ``||nu_i g_i|| <= C``; sensitivity of the sum: C.
    Edge case: a zero gradient gets factor 1 (computed as ``C / max(||g||, C)``,
    never a division by zero).
    """

    def __init__(self, threshold: float, nb_variables: int):
        self.threshold = float(threshold)
        self._nb_variables = int(nb_variables)

    def example_factors(self, squared_norms):
        norm = _total_norm(squared_norms)
        return self.threshold / tf.maximum(norm, self.threshold)

    def factors(self, squared_norms):
        nu = self.example_factors(squared_norms)
        return [nu] * len(squared_norms)

    def sensitivity(self):
        return self.threshold

    def variable_sensitivities(self):
        # One example may put its whole clipped norm on any single variable.
        return [self.threshold] * self._nb_variables


class GlobalClipping(FlatClipping):
    """``nu_i = 1{||g_i|| <= R}`` (Bu et al., Algorithm 1, option 2: "global clipping").

    An example's gradient is kept unchanged when its norm is at most R and
    dropped otherwise. Formal guarantee: ``||nu_i g_i|| <= R``, so the sum has
    L2 sensitivity R under add/remove-one (the paper's Theorem 3: the same
    privacy as flat clipping at threshold R), and the averaged gradient ``R / D``.
    Note the paper divides the noisy sum by the realised batch size ``|I_t|``;
    lipdp divides by the public D (DESIGN.md), which keeps the sensitivity R/D.
    """

    def example_factors(self, squared_norms):
        norm = _total_norm(squared_norms)
        return tf.cast(norm <= self.threshold, norm.dtype)


class PerLayerClipping(ClippingRule):
    """``nu_{i,v} = min(1, C_v / ||g_{i,v}||)`` for each trainable variable v.

    Formal guarantee: ``||clip(g_i)_v|| <= C_v``, so ``||clip(g_i)|| <=
    sqrt(sum_v C_v^2)``: the sensitivity of the sum. Isotropic noise of std
    ``sigma * sqrt(sum_v C_v^2)`` then makes the step a Gaussian mechanism with
    noise multiplier sigma.
    """

    def __init__(self, thresholds: Sequence[float]):
        self.thresholds = [float(c) for c in thresholds]

    def factors(self, squared_norms):
        if len(squared_norms) != len(self.thresholds):
            raise ValueError(f"{len(squared_norms)} variables for {len(self.thresholds)} "
                             "per-layer thresholds.")
        return [c / tf.maximum(tf.sqrt(s), c) for s, c in zip(squared_norms, self.thresholds)]

    def sensitivity(self):
        return math.sqrt(sum(c * c for c in self.thresholds))

    def variable_sensitivities(self):
        return list(self.thresholds)


def make_rule(params: DPParameters, variables: Sequence[tf.Variable]) -> ClippingRule:
    """The rule `params` asks for, for these trainable variables.

    Per-layer thresholds: a sequence is used as is and must have one entry per
    variable; a single C is split as ``C / sqrt(V)`` for each of the V variables.

    Raises:
        ValueError: a threshold list whose length is not the number of variables.
    """
    variables = list(variables)
    clip = params.l2_norm_clip
    if params.clipping is Clipping.PER_LAYER:
        if isinstance(clip, tuple):
            if len(clip) != len(variables):
                names = [v.name for v in variables]
                raise ValueError(
                    "Received an invalid value for `l2_norm_clip`, expected one threshold per "
                    f"trainable variable ({len(variables)}: {names}). "
                    f"Received: l2_norm_clip={list(clip)!r} ({len(clip)} thresholds)"
                )
            return PerLayerClipping(clip)
        return PerLayerClipping([clip / math.sqrt(len(variables))] * len(variables))
    if params.clipping is Clipping.GLOBAL:
        return GlobalClipping(clip, len(variables))
    return FlatClipping(clip, len(variables))
