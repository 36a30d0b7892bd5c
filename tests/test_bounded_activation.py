"""`DP_BoundedActivation`: activations clipped inside the network, and the first kernel's
norm left uncertified by the private step when no gradient bound reads it."""

import numpy as np
import pytest
import tensorflow as tf

import lipdp.bounds
from lipdp.bounds import (certified_norm_requests, dp_layers, gradient_bounds, lipschitz_bound,
                          norms_no_gradient_bound_reads)
from lipdp.config import ConfigError, build_model, load_config
from lipdp.layers import (DP_AddBias, DP_BoundedActivation, DP_BoundedInput, DP_Flatten,
                          DP_GroupSort, DP_QuickSpectralDense, DP_SpectralDense)
from lipdp.losses import DP_TauCategoricalCrossentropy
from lipdp.metadata import DPParameters
from lipdp.model import DP_Sequential
from tests._models import X0, metadata
from tests._soundness import adversarial_gradient_norms, assert_within_bounds, one_hot_labels

LOSS = DP_TauCategoricalCrossentropy(5.0)


def _mlp(bounded=True, seed=0, first=DP_QuickSpectralDense):
    """BoundedInput(X0) -> Dense(16) [-> BoundedActivation(X0)] -> GroupSort2 -> Dense(4)."""
    tf.keras.utils.set_random_seed(seed)
    stack = [DP_BoundedInput(X0, input_shape=(24,)), first(16, use_bias=False)]
    stack += [DP_BoundedActivation(X0)] if bounded else []
    stack += [DP_GroupSort(2), DP_QuickSpectralDense(4)]
    model = DP_Sequential(stack, dp_parameters=DPParameters(2.0, 1e-5),
                          dataset_metadata=metadata((24,), 4))
    model.compile(loss=LOSS, optimizer=tf.keras.optimizers.SGD(0.5))
    return model


def _inflate_first_kernel(model, factor):
    """The first dense kernel times `factor` (its spectral norm ~factor: off the constraint
    set, as a power-iteration estimate far below the norm would leave it)."""
    layer = model.layers[1]
    layer.kernel.assign(layer.kernel * factor)
    return float(np.linalg.norm(layer.kernel.numpy().astype(np.float64), 2))


def _every_norm_certified(model, monkeypatch):
    """`gradient_bounds` with every kernel's norm certified (no norm left unread)."""
    with monkeypatch.context() as patch:
        patch.setattr(lipdp.bounds, "norms_no_gradient_bound_reads", lambda layers: [])
        return gradient_bounds(model)


def _adversarial_norms(model, rng):
    return adversarial_gradient_norms(model, LOSS, rng, (24,), X0, 4)


@pytest.mark.parametrize("bounded", [True, False], ids=["bounded activation", "none"])
def test_bounds_hold_when_the_first_kernel_leaves_its_constraint_set(bounded, monkeypatch):
    """The first kernel scaled to norm ~3: behind a `DP_BoundedActivation` its norm enters no
    bound (the step certifies it not at all, and the bounds are those with it certified);
    without one it is certified and every bound grows with it. Either way exact per-example
    gradients stay within the bounds. (Skipping the first norm without the activation clip,
    or taking it as 1 instead of +inf, fails here: tried.)"""
    rng = np.random.default_rng(0)
    model = _mlp(bounded)
    layers = dp_layers(model)
    assert norms_no_gradient_bound_reads(layers) == ([model.layers[1]] if bounded else [])
    assert len(certified_norm_requests(layers)) == (1 if bounded else 2)
    assert _inflate_first_kernel(model, 3.0) > 2.5
    bounds = gradient_bounds(model)
    assert bounds == _every_norm_certified(model, monkeypatch)
    assert all(np.isfinite(b) for b in bounds.values())
    norms = _adversarial_norms(model, rng)
    assert_within_bounds(norms, bounds, f"first kernel x3, bounded={bounded}")
    # Behind the clip the last kernel's per-example gradient reaches its bound (X0 G: the
    # clip is active on the inflated kernel); the bound is tight, not merely sound.
    last = [name for name in bounds if name.endswith("kernel")][-1]
    assert float(np.max(norms[last])) >= (0.8 if bounded else 0.5) * bounds[last]


@pytest.mark.parametrize("chain,expected", [
    ("in flatten dense CLIP sort dense", 2),
    ("in dense sort CLIP dense", 1),
    ("in dense sort dense", None),
    ("in dense dense CLIP dense", None),
    ("in bias dense CLIP dense", None),
    ("in frozen dense CLIP dense", 2),
    ("in dense sort dense CLIP dense", None),
])
def test_only_the_first_trained_kernel_feeding_a_clip_is_left_unread(chain, expected):
    """The rule of `norms_no_gradient_bound_reads`: the first layer with variables, when only
    parameter-free layers lie between it and a `DP_BoundedActivation` (a frozen certified
    layer before it is certified: its norm enters that layer's input bound)."""
    makers = {"in": lambda: DP_BoundedInput(X0, input_shape=(4, 6)), "flatten": DP_Flatten,
              "dense": lambda: DP_QuickSpectralDense(8, use_bias=False),
              "frozen": lambda: DP_QuickSpectralDense(8, use_bias=False, trainable=False),
              "CLIP": lambda: DP_BoundedActivation(X0), "sort": lambda: DP_GroupSort(2),
              "bias": lambda: DP_AddBias(1.0)}
    names = chain.split()
    if "flatten" not in names:
        names.insert(1, "flatten")
        expected = None if expected is None else expected + 1
    stack = [makers[name]() for name in names]
    model = DP_Sequential(stack, dp_parameters=DPParameters(2.0, 1e-5),
                          dataset_metadata=metadata((4, 6), 8))
    unread = norms_no_gradient_bound_reads(dp_layers(model))
    assert unread == ([] if expected is None else [stack[expected]])


def test_a_wrong_skip_stops_the_step_instead_of_calibrating_noise(monkeypatch):
    """Were a norm that a bound reads left uncertified (+inf), the bounds would be inf and the
    step would stop before the update; no noise is calibrated to an infinite bound."""
    model = _mlp(bounded=False)
    before = [v.numpy() for v in model.trainable_variables]
    monkeypatch.setattr(lipdp.bounds, "norms_no_gradient_bound_reads",
                        lambda layers: [layers[-1]])
    rng = np.random.default_rng(1)
    with pytest.raises(tf.errors.InvalidArgumentError):
        model.train_on_batch(rng.normal(size=(16, 24)).astype("float32"),
                             one_hot_labels(rng, 16, 4))
    for v, old in zip(model.trainable_variables, before):
        np.testing.assert_array_equal(v.numpy(), old)


@pytest.mark.parametrize("first", [DP_QuickSpectralDense, DP_SpectralDense])
def test_bounds_hold_between_refreshes_of_a_schedule(first):
    """bjorck_every=4, a step after a refresh: the first kernel only spectrally normalised by
    its power-iteration estimate (not orthogonal) and not certified; exact per-example
    gradients within the bounds."""
    rng = np.random.default_rng(2)
    model = _mlp(first=first, seed=3)
    model.compile(loss=LOSS, optimizer=tf.keras.optimizers.SGD(0.5), bjorck_every=4)
    x, y = rng.normal(size=(48, 24)).astype("float32"), one_hot_labels(rng, 48, 4)
    for batch in (slice(0, 16), slice(16, 32), slice(32, 48)):  # steps 0 (Björck), 1, 2
        model.train_on_batch(x[batch], y[batch])
    kernel = model.layers[1].bounded_kernel().numpy().astype(np.float64)
    assert np.linalg.svd(kernel, compute_uv=False)[-1] < 0.97  # not orthogonal
    assert_within_bounds(_adversarial_norms(model, rng), gradient_bounds(model),
                         "bjorck_every=4, step 3")


def test_the_certified_lipschitz_constant_still_certifies_the_first_kernel():
    """`lipschitz_bound` (certified radii) reads every norm: the first kernel scaled by 3
    scales it by ~3 (the clip is 1-Lipschitz and does not cap a Lipschitz constant)."""
    model = _mlp()
    before = float(lipschitz_bound(model))
    _inflate_first_kernel(model, 3.0)
    assert float(lipschitz_bound(model)) == pytest.approx(3.0 * before, rel=1e-3)


def test_clips_in_the_forward_pass_and_round_trips(tmp_path):
    layer = DP_BoundedActivation(2.0)
    out = layer(tf.constant([[3.0, 4.0], [0.3, 0.4]])).numpy()
    np.testing.assert_allclose(np.linalg.norm(out, axis=1), [2.0, 0.5], rtol=1e-5)
    assert np.linalg.norm(out[0]) <= 2.0
    model = _mlp()
    path = str(tmp_path / "model.keras")
    model.save(path)
    loaded = tf.keras.models.load_model(path)
    assert isinstance(loaded.layers[2], DP_BoundedActivation)
    assert loaded.layers[2].upper_bound == X0
    x = np.random.default_rng(3).normal(size=(5, 24)).astype("float32") * 5
    np.testing.assert_array_equal(loaded.predict(x, verbose=0), model.predict(x, verbose=0))


def test_config_inserts_it_after_the_first_dense_layer_and_checks_where():
    cfg = load_config(None, ["model.bounded_activation=true", "model.widths=[32,16]"])
    model = build_model(cfg["model"], metadata((28, 28, 1), 10, batch=64),
                        DPParameters(3.0, 1e-5))
    kinds = [type(layer).__name__ for layer in model.layers]
    assert kinds == ["DP_BoundedInput", "DP_Flatten", "DP_QuickSpectralDense",
                     "DP_BoundedActivation", "DP_GroupSort", "DP_QuickSpectralDense",
                     "DP_GroupSort", "DP_QuickSpectralDense"]
    assert model.layers[3].upper_bound == model.layers[0].upper_bound
    for bad in (["model.architecture=cnn"], ["model.use_bias=true"], ["model.widths=[]"]):
        with pytest.raises(ConfigError, match="bounded_activation"):
            load_config(None, ["model.bounded_activation=true"] + bad)
