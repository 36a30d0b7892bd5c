"""gradient_bounds(model) against exact per-example gradients of whole networks."""

import numpy as np
import pytest
import tensorflow as tf

from lipdp.bounds import gradient_bounds, lipschitz_bound
from lipdp.losses import (DP_MulticlassHinge, DP_MulticlassHKR, DP_MulticlassKR, DP_TauBCE,
                          DP_TauCategoricalCrossentropy)
from tests._grad_utils import assert_within_bounds, maximize_gradient_norm, per_example_gradient_norms
from tests._models import X0, cnn, mlp

LOSSES = {
    "cce": lambda: DP_TauCategoricalCrossentropy(5.0),
    "bce": lambda: DP_TauBCE(3.0),
    "hinge": lambda: DP_MulticlassHinge(1.0),
    "kr": lambda: DP_MulticlassKR(),
    "hkr": lambda: DP_MulticlassHKR(alpha=2.0, min_margin=10.0),
}


def _inputs(rng, shape, n=12):
    """Random inputs below, on and far beyond the bound; constant images; one hot pixel."""
    x = rng.normal(size=(n,) + shape)
    x = x / np.linalg.norm(x.reshape(n, -1), axis=1).reshape((n,) + (1,) * len(shape))
    x = x * np.array([0.5, 1.0, 1.0, 50.0] * (n // 4)).reshape((n,) + (1,) * len(shape)) * X0
    constant = np.ones((2,) + shape) * np.array([X0, -X0]).reshape((2,) + (1,) * len(shape)) \
        / np.sqrt(np.prod(shape))
    pixel = np.zeros((1,) + shape)
    pixel[(0,) * (len(shape) + 1)] = X0
    return np.concatenate([x, constant, pixel]).astype("float32")


def _labels(rng, n, k):
    return np.eye(k, dtype="float32")[rng.integers(0, k, n)]


@pytest.mark.parametrize("loss_name", sorted(LOSSES))
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_cnn_bounds_hold(loss_name, bias):
    rng = np.random.default_rng(0)
    model = cnn(bias=bias)
    loss = LOSSES[loss_name]()
    x = _inputs(rng, (8, 8, 2))
    y = _labels(rng, len(x), 4)
    bounds = gradient_bounds(model, loss)
    assert_within_bounds(per_example_gradient_norms(model, loss, x, y), bounds, loss_name)
    # Adversarial: inputs optimised to maximise the first kernel's gradient.
    first_kernel = model.trainable_variables[0]
    x_adv = maximize_gradient_norm(model, loss, x[:3], y[:3], first_kernel, X0)
    assert_within_bounds(per_example_gradient_norms(model, loss, x_adv, y[:3]), bounds,
                         f"{loss_name} gradient ascent")


def test_bounds_hold_after_noisy_training_moves_the_weights():
    rng = np.random.default_rng(1)
    model = cnn(sigma=2.0)
    model.compile(loss=LOSSES["cce"](), optimizer=tf.keras.optimizers.SGD(0.05))
    x, y = _inputs(rng, (8, 8, 2), n=64)[:64], _labels(rng, 64, 4)
    model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(16), epochs=3, verbose=0)
    bounds = gradient_bounds(model)
    assert_within_bounds(per_example_gradient_norms(model, model.dp_loss, x[:16], y[:16]), bounds,
                         "after training")


def test_functional_model_bounds_hold():
    rng = np.random.default_rng(2)
    model = mlp()
    loss = LOSSES["hkr"]()
    x = _inputs(rng, (10,))
    y = _labels(rng, len(x), 3)
    assert_within_bounds(per_example_gradient_norms(model, loss, x, y), gradient_bounds(model, loss),
                         "functional")


def test_model_lipschitz_bound_holds():
    rng = np.random.default_rng(3)
    model = cnn(bias=False)
    constant = float(lipschitz_bound(model))
    a = tf.constant(rng.normal(size=(32, 8, 8, 2)) * 0.1, tf.float32)
    b = a + tf.constant(rng.normal(size=(32, 8, 8, 2)) * 0.01, tf.float32)
    ratio = tf.norm(model(a) - model(b), axis=1) / tf.norm(tf.reshape(a - b, (32, -1)), axis=1)
    assert float(tf.reduce_max(ratio)) <= constant * (1 + 1e-4)


def test_each_certified_norm_is_computed_once_per_bound_pass(monkeypatch):
    """The cache is scoped to one pass: same bounds, one eigen-solve per layer and pass."""
    import lipdp.layers.dense as dense

    model = mlp()
    loss = DP_TauCategoricalCrossentropy(5.0)
    expected = gradient_bounds(model, loss)
    calls = []
    original = dense.dense_spectral_norm_upper
    monkeypatch.setattr(dense, "dense_spectral_norm_upper",
                        lambda kernel: calls.append(1) or original(kernel))
    assert gradient_bounds(model, loss) == expected
    assert len(calls) == 2  # two dense layers, each needed forward and backward
    model.layers[-1].kernel.assign(model.layers[-1].kernel * 3.0)  # a new pass sees new weights
    assert gradient_bounds(model, loss) != expected
