"""Certified radii under float32 rounding (lipdp.certify, lipdp.rounding).

A Lipschitz certificate holds for the exact network F; the model answers with its
float32 evaluation F^. With logits near 1e7 (one float32 ulp = 1) rounding alone
moves a margin by whole units, and a perturbation far inside ``margin / (sqrt(2) Lip)``
flips the float32 prediction. These tests check that

1. the breach is real, and that the radii now returned exclude it;
2. ``float_error_bound`` dominates ``||F^(z) - F(z)||`` measured against an
   independent float64 evaluation of the same weights (numpy, written here), on
   random inputs, inputs on and far beyond the clipping ball, inputs that maximise
   the activations, and inputs found by a search that maximises the discrepancy
   itself, with ordinary and very large biases;
3. on an ordinary model shaped like Fashion-MNIST's main job the radii shrink by
   a negligible amount.
"""

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

import lipdp.layers as dp
from lipdp import certify, rounding, zoo
from lipdp.bounds import dp_layers, lipschitz_bound
from lipdp.data import load_arrays
from lipdp.layers.dense import _BoundedDense
from tests import _summation_order

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SQRT2 = math.sqrt(2.0)
U = rounding.UNIT_ROUNDOFF


def _mlp_with_large_biases(bias=1.2e7, seed=0):
    """16 -> 32 -> GroupSort -> 4 MLP whose output biases sit near 1.2e7 (ulp 1)."""
    tf.keras.utils.set_random_seed(seed)
    model = zoo.mlp((16,), 4, width=32, depth=1, use_bias=True, input_bound=20.0)
    rng = np.random.default_rng(seed)
    hidden, output = [layer for layer in model.layers if hasattr(layer, "kernel")]
    hidden.bias.assign(rng.normal(0.0, 0.3, hidden.bias.shape).astype(np.float32))
    output.bias.assign((bias + rng.normal(0.0, 0.3, output.bias.shape)).astype(np.float32))
    return model


def _flips_inside(model, x, radii, scales, seed):
    """Perturbations of norm < radius that change the float32 prediction.

    For each input: the normalised gradient of ``f_j - f_k`` (j the runner-up,
    k the prediction) and 8 random directions, each scaled by every factor of
    `scales` times the input's radius. The norm of a perturbation is measured in
    float64 on the float32 inputs actually fed to the model.

    Returns ``(number of flips, smallest flipping norm / radius)``.
    """
    rng = np.random.default_rng(seed)
    x = tf.constant(x)
    with tf.GradientTape() as tape:
        tape.watch(x)
        logits = model(x, training=False)
        top2 = tf.math.top_k(logits, k=2).indices
        gap = tf.reduce_sum(tf.gather(logits, top2[:, 1], batch_dims=1)
                            - tf.gather(logits, top2[:, 0], batch_dims=1))
    labels = top2[:, 0].numpy()
    directions = [tape.gradient(gap, x).numpy()]
    directions += [rng.normal(size=x.shape) for _ in range(8)]
    flips, worst = 0, np.inf
    for d in directions:
        d = d / np.maximum(np.linalg.norm(d, axis=1, keepdims=True), 1e-30)
        for s in scales:
            moved = (x.numpy() + s * radii[:, None] * d).astype(np.float32)
            norms = np.linalg.norm(moved.astype(np.float64) - x.numpy(), axis=1)
            flipped = np.argmax(model(moved, training=False).numpy(), axis=1) != labels
            inside = flipped & (norms < radii)
            flips += int(np.sum(inside))
            if inside.any():
                worst = min(worst, float(np.min(norms[inside] / radii[inside])))
    return flips, worst


def test_rounding_cannot_flip_a_prediction_inside_its_radius():
    model = _mlp_with_large_biases()
    rng = np.random.default_rng(1)
    x = rng.normal(size=(256, 16))
    x = (x / np.linalg.norm(x, axis=1, keepdims=True) * rng.uniform(5.0, 30.0, (256, 1)))
    x = x.astype(np.float32)
    scales = np.geomspace(1e-4, 0.99, 40)

    # The breach is real: inside margin / (sqrt(2) Lip), the radius of the exact
    # network, tiny perturbations flip float32 predictions.
    lip = float(lipschitz_bound(model))
    exact_radii = certify.margins(model(x, training=False).numpy()) / (SQRT2 * lip)
    keep = exact_radii > 0
    flips, worst = _flips_inside(model, x[keep], exact_radii[keep], scales, seed=2)
    assert flips > 0 and worst < 0.05

    # The certified radii exclude it, and are not all zero (the search has
    # something to attack).
    radii = certify.certified_radii(model, x)
    certified = radii > 0
    assert certified.sum() >= 20
    flips, worst = _flips_inside(model, x[certified], radii[certified], scales, seed=2)
    assert flips == 0, (f"{flips} float32 predictions flipped inside their certified radius, "
                        f"the closest at {worst:.2e} of the radius")


# ---------------------------------------------------------------------------
# The arithmetic model of lipdp.rounding holds on this backend.


def test_products_use_one_summation_order_per_example():
    """A2: a kernel with identical output columns gives bit-identical outputs, with the
    session's Eigen kernels (`tests._summation_order`)."""
    assert not _summation_order.onednn_enabled()
    assert _summation_order.differing_cases() == []


def test_products_use_one_summation_order_per_example_with_onednn():
    """A2 with oneDNN on, as users run TensorFlow (a process of its own: the switch is read
    when TensorFlow starts)."""
    env = dict(os.environ, TF_ENABLE_ONEDNN_OPTS="1", TF_CPP_MIN_LOG_LEVEL="3", PYTHONPATH=ROOT)
    done = subprocess.run([sys.executable, "-m", "tests._summation_order"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result == {"onednn": True, "differing": []}


def test_float32_functions_within_the_stated_accuracy():
    """A1: ``/`` and ``sqrt`` correctly rounded on normal numbers; A3: tanh, sigmoid,
    softplus within ``K u |phi| + mu`` (K = 16; the exhaustive maxima are below 8)."""
    rng = np.random.default_rng(0)
    bits = rng.integers(0, 2 ** 32, size=2_000_000, dtype=np.uint64).astype(np.uint32)
    t = bits.view(np.float32)
    t = np.concatenate([t[np.isfinite(t)], np.linspace(-40, 40, 400_001, dtype=np.float32)])
    t64 = t.astype(np.float64)
    a = np.abs(t[(np.abs(t) >= 2.0 ** -126) & (np.abs(t) < 2.0 ** 100)])
    np.testing.assert_array_equal(tf.sqrt(a).numpy(),
                                  np.sqrt(a.astype(np.float64)).astype(np.float32))
    b = rng.permutation(a)
    quotient = a.astype(np.float64) / b
    normal = (quotient >= 2.0 ** -126) & (quotient < 2.0 ** 127)  # no underflow, no overflow
    np.testing.assert_array_equal((tf.constant(a) / b).numpy()[normal],
                                  quotient[normal].astype(np.float32))
    with np.errstate(over="ignore", under="ignore"):
        e = np.exp(-np.abs(t64))
        exact = {tf.tanh: np.tanh(t64), tf.sigmoid: np.where(t64 >= 0, 1.0, e) / (1.0 + e),
                 tf.nn.softplus: np.maximum(t64, 0.0) + np.log1p(e)}
    for fn, reference in exact.items():
        error = np.abs(fn(t).numpy().astype(np.float64) - reference)
        allowed = rounding.ELEMENTWISE_ULPS * U * np.abs(reference) + rounding.SMALLEST_NORMAL
        assert np.all(error <= allowed), fn.__name__
        assert np.max((error - rounding.SMALLEST_NORMAL) / np.maximum(np.abs(reference), 1e-300)) \
            < 8 * U  # the factor 2 of margin that K = 16 claims


def test_every_dp_layer_bounds_its_rounding():
    """The default (inf) is a safety net for third-party layers only."""
    classes = [obj for obj in vars(dp).values()
               if isinstance(obj, type) and issubclass(obj, dp.DPLayer) and obj is not dp.DPLayer]
    assert len(classes) >= 24
    for cls in classes:
        assert cls.rounding_error is not dp.DPLayer.rounding_error, cls.__name__


# ---------------------------------------------------------------------------
# E dominates the float32 error, measured against an independent float64 evaluation.


def _reference(layers, x):
    """The exact network F on the stored float32 weights, evaluated in float64 (numpy,
    and TensorFlow's float64 convolutions and max pooling)."""
    for layer in layers:
        x = _reference_layer(layer, x)
    return x


def _window_sums(x, pool):
    n, h, w, c = x.shape
    ph, pw = pool
    x = x[:, :h // ph * ph, :w // pw * pw]
    return x.reshape(n, h // ph, ph, w // pw, pw, c).sum(axis=(2, 4))


def _reference_layer(layer, x):  # noqa: C901 (one branch per layer type)
    def weight(v):
        return np.asarray(v, np.float64)

    if isinstance(layer, dp.DP_BoundedInput):
        target = layer.target
        norms = np.sqrt(np.sum(x ** 2, axis=tuple(range(1, x.ndim)), keepdims=True))
        return x * np.minimum(1.0, target / np.maximum(norms, 1e-300))
    if isinstance(layer, dp.DP_SplitResidual):
        return (x, x)
    if isinstance(layer, dp.DP_WrappedResidual):
        return (x[0], _reference(layer.branch, x[1]))
    if isinstance(layer, dp.DP_MergeResidual):
        return layer._coef * (x[0] + x[1])
    if isinstance(layer, _BoundedDense):
        y = np.tensordot(x, weight(layer.bounded_kernel()), [[x.ndim - 1], [0]])
        return y + weight(layer.bias) if layer.use_bias else y
    if isinstance(layer, dp.DP_QuickSpectralConv2D):
        y = tf.nn.conv2d(x, weight(layer.effective_kernel()), layer.strides,
                         layer.padding.upper()).numpy()
        return y + weight(layer.bias) if layer.use_bias else y
    if isinstance(layer, dp.DP_GroupSort):
        n = layer.n or x.shape[-1]
        if n == 2 and layer.pairing == "halves":
            first, second = np.split(x, 2, axis=-1)
            return np.concatenate([np.minimum(first, second), np.maximum(first, second)], -1)
        return np.sort(x.reshape(x.shape[:-1] + (-1, n)), axis=-1).reshape(x.shape)
    if isinstance(layer, dp.DP_ScaledL2NormPooling2D):
        return float(layer.k_coef_lip) * np.sqrt(_window_sums(x ** 2, layer.pool_size))
    if isinstance(layer, dp.DP_GlobalL2NormPooling2D):
        return float(layer.k_coef_lip) * np.sqrt(np.sum(x ** 2, axis=(1, 2)))
    if isinstance(layer, dp.DP_MaxPool2D):
        return tf.nn.max_pool2d(x, layer.pool_size, layer.strides, layer.padding.upper()).numpy()
    if isinstance(layer, dp.DP_LayerCentering):
        return x - np.mean(x, axis=layer.axis, keepdims=True)
    if isinstance(layer, dp.DP_AddBias):
        return x + weight(layer.bias)
    if isinstance(layer, dp.DP_Patches):
        n, h, w, c = x.shape
        ph, pw = layer.patch_size
        x = x.reshape(n, h // ph, ph, w // pw, pw, c).transpose(0, 1, 3, 2, 4, 5)
        return x.reshape(n, (h // ph) * (w // pw), ph * pw * c)
    if isinstance(layer, dp.DP_Permute):
        return np.transpose(x, (0,) + tuple(layer.dims))
    if isinstance(layer, dp.DP_Reshape):
        return x.reshape((len(x),) + tuple(layer.target_shape))
    if isinstance(layer, dp.DP_Flatten):
        return x.reshape(len(x), -1)
    functions = {dp.DP_ReLU: lambda v: np.maximum(v, 0.0), dp.DP_Tanh: np.tanh,
                 dp.DP_Sigmoid: lambda v: 0.5 * (1.0 + np.tanh(0.5 * v)),
                 dp.DP_Softplus: lambda v: np.logaddexp(0.0, v), dp.DP_ClipGradient: lambda v: v}
    return functions[type(layer)](x)


def _discrepancy(model, layers, z):
    """``||F^(z) - F(z)||_2`` per input: float32 model against the float64 reference."""
    computed = model(z, training=False).numpy().astype(np.float64)
    exact = _reference(layers, z.astype(np.float64))
    return np.linalg.norm((computed - exact).reshape(len(z), -1), axis=1)


def _with_random_biases(model, scale, seed):
    rng = np.random.default_rng(seed)
    for layer in dp_layers(model):
        for inner in getattr(layer, "branch", [layer]):
            if getattr(inner, "use_bias", False) or isinstance(inner, dp.DP_AddBias):
                inner.bias.assign(rng.normal(0.0, scale, inner.bias.shape).astype(np.float32))
    return model


def _zoo_models():
    tf.keras.utils.set_random_seed(3)
    return {
        "mlp": _with_random_biases(zoo.mlp((16,), 4, width=32, depth=2, use_bias=True,
                                            input_bound=20.0), 0.3, 0),
        "mlp-bias-1e4": _with_random_biases(zoo.mlp((16,), 4, width=32, depth=2, use_bias=True,
                                                    input_bound=20.0), 1e4, 1),
        "mlp-bias-1.2e7": _mlp_with_large_biases(),
        "vgg": _with_random_biases(zoo.vgg((8, 8, 2), 3, widths=(4,), dense_width=8,
                                           use_bias=True, input_bound=5.0), 0.3, 2),
        "mixer": _with_random_biases(zoo.mlp_mixer((8, 8, 1), 3, patch_size=4, hidden_dim=4,
                                                   centering=True, use_bias=True,
                                                   head="global-l2", input_bound=5.0), 0.3, 3),
        "zoo": _with_random_biases(tf.keras.Sequential([
            dp.DP_BoundedInput(4.0, input_shape=(8, 8, 3)),
            dp.DP_SpectralConv2D(4, 3, strides=2, use_bias=True),
            dp.DP_Tanh(),
            dp.DP_MaxPool2D(pool_size=(2, 2), strides=(1, 1), padding="same"),
            dp.DP_LayerCentering(),
            *dp.make_residuals([dp.DP_QuickSpectralConv2D(4, 3, use_bias=True), dp.DP_Sigmoid(),
                                dp.DP_QuickSpectralConv2D(4, 3)], merge_policy="add"),
            dp.DP_Softplus(),
            dp.DP_AddBias(norm_max=10.0),
            dp.DP_GroupSort(None),
            dp.DP_GlobalL2NormPooling2D(),
            dp.DP_SpectralDense(6, use_bias=True),
            dp.DP_ReLU(),
            dp.DP_QuickFrobeniusDense(3, use_bias=True),
            dp.DP_ClipGradient(1.0),
        ]), 0.3, 4),
    }


def _search_inputs(model, layers, x0, shape, rng):
    """Inputs to test the bound on, and the largest discrepancy found.

    Random directions at norms inside, on and far beyond the clipping ball (up
    to 1e15 X0), constant and one-hot inputs, inputs maximising the logits' norm
    (gradient ascent on the sphere of radius X0), then a hill climb on the
    discrepancy itself from the worst inputs found.
    """
    d = int(np.prod(shape))

    def sphere(n):
        v = rng.normal(size=(n, d))
        return v / np.linalg.norm(v, axis=1, keepdims=True)

    norms = np.concatenate([rng.uniform(0.0, x0, 64), x0 * (1.0 + rng.uniform(-1e-6, 1e-6, 32)),
                            x0 * np.geomspace(2.0, 1e15, 32), np.geomspace(1e-30, 1e-3, 16)])
    candidates = [sphere(len(norms)) * norms[:, None], np.full((1, d), x0 / math.sqrt(d)),
                  np.eye(d)[rng.choice(d, 8)] * x0]
    z = tf.Variable(sphere(32).astype(np.float32) * x0)
    for _ in range(20):  # gradient ascent on ||F(z)||^2 on the sphere
        with tf.GradientTape() as tape:
            objective = tf.reduce_sum(tf.square(model(tf.reshape(z, (-1,) + shape))))
        step = tape.gradient(objective, z).numpy()
        step /= np.maximum(np.linalg.norm(step, axis=1, keepdims=True), 1e-30)
        moved = z.numpy() + 0.1 * x0 * step
        z.assign(x0 * moved / np.linalg.norm(moved, axis=1, keepdims=True))
    candidates.append(z.numpy())
    z = np.concatenate(candidates).astype(np.float32).reshape((-1,) + shape)
    found = _discrepancy(model, layers, z)
    best = z[np.argsort(found)[-8:]]
    for _ in range(15):  # hill climb on the discrepancy
        trial = np.concatenate([best * (1.0 + rng.normal(0.0, 1e-3, best.shape)),
                                best + rng.normal(0.0, 1e-3 * x0 / math.sqrt(d), best.shape)])
        trial = np.concatenate([best, trial.astype(np.float32)])
        scores = _discrepancy(model, layers, trial)
        found = np.concatenate([found, scores])
        best = trial[np.argsort(scores)[-8:]]
    return found


@pytest.mark.parametrize("name", ["mlp", "mlp-bias-1e4", "mlp-bias-1.2e7", "vgg", "mixer", "zoo"])
def test_error_bound_dominates_float32_error(name):
    model = _zoo_models()[name]
    layers = dp_layers(model)
    bound = certify.float_error_bound(model)
    assert 0.0 < bound < math.inf
    shape = tuple(model.input_shape[1:])
    found = _search_inputs(model, layers, layers[0].upper_bound, shape, np.random.default_rng(7))
    # The float64 reference errs by ~1e-16 relative, far below the bound.
    assert found.max() > 0.0  # rounding does happen
    assert found.max() <= bound, f"{name}: measured {found.max():.3e} > bound {bound:.3e}"


# ---------------------------------------------------------------------------
# On an ordinary model the radii barely move.


def _upscaled_digits():
    """scikit-learn's digits (offline) as 28x28 images in [0, 1]: Fashion-MNIST's shape
    and norms (median ~11.7)."""
    raw = load_arrays("digits")

    def upscale(x):
        x = np.kron(np.asarray(x, np.float32).reshape(-1, 8, 8), np.ones((3, 3), np.float32))
        return np.pad(x, ((0, 0), (2, 2), (2, 2)))[..., None]

    return (upscale(raw.x_train), np.asarray(raw.y_train), upscale(raw.x_test),
            np.asarray(raw.y_test))


@pytest.mark.parametrize("input_bound, max_shrink", [(10.0, 3e-3), (28.0, 8e-3)])
def test_radii_shrink_negligibly_on_an_ordinary_model(input_bound, max_shrink):
    """Fashion-MNIST's main job: 784 -> Dense(1024) -> GroupSort2 -> Dense(10), X0 = 10
    (also 28: no clipping of [0, 1] images), trained briefly (not privately) on
    upscaled digits, logits O(1).

    Every radius moves by ``2 E / Lip`` (clipped at 0): measured 2.7e-3 (X0 = 10)
    and 7.5e-3 (X0 = 28), 0.5% and 1.2% of the median radius. The certified accuracy
    loses 1 (X0 = 10) and 2 (X0 = 28) of 359 test examples at 0.1, 1 and 4 at 0.25.
    """
    x_train, y_train, x_test, y_test = _upscaled_digits()
    tf.keras.utils.set_random_seed(0)
    model = zoo.mlp((28, 28, 1), 10, width=1024, depth=1, input_bound=input_bound)
    optimizer = tf.keras.optimizers.Adam(1e-3)
    optimizer.build(model.trainable_variables)  # built inside `step`, it would trace twice

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.keras.losses.sparse_categorical_crossentropy(
                y, 10.0 * model(x), from_logits=True))
        optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                                      model.trainable_variables))

    rng = np.random.default_rng(0)
    for _ in range(5):
        order = rng.permutation(len(x_train))
        for start in range(0, len(order), 64):
            step(x_train[order[start:start + 64]], y_train[order[start:start + 64]])
    for layer in dp_layers(model):
        layer.project()

    lip = float(lipschitz_bound(model))
    logits = model(x_test, training=False).numpy()
    before = certify.margins(logits) / (SQRT2 * lip)
    after = certify.certified_radii(model, x_test)
    shrink = 2.0 * certify.float_error_bound(model) / lip
    assert shrink < max_shrink
    assert np.all(after <= before)
    np.testing.assert_allclose(before - after, np.minimum(before, shrink), rtol=1e-6, atol=1e-12)
    correct = np.argmax(logits, axis=1) == y_test
    assert np.mean(correct) > 0.9 and np.median(before[correct]) > 0.3  # an ordinary model
    accuracy = certify.certified_accuracy(model, (x_test, y_test), [0.1, 0.25])
    lost = [round(len(x_test) * (np.mean(correct & (before > r)) - accuracy[r]))
            for r in (0.1, 0.25)]
    assert lost[0] <= 2 and lost[1] <= 4, lost


def test_no_radius_is_certified_for_arithmetic_other_than_float32_rounded_to_nearest(
        monkeypatch):
    """E's proof is for float32 arithmetic: a plain Keras model of DP layers with one float16
    layer (which `compile` would refuse, but certification does not compile) had E = 4e-6 and
    a radius of 6.8e-4 around an input whose float16 rounding made the margin, and a step 341
    times smaller flipped the prediction (found by an audit). No radius now, nor under
    oneDNN's bfloat16 products mode."""
    model = tf.keras.Sequential([dp.DP_BoundedInput(10.0, input_shape=(2,)),
                                 dp.DP_ReLU(dtype="float16"),
                                 dp.DP_QuickSpectralDense(2, use_bias=False)])
    model.layers[-1].kernel.assign(np.eye(2, dtype=np.float32))
    x = np.array([[1.0, 1.000489]], np.float32)
    step = np.array([[0.0, -2e-6]], np.float32)
    assert np.argmax(model(x)) != np.argmax(model(x + step))  # the flip the radius allowed
    assert certify.float_error_bound(model) == math.inf
    assert certify.certified_radii(model, x)[0] == 0.0
    float32 = tf.keras.Sequential([dp.DP_BoundedInput(10.0, input_shape=(2,)), dp.DP_ReLU(),
                                   dp.DP_QuickSpectralDense(2, use_bias=False)])
    assert math.isfinite(certify.float_error_bound(float32))
    monkeypatch.setenv("ONEDNN_DEFAULT_FPMATH_MODE", "BF16")
    assert certify.float_error_bound(float32) == math.inf


def test_no_radius_is_certified_through_a_float16_input():
    """Keras rounds the records to a float16 ``tf.keras.Input`` before the first layer, a
    rounding that E does not cover: it made the margin of this input, and a step of 2e-6
    flips the prediction (`lipdp.layers.base.check_float32_inputs`)."""
    inputs = tf.keras.Input((2,), dtype="float16")
    dense = dp.DP_QuickSpectralDense(2, use_bias=False)
    model = tf.keras.Model(inputs, dense(dp.DP_BoundedInput(10.0)(inputs)))
    dense.kernel.assign(np.eye(2, dtype=np.float32))
    x = np.array([[1.0, 1.000489]], np.float32)
    step = np.array([[0.0, -2e-6]], np.float32)
    assert np.argmax(model(x)) != np.argmax(model(x + step))
    assert certify.float_error_bound(model) == math.inf
    assert certify.certified_radii(model, x)[0] == 0.0


def test_a_negative_rounding_bound_certifies_no_radius():
    """A layer whose `rounding_error` has a sign error made E negative and every radius larger
    than the distance to the decision boundary (found by an audit): E is inf instead."""

    class SignErrorDense(dp.DP_QuickSpectralDense):
        def rounding_error(self, input_bound):
            return -10.0 * abs(super().rounding_error(input_bound)) - 0.3

    model = tf.keras.Sequential([dp.DP_BoundedInput(1.0, input_shape=(2,)),
                                 SignErrorDense(2, use_bias=False)])
    assert certify.float_error_bound(model) == math.inf
    assert certify.certified_radii(model, np.array([[0.3, 0.1]], np.float32))[0] == 0.0
