"""Loss-logits gradient clipping at a privately estimated quantile (appendix B.5).

- Soundness: exact per-example gradients of the loss the step differentiates (clipped
  logit gradient) stay within the bounds computed from ``min(L, C_t)``, on random inputs
  inside, on and beyond the bound, constant images, a hot pixel and inputs found by
  gradient ascent on each variable's gradient norm; broken on purpose (the bound pass started from C_t / 1.4), the
  check fails.
- Accounting: the count is a Gaussian mechanism of sensitivity 1/2 released with the
  gradient from the same subsample; the ledger's step multiplier is
  ``(z^-2 + (2 sigma_b)^-2)^-1/2``, checked in closed form and against dp_accounting.
- Tracking: with little count noise, C_t settles at the target quantile of the
  logit-gradient norms of the training set (computed exactly here).
"""

import numpy as np
import pytest
import tensorflow as tf

import lipdp
from lipdp.bounds import gradient_bounds
from lipdp.layers import DP_BoundedInput, DP_GroupSort, DP_QuickSpectralDense
from tests._soundness import (adversarial_inputs, assert_within_bounds, maximize_gradient_norm,
                              one_hot_labels, per_example_gradient_norms)

X0 = 2.0
N, D = 512, 64


def _metadata():
    return lipdp.DatasetMetadata((8,), 3, N, 100, D, X0, "shuffle")


def _model(clipping=None, sigma=1.0, strategy="global"):
    model = lipdp.DP_Sequential(
        [DP_BoundedInput(X0, input_shape=(8,)), DP_QuickSpectralDense(16), DP_GroupSort(2),
         DP_QuickSpectralDense(3)],
        dp_parameters=lipdp.DPParameters(sigma, 1e-5, strategy,
                                         loss_gradient_clipping=clipping),
        dataset_metadata=_metadata())
    model.compile(optimizer=tf.keras.optimizers.SGD(0.0),
                  loss=lipdp.losses.DP_TauCategoricalCrossentropy(0.5))
    return model


def _data(seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(N, 8)).astype(np.float32)
    x *= X0 / np.linalg.norm(x, axis=1, keepdims=True) * rng.uniform(0.5, 1, (N, 1))
    return x, one_hot_labels(rng, N, 3)


def test_clipped_gradients_stay_within_the_lowered_bounds():
    rng = np.random.default_rng(1)
    plain = _model()
    loss_constant = plain.top_gradient_bound()
    clip = 0.3 * loss_constant
    model = _model(lipdp.AdaptiveClipping(initial_clip=clip))
    for layer, source in zip(model.layers, plain.layers):
        layer.set_weights(source.get_weights())
    assert float(model.top_gradient_bound()) == pytest.approx(clip)
    bounds, plain_bounds = gradient_bounds(model), gradient_bounds(plain)
    for bound, plain_bound in zip(bounds.values(), plain_bounds.values()):
        # every bound scales with the cotangent bound at the logits
        assert bound == pytest.approx(0.3 * plain_bound, rel=1e-5)
    x = np.concatenate([adversarial_inputs(rng, (8,), X0, n=12), _data()[0][:20]])
    y = one_hot_labels(rng, len(x), 3)
    for variable in model.trainable_variables:  # inputs ascending each variable's gradient
        ascended = maximize_gradient_norm(model, model.per_example_step_loss, x[:4], y[:4],
                                          variable, X0, steps=30)
        x, y = np.concatenate([x, ascended]), np.concatenate([y, y[:4]])
    norms = per_example_gradient_norms(model, model.per_example_step_loss, x, y)
    assert_within_bounds(norms, bounds, "adaptive clipping")
    # The clip binds: the last kernel's gradients reach its bound within 1.4x, so a bound
    # pass started from C_t / 1.4 would be exceeded.
    last = [name for name in bounds if "kernel" in name][-1]
    assert np.max(norms[last]) > bounds[last] / 1.4
    unclipped = per_example_gradient_norms(model, model.dp_loss, x, y)
    assert np.max(unclipped[last]) > bounds[last] * 1.4  # without the clip: a breach


def test_the_bound_check_fails_when_the_bound_is_broken():
    rng = np.random.default_rng(2)
    model = _model(lipdp.AdaptiveClipping(initial_clip=0.1))
    x = adversarial_inputs(rng, (8,), X0, n=12)
    y = one_hot_labels(rng, len(x), 3)
    norms = per_example_gradient_norms(model, model.per_example_step_loss, x, y)
    model._logit_clip.assign(0.1 / 1.4)  # the bound pass now starts below the step's clip
    with pytest.raises(AssertionError, match="per-example gradient"):
        assert_within_bounds(norms, gradient_bounds(model), "broken on purpose")


@pytest.mark.parametrize("strategy", ["global", "per-layer"])
def test_the_ledger_composes_the_count_with_the_gradient(strategy):
    clipping = lipdp.AdaptiveClipping(noise_multiplier=2.0)
    model = _model(clipping, sigma=1.5, strategy=strategy)
    x, y = _data()
    model.fit(x, y, batch_size=D, epochs=1, verbose=0)
    gradient = 1.5 if strategy == "global" else 1.5 / np.sqrt(len(model.trainable_variables))
    joint = (gradient ** -2 + 4.0 ** -2) ** -0.5  # the count: sensitivity 1/2, std 2
    mechanism = model.privacy_ledger.segments[0].mechanism
    assert mechanism.quantile_noise_multiplier == 2.0
    assert mechanism.step_noise_multiplier == pytest.approx(joint, rel=1e-12)
    assert lipdp.accounting.model_step_noise_multiplier(model) == pytest.approx(joint)
    steps, q = model.dp_steps_taken, D / N
    epsilon = lipdp.accounting.epsilon_spent(model)
    assert epsilon == pytest.approx(lipdp.accounting.compute_epsilon(joint, q, steps, 1e-5))
    assert epsilon > lipdp.accounting.compute_epsilon(gradient, q, steps, 1e-5)
    dp_accounting = pytest.importorskip("dp_accounting")
    accountant = dp_accounting.rdp.RdpAccountant()
    accountant.compose(dp_accounting.PoissonSampledDpEvent(
        q, dp_accounting.GaussianDpEvent(joint)), steps)
    reference = accountant.get_epsilon(1e-5)
    assert reference * 0.98 <= epsilon <= reference * 1.05  # autodp's orders: conservative


def test_default_count_noise_is_d_over_20():
    model = _model(lipdp.AdaptiveClipping())
    assert model.step_mechanism.quantile_noise_multiplier == D / 20
    assert float(model._logit_clip.numpy()) == pytest.approx(model._loss_lipschitz)


class _RecordClip(tf.keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.values = []

    def on_train_batch_end(self, batch, logs=None):
        self.values.append(float(self.model._logit_clip.numpy()))


def test_clip_tracks_the_target_quantile():
    """The fraction of training examples whose logit gradient is below C_t, averaged over
    the last 100 of 200 steps (a fixed model: learning rate 0), is the target 0.7 within
    0.05. (C_t jitters around its target: the geometric update overshoots where many
    norms are alike, so single values are not checked.)"""
    x, y = _data()
    model = _model(lipdp.AdaptiveClipping(target_quantile=0.7, noise_multiplier=0.5,
                                          initial_clip=1.0, learning_rate=0.2))
    record = _RecordClip()
    model.fit(x, y, batch_size=D, epochs=25, verbose=0, shuffle=True, callbacks=[record])
    logits = tf.constant(model.predict(x, verbose=0))
    with tf.GradientTape() as tape:
        tape.watch(logits)
        loss = tf.reduce_sum(model.dp_loss.call(tf.constant(y), logits))
    norms = np.linalg.norm(tape.gradient(loss, logits).numpy(), axis=1)
    fractions = [float(np.mean(norms <= clip)) for clip in record.values[-100:]]
    assert abs(np.mean(fractions) - 0.7) < 0.05, (np.mean(fractions), record.values[-5:])
    assert record.values[0] != 1.0  # it moved from the start


def test_the_clip_is_saved_and_not_reset_by_compile(tmp_path):
    x, y = _data()
    model = _model(lipdp.AdaptiveClipping(initial_clip=1.0))
    model.fit(x, y, batch_size=D, epochs=1, verbose=0)
    clip = float(model._logit_clip.numpy())
    assert clip != 1.0
    model.compile(optimizer="sgd", loss=lipdp.losses.DP_TauCategoricalCrossentropy(0.5))
    assert float(model._logit_clip.numpy()) == clip
    path = str(tmp_path / "model.keras")
    model.save(path)
    loaded = tf.keras.models.load_model(path)
    assert float(loaded._logit_clip.numpy()) == clip
    assert loaded.dp_parameters.loss_gradient_clipping == model.dp_parameters.loss_gradient_clipping


@pytest.mark.parametrize("value", [-1.0, 0.0, float("nan"), float("inf")])
def test_a_clip_set_by_set_weights_that_no_update_makes_stops_the_step(value):
    """C_t is a weight of the model: set to -1 by set_weights, its negative factor rescaled
    every logit-gradient row to norm 1 while the bound took 2^-32, and the first step
    released gradients 4e9 times their bound with no noise to speak of (an audit,
    2026-12-07). The step stops before any update, and the clipping itself zeroes the rows
    of a clip that is not positive."""
    from lipdp.layers.gradient_clipping import _clip_rows, clipped_norm_bound

    model = _model(lipdp.AdaptiveClipping(initial_clip=0.5), sigma=0.0)
    model.optimizer.learning_rate.assign(1.0)
    weights = model.get_weights()
    weights[[i for i, v in enumerate(model.weights) if v is model._logit_clip][0]] = value
    model.set_weights(weights)
    before = [v.numpy() for v in model.trainable_variables]
    x, y = _data()
    with pytest.raises(tf.errors.InvalidArgumentError, match="the adaptive clip C_t"):
        model.train_on_batch(x[:D], y[:D])
    for v, b in zip(model.trainable_variables, before):
        np.testing.assert_array_equal(v.numpy(), b)
    assert model.dp_steps_taken == 0
    rows = tf.constant(np.random.default_rng(1).normal(size=(4, 3)).astype(np.float32))
    clipped = _clip_rows(rows, tf.constant(value, tf.float32)).numpy()
    bound = float(clipped_norm_bound(10.0, value))
    assert np.all(np.linalg.norm(clipped, axis=1) <= bound)
    assert bound == (10.0 if value == float("inf") else 2.0 ** -32 + 3.0 * 2.0 ** -149)


def test_invalid_settings_are_refused():
    with pytest.raises(ValueError, match="target_quantile"):
        lipdp.AdaptiveClipping(target_quantile=1.0)
    with pytest.raises(ValueError, match="clipless"):
        lipdp.DPParameters(1.0, 1e-5, mode="clipped", l2_norm_clip=1.0,
                           loss_gradient_clipping=lipdp.AdaptiveClipping())
    parameters = lipdp.DPParameters(1.0, 1e-5, loss_gradient_clipping={"target_quantile": 0.8})
    assert lipdp.DPParameters.from_config(parameters.get_config()) == parameters
    # A count noise whose float32 draws flush to zero (a noiseless count, epsilon 1e60
    # reported: an audit) or overflow.
    for sigma_b in (1e-30, 1e38):
        with pytest.raises(ValueError, match=r"\[2\^-64, 4e37\]"):
            lipdp.AdaptiveClipping(noise_multiplier=sigma_b)
    # Stored in float32 as inf and 0, which the step refuses (a review, 2026-12-07).
    for clip in (1e39, 1e-50):
        with pytest.raises(ValueError, match="float32's normal range"):
            lipdp.AdaptiveClipping(initial_clip=clip)


@pytest.mark.parametrize("clipping, expected", [
    (dict(initial_clip=1e38, target_quantile=1e-9, learning_rate=100.0), 1e38 * np.exp(-100.0)),
    (dict(learning_rate=1e6, target_quantile=0.9), None),
])
def test_the_threshold_update_stays_in_float32s_normal_range(clipping, expected):
    """C_t's geometric update in float32 went to 0 for 1e38 e^-100 = 3.7e-6, or to 0 then NaN
    (0 * inf) at a learning rate of 1e6, which stopped a later step with a message about the
    layers (an audit). In the log domain and clamped to [2^-120, 2^120], it stays positive
    and finite, and equals the exact update where that fits."""
    x, y = _data()
    model = _model(lipdp.AdaptiveClipping(noise_multiplier=1e-12, **clipping))
    for step in range(3):
        model.train_on_batch(x[step * D:(step + 1) * D], y[step * D:(step + 1) * D])
        clip = float(model._logit_clip.numpy())
        assert 2.0 ** -120 * (1 - 1e-6) <= clip <= 2.0 ** 120 * (1 + 1e-6), (step, clip)
        if expected is not None and step == 0:  # every example below C_0: fraction 1
            assert clip == pytest.approx(expected, rel=1e-4)
    assert model.dp_steps_taken == 3


def test_bound_monitor_checks_the_clipped_step():
    """With C_t far below L the unclipped gradients exceed the step's bounds (checked in
    the soundness test), so a monitor that looked at the unclipped loss would stop the fit."""
    x, y = _data()
    model = _model(lipdp.AdaptiveClipping(initial_clip=0.1, learning_rate=1e-6))
    monitor = lipdp.BoundMonitor((x, y), sample_size=64)
    history = model.fit(x, y, batch_size=D, epochs=1, verbose=0, callbacks=[monitor])
    ratios = {k: v[-1] for k, v in history.history.items() if k.startswith("tightness_max/")}
    assert ratios and max(ratios.values()) <= 1 + 1e-4
    assert max(ratios.values()) > 1 / 1.4
    assert history.history["logit_clip"][-1] == pytest.approx(0.1, rel=1e-3)
