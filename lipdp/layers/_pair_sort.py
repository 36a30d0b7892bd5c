"""GroupSort2 as one selection between each coordinate and its partner.

A GroupSort2 sorts disjoint pairs of channels. *Which* fixed pairing is used does
not matter for the bounds: every fixed pairing, with the sorted pair written back
to the pair's own two positions, is a permutation of each input (norm preserving)
and 1-Lipschitz (sorting a pair is 1-Lipschitz, the pairs are disjoint blocks).

Each coordinate ``x_c`` has a partner ``p_c`` (the other member of its pair) and
a side: the *first* member of a pair receives the minimum, the second the
maximum. With ``swap = (first member >= second member)``, shared by both members
(computed as ``x >= p`` on first members and ``p >= x`` on second ones), the
output is ``y = where(swap, p, x)``: on a first member, ``min``; on a second
member, ``max``; at a tie both members agree on ``swap``, so the output is still
one permutation of the pair. The backward pass applies the same permutation to
the cotangent, ``where(swap, partner(g), g)``, so the computed input cotangent has
*exactly* the norm of the output cotangent (``tf.minimum`` / ``tf.maximum``
would both send a tied pair's cotangent to one input: norm up to ``sqrt(2) G``).
Only comparisons and selections: no rounding.

Two pairings:

- ``"halves"`` (fast): channel c is paired with ``c + C/2``; the partner tensor
  is one ``tf.roll`` of the channel axis, and no reshape, slice or concat is
  needed. Minima fill the first half of the channels, maxima the second.
- ``"interleaved"`` (deel-lip's GroupSort2): channels ``2i`` and ``2i + 1``,
  minimum then maximum; the layout of models saved before the fast pairing.

`sort_pairs` runs the fused CPU kernel of `lipdp.kernels` when it can (one pass over
memory each way: ``LipdpPairPermute(x, x)`` forward, ``LipdpPairPermute(x, dy)``
backward, the same comparison and selections, so the same values bit for bit) and
`reference_sort_pairs`, written with TensorFlow ops, otherwise.
"""

from __future__ import annotations

import tensorflow as tf

from lipdp import kernels

PAIRINGS = ("halves", "interleaved")


def _halves_partner(x):
    # A non-negative axis: tf.vectorized_map mis-vectorises tf.roll on axis=-1 (TF 2.15).
    return tf.roll(x, shift=x.shape[-1] // 2, axis=x.shape.rank - 1)


def _interleaved_partner(x):
    pairs = tf.reshape(x, tf.concat([tf.shape(x)[:-1], [x.shape[-1] // 2, 2]], 0))
    return tf.reshape(tf.reverse(pairs, axis=[-1]), tf.shape(x))


def _first_members(channels, pairing):
    """Boolean vector over the channels: True on the member that receives the min."""
    index = tf.range(channels)
    return index < channels // 2 if pairing == "halves" else index % 2 == 0


def sort_pairs(x, pairing="halves"):
    """GroupSort2 of `x` along its last axis (even size), with the tie-safe
    permutation backward described in the module docstring: the fused kernel when
    `lipdp.kernels.usable_for` allows it, else `reference_sort_pairs`."""
    if kernels.usable_for(x):
        return kernels.fused_ops().lipdp_pair_permute(x, x, interleaved=pairing == "interleaved")
    return reference_sort_pairs(x, pairing)


def reference_sort_pairs(x, pairing="halves"):
    """`sort_pairs` written with TensorFlow ops (a partner tensor, then selections)."""
    partner_of = _halves_partner if pairing == "halves" else _interleaved_partner
    first = _first_members(x.shape[-1], pairing)

    @tf.custom_gradient
    def pair_sort(values):
        partner = partner_of(values)
        swap = tf.where(first, values >= partner, partner >= values)

        def permute_back(cotangent):
            return tf.where(swap, partner_of(cotangent), cotangent)

        return tf.where(swap, partner, values), permute_back

    return pair_sort(x)
