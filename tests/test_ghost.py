"""Ghost norms (Lee & Kifer) against exact per-example gradients.

Reference: one GradientTape per example (no per-example trick shared with the
library). Tolerance: rtol 1e-5 on squared norms. Both sides are float32 sums of
a few hundred to a few thousand products; measured disagreement is <= 1e-6
relative, a wrong stride/padding/patch alignment or a missing constant is off by
far more than 1e-5.
"""

import warnings

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import example, given, settings, strategies as st

from lipdp.clipping import GhostFallbackWarning, ghost_norms, ghost_plan
from lipdp.clipping.ghost import GhostEngine
from lipdp.clipping.rules import make_rule
from lipdp.clipping.validation import per_example_loss
from lipdp.clipping.vectorized import per_example_squared_norms
from lipdp.layers import (DP_BoundedInput, DP_Flatten, DP_GroupSort, DP_QuickSpectralConv2D,
                          DP_QuickSpectralDense, DP_ScaledL2NormPooling2D)
from lipdp.metadata import DPParameters

L = tf.keras.layers
RTOL = 1e-5
CCE = tf.keras.losses.CategoricalCrossentropy(from_logits=True)


def exact_squared_norms(model, loss, x, y):
    """``(variables, n)`` array of ||grad_v loss_i||^2, one tape per example."""
    rows = []
    for i in range(len(x)):
        with tf.GradientTape() as tape:
            value = tf.reduce_sum(loss.call(y[i:i + 1], model(x[i:i + 1], training=True)))
        grads = tape.gradient(value, model.trainable_variables)
        rows.append([0.0 if g is None else float(tf.reduce_sum(tf.square(tf.convert_to_tensor(g))))
                     for g in grads])
    return np.array(rows).T


def _quiet_engine(model, method="auto"):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GhostFallbackWarning)
        return GhostEngine(model, norm_method=method)


def _assert_norms(model, loss, x, y, method="auto"):
    fn = per_example_loss(loss)
    engine = _quiet_engine(model, method)
    ghost = np.array([n.numpy() for n in engine.per_example_squared_norms(model, fn, x, y)])
    vectorized = np.array([n.numpy() for n in per_example_squared_norms(model, fn, x, y)])
    reference = exact_squared_norms(model, loss, x, y)
    assert reference.min() > 0
    np.testing.assert_allclose(ghost, vectorized, rtol=RTOL)
    np.testing.assert_allclose(ghost, reference, rtol=RTOL)


def _data(n, shape=(8, 8, 2), k=4, seed=0):
    rng = np.random.default_rng(seed)
    return (tf.constant(rng.normal(size=(n,) + shape), tf.float32),
            tf.one_hot(rng.integers(0, k, n), k))


def mixed_cnn():
    """Conv2D stride 1 'same' (+relu), stride 2 'valid', stride 2 'same'; max/avg pooling."""
    tf.keras.utils.set_random_seed(1)
    return tf.keras.Sequential([
        L.Input((8, 8, 2)), L.Conv2D(3, 3, padding="same", activation="relu"),
        L.Conv2D(4, 3, strides=2, padding="valid"), L.ReLU(), L.MaxPooling2D(2, padding="same"),
        L.Conv2D(3, 2, strides=2, padding="same"), L.AveragePooling2D(1), L.Flatten(),
        L.Dense(5, activation="tanh"), L.Dense(4)])


METHODS = pytest.mark.parametrize("method", ["auto", "gram"])


@METHODS
def test_ghost_norms_equal_exact_norms_on_a_mixed_cnn(method):
    model = mixed_cnn()
    assert ghost_plan(model).fallback == ()
    assert len(ghost_plan(model).ghost) == 5
    _assert_norms(model, CCE, *_data(6), method=method)


def test_auto_method_picks_the_smaller_intermediate():
    """First conv of mixed_cnn: 64 patches of 18 inputs, 3 filters -> 2*64^2 > 18*3: direct."""
    assert not ghost_norms.uses_gram(64, 18, 3, "auto")
    assert ghost_norms.uses_gram(64, 18, 3, "gram")
    assert ghost_norms.uses_gram(64, 18, 3)  # the default: engine "ghost"
    assert GhostEngine(mixed_cnn()).norm_method == "gram"
    assert ghost_norms.uses_gram(4, 16, 8)  # 32 <= 128: Gram
    with pytest.raises(ValueError, match="method"):
        GhostEngine(mixed_cnn(), norm_method="fast")


def _matmul_spy(monkeypatch):
    """Record the shape of every ``tf.matmul`` result (the only batched product the ghost
    rules use: Gram matrices ``(c, T, T)`` or direct per-example gradients ``(c, m, n)``)."""
    shapes = []
    matmul = tf.matmul

    def spy(*args, **kwargs):
        out = matmul(*args, **kwargs)
        shapes.append(tuple(out.shape))
        return out

    monkeypatch.setattr(tf, "matmul", spy)
    return shapes


@pytest.mark.parametrize("method,forms_gradients", [("gram", False), ("auto", True)])
def test_ghost_engine_never_forms_a_per_example_layer_gradient(monkeypatch, method,
                                                               forms_gradients):
    """Engine "ghost" (method "gram") computes no ``(examples, m, n)`` tensor with a ghost
    layer's kernel shape ``m x n`` (``kh kw C_in x C_out`` for Conv2D); the whole clipped step
    runs eagerly so every product of the rules is seen. Engine "mixed-ghost" ("auto") forms
    them for mixed_cnn's first convolution, which shows the spy can see them."""
    model = mixed_cnn()
    engine = _quiet_engine(model, method)
    kernels = {(int(np.prod(layer.kernel.shape[:-1])), int(layer.kernel.shape[-1]))
               for layer in ghost_plan(model).ghost}
    shapes = _matmul_spy(monkeypatch)
    x, y = _data(6)
    engine.clipped_sum(model, per_example_loss(CCE), x, y, make_rule(
        DPParameters(0.0, mode="clipped", l2_norm_clip=1.0), model.trainable_variables))
    per_example_gradients = [s for s in shapes if len(s) == 3 and s[1:] in kernels]
    assert shapes  # the Conv2D rules ran through the spy
    assert bool(per_example_gradients) == forms_gradients, (per_example_gradients, kernels)


@METHODS
def test_ghost_norms_on_lipdp_layers_carry_the_conv_constant(method):
    """DP_QuickSpectralConv2D convolves with coef * kernel: the rule multiplies by coef^2."""
    tf.keras.utils.set_random_seed(2)
    model = tf.keras.Sequential([
        DP_BoundedInput(3.0, input_shape=(8, 8, 2)), DP_QuickSpectralConv2D(4, 3), DP_GroupSort(2),
        DP_ScaledL2NormPooling2D(2), DP_QuickSpectralConv2D(4, 3, strides=2, padding="valid"),
        DP_Flatten(), DP_QuickSpectralDense(4)])
    assert ghost_plan(model).fallback == ()
    assert any(abs(layer.coef - 1.0) > 0.1 for layer in model.layers
               if isinstance(layer, DP_QuickSpectralConv2D))
    _assert_norms(model, CCE, *_data(5, seed=1), method=method)


def sequence_model():
    """Embedding (ids repeat), Dense on rank-3 inputs (Gram), LayerNormalization (fallback)."""
    tf.keras.utils.set_random_seed(3)
    inputs = L.Input((5,), dtype="int32")
    h = L.Embedding(4, 3)(inputs)
    h = L.Dense(4, activation="relu")(h)
    h = L.LayerNormalization(name="norm_fallback")(h)
    h = L.Flatten()(h)
    return tf.keras.Model(inputs, L.Dense(3)(h))


def _ids(n, seed=0):
    rng = np.random.default_rng(seed)
    return tf.constant(rng.integers(0, 4, (n, 5)), tf.int32), tf.one_hot(rng.integers(0, 3, n), 3)


@METHODS
def test_embedding_and_rank3_dense_ghost_norms_and_visible_fallback(method):
    model = sequence_model()
    plan = ghost_plan(model)
    assert [type(layer).__name__ for layer in plan.ghost] == ["Embedding", "Dense", "Dense"]
    assert [name for name, _ in plan.fallback] == ["norm_fallback"]
    with pytest.warns(GhostFallbackWarning, match="norm_fallback"):
        GhostEngine(model)
    assert "exact per-example gradients" in plan.describe()
    _assert_norms(model, CCE, *_ids(6), method=method)


@METHODS
def test_chunked_computation_gives_the_same_norms(monkeypatch, method):
    """Chunks of 2 examples or fewer (with a zero-padded last chunk) change nothing."""
    monkeypatch.setattr(ghost_norms, "_CHUNK_ELEMENTS", 2 * 2 * 64 * 64)
    _assert_norms(mixed_cnn(), CCE, *_data(5, seed=3), method=method)
    _assert_norms(sequence_model(), CCE, *_ids(5, seed=4), method=method)


def test_shared_layer_falls_back_at_trace_time():
    """A layer called twice in one pass: its norms need both calls, so it falls back."""
    tf.keras.utils.set_random_seed(4)
    shared = L.Dense(4)
    inputs = L.Input((4,))
    model = tf.keras.Model(inputs, L.Dense(3)(shared(shared(inputs))))
    x, y = _data(4, shape=(4,), k=3)
    fn = per_example_loss(CCE)
    engine = _quiet_engine(model)
    with pytest.warns(GhostFallbackWarning, match="called 2 times"):
        ghost = engine.per_example_squared_norms(model, fn, x, y)
    np.testing.assert_allclose([n.numpy() for n in ghost], exact_squared_norms(model, CCE, x, y),
                               rtol=RTOL)


@settings(max_examples=12, deadline=None)
@given(size=st.integers(5, 9), kernel=st.integers(1, 4), stride=st.integers(1, 3),
       padding=st.sampled_from(["same", "valid"]), channels=st.integers(1, 3),
       bias=st.booleans(), method=st.sampled_from(["auto", "gram"]))
# The strided 1x1 'same' case on which TensorFlow's oneDNN kernels fail (tests/conftest.py).
@example(size=6, kernel=1, stride=2, padding="same", channels=3, bias=True, method="gram")
def test_conv2d_ghost_norm_for_drawn_shapes(size, kernel, stride, padding, channels, bias, method):
    if padding == "valid" and kernel > size:
        return
    tf.keras.utils.set_random_seed(size * 100 + kernel * 10 + stride)
    model = tf.keras.Sequential([L.Input((size, size + 1, channels)),
                                 L.Conv2D(2, (kernel, max(1, kernel - 1)), strides=(stride, 1),
                                          padding=padding, use_bias=bias),
                                 L.Flatten(), L.Dense(3)])
    x, y = _data(3, shape=(size, size + 1, channels), k=3, seed=size)
    _assert_norms(model, CCE, x, y, method=method)
