"""Ghost norms (Lee & Kifer) against exact per-example gradients.

Reference: one GradientTape per example (no per-example trick shared with the
library). The rules return upper bounds that cover their own rounding
(`lipdp.clipping.ghost_norms`, "Rounding"), so a ghost norm must lie in
``[(1 - 1e-5) ref, (1 + 1e-3) ref]``: the reference is a float32 sum of a few
hundred products (off by up to about 1e-6 relative, as are the fallback layers'
exact norms), the rounding terms add up to a few 1e-5 on these data, and a wrong stride/padding/patch alignment or a missing
constant is off by far more than 1e-3. Gradient sums of the two engines then
differ by the clipping factors' difference, at most 1e-3 relative.

Randomness inside layers (the last tests): the vector clipped for an example is
the one whose norm was measured, whatever a replayed layer draws; fallback
layers with declared randomness are refused; the vectorized engine takes each
example's gradient from the draw that gave its loss.
"""

import math
import warnings

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import example, given, settings, strategies as st

from lipdp.clipping import GhostFallbackWarning, GhostRandomnessError, ghost_norms, ghost_plan
from lipdp.clipping.ghost import GhostEngine
from lipdp.clipping.rules import make_rule
from lipdp.clipping.validation import per_example_loss
from lipdp.clipping.vectorized import VectorizedEngine, per_example_squared_norms
from lipdp.layers import (DP_BoundedInput, DP_Flatten, DP_GroupSort, DP_QuickSpectralConv2D,
                          DP_QuickSpectralDense, DP_ScaledL2NormPooling2D)
from lipdp.layers._pair_sort import sort_pairs
from lipdp.metadata import DatasetMetadata, DPParameters
from lipdp.model import DP_Sequential
from tests._soundness import per_example_gradients

L = tf.keras.layers
RTOL = 1e-5
BELOW, ABOVE = 1e-5, 1e-3  # how far a ghost bound may sit below and above a reference
CCE = tf.keras.losses.CategoricalCrossentropy(from_logits=True)


def exact_squared_norms(model, loss, x, y):
    """``(variables, n)`` array of ||grad_v loss_i||^2 (exact, one tape per example)."""
    return np.array([[np.sum(np.square(g)) for g in grads]
                     for grads in per_example_gradients(model, loss, x, y)]).T


def assert_bounds(ghost, reference):
    """Every ghost squared norm is an upper bound of its reference, and a close one."""
    ghost, reference = np.asarray(ghost, np.float64), np.asarray(reference, np.float64)
    assert ghost.shape == reference.shape
    np.testing.assert_array_less(reference * (1.0 - BELOW), ghost)
    np.testing.assert_array_less(ghost, reference * (1.0 + ABOVE) + 1e-30)


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
    assert_bounds(ghost, vectorized)
    assert_bounds(ghost, reference)


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


class _ConvThenGroupSort(L.Layer):
    """A weighted leaf layer whose output is GroupSort2's (lipdp's kernel): a ghost fallback
    layer (replayed), whose recorded output the next layer, an L2-norm pooling, would fuse
    with."""

    def build(self, input_shape):
        self.kernel = self.add_weight(name="kernel", shape=(3, 3, input_shape[-1], 4))

    def call(self, x):
        return sort_pairs(tf.nn.conv2d(x, self.kernel, 1, "SAME"))


@METHODS
def test_a_layer_ending_in_groupsort2_before_pooling_gets_its_norm(method):
    """Fused with the pooling after it, a layer's GroupSort2 output would leave the autodiff
    graph: the engine traces layers separately, so that output keeps its cotangent and the
    layer its exact per-example norm (with fusion, its norm was 0 and the rest clipped to
    C without it: a per-example gradient above C)."""
    tf.keras.utils.set_random_seed(2)
    model = tf.keras.Sequential([L.Input((8, 8, 2)), _ConvThenGroupSort(),
                                 DP_ScaledL2NormPooling2D(2), L.Flatten(), L.Dense(4)])
    assert [type(layer) for layer in ghost_plan(model).fallback_layers] == [_ConvThenGroupSort]
    x, y = _data(6)
    engine, fn = _quiet_engine(model, method), per_example_loss(CCE)
    traced = tf.function(lambda x, y: engine.per_example_squared_norms(model, fn, x, y))
    ghost = np.array([n.numpy() for n in traced(x, y)])  # traced, as the train step runs it
    assert_bounds(ghost, exact_squared_norms(model, CCE, x, y))


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


@pytest.mark.parametrize("traced", [False, True])
@pytest.mark.parametrize("method,forms_gradients", [("gram", False), ("auto", True)])
def test_ghost_engine_never_forms_a_per_example_layer_gradient(monkeypatch, method,
                                                               forms_gradients, traced):
    """Engine "ghost" (method "gram") computes no ``(examples, m, n)`` tensor with a ghost
    layer's kernel shape ``m x n`` (``kh kw C_in x C_out`` for Conv2D, or the ``C_in x C_out``
    block of one kernel offset, how the direct form builds it); the whole clipped step
    runs eagerly so every product of the rules is seen, or is traced with an unknown batch
    dimension as in `fit` (then the spy sees the products' static shapes). Engine
    "mixed-ghost" ("auto") forms them for mixed_cnn's first convolution, which shows the spy
    can see them; traced, it did not before 2026-11-26 (an unknown batch dimension made the
    number of positions unknown, and the rules fell back to Gram matrices)."""
    model = mixed_cnn()
    engine = _quiet_engine(model, method)
    kernels = {(int(np.prod(layer.kernel.shape[:-1])), int(layer.kernel.shape[-1]))
               for layer in ghost_plan(model).ghost}
    # A convolution's direct form builds its gradient one kernel offset at a time: C_in x C_out.
    kernels |= {tuple(int(d) for d in layer.kernel.shape[-2:]) for layer in ghost_plan(model).ghost
                if layer.kernel.shape.rank == 4}
    shapes = _matmul_spy(monkeypatch)
    x, y = _data(6)
    rule = make_rule(DPParameters(0.0, mode="clipped", l2_norm_clip=1.0),
                     model.trainable_variables)

    def step(x, y):
        return engine.clipped_sum(model, per_example_loss(CCE), x, y, rule).gradient_sums

    sums = step(x, y)
    if traced:  # the same clipped sums as eagerly (where the shapes are known)
        step = tf.function(step, input_signature=[tf.TensorSpec((None, 8, 8, 2)),
                                                  tf.TensorSpec((None, 4))])
        shapes.clear()
        for got, want in zip(step(x, y), sums):
            np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=RTOL, atol=1e-7)
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


def test_a_conv2d_on_inputs_with_two_batch_dimensions_falls_back():
    """Keras folds a (B, T, H, W, C) input's leading dimensions into the batch; the
    convolution rule takes (B, H, W, C): every step failed in both ghost engines (an audit,
    2026-12-07). The layer now takes the exact per-example gradients."""
    tf.keras.utils.set_random_seed(6)
    inputs = L.Input((2, 6, 6, 2))
    h = L.Conv2D(3, 3, strides=2, padding="same", name="conv_5d")(inputs)
    model = tf.keras.Model(inputs, L.Dense(3)(L.Flatten()(h)))
    plan = ghost_plan(model)
    assert [(name, reason) for name, reason in plan.fallback] == [
        ("conv_5d", "inputs of rank 5 (the rule takes (B, H, W, C))")]
    _assert_norms(model, CCE, *_data(4, shape=(2, 6, 6, 2), k=3))
    # Built by hand on rank 4 first, the layer keeps that shape: a message, not a failed
    # unpacking inside the rule (a review)
    prebuilt = L.Conv2D(3, 3, name="prebuilt")
    prebuilt.build((None, 6, 6, 2))
    model = tf.keras.Model(inputs, L.Dense(3)(L.Flatten()(prebuilt(inputs))))
    with pytest.raises(ValueError, match="Conv2D 'prebuilt' receives inputs of rank 5"):
        _assert_norms(model, CCE, *_data(4, shape=(2, 6, 6, 2), k=3))


@pytest.mark.parametrize("traced", [False, True])
def test_an_activation_reading_its_layer_s_kernel_gets_exact_norms(traced):
    """The activation runs outside the ghost layer's call (the rule needs the
    pre-activation), so its read of the kernel is a read outside the layer: exact gradients.
    Eagerly, that read was looked for in a pass traced without the wrapper and passed as the
    layer's own, and the ghost norm missed the activation's part (an audit, 2026-12-07)."""
    tf.keras.utils.set_random_seed(7)
    inputs, dense = L.Input((4,)), L.Dense(3, name="self_reading")
    dense.activation = lambda z: z + 0.5 * tf.reduce_sum(dense.kernel)
    model = tf.keras.Model(inputs, L.Dense(3)(dense(inputs)))
    x, y = _data(6, shape=(4,), k=3, seed=2)
    fn, engine = per_example_loss(CCE), _quiet_engine(model)
    norms = engine.per_example_squared_norms
    with pytest.warns(GhostFallbackWarning, match="self_reading/kernel"):
        ghost = (tf.function(norms) if traced else norms)(model, fn, x, y)
    assert_bounds([n.numpy() for n in ghost], exact_squared_norms(model, CCE, x, y))


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
    assert_bounds([n.numpy() for n in ghost], exact_squared_norms(model, CCE, x, y))


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


class BernoulliScale(L.Layer):
    """``w * x`` times a fresh Bernoulli(1/2) mask (kept entries doubled) in training mode:
    trainable, no ghost rule, and randomness no refusal list can see (a bare `tf.random`).
    w starts at 0.1, which shrinks the other layers' gradients, so that w's gradient (whose
    norm the replay measures under another mask) carries much of the total norm."""

    def build(self, input_shape):
        self.w = self.add_weight(name="w", shape=input_shape[-1:],
                                 initializer=tf.keras.initializers.Constant(0.1))

    def call(self, inputs, training=None):
        outputs = inputs * self.w
        if training:
            keep = tf.random.uniform(tf.shape(outputs)) < 0.5
            outputs = tf.where(keep, 2.0 * outputs, tf.zeros_like(outputs))
        return outputs


def _bernoulli_model():
    tf.keras.utils.set_random_seed(8)
    return tf.keras.Sequential([L.Input((6,)), L.Dense(8), BernoulliScale(name="bernoulli"),
                                L.Dense(3)])


# Thresholds for the 5 trainable variables of the models below; flat and global thresholds
# sit below most (flat) or around the middle (global) of their per-example gradient norms.
CLIPS = [("flat", 0.05), ("global", 1.5), ("per-layer", [0.02, 0.01, 0.03, 0.02, 0.01])]


def _clipping_ratios(engine, model, clipping, clip, shape, draws):
    """Over `draws` seeded single-example batches: the largest ratio of the clipped sum's norm
    to its bound (per variable for per-layer clipping), and the fraction of draws whose
    unclipped norm, as the engine measured it, exceeded the bound.

    With one example the clipped sum *is* that example's clipped gradient, so the rule bounds
    its norm whatever the engine measured. The layers' random draws happen inside the compiled
    step, from the seed set before it is traced."""
    tf.keras.utils.set_random_seed(9)
    rule = make_rule(DPParameters(0.0, mode="clipped", clipping=clipping, l2_norm_clip=clip),
                     model.trainable_variables)
    fn = per_example_loss(CCE)
    step = tf.function(lambda x, y: engine.clipped_sum(model, fn, x, y, rule))
    bounds = np.array(rule.thresholds if clipping == "per-layer" else [rule.sensitivity()])
    worst, exceeded = 0.0, 0
    for draw in range(draws):
        x, y = _data(1, shape=shape, k=3, seed=draw)
        batch = step(x, y)
        sums = [g.numpy().astype(np.float64) for g in batch.gradient_sums]
        squared = np.array([float(n[0]) for n in batch.squared_norms])
        if clipping == "per-layer":
            norms, measured = np.array([np.linalg.norm(g) for g in sums]), np.sqrt(squared)
        else:
            norms = np.array([math.sqrt(sum(float(np.sum(g ** 2)) for g in sums))])
            measured = np.array([math.sqrt(squared.sum())])
        worst = max(worst, float(np.max(norms / bounds)))
        exceeded += bool(np.any(measured > bounds))
    return worst, exceeded / draws


@pytest.mark.parametrize("clipping,clip", CLIPS)
def test_hidden_randomness_in_a_fallback_layer_cannot_break_the_clipping_bound(clipping, clip):
    """The ghost engine replays `BernoulliScale` (new masks) for its per-example gradients:
    the clipped vectors must still be the ones whose norms were measured. 60 draws per rule.
    Tolerance 1e-5 relative: float32 rounding of the norms."""
    model = _bernoulli_model()
    assert [name for name, _ in ghost_plan(model).fallback] == ["bernoulli"]
    worst, exceeded = _clipping_ratios(_quiet_engine(model, "gram"), model, clipping, clip,
                                       (6,), draws=60)
    assert worst <= 1 + 1e-5, worst
    assert 0 < exceeded < 1 if clipping == "global" else exceeded > 0, exceeded


class NoisyDense(L.Layer):
    """A Dense layer behind a Keras random layer, both inside one custom layer: a ghost
    fallback (no rule for the custom type), called a second time by the ghost engine."""

    def __init__(self, units, noise, **kwargs):
        super().__init__(**kwargs)
        self.noise = noise
        self.dense = L.Dense(units)

    def call(self, inputs, training=None):
        return self.dense(self.noise(inputs, training=training))


def _sequential(*layers):
    tf.keras.utils.set_random_seed(10)
    return tf.keras.Sequential(list(layers))


def _attention(dropout):
    tf.keras.utils.set_random_seed(10)
    inputs = L.Input((5, 4))
    h = L.MultiHeadAttention(2, 3, dropout=dropout, name="attention")(inputs, inputs)
    return tf.keras.Model(inputs, L.Dense(3)(L.Flatten()(h)))


RANDOM_FALLBACKS = {
    "lstm": (lambda: _sequential(L.Input((5, 3)), L.LSTM(4, dropout=0.5, name="lstm"),
                                 L.Dense(3)),
             r"layer 'lstm' \(LSTM\).*'lstm' \(LSTM\): dropout=0.5"),
    "gru": (lambda: _sequential(L.Input((5, 3)), L.GRU(4, recurrent_dropout=0.3, name="gru"),
                                L.Dense(3)),
            r"layer 'gru' \(GRU\).*recurrent_dropout=0.3"),
    "simple_rnn": (lambda: _sequential(L.Input((5, 3)),
                                       L.SimpleRNN(4, dropout=0.2, name="rnn"), L.Dense(3)),
                   r"layer 'rnn' \(SimpleRNN\).*\(SimpleRNNCell\): dropout=0.2"),
    "attention": (lambda: _attention(0.1),
                  r"layer 'attention' \(MultiHeadAttention\).*\(Dropout\): rate=0.1"),
    "dropout": (lambda: _sequential(L.Input((6,)), NoisyDense(3, L.Dropout(0.5), name="noisy")),
                r"layer 'noisy' \(NoisyDense\).*\(Dropout\): rate=0.5"),
    "spatial": (lambda: _sequential(L.Input((5, 3)),
                                    NoisyDense(3, L.SpatialDropout1D(0.5), name="noisy"),
                                    L.Flatten(), L.Dense(3)),
                r"\(SpatialDropout1D\): rate=0.5"),
    "gaussian_noise": (lambda: _sequential(L.Input((6,)),
                                           NoisyDense(3, L.GaussianNoise(0.1), name="noisy")),
                       r"\(GaussianNoise\): stddev=0.1"),
    "gaussian_dropout": (lambda: _sequential(L.Input((6,)),
                                             NoisyDense(3, L.GaussianDropout(0.2), name="noisy")),
                         r"\(GaussianDropout\): rate=0.2"),
    "alpha_dropout": (lambda: _sequential(L.Input((6,)),
                                          NoisyDense(3, L.AlphaDropout(0.1), name="noisy")),
                      r"\(AlphaDropout\): rate=0.1"),
    "augmentation": (lambda: _sequential(L.Input((4, 4, 1)),
                                         NoisyDense(3, L.RandomFlip(), name="noisy"),
                                         L.Flatten(), L.Dense(3)),
                     r"\(RandomFlip\)\): that second call"),
}


@pytest.mark.parametrize("case", sorted(RANDOM_FALLBACKS))
def test_fallback_layers_with_declared_randomness_are_refused(case):
    """The second call would draw other masks than the forward pass: the error names the layer,
    its random part, and the engine that computes each example's gradient in one pass."""
    make_model, message = RANDOM_FALLBACKS[case]
    with pytest.raises(GhostRandomnessError, match=message) as refused:
        GhostEngine(make_model(), warn=False)
    assert "engine='vectorized'" in str(refused.value)


def test_randomness_is_refused_at_compile_and_only_inside_fallback_layers():
    """Refused when a DP model is compiled with engine 'ghost' or 'mixed-ghost', accepted with
    'vectorized'. Accepted by the ghost engine: random layers with zero rates, and a Dropout
    layer of its own (drawn once, on the tape: the norms and the sums both see that draw)."""
    metadata = DatasetMetadata((5, 3), 3, 64, 16, 8, None, "shuffle")
    for engine in ("ghost", "mixed-ghost", "vectorized"):
        model = DP_Sequential([L.Input((5, 3)), L.LSTM(4, dropout=0.5, name="lstm"), L.Dense(3)],
                              dp_parameters=DPParameters(0.0, mode="clipped", l2_norm_clip=1.0,
                                                         engine=engine),
                              dataset_metadata=metadata)
        if engine == "vectorized":
            model.compile(loss=CCE)
        else:
            with pytest.raises(GhostRandomnessError, match="'lstm'"):
                model.compile(loss=CCE)
    deterministic = [
        _sequential(L.Input((5, 3)), L.LSTM(4, dropout=0.0, recurrent_dropout=0.0), L.Dense(3)),
        _attention(0.0),
        _sequential(L.Input((6,)), NoisyDense(3, L.Dropout(0.0))),
        _sequential(L.Input((6,)), NoisyDense(3, L.GaussianNoise(0.0))),
    ]
    for model in deterministic:
        assert GhostEngine(model, warn=False).plan.fallback_layers
    model = _sequential(L.Input((6,)), L.Dense(8), L.Dropout(0.5), L.Dense(3))
    assert GhostEngine(model).plan.fallback == ()


def _linear_loss(y_true, y_pred):
    """``<y, f(x)>``: linear in the logits, so homogeneous of degree 1 in the last layer."""
    return tf.reduce_sum(y_true * y_pred, axis=-1)


@pytest.mark.parametrize("engine,make_model", [
    ("vectorized", lambda: _sequential(L.Input((6,)), L.Dense(8, activation="tanh"),
                                       NoisyDense(3, L.Dropout(0.5)))),
    ("ghost", lambda: _sequential(L.Input((6,)), L.Dense(8, activation="tanh"), L.Dropout(0.5),
                                  L.Dense(3))),
])
def test_gradient_comes_from_the_draw_that_gave_the_loss(engine, make_model):
    """The loss is ``<y, K h + b>`` with h the dropped-out features of the last layer (K, b):
    ``<grad_K, K> + <grad_b, b> = loss`` exactly when the gradient used the same mask as the
    loss. One example, no clipping (C = 1e6): the sum is that example's gradient; 20 seeded
    draws, some of which must differ from the loss without dropout (dropout active).
    Tolerance: rtol 1e-5 / atol 1e-6 on a float32 sum of 27 products of size ~1."""
    model = make_model()
    kernel, bias = model.layers[-1].trainable_weights
    rule = make_rule(DPParameters(0.0, mode="clipped", l2_norm_clip=1e6),
                     model.trainable_variables)
    clipped = GhostEngine(model) if engine == "ghost" else VectorizedEngine()
    step = tf.function(lambda x, y: clipped.clipped_sum(model, _linear_loss, x, y, rule))
    gaps = []
    for draw in range(20):
        x, y = _data(1, shape=(6,), k=3, seed=draw)
        batch = step(x, y)
        grads = dict(zip([v.ref() for v in model.trainable_variables], batch.gradient_sums))
        pairing = sum(float(tf.reduce_sum(grads[v.ref()] * v)) for v in (kernel, bias))
        np.testing.assert_allclose(pairing, float(batch.losses[0]), rtol=1e-5, atol=1e-6)
        gaps.append(abs(float(batch.losses[0]) - float(_linear_loss(y, model(x))[0])))
    assert max(gaps) > 1e-2, gaps


@pytest.mark.parametrize("clipping,clip", CLIPS)
def test_vectorized_engine_clips_models_with_random_layers(clipping, clip):
    """Engine 'vectorized' runs each example forward and backward once (one draw of every
    mask), so the clipping bound holds with an LSTM whose dropout the ghost engine refuses:
    30 draws per rule, tolerance as above. (Unrolled over its 3 steps: the same masks, and
    15x faster to trace inside `tf.vectorized_map` than the symbolic loop.)"""
    model = _sequential(L.Input((3, 2)),
                        L.LSTM(4, dropout=0.5, recurrent_dropout=0.3, unroll=True), L.Dense(3))
    worst, exceeded = _clipping_ratios(VectorizedEngine(), model, clipping, clip, (3, 2),
                                       draws=30)
    assert worst <= 1 + 1e-5, worst
    assert 0 < exceeded < 1 if clipping == "global" else exceeded > 0, exceeded


def _folding_model(engine, clipping="per-layer", clip=(0.01, 0.01), batch=4):
    """A Dense applied at T = 4 positions that a Lambda folds into the batch axis, then back:
    each example owns 4 rows of the Dense's input. Exact per-example gradients exist (examples
    do not interact), but a ghost norm per row would clip each row on its own."""
    tf.keras.utils.set_random_seed(11)
    inputs = L.Input((4, 5))
    h = L.Lambda(lambda t: tf.reshape(t, (-1, 5)))(inputs)
    h = L.Dense(3, name="per_position")(h)
    outputs = L.Lambda(lambda t: tf.reshape(t, (-1, 12)))(h)
    from lipdp.model import DP_Model

    metadata = DatasetMetadata((4, 5), 12, 8, 8, batch, None, "shuffle")
    model = DP_Model(inputs, outputs, dataset_metadata=metadata, dp_parameters=DPParameters(
        0.0, mode="clipped", clipping=clipping, l2_norm_clip=list(clip) if
        clipping == "per-layer" else clip, engine=engine))
    model.compile(loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  optimizer=tf.keras.optimizers.SGD(1.0))
    return model


def _folding_data(n=8):
    rng = np.random.default_rng(12)
    return (3 * rng.standard_normal((n, 4, 5))).astype(np.float32), rng.integers(0, 12, n)


@pytest.mark.parametrize("engine", ["ghost", "mixed-ghost"])
def test_a_batch_axis_folded_with_positions_is_refused_by_ghost_norms(engine):
    """Ghost norms per row would let one example contribute 4 times the threshold (measured
    2.47 C_v before the check, the per-layer rule's worst example of 8). Refused at trace time
    when the batch is static (`train_on_batch`), at run time when it is not (`fit` over a
    dataset of unknown batch size), both naming the layer and the engine that works."""
    x, y = _folding_data()
    model = _folding_model(engine)
    # Raised while Keras traces the step, which re-raises it as a StagingError quoting it.
    with pytest.raises(Exception, match="GhostRowsError: Ghost clipping: layer 'per_position' "
                                        "sees 16 rows for a batch of 4 examples.*"
                                        "engine='vectorized'"):
        model.train_on_batch(x[:4], y[:4])
    model = _folding_model(engine)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(4).map(
        lambda a, b: (tf.ensure_shape(a, (None, 4, 5)), b))
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"per_position.{1,4} sees x rows "
                                                             r"for a batch of y examples(.|\n)*"
                                                             r"x \(.*\[16\](.|\n)*\[4\]"):
        model.fit(dataset, epochs=1, verbose=0, validate_data=False)


def test_the_vectorized_engine_clips_a_folded_batch_axis_per_example():
    """The same model with engine 'vectorized': one example's update (SGD at learning rate 1,
    no noise, D = 4) is its clipped gradient / D, at most C_v per variable (tolerance 1e-5,
    float32 rounding), and the clipping is active (some example reaches it)."""
    x, y = _folding_data()
    worst = 0.0
    for i in range(len(x)):
        model = _folding_model("vectorized")
        before = [v.numpy() for v in model.trainable_variables]
        model.train_on_batch(x[i:i + 1], y[i:i + 1])
        worst = max(worst, max(np.linalg.norm(b - v.numpy()) * 4 / 0.01
                               for b, v in zip(before, model.trainable_variables)))
    assert 0.99 < worst <= 1 + 1e-5, worst


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_reduced_precision_layers_are_refused_by_ghost_norms(policy):
    """Under a mixed-precision policy the ghost norms' squared float16 cotangents underflow: an
    example whose gradient norm is 2.21 C was released unclipped (norm 0 measured). The ghost
    engines refuse such layers at compile; 'vectorized' (norms of the float32 variables'
    gradients) accepts them and clips that example to C (tolerance 1e-3: float16 forward)."""
    from lipdp.model import DP_Model

    previous = tf.keras.mixed_precision.global_policy()
    tf.keras.mixed_precision.set_global_policy(policy)
    try:
        def build(engine):
            tf.keras.utils.set_random_seed(13)
            inputs = L.Input((8,))
            h = L.Dense(2048, name="big")(inputs)
            outputs = L.Dense(1, dtype="float32")(h)
            model = DP_Model(inputs, outputs, dataset_metadata=DatasetMetadata(
                (8,), 1, 8, 8, 1, None, "shuffle"), dp_parameters=DPParameters(
                0.0, mode="clipped", clipping="flat", l2_norm_clip=1.0, engine=engine))
            model.compile(loss="mae", optimizer=tf.keras.optimizers.SGD(1.0))
            return model

        for engine in ("ghost", "mixed-ghost"):
            with pytest.raises(ValueError, match="'big' computes in (b)?float16.*"
                                                 "engine='vectorized'"):
                build(engine)
        model = build("vectorized")
        x = np.full((1, 8), 200 / math.sqrt(8), np.float32)
        before = [v.numpy() for v in model.trainable_variables]
        model.train_on_batch(x, np.zeros((1, 1), np.float32))
        released = math.sqrt(sum(float(np.sum((b - v.numpy()) ** 2))
                                 for b, v in zip(before, model.trainable_variables)))
        assert 0.99 < released <= 1 + 1e-3, released
    finally:
        tf.keras.mixed_precision.set_global_policy(previous)
