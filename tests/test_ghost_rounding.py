"""Ghost norms are upper bounds also for records whose per-position gradients cancel.

A Gram identity sums terms of both signs. Before 2026-12-04 a record with features
alternating in sign along its positions (plus a small mean) had its float32 Gram sum come
out 0 or negative while its per-example gradient had a norm of several C: the ghost engine
summed it unclipped (8.1 C measured) or stopped at a NaN factor. Each rule now adds the
bound of its own rounding (`lipdp.clipping.ghost_norms`, "Rounding").

Reference: the per-example gradient ``sum_t a_t g_t^T`` of the very float32 inputs and
cotangents the rule receives, formed in float64 (numpy). Every record draws the size of its
alternating part from 1 to 1e9, so both ordinary and cancelling records are checked.
"""

import warnings

import numpy as np
import pytest
import tensorflow as tf

from lipdp.clipping import GhostFallbackWarning, ghost_norms
from lipdp.clipping.ghost import GhostEngine
from lipdp.clipping.rules import FlatClipping
from lipdp.clipping.validation import per_example_loss

L = tf.keras.layers
EXAMPLES = 24
SCALES = np.geomspace(1.0, 1e9, EXAMPLES)  # the alternating part's size, record by record


def _alternating(rng, positions, features):
    """``(EXAMPLES, positions, features)``: per record, ``+-A v`` alternating along the
    positions plus a standard normal part, A from `SCALES`."""
    signs = np.where(np.arange(positions) % 2 == 0, 1.0, -1.0)[:, None]
    records = [signs * scale * rng.normal(size=(1, features)) + rng.normal(size=(positions,
                                                                               features))
               for scale in SCALES]
    return np.array(records, np.float32)


def _assert_upper_bounds(bounds, exact):
    """float32 `bounds` >= the float64 `exact` squared norms, record by record."""
    bounds, exact = np.asarray(bounds, np.float64), np.asarray(exact, np.float64)
    below = np.flatnonzero(bounds < exact)
    assert below.size == 0, [(SCALES[i], bounds[i], exact[i]) for i in below]


@pytest.mark.parametrize("method", ["gram", "auto"])
def test_dense_over_positions_bounds_cancelling_gradients(method):
    """Kernel ``sum_t a_t g_t^T`` (Gram form, or the direct one with "auto" here: 2 T^2 >
    m n) and bias ``sum_t g_t``, the cotangents cancelling too."""
    rng = np.random.default_rng(0)
    positions, features, units = 64, 4, 3
    layer = L.Dense(units)
    layer.build((None, positions, features))
    a = _alternating(rng, positions, features)
    g = _alternating(rng, positions, units) * np.float32(1e-3)
    kernel, bias = (t.numpy() for t in ghost_norms.dense_squared_norms(
        layer, tf.constant(a), tf.constant(g), method))
    a64, g64 = a.astype(np.float64), g.astype(np.float64)
    _assert_upper_bounds(kernel, np.sum(np.einsum("btm,btn->bmn", a64, g64) ** 2, axis=(1, 2)))
    _assert_upper_bounds(bias, np.sum(g64.sum(axis=1) ** 2, axis=1))


def _patches64(images, kernel_size, padding):
    """``(B, P, kh kw C)`` float64 patches (an exact copy of the float32 pixels)."""
    patches = tf.image.extract_patches(tf.constant(images, tf.float64),
                                       sizes=[1, kernel_size, kernel_size, 1],
                                       strides=[1, 1, 1, 1], rates=[1, 1, 1, 1],
                                       padding=padding.upper()).numpy()
    return patches.reshape(len(images), -1, patches.shape[-1])


@pytest.mark.parametrize("method", ["gram", "auto"])
@pytest.mark.parametrize("padding", ["same", "valid"])
def test_conv2d_bounds_cancelling_gradients(method, padding):
    """A checkerboard of +-A in every channel, plus noise: the patches' contributions
    cancel. "auto" takes the direct form here (2 P^2 > 27 x 3)."""
    rng = np.random.default_rng(1)
    size, channels, filters = 8, 3, 3
    layer = L.Conv2D(filters, 3, padding=padding)
    layer.build((None, size, size, channels))
    board = np.where(np.add.outer(np.arange(size), np.arange(size)) % 2 == 0, 1.0, -1.0)
    images = np.array([board[:, :, None] * scale * rng.normal(size=channels)
                       + rng.normal(size=(size, size, channels)) for scale in SCALES],
                      np.float32)
    out = size if padding == "same" else size - 2
    cotangents = rng.normal(size=(EXAMPLES, out, out, filters)).astype(np.float32)
    cotangents[:, :, :, 0] = 1.0  # a constant cotangent: the checkerboard cancels exactly
    kernel, bias = (t.numpy() for t in ghost_norms.conv2d_squared_norms(
        layer, tf.constant(images), tf.constant(cotangents), method))
    patches = _patches64(images, 3, padding)
    g64 = cotangents.astype(np.float64).reshape(EXAMPLES, -1, filters)
    exact = np.sum(np.einsum("bpm,bpn->bmn", patches, g64) ** 2, axis=(1, 2))
    _assert_upper_bounds(kernel, exact)
    _assert_upper_bounds(bias, np.sum(g64.sum(axis=1) ** 2, axis=1))


def test_embedding_bounds_cancelling_gradients():
    """Positions sharing an id with alternating cotangents: ``sum_t 1{id_t = id_s}
    <g_t, g_s>`` cancels, and the reference adds the rows of each id."""
    rng = np.random.default_rng(2)
    positions, vocabulary, width = 32, 3, 4
    layer = L.Embedding(vocabulary, width)
    layer.build((None, positions))
    ids = rng.integers(0, vocabulary, (EXAMPLES, positions)).astype(np.int32)
    ids[:, ::2] = ids[:, 1::2]  # every even position repeats the next one's id
    g = _alternating(rng, positions, width)
    (bound,) = (t.numpy() for t in ghost_norms.embedding_squared_norms(
        layer, tf.constant(ids), tf.constant(g)))
    rows = np.zeros((EXAMPLES, vocabulary, width))
    for b in range(EXAMPLES):
        np.add.at(rows[b], ids[b], g[b].astype(np.float64))
    _assert_upper_bounds(bound, np.sum(rows ** 2, axis=(1, 2)))


@pytest.mark.parametrize("engine", ["ghost", "mixed-ghost"])
def test_a_cancelling_record_is_clipped_to_c(engine):
    """End to end: one record per batch through a Dense over 64 positions, the record's
    alternating part from 1e4 to 1e9. The clipped sum (that record's contribution) stays
    within C; the float32 Gram sum let 8.1 C through, or stopped the step on a NaN."""
    rng = np.random.default_rng(3)
    tf.keras.utils.set_random_seed(3)
    positions, features = 64, 4
    inputs = tf.keras.Input((positions, features))
    hidden = L.GlobalAveragePooling1D()(L.Dense(3, use_bias=False)(inputs))
    model = tf.keras.Model(inputs, L.Dense(2, use_bias=False, trainable=False)(hidden))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GhostFallbackWarning)
        clipper = GhostEngine(model, norm_method="gram" if engine == "ghost" else "auto")
    loss = per_example_loss(tf.keras.losses.CategoricalCrossentropy(from_logits=True))
    rule, clip = FlatClipping(1.0, 1), 1.0
    step = tf.function(lambda x, y: clipper.clipped_sum(model, loss, x, y, rule).gradient_sums)
    signs = np.where(np.arange(positions) % 2 == 0, 1.0, -1.0)[:, None]
    norms = []
    for _ in range(16):
        scale, mean = 10 ** rng.uniform(4, 9), 10 ** rng.uniform(0, 3)
        x = signs * scale * rng.normal(size=(1, features)) + mean * rng.normal(size=(1, features))
        x = (x + rng.normal(size=(positions, features)))[None].astype(np.float32)
        (total,) = step(tf.constant(x), tf.constant([[1.0, 0.0]]))
        norms.append(np.linalg.norm(total.numpy().astype(np.float64)))
    assert np.all(np.isfinite(norms)) and max(norms) <= clip * (1 + 1e-4), norms
