"""lipdp.callbacks.BoundMonitor and SignalToNoise.

References are independent of the callbacks' code path: per-example gradient norms from one
`tf.GradientTape` per example (`tests/_soundness.py`, not `lipdp.per_example`'s vectorised
map), bounds from `lipdp.bounds.gradient_bounds`, noise standard deviations from the
closed forms ``sigma * bound(v) / D`` (per-layer) and ``sigma * sqrt(sum_v bound(v)^2) / D``
(global). Tolerances: float32 per-example gradients computed two ways agree to ~1e-6
relative; 1e-5 leaves room for that and stays far below any real disagreement.

Breaking the bound on purpose: two test layers under-report by a factor 1.4, one the
kernel bound of a dense layer, one the input bound of `DP_BoundedInput` (it still clips at
X0 but tells the next layers X0 / 1.4). With the Kantorovich-Rubinstein loss, whose gradient
w.r.t. the logits has constant norm L, and inputs beyond the clipping ball, the kernel's
per-example gradient norm is exactly ``X0 L`` (the bound is attained), so the observed ratio
is 1.4 and the honest model sits at ratio 1 (up to rounding) without an alarm.
"""

import types

import numpy as np
import pytest
import tensorflow as tf

from tests._models import cnn, mlp
from tests._soundness import per_example_gradient_norms
from lipdp.bounds import gradient_bounds
from lipdp.callbacks import BoundMonitor, BoundViolationError, SignalToNoise
from lipdp.layers import DP_BoundedInput, DP_QuickSpectralDense
from lipdp.losses import DP_MulticlassKR, DP_TauCategoricalCrossentropy
from lipdp.metadata import DatasetMetadata, DPParameters
from lipdp.model import DP_Sequential

REL = 1e-5
FACTOR = 1.4


def _data(shape, nb_classes, n=64, seed=0, scale=1.0):
    rng = np.random.default_rng(seed)
    x = (scale * rng.normal(size=(n,) + shape)).astype(np.float32)
    return x, np.eye(nb_classes, dtype=np.float32)[rng.integers(0, nb_classes, n)]


def _expected_sample(x, y, seed, epoch, size):
    index = np.sort(np.random.default_rng([seed, epoch]).choice(len(x), size, replace=False))
    return x[index], y[index]


def _check_tightness_logs(logs, model, x, y):
    """The monitor's logs against one-tape-per-example norms and `gradient_bounds`."""
    bounds = gradient_bounds(model)
    norms = per_example_gradient_norms(model, model.dp_loss, x, y)
    assert set(bounds) == set(norms)
    for name, bound in bounds.items():
        ratios = norms[name] / bound
        assert logs[f"gradient_bound/{name}"] == pytest.approx(bound, rel=REL)
        assert logs[f"tightness_max/{name}"] == pytest.approx(ratios.max(), rel=REL)
        assert logs[f"tightness_mean/{name}"] == pytest.approx(ratios.mean(), rel=REL)
        assert 0 < logs[f"tightness_max/{name}"] <= 1 + 1e-4
    return bounds, norms


def test_monitors_during_fit_match_independent_computations():
    """Two epochs of a conv model (global noise): both callbacks log every variable every
    epoch; the last epoch's values equal the references at the final weights."""
    model = cnn(nb_classes=4, strategy="global", sigma=2.0)
    model.compile(tf.keras.optimizers.SGD(0.05), DP_TauCategoricalCrossentropy(4.0))
    x, y = _data((8, 8, 2), 4)
    monitor = BoundMonitor((x, y), sample_size=20, seed=3)
    snr = SignalToNoise((x, y), sample_size=20, seed=3)
    history = model.fit(x, y, epochs=2, verbose=0, callbacks=[monitor, snr]).history
    bounds = gradient_bounds(model)
    for name in bounds:
        for prefix in ("tightness_max", "tightness_mean", "gradient_bound", "grad_norm_mean",
                       "noise_std", "signal_to_noise"):
            assert len(history[f"{prefix}/{name}"]) == 2
    last = {key: values[-1] for key, values in history.items()}
    xs, ys = _expected_sample(x, y, seed=3, epoch=1, size=20)
    _, norms = _check_tightness_logs(last, model, xs, ys)
    assert set(monitor.last_report) == set(bounds)
    # Global strategy: one std sigma * sqrt(sum_v bound(v)^2) / D on every variable.
    std = 2.0 * np.sqrt(sum(b ** 2 for b in bounds.values())) / 16
    for name in bounds:
        mean_norm = float(np.mean(norms[name]))
        assert last[f"grad_norm_mean/{name}"] == pytest.approx(mean_norm, rel=REL)
        assert last[f"noise_std/{name}"] == pytest.approx(std, rel=REL)
        assert last[f"signal_to_noise/{name}"] == pytest.approx(mean_norm / (16 * std), rel=REL)


def test_signal_to_noise_per_layer_strategy():
    """Per-layer noise: std sigma * bound(v) / D, so signal_to_noise = tightness_mean / sigma.
    Called directly after compile (weights of the first step)."""
    model = mlp(nb_classes=3, strategy="per-layer", sigma=3.0, batch=8)
    model.compile(tf.keras.optimizers.SGD(0.1), DP_TauCategoricalCrossentropy(8.0))
    x, y = _data((10,), 3, n=64, seed=1, scale=2.0)
    callbacks = [BoundMonitor((x, y), sample_size=16, seed=0),
                 SignalToNoise((x, y), sample_size=16, seed=0)]
    logs = {}
    for callback in callbacks:
        callback.set_model(model)
        callback.on_train_begin()
        callback.on_epoch_end(0, logs)
    xs, ys = _expected_sample(x, y, seed=0, epoch=0, size=16)
    bounds, norms = _check_tightness_logs(logs, model, xs, ys)
    for name, bound in bounds.items():
        assert logs[f"noise_std/{name}"] == pytest.approx(3.0 * bound / 8, rel=REL)
        assert logs[f"grad_norm_mean/{name}"] == pytest.approx(np.mean(norms[name]), rel=REL)
        assert logs[f"signal_to_noise/{name}"] == pytest.approx(
            logs[f"tightness_mean/{name}"] / 3.0, rel=REL)


class _UnderReportingDense(DP_QuickSpectralDense):
    """Reports its kernel bound divided by 1.4 (a broken layer; the bias bound is honest)."""

    def backpropagate_params(self, input_bound, gradient_bound):
        return [(v, b / FACTOR if v is self.kernel else b)
                for v, b in super().backpropagate_params(input_bound, gradient_bound)]


class _LyingInput(DP_BoundedInput):
    """Clips at X0 but tells the next layers that inputs have norm <= X0 / 1.4."""

    def propagate_inputs(self, input_bound):
        return tf.minimum(input_bound, self.upper_bound / FACTOR)


def _kr_model(kind):
    x0 = 2.0
    first = (_LyingInput if kind == "lying input" else DP_BoundedInput)(x0, input_shape=(6,))
    dense = (_UnderReportingDense if kind == "under-reporting dense"
             else DP_QuickSpectralDense)(3, name="head")
    metadata = DatasetMetadata((6,), 3, 48, 8, 16, x0, "shuffle")
    model = DP_Sequential([first, dense], dp_parameters=DPParameters(1.0, 1e-5),
                          dataset_metadata=metadata)
    model.compile(tf.keras.optimizers.SGD(0.01), DP_MulticlassKR())
    return model


@pytest.mark.parametrize("kind", ["under-reporting dense", "lying input"])
def test_bound_monitor_stops_training_naming_the_broken_variable(kind):
    model = _kr_model(kind)
    x, y = _data((6,), 3, n=48, seed=2, scale=3.0)  # norms ~7 > X0 = 2: clipped onto the sphere
    monitor = BoundMonitor((x, y), sample_size=16, seed=0)
    with pytest.raises(BoundViolationError) as info:
        model.fit(x, y, epochs=3, verbose=0, callbacks=[monitor])
    message = str(info.value)
    assert "'head/kernel': ratio 1.4" in message and "after epoch 1" in message
    assert "head/bias" not in message  # honest bound, not reported
    assert monitor.last_report["head/kernel"]["max_ratio"] == pytest.approx(FACTOR, rel=1e-4)
    assert model.dp_steps_taken == 3  # one epoch of 48 / 16 steps, then stopped


def test_bound_monitor_silent_where_the_bound_is_attained():
    """The honest twin of the broken models: ratios reach 1 (minus the clipping slack and
    rounding) on both variables, and the tolerance lets training run."""
    model = _kr_model("honest")
    x, y = _data((6,), 3, n=48, seed=2, scale=3.0)
    history = model.fit(x, y, epochs=2, verbose=0,
                        callbacks=[BoundMonitor((x, y), sample_size=16)]).history
    for name in ("head/kernel", "head/bias"):
        assert history[f"tightness_max/{name}"][-1] == pytest.approx(1.0, abs=1e-5)
        assert history[f"tightness_mean/{name}"][-1] == pytest.approx(1.0, abs=1e-5)


def test_examples_holding_nan_or_inf_are_left_out_of_the_sample():
    """The private step passes them with a zero contribution; their gradients are NaN, and a
    sound model was stopped with "the reported privacy guarantee does not hold" (an audit,
    2026-12-07)."""
    model = _kr_model("honest")
    x, y = _data((6,), 3, n=48, seed=3, scale=3.0)
    x[5, 2], x[9, 0], y[11, 1] = np.nan, np.inf, np.nan
    monitor = BoundMonitor((x, y), sample_size=48)
    xs, ys = monitor.sample(0)
    assert len(xs) == 45 and np.isfinite(xs).all() and np.isfinite(ys).all()
    monitor.set_model(model)
    monitor.on_epoch_end(0, {})  # no BoundViolationError
    assert max(row["max_ratio"] for row in monitor.last_report.values()) <= 1 + 1e-4
    x[:] = np.nan
    with pytest.raises(ValueError, match="every example of the sample holds NaN or inf"):
        BoundMonitor((x, y), sample_size=8).sample(0)


def test_samples_of_arrays_and_datasets():
    x, y = _data((4,), 2, n=30)
    monitor = BoundMonitor((x, y), sample_size=12, seed=5)
    first, again, second = monitor.sample(0), monitor.sample(0), monitor.sample(1)
    np.testing.assert_array_equal(first[0], again[0])  # seeded: the same on every call
    assert not np.array_equal(first[0], second[0])  # a new draw each epoch
    assert len(first[0]) == 12 and len(np.unique(first[0], axis=0)) == 12
    np.testing.assert_array_equal(first[0], _expected_sample(x, y, 5, 0, 12)[0])
    assert len(BoundMonitor((x, y), sample_size=100).sample(0)[0]) == 30  # capped at n
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(7)
    xs, ys = BoundMonitor(dataset, sample_size=10).sample(0)
    np.testing.assert_array_equal(xs, x[:10])
    np.testing.assert_array_equal(ys, y[:10])


def test_arguments_configs_and_clipped_mode():
    x, y = _data((4,), 2, n=8)
    with pytest.raises(ValueError, match="sample_size"):
        BoundMonitor((x, y), sample_size=0)
    with pytest.raises(ValueError, match="rtol"):
        BoundMonitor((x, y), rtol=-1e-3)
    with pytest.raises(ValueError, match="seed"):
        SignalToNoise((x, y), seed=-1)
    with pytest.raises(ValueError, match="labels"):
        BoundMonitor((x, y[:3]))
    with pytest.raises(TypeError, match="data"):
        SignalToNoise(x)
    assert BoundMonitor((x, y), 32, 1, 1e-3).get_config() == {
        "sample_size": 32, "seed": 1, "chunk_size": 64, "rtol": 1e-3}
    assert SignalToNoise((x, y), 32, 1).get_config() == {
        "sample_size": 32, "seed": 1, "chunk_size": 64}
    clipped = types.SimpleNamespace(dp_loss=object(), dp_parameters=DPParameters(
        1.0, 1e-5, mode="clipped", l2_norm_clip=1.0))
    for callback in (BoundMonitor((x, y)), SignalToNoise((x, y))):
        callback.set_model(clipped)
        with pytest.raises(ValueError, match="clipped mode"):
            callback.on_train_begin()


# --------------------------------------------------------------------------- #
# Silent on every real layer and zoo model (issue 11): a short fit with the monitor on.
# --------------------------------------------------------------------------- #
# Inputs of norm ~4.6 (8x8 pixels in [0, 1]) are clipped to X0 = 3, so the first layers see
# inputs on the bound. Every model trains one epoch (2 steps) and is checked after it.
SILENT_SHAPE, SILENT_CLASSES, X0_SILENT = (8, 8, 1), 4, 3.0


def _real_layer_models():
    """Four small models that hold every trainable and free layer of `lipdp.layers` (the
    residual layers are in the zoo's ResNet and MLP-Mixer below)."""
    from lipdp.layers import (DP_AddBias, DP_BoundedActivation, DP_ClipGradient, DP_Flatten, DP_GlobalL2NormPooling2D,
                              DP_GroupSort, DP_LayerCentering, DP_MaxPool2D, DP_Patches,
                              DP_Permute, DP_QuickFrobeniusDense, DP_QuickSpectralConv2D,
                              DP_MultiscaleScattering, DP_ReLU, DP_Reshape,
                              DP_ScaledL2NormPooling2D, DP_Scattering,
                              DP_Sigmoid, DP_Softplus, DP_SpectralConv2D, DP_SpectralDense,
                              DP_Tanh)
    convolutions = [  # 8x8x1 -> ... -> 4 logits
        DP_QuickSpectralConv2D(4, 3), DP_GroupSort(2),
        DP_SpectralConv2D(4, 3, use_bias=False), DP_GroupSort(2, pairing="interleaved"),
        DP_AddBias(0.5), DP_LayerCentering(), DP_MaxPool2D(2),  # 4x4x4
        DP_QuickSpectralConv2D(6, 3, strides=2), DP_ReLU(),  # 2x2x6
        DP_ScaledL2NormPooling2D(2), DP_Tanh(), DP_Flatten(),  # 6
        DP_QuickFrobeniusDense(8), DP_Sigmoid(), DP_SpectralDense(8), DP_Softplus(),
        DP_QuickSpectralDense(SILENT_CLASSES), DP_ClipGradient(0.5)]
    tokens = [  # 8x8x1 -> 16 patches of 4 -> ... -> 4 logits
        DP_Patches(2), DP_QuickSpectralDense(6), DP_BoundedActivation(X0_SILENT),
        DP_GroupSort(None),  # (16, 6); the first kernel left uncertified by the step
        DP_Permute((2, 1)), DP_SpectralDense(16), DP_Permute((2, 1)),  # (16, 6)
        DP_LayerCentering((1, 2)), DP_Reshape((4, 4, 6)), DP_GlobalL2NormPooling2D(),
        DP_QuickSpectralDense(SILENT_CLASSES)]
    # 4 angles: these cases hold the scattering layers' classes (kymatio's default of 8
    # builds a graph 3.4x as large; tests/test_scattering.py holds 8)
    scattering = [DP_Scattering(J=2, angles=4, order_weights=(0.5, 1.0, 2.0)), DP_Flatten(),
                  DP_QuickSpectralDense(SILENT_CLASSES)]
    multiscale = [DP_MultiscaleScattering(scales=(2, 1), angles=4,
                                          order_weights=(0.5, 1.0, 2.0)),
                  DP_QuickSpectralDense(SILENT_CLASSES)]
    return {"convolutions": convolutions, "tokens": tokens, "scattering": scattering,
            "multiscale": multiscale}


ZOO_SMALL = {  # every builder of lipdp.zoo, small, across activations, biases and heads
    "mlp": dict(width=8, depth=2, use_bias=True, activation="tanh"),
    "vgg": dict(widths=(4, 4), convs_per_block=1, dense_width=8, activation="relu"),
    "resnet": dict(width=4, stages=2, use_bias=True),
    "resnet-global-l2": dict(width=4, stages=1, head="global-l2", activation="fullsort"),
    "mlp_mixer": dict(patch_size=4, hidden_dim=4, centering=True, use_bias=True),
    "mlp_mixer-global-l2": dict(patch_size=4, hidden_dim=4, head="global-l2",
                                activation="softplus"),
}
SILENT_CASES = (["convolutions", "tokens", "scattering", "multiscale"]
                + [f"zoo:{k}" for k in ZOO_SMALL])


def _silent_case_model(case):
    import lipdp

    metadata = DatasetMetadata(SILENT_SHAPE, SILENT_CLASSES, 32, 8, 16, X0_SILENT, "shuffle")
    parameters = DPParameters(1.0, 1e-5)
    if case.startswith("zoo:"):
        name = case[4:]
        return getattr(lipdp.zoo, name.split("-")[0])(
            SILENT_SHAPE, SILENT_CLASSES, dp_parameters=parameters, dataset_metadata=metadata,
            **ZOO_SMALL[name])
    layers = [DP_BoundedInput(X0_SILENT, input_shape=SILENT_SHAPE)] + _real_layer_models()[case]
    return DP_Sequential(layers, dp_parameters=parameters, dataset_metadata=metadata)


def _fit_monitored(case, epochs):
    """`_silent_case_model(case)` trained `epochs` noisy epochs on 32 uniform images under a
    BoundMonitor (16 sampled examples an epoch): ``(model, monitor, history)``."""
    model = _silent_case_model(case)
    model.compile(tf.keras.optimizers.SGD(0.05), DP_TauCategoricalCrossentropy(4.0))
    rng = np.random.default_rng(7)
    x = rng.uniform(size=(32,) + SILENT_SHAPE).astype(np.float32)
    y = np.eye(SILENT_CLASSES, dtype=np.float32)[rng.integers(0, SILENT_CLASSES, 32)]
    monitor = BoundMonitor((x, y), sample_size=16, seed=1)
    history = model.fit(x, y, batch_size=16, epochs=epochs, verbose=0, callbacks=[monitor])
    return model, monitor, history.history


@pytest.mark.parametrize("case", SILENT_CASES)
def test_bound_monitor_silent_on_real_layers_and_zoo_models(case):
    """No BoundViolationError during one epoch of noisy training, and a tightness entry in
    (0, 1 + rtol] for every trainable variable in the epoch's logs."""
    model, monitor, history = _fit_monitored(case, epochs=1)
    bounds = gradient_bounds(model)
    assert len(bounds) == len(model.trainable_variables) > 0
    for name in bounds:
        maximum = history[f"tightness_max/{name}"][-1]
        assert 0 < history[f"tightness_mean/{name}"][-1] <= maximum <= 1 + 1e-4, (name, maximum)
        assert monitor.last_report[name]["max_ratio"] == pytest.approx(maximum)


def test_bound_monitor_traces_the_per_example_gradients_once(monkeypatch):
    """The monitor asks for exact per-example gradients every epoch; their vectorised
    function is traced at the first epoch only (it used to be traced anew every epoch)."""
    import lipdp.per_example

    traces, original = [], lipdp.per_example.per_example_gradients

    def counting(*args, **kwargs):  # runs when a function calling it is traced
        traces.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(lipdp.per_example, "per_example_gradients", counting)
    _, _, history = _fit_monitored("zoo:mlp", epochs=3)
    assert len(traces) == 1
    assert all(len(values) == 3 for name, values in history.items()
               if name.startswith("tightness_max/"))


def test_silent_cases_hold_every_layer_of_lipdp_layers():
    """The models above (built, not trained) contain every DP layer class lipdp exports."""
    import lipdp.layers

    def classes(layers):
        for layer in layers:
            yield type(layer)
            yield from classes(getattr(layer, "branch", []))  # DP_WrappedResidual

    seen = set()
    for case in SILENT_CASES:
        seen |= set(classes(_silent_case_model(case).layers))
    exported = {getattr(lipdp.layers, name) for name in lipdp.layers.__all__}
    exported = {c for c in exported if isinstance(c, type) and c is not lipdp.layers.DPLayer}
    assert exported - seen == set()
