"""Classic clipped DP-SGD in lipdp's train step (`DPParameters(mode="clipped")`).

Reference for every update: exact per-example gradients, one GradientTape per
example, clipped with the rule written out here, summed and divided by the
public denominator D. Tolerances: rtol 1e-5 / atol 1e-7 on averaged gradients
(float32 sums of a handful of terms; measured agreement ~1e-7 relative); rtol 1e-3 for
the ghost engines' clipped sums, whose clipping factors come from upper bounds up to
1e-3 above the exact squared norms (their rounding terms, `tests/test_ghost.py`).
"""

import math
import warnings

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_privacy  # the independent implementation compared against

from lipdp.accounting import compute_epsilon, get_eps_delta, model_step_noise_multiplier
from lipdp.bounds import bound_fraction_thresholds, gradient_bounds
from lipdp.clipping import (BatchCouplingError, GhostFallbackWarning, PreclipFallbackWarning,
                            ghost_plan, make_rule)
from lipdp.layers import (DP_BoundedInput, DP_Flatten, DP_GroupSort, DP_QuickSpectralConv2D,
                          DP_QuickSpectralDense, DP_ScaledL2NormPooling2D)
from lipdp.losses import DP_TauCategoricalCrossentropy
from lipdp.metadata import DatasetMetadata, DPParameters
from lipdp.model import DP_Model, DP_Sequential
from tests._soundness import per_example_gradients
from tests._stats import assert_gaussian_noise

L = tf.keras.layers
CCE = tf.keras.losses.CategoricalCrossentropy(from_logits=True)
D = 8  # public denominator (dataset_metadata.batch_size), larger than the test batches


def _metadata(shape, k, batch=D, n=64):
    return DatasetMetadata(shape, k, n, 16, batch, None, "shuffle")


def _params(clip, clipping="flat", engine="ghost", sigma=0.0, **kwargs):
    return DPParameters(sigma, 1e-5, mode="clipped", clipping=clipping, l2_norm_clip=clip,
                        engine=engine, **kwargs)


def _mixed_layers():
    """Dense, Conv2D (stride 1 'same' + relu, stride 2 'valid', stride 2 'same'), pooling."""
    return [L.Input((8, 8, 2)), L.Conv2D(3, 3, padding="same", activation="relu"),
            L.Conv2D(4, 3, strides=2, padding="valid"), L.ReLU(), L.MaxPooling2D(2, padding="same"),
            L.Conv2D(3, 2, strides=2, padding="same"), L.AveragePooling2D(1), L.Flatten(),
            L.Dense(5, activation="tanh"), L.Dense(4)]


def _dp_layers():
    return [DP_BoundedInput(3.0, input_shape=(8, 8, 2)), DP_QuickSpectralConv2D(4, 3),
            DP_GroupSort(2), DP_ScaledL2NormPooling2D(2),
            DP_QuickSpectralConv2D(4, 3, strides=2, padding="valid"), DP_GroupSort(None),
            DP_Flatten(), DP_QuickSpectralDense(6), DP_GroupSort(2), DP_QuickSpectralDense(4)]


def _data(n, shape=(8, 8, 2), k=4, seed=0):
    rng = np.random.default_rng(seed)
    return (tf.constant(rng.normal(size=(n,) + shape) * 2.0, tf.float32),
            tf.one_hot(rng.integers(0, k, n), k))


def reference_update(per_example, clipping, clip, denominator):
    """sum_i clip(g_i) / D with the rule written out; also which examples (per-layer: which
    (example, variable) pairs) were clipped."""
    sums = [np.zeros_like(g, dtype=np.float64) for g in per_example[0]]
    clipped = []
    for grads in per_example:
        if clipping == "per-layer":
            norms = [np.linalg.norm(g) for g in grads]
            factors = [min(1.0, c / n) if n > 0 else 1.0 for c, n in zip(clip, norms)]
            clipped.extend(f < 1 for f in factors)
        else:
            norm = math.sqrt(sum(float(np.sum(g.astype(np.float64) ** 2)) for g in grads))
            if clipping == "flat":
                factor = min(1.0, clip / norm)
            else:  # global: keep the gradient only if its norm is at most C
                factor = 1.0 if norm <= clip else 0.0
            factors = [factor] * len(grads)
            clipped.append(factor < 1)
        for s, g, f in zip(sums, grads, factors):
            s += f * g.astype(np.float64)
    return [s / denominator for s in sums], clipped


def _thresholds(per_example, clipping):
    """Medians of the per-example norms: some examples are clipped, some are not."""
    if clipping == "per-layer":
        return [float(np.median([np.linalg.norm(g[v]) for g in per_example]))
                for v in range(len(per_example[0]))]
    totals = [math.sqrt(sum(float(np.sum(t ** 2)) for t in g)) for g in per_example]
    return float(np.median(totals))


def _compiled(make_layers, clipping, engine, loss, shape=(8, 8, 2), k=4, model_cls=DP_Sequential,
              clip=None, **kwargs):
    tf.keras.utils.set_random_seed(7)  # same weights for every call with the same factory
    params = _params(1.0 if clip is None else clip, clipping, engine, **kwargs)
    model = model_cls(make_layers(), dp_parameters=params, dataset_metadata=_metadata(shape, k))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GhostFallbackWarning)
        model.compile(loss=loss, optimizer=tf.keras.optimizers.SGD(0.1))
    return model


def _rtol(engine):
    """Of a clipped sum against the reference (module docstring)."""
    return 1e-5 if engine == "vectorized" else 1e-3


def _check_against_reference(make_layers, clipping, engine, loss, x, y, **kwargs):
    # Thresholds from the exact norms of the very weights used below (fixed seed).
    probe = _compiled(make_layers, "flat", "vectorized", loss, **kwargs)
    clip = _thresholds(per_example_gradients(probe, loss, x, y), clipping)
    model = _compiled(make_layers, clipping, engine, loss, clip=clip, **kwargs)
    per_example = per_example_gradients(model, loss, x, y)
    expected, clipped = reference_update(per_example, clipping, clip, D)
    assert any(clipped) and not all(clipped), clipped
    # Eagerly and compiled (as in fit).
    for private_gradients in (model.private_gradients, tf.function(model.private_gradients)):
        clean, noisy, sens, losses, y_pred = private_gradients(x, y)
        for c, n, e, v in zip(clean, noisy, expected, model.trainable_variables):
            np.testing.assert_allclose(c.numpy(), e, rtol=_rtol(engine), atol=1e-7,
                                       err_msg=v.name)
            np.testing.assert_array_equal(c.numpy(), n.numpy())  # sigma = 0
        assert losses.shape == (len(x),) and y_pred.shape[0] == len(x)
    return model


ENGINES = ["ghost", "mixed-ghost", "vectorized"]


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("clipping", ["flat", "per-layer", "global"])
def test_clipped_update_equals_example_by_example_reference(clipping, engine):
    x, y = _data(6)
    model = _check_against_reference(_mixed_layers, clipping, engine, CCE, x, y)
    assert model._clipped_dpsgd.engine.name == engine
    if engine != "vectorized":
        assert ghost_plan(model).fallback == ()


@pytest.mark.parametrize("engine,clipping", [("ghost", "flat"), ("ghost", "per-layer"),
                                             ("ghost", "global"), ("mixed-ghost", "flat"),
                                             ("vectorized", "flat")])
def test_clipped_update_on_lipdp_layers(clipping, engine):
    x, y = _data(6, seed=1)
    _check_against_reference(_dp_layers, clipping, engine, DP_TauCategoricalCrossentropy(5.0), x, y)


def _float64_layers(mixed):
    """A float64 model, or one mixing a float64 layer with a float32 one."""
    return [L.Input((6,)), L.Dense(5, activation="tanh", dtype="float64"),
            L.Dense(4, dtype="float32" if mixed else "float64")]


@pytest.mark.parametrize("engine,clipping", [("ghost", "flat"), ("ghost", "per-layer"),
                                             ("vectorized", "global")])
@pytest.mark.parametrize("mixed", [False, True], ids=["float64", "float64+float32"])
def test_clipped_update_of_float64_variables(clipping, engine, mixed):
    """Ghost norms are float32 upper bounds: a float64 model's factors met its float64
    gradients in a product and fit failed with a TypeError (an audit), and a model mixing
    float32 and float64 variables failed to add their squared norms, in every engine. The
    factors are now cast to each gradient's dtype, never rounded up (`factors_in`)."""
    x, y = _data(6, shape=(6,), seed=4)
    model = _check_against_reference(lambda: _float64_layers(mixed), clipping, engine, CCE, x, y,
                                      shape=(6,))
    assert [v.dtype for v in model.trainable_variables][:2] == [tf.float64, tf.float64]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_variables_are_refused(dtype):
    """Clipped in float16, contributions exceeded C by 1.2e-3 of it (a review, 2026-12-07);
    the mixed_float16 policy keeps float32 variables."""
    layers = [L.Input((6,)), L.Dense(5, activation="tanh"), L.Dense(4, dtype=dtype)]
    with pytest.raises(ValueError, match=f"'dense_.*kernel:0' is {dtype}"):
        _compiled(lambda: layers, "flat", "vectorized", CCE, shape=(6,))


def test_factors_cast_to_float32_are_never_rounded_up():
    """A float64 factor just below a float32 one would be rounded up to it by a plain cast."""
    from lipdp.clipping.engine import factors_in

    above = np.nextafter(np.float32(0.75), np.float32(1.0))
    factors = tf.constant([0.75 + 1e-12, float(above) - 1e-12, 0.5, 1.0], tf.float64)
    cast = factors_in(factors, tf.float32).numpy()
    assert np.all(cast.astype(np.float64) <= factors.numpy())
    np.testing.assert_array_equal(cast, np.float32([0.75, 0.75, 0.5, 1.0]))
    assert factors_in(tf.constant(cast), tf.float64).dtype == tf.float64


class _SwitchedScale(L.Layer):
    """Doubles its input while a variable says so: Python control flow on a tensor, which
    AutoGraph turns into a `tf.cond` inside a traced step, as it does in Keras' `fit`."""

    def build(self, input_shape):
        self.on = self.add_weight(name="on", shape=(), dtype=tf.bool, trainable=False,
                                  initializer=tf.keras.initializers.Constant(True))

    def call(self, inputs):
        if self.on:
            return 2.0 * inputs
        return inputs


def _recurrent_layers(kind):
    recurrent = {"lstm": lambda: L.LSTM(5), "gru": lambda: L.GRU(5, return_sequences=True),
                 "bidirectional": lambda: L.Bidirectional(L.LSTM(3))}[kind]()
    return [L.Input((5, 3)), recurrent, L.Flatten(), L.Dense(4)]


@pytest.mark.parametrize("engine,kind", [("ghost", "bidirectional"), ("mixed-ghost", "gru"),
                                         ("vectorized", "lstm")])
def test_recurrent_layers_are_clipped_example_by_example(engine, kind):
    """TensorFlow 2.15's tf.vectorized_map cannot vectorise the gradient of a Keras RNN's
    time loop (a TypeError from its converters: every engine failed to trace). Their
    per-example gradients go one example after the other (`lipdp.per_example.map_examples`):
    each engine's clipped sum equals the example-by-example reference."""
    x, y = _data(6, shape=(5, 3), seed=3)
    _check_against_reference(lambda: _recurrent_layers(kind), "flat", engine, CCE, x, y,
                             shape=(5, 3))


@pytest.mark.parametrize("engine", ENGINES)
def test_a_layer_with_python_control_flow_on_tensors_trains_in_every_engine(engine):
    """The ghost engines trace their pass as a nested function; built without AutoGraph
    (2026-12-04 to 12-05), such a layer failed to trace (OperatorNotAllowedInGraphError)."""
    x, y = _data(6, shape=(6,), seed=4)
    _check_against_reference(lambda: [L.Input((6,)), L.Dense(5, activation="tanh"),
                                      _SwitchedScale(), L.Dense(4)],
                             "flat", engine, CCE, x, y, shape=(6,))


@pytest.mark.parametrize("engine", ENGINES)
def test_a_layer_writing_variables_in_its_call_is_named_in_a_clear_error(engine):
    """deel-lip's SpectralDense assigns its power-iteration vectors in every training call,
    which tf.vectorized_map cannot run per example: every engine failed with pfor's
    "Attempting to slice scalar input" (an audit, 2026-12-05). The error now names the
    layers whose call writes and what to use instead."""
    from deel.lip.layers import SpectralDense

    model = _compiled(lambda: [L.Input((6,)), SpectralDense(5, name="raw_spectral"),
                               L.Dense(4)], "flat", engine, CCE, shape=(6,))
    x, y = _data(4, shape=(6,), seed=5)
    with pytest.raises(ValueError, match=r"write variables in training mode: \S*raw_spectral"
                                         r".*lipdp.layers.DP_SpectralDense"):
        tf.function(model.private_gradients)(x, y)


def _sequence_layers():
    inputs = L.Input((5,), dtype="int32")
    h = L.Embedding(4, 3)(inputs)
    h = L.Dense(4, activation="relu")(h)
    h = L.LayerNormalization(name="norm_fallback")(h)  # no ghost rule: exact fallback
    return inputs, L.Dense(3, activation="softmax")(L.Flatten()(h))


@pytest.mark.parametrize("clipping", ["flat", "per-layer"])
def test_functional_model_with_embedding_and_fallback_layer(clipping):
    rng = np.random.default_rng(2)
    x = tf.constant(rng.integers(0, 4, (6, 5)), tf.int32)
    y = tf.one_hot(rng.integers(0, 3, 6), 3)
    _check_against_reference(_sequence_layers, clipping, "ghost",
                             "categorical_crossentropy", x, y, shape=(5,), k=3,
                             model_cls=lambda io, **kw: DP_Model(*io, **kw))


def test_fallback_is_announced_at_compile():
    inputs, outputs = _sequence_layers()
    model = DP_Model(inputs, outputs, dp_parameters=_params(1.0),
                     dataset_metadata=_metadata((5,), 3))
    with pytest.warns(GhostFallbackWarning, match="norm_fallback"):
        model.compile(loss=CCE)


@pytest.mark.parametrize("engine", ENGINES)
def test_flat_clipping_agrees_with_tensorflow_privacy(engine):
    """Same model, weights and batch; tf-privacy averages over its microbatches (= the batch
    size here), so D = batch size. One SGD step each (ours through `fit`, i.e. the compiled
    train step), compared on the weights."""
    batch, clip, lr = 6, 2.7, 0.5
    x, y = _data(batch, seed=3)
    tf.keras.utils.set_random_seed(11)
    reference = tf.keras.Sequential(_mixed_layers())
    model = DP_Sequential(_mixed_layers(), dp_parameters=_params(clip, engine=engine),
                          dataset_metadata=_metadata((8, 8, 2), 4, batch=batch, n=batch))
    for ours, theirs in zip(model.trainable_variables, reference.trainable_variables):
        ours.assign(theirs)
    model.compile(loss=CCE, optimizer=tf.keras.optimizers.SGD(lr))
    norms = [math.sqrt(sum(float(np.sum(t ** 2)) for t in g))
             for g in per_example_gradients(model, CCE, x, y)]
    assert min(norms) < clip < max(norms), norms

    optimizer = tensorflow_privacy.DPKerasSGDOptimizer(
        l2_norm_clip=clip, noise_multiplier=0.0, num_microbatches=batch, learning_rate=lr)
    loss_none = tf.keras.losses.CategoricalCrossentropy(
        from_logits=True, reduction=tf.keras.losses.Reduction.NONE)
    optimizer.minimize(lambda: loss_none(y, reference(x, training=True)),
                       reference.trainable_variables)
    model.fit(tf.data.Dataset.from_tensors((x, y)), epochs=1, verbose=0)
    assert model.dp_steps_taken == 1
    for ours, theirs in zip(model.trainable_variables, reference.trainable_variables):
        np.testing.assert_allclose(ours.numpy(), theirs.numpy(), rtol=1e-5, atol=1e-6,
                                   err_msg=ours.name)


def _wide_model(params):
    tf.keras.utils.set_random_seed(5)
    model = DP_Sequential([L.Input((30,)), L.Dense(200, activation="relu"), L.Dense(3)],
                          dp_parameters=params, dataset_metadata=_metadata((30,), 3))
    model.compile(loss=CCE, optimizer="sgd")
    return model


@pytest.mark.parametrize("clipping,clip,expected", [
    ("flat", 0.7, 0.7),
    ("global", 0.7, 0.7),
    ("per-layer", [0.3, 0.1, 0.4, 0.2], math.sqrt(0.09 + 0.01 + 0.16 + 0.04)),
])
def test_noise_std_is_sigma_times_sensitivity_over_denominator(clipping, clip, expected):
    """noisy - clean over 6803 coordinates x 3 draws (20409 samples) is N(0, (sigma S / D)^2):
    tests._stats, false-failure rate <= 1e-6, a std off by 10% (x1.1 or x0.9) or a mean of
    0.1 std caught with probability >= 1 - 1e-6 (asserted)."""
    sigma = 2.5
    model = _wide_model(_params(clip, clipping, sigma=sigma))
    x, y = _data(5, shape=(30,), k=3)
    diffs = []
    for _ in range(3):
        clean, noisy, sens, _, _ = model.private_gradients(x, y)
        diffs.append(np.concatenate([(n - c).numpy().ravel() for c, n in zip(clean, noisy)]))
    std = sigma * expected / D
    assert_gaussian_noise(np.concatenate(diffs), std, f"{clipping} clipping noise")
    per_variable = clip if clipping == "per-layer" else [clip] * 4
    np.testing.assert_allclose([float(s) for s in sens], np.array(per_variable) / D, rtol=1e-6)
    np.testing.assert_allclose([float(s) for s in model.sensitivities()],
                               np.array(per_variable) / D, rtol=1e-6)
    assert model._clipped_dpsgd.noise_stddev == pytest.approx(std)


def _clipless_dp_model(loss):
    tf.keras.utils.set_random_seed(7)
    model = DP_Sequential(_dp_layers(), dp_parameters=DPParameters(0.0, 1e-5),
                          dataset_metadata=_metadata((8, 8, 2), 4))
    model.compile(loss=loss, optimizer=tf.keras.optimizers.SGD(0.1))
    return model


@pytest.mark.parametrize("engine", ["ghost", "mixed-ghost"])
def test_bound_fraction_thresholds_clip_at_that_fraction_of_the_analytic_bounds(engine):
    """C_v = f bound(v): at f = 1 no example reaches a threshold (the clipped update is the
    clipless one), at f = 0.05 the update is the example-by-example per-layer reference
    with those thresholds, some (example, variable) pairs clipped."""
    loss = DP_TauCategoricalCrossentropy(5.0)
    x, y = _data(6, seed=2)
    clipless = _clipless_dp_model(loss)
    bounds = list(gradient_bounds(clipless).values())
    assert bound_fraction_thresholds(clipless, 1.0) == pytest.approx(bounds, rel=1e-12)
    exact, _, _, _, _ = clipless.private_gradients(x, y)
    for fraction in (1.0, 0.05):
        thresholds = bound_fraction_thresholds(clipless, fraction, loss)
        assert thresholds == pytest.approx([fraction * b for b in bounds], rel=1e-12)
        model = _compiled(_dp_layers, "per-layer", engine, loss, clip=thresholds)
        per_example = per_example_gradients(model, loss, x, y)
        expected, clipped = reference_update(per_example, "per-layer", thresholds, D)
        assert any(clipped) == (fraction < 1) and not all(clipped), clipped
        clean, _, sens, _, _ = model.private_gradients(x, y)
        for c, e, g, v in zip(clean, expected, exact, model.trainable_variables):
            np.testing.assert_allclose(c.numpy(), e, rtol=1e-5, atol=1e-7, err_msg=v.name)
            if fraction == 1.0:
                np.testing.assert_allclose(c.numpy(), g.numpy(), rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose([float(s) for s in sens], np.array(thresholds) / D,
                                   rtol=1e-6)
    for bad in (0.0, -1.0, float("inf"), True, "0.5"):
        with pytest.raises(ValueError, match="fraction"):
            bound_fraction_thresholds(clipless, bad)


def test_single_per_layer_threshold_is_split_evenly():
    variables = [tf.Variable(tf.zeros((3,))) for _ in range(4)]
    rule = make_rule(_params(2.0, "per-layer"), variables)
    assert rule.thresholds == pytest.approx([1.0] * 4)
    assert rule.sensitivity() == pytest.approx(2.0)


def test_preclip_perturbation_adds_gaussian_noise_to_each_example_before_clipping():
    """E||g + k z||^2 = ||g||^2 + k^2 P (P parameters): checked on the engine's pre-clipping
    norms (relative sd of the mean excess ~ sqrt(2 / (P n)) = 1.4% here, 10% asserted);
    every clipped example then has norm <= C, so ||sum|| <= n C."""
    k, clip = 0.05, 0.5
    with pytest.warns(PreclipFallbackWarning):
        model = _wide_model(_params(clip, preclip_noise=k))
    assert model._clipped_dpsgd.engine.name == "vectorized"
    x, y = _data(6, shape=(30,), k=3)
    exact = per_example_gradients(model, CCE, x, y)
    clean_sq = np.array([sum(float(np.sum(t ** 2)) for t in g) for g in exact])
    batch = model._clipped_dpsgd.clipped_batch(model, x, y)
    noisy_sq = np.sum([n.numpy() for n in batch.squared_norms], axis=0)
    nb_params = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    assert np.mean(noisy_sq - clean_sq) == pytest.approx(k * k * nb_params, rel=0.1)
    total = math.sqrt(sum(float(tf.reduce_sum(tf.square(g))) for g in batch.gradient_sums))
    assert total <= len(x) * clip * (1 + 1e-5)


@pytest.mark.parametrize("engine", ENGINES)
def test_empty_poisson_batch_gives_pure_noise(engine):
    """An empty batch: zero clipped gradient plus noise of std sigma C / D on every coordinate
    (eagerly and compiled); the model is not run on it (some TensorFlow builds return
    mis-shaped convolutions of empty batches). Noise: 40 draws x 264 coordinates (10560
    samples) for each of the two, tests._stats (false-failure rate <= 1e-6 over both; a
    10% error caught with probability >= 1 - 1e-6)."""
    model = _compiled(_mixed_layers, "flat", engine, CCE, sigma=1.0)
    x, y = _data(0)
    for name, private_gradients in [("eager", model.private_gradients),
                                    ("compiled", tf.function(model.private_gradients))]:
        noise = []
        for _ in range(40):
            clean, noisy, sens, losses, y_pred = private_gradients(x, y)
            assert all(float(tf.reduce_max(tf.abs(c))) == 0.0 for c in clean)
            noise.append(np.concatenate([n.numpy().ravel() for n in noisy]))
            assert [float(s) for s in sens] == pytest.approx([1.0 / D] * len(sens))
            assert losses.shape == (0,) and tuple(y_pred.shape) == (0, 4)
        assert_gaussian_noise(np.concatenate(noise), 1.0 * 1.0 / D, f"{engine}, {name}",
                              nb_tests=2)


def test_accounting_and_fit_in_clipped_mode():
    """epsilon of a clipped run is the Poisson-subsampled Gaussian with multiplier sigma;
    fit runs, records its steps, and projects the DP layers after every step."""
    sigma = 1.3
    tf.keras.utils.set_random_seed(3)
    model = DP_Sequential(_dp_layers(), dp_parameters=_params(1.0, "per-layer", sigma=sigma),
                          dataset_metadata=DatasetMetadata((8, 8, 2), 4, 64, 16, 16, 3.0,
                                                           "shuffle"))
    model.compile(loss=DP_TauCategoricalCrossentropy(5.0), optimizer=tf.keras.optimizers.SGD(0.5),
                  metrics=["accuracy"])
    assert model_step_noise_multiplier(model) == sigma
    eps, delta = get_eps_delta(model, 3)
    assert eps == compute_epsilon(sigma, 16 / 64, 3 * 4, 1e-5) and delta == 1e-5
    x, y = _data(64)
    before = [v.numpy() for v in model.trainable_variables]
    history = model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(16), epochs=1, verbose=0)
    assert model.dp_steps_taken == 4
    assert np.isfinite(history.history["loss"][0])
    assert any(not np.allclose(b, v.numpy()) for b, v in zip(before, model.trainable_variables))
    for layer in model.layers:
        if isinstance(layer, DP_QuickSpectralDense):
            assert np.linalg.svd(layer.kernel.numpy(), compute_uv=False)[0] <= 1 + 1e-3


def test_parameters_validation_and_round_trip():
    with pytest.raises(ValueError, match="Received an invalid value for `clipping`"):
        _params(1.0, "adaptive")
    with pytest.raises(ValueError, match="Received an invalid value for `engine`"):
        _params(1.0, engine="hooks")
    with pytest.raises(ValueError, match="Received an invalid value for `mode`"):
        DPParameters(mode="clip")
    for bad in (0.0, -1.0, float("inf"), "1", True):
        with pytest.raises(ValueError, match="l2_norm_clip"):
            _params(bad)
    with pytest.raises(ValueError, match="l2_norm_clip"):
        _params([1.0, 0.0], "per-layer")
    with pytest.raises(ValueError, match="clipping='per-layer'"):
        _params([1.0, 2.0], "flat")
    with pytest.raises(ValueError, match="needs a clipping threshold"):
        DPParameters(mode="clipped")
    with pytest.raises(ValueError, match="noisify_strategy"):
        DPParameters(1.0, 1e-5, "per-layer", mode="clipped", l2_norm_clip=1.0)
    with pytest.raises(ValueError, match="only applies to mode='clipped'"):
        DPParameters(l2_norm_clip=1.0)
    with pytest.raises(ValueError, match="preclip_noise"):
        _params(1.0, preclip_noise=-0.1)
    params = _params([0.5, 1.0], "per-layer", "vectorized", sigma=2.0, preclip_noise=0.1)
    assert params.l2_norm_clip == (0.5, 1.0)
    assert DPParameters.from_config(params.get_config()) == params
    old = {"noise_multiplier": 1.0, "delta": 1e-5, "noisify_strategy": "global"}
    assert DPParameters.from_config(old) == DPParameters(1.0, 1e-5)


def test_clipped_model_config_round_trip():
    params = _params([0.5] * 10, "per-layer", "vectorized", sigma=2.0)
    model = DP_Sequential(_mixed_layers(), dp_parameters=params,
                          dataset_metadata=_metadata((8, 8, 2), 4))
    clone = DP_Sequential.from_config(model.get_config())
    assert clone.dp_parameters == params
    assert clone.dataset_metadata == model.dataset_metadata
    assert [type(a) for a in clone.layers] == [type(b) for b in model.layers]


def test_wrong_number_of_per_layer_thresholds_is_refused_at_compile():
    model = DP_Sequential(_mixed_layers(), dp_parameters=_params([1.0, 2.0], "per-layer"),
                          dataset_metadata=_metadata((8, 8, 2), 4))
    with pytest.raises(ValueError, match="one threshold per trainable variable \\(10"):
        model.compile(loss=CCE)


@pytest.mark.parametrize("engine", ["ghost", "mixed-ghost", "vectorized"])
@pytest.mark.parametrize("wrapped", [False, True])
def test_a_grouped_convolution_is_refused_at_compile(engine, wrapped):
    """TensorFlow's vectorised per-example gradient of a grouped convolution fails
    ("filter_size does not have enough elements"): such a model compiled, and every step
    failed (a review, 2026-12-07). Also inside a wrapper."""
    conv = L.Conv2D(4, 3, groups=2)
    layers = ([L.Input((2, 6, 6, 4)), L.TimeDistributed(conv)] if wrapped
              else [L.Input((6, 6, 4)), conv]) + [L.Flatten(), L.Dense(3)]
    shape = (2, 6, 6, 4) if wrapped else (6, 6, 4)
    model = DP_Sequential(layers, dp_parameters=_params(1.0, engine=engine),
                          dataset_metadata=_metadata(shape, 3))
    with pytest.raises(ValueError, match="grouped convolution"):
        model.compile(loss=CCE)


def test_batch_coupled_layers_and_bad_losses_are_refused():
    layers = [L.Input((6,)), L.Dense(4), L.BatchNormalization(), L.Dense(3)]
    model = DP_Sequential(layers, dp_parameters=_params(1.0), dataset_metadata=_metadata((6,), 3))
    with pytest.raises(BatchCouplingError, match="batch_normalization"):
        model.compile(loss=CCE)
    model = DP_Sequential([L.Input((6,)), L.Dense(3)], dp_parameters=_params(1.0),
                          dataset_metadata=_metadata((6,), 3))
    with pytest.raises(TypeError, match="per-example"):
        model.compile(loss=None)
    model.compile(loss=lambda y, p: tf.reduce_mean(tf.square(y - p)))
    with pytest.raises(ValueError, match="returned a scalar"):
        model.private_gradients(*_data(4, shape=(6,), k=3))


def _single_output_layers(activation=None):
    return lambda: [L.Input((4,)), L.Dense(3, activation="tanh"), L.Dense(1, activation=activation)]


# name -> (loss given to compile, output activation, the same loss written out for one example,
# label of example 0 (the other labels: standard normal, 0 for the binary loss), clipping
# threshold C (some examples clipped, some not; measured norms 0.77 to 6239)).
SHAPE_B_LOSSES = {
    "mse": ("mse", None, lambda y, p: tf.square(y - p[:, 0]), 1e3, 12.0),
    "binary_crossentropy": ("binary_crossentropy", "sigmoid",
                            lambda y, p: tf.keras.losses.binary_crossentropy(y[:, None], p), 1.0,
                            1.2),
    "batch-mean target": (lambda y, p: tf.square(tf.reshape(p, [-1]) - tf.reduce_mean(y)), None,
                          lambda y, p: tf.square(y - p[:, 0]), 1e3, 12.0),
}


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("case", sorted(SHAPE_B_LOSSES))
def test_each_loss_depends_on_its_own_example_with_labels_of_shape_batch(case, engine):
    """Labels (B,) against predictions (B, 1): Keras' raw "mse" broadcasts them to (B, B), and
    a loss may reduce over the batch (the batch-mean target); the clipped step evaluates each
    example's loss on its own pair. Checked: the update is the example-by-example reference
    (the loss written out for one example, one tape per example), and removing example 0 (an
    outlier label) moves the noiseless update by at most the sensitivity C / D
    (before the fix: 9.2x that for "mse", 2x for binary cross-entropy). Tolerances as above."""
    loss, activation, reference_loss, label, clip = SHAPE_B_LOSSES[case]
    rng = np.random.default_rng(4)
    x = tf.constant(rng.normal(size=(6, 4)), tf.float32)
    y = np.zeros(6, np.float32) if activation else rng.normal(size=6).astype(np.float32)
    y[0] = label
    y = tf.constant(y)
    model = _compiled(_single_output_layers(activation), "flat", engine, loss, shape=(4,), k=1,
                      clip=clip)
    per_example = per_example_gradients(model, reference_loss, x, y)
    expected, clipped = reference_update(per_example, "flat", clip, D)
    assert any(clipped) and not all(clipped), clipped
    expected_without_first, _ = reference_update(per_example[1:], "flat", clip, D)
    for private_gradients in (model.private_gradients, tf.function(model.private_gradients)):
        full = private_gradients(x, y)[0]
        without_first = private_gradients(x[1:], y[1:])[0]
        for c, e, v in zip(full + without_first, expected + expected_without_first,
                           model.trainable_variables * 2):
            np.testing.assert_allclose(c.numpy(), e, rtol=1e-5, atol=1e-7, err_msg=v.name)
        moved = math.sqrt(sum(float(tf.reduce_sum(tf.square(a - b)))
                              for a, b in zip(full, without_first)))
        assert moved <= model._clipped_dpsgd.sensitivity * (1 + 1e-5)


class _DenseBatchNormBlock(L.Layer):
    """A 'Dense + BatchNormalization' block written as one layer: the BN is a sub-layer."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = L.Dense(4)
        self.norm = L.BatchNormalization(name="hidden_norm")

    def call(self, x, training=None):
        return tf.nn.relu(self.norm(self.dense(x), training=training))


class _RunningSum(L.Layer):
    """Adds the sum of its training inputs into a non-trainable variable."""

    def build(self, input_shape):
        self.seen = self.add_weight(name="seen", shape=(), initializer="zeros", trainable=False)

    def call(self, x, training=None):
        if training:
            self.seen.assign_add(tf.reduce_sum(x))
        return x


class _NonFiniteCounter(L.Layer):
    """Counts the non-finite values of its training inputs: zero for every ordinary batch,
    so two random batches agree, yet it records which training records were unusable."""

    def build(self, input_shape):
        self.count = self.add_weight(name="count", shape=(), initializer="zeros",
                                     trainable=False)

    def call(self, x, training=None):
        if training:
            self.count.assign_add(tf.reduce_sum(tf.cast(~tf.math.is_finite(x), tf.float32)))
        return x


class _OutlierMaximum(L.Layer):
    """Keeps the largest training input above 100 (0 until one comes): ordinary batches
    leave it alone."""

    def build(self, input_shape):
        self.largest = self.add_weight(name="largest", shape=(), initializer="zeros",
                                       trainable=False)

    def call(self, x, training=None):
        if training:
            top = tf.reduce_max(tf.where(tf.math.is_nan(x), tf.zeros_like(x), x))
            self.largest.assign(tf.where(top > 100.0, tf.maximum(self.largest, top),
                                         self.largest))
        return x


class _TrainingBatchCentring(L.Layer):
    """Subtracts the batch mean in training only: behind a random layer, the first probe
    compared rows in inference mode and passed it (2.5x the sensitivity, found by an audit);
    the random layer is now held in inference mode instead."""

    def call(self, x, training=None):
        return x - tf.reduce_mean(x, 0, keepdims=True) if training else x


class _RunningMeanWeight(L.Layer):
    """Adds a trainable offset to its input, then assigns the offset half the batch mean:
    per example forward (the offset is read first), yet a weight written from the data."""

    def build(self, input_shape):
        self.offset = self.add_weight(name="offset", shape=input_shape[1:], initializer="zeros")

    def call(self, x, training=None):
        out = x + tf.identity(self.offset)
        if training:
            with tf.control_dependencies([out]):
                self.offset.assign(0.5 * self.offset + 0.5 * tf.reduce_mean(x, 0))
        return out


class _CotangentMaximum(L.Layer):
    """The identity, whose custom gradient keeps the largest cotangent it passes back in a
    non-trainable variable: no forward pass writes it."""

    def build(self, input_shape):
        self.largest = self.add_weight(name="largest", shape=(), initializer="zeros",
                                       trainable=False)

    def call(self, x):
        @tf.custom_gradient
        def recorded(t):
            def gradient(dy):
                self.largest.assign(tf.maximum(self.largest, tf.reduce_max(tf.abs(dy))))
                return dy
            return tf.identity(t), gradient

        return recorded(x)


class _CallCounter(L.Layer):
    """Counts its training calls in a non-trainable variable: the same for every input."""

    def build(self, input_shape):
        self.calls = self.add_weight(name="calls", shape=(), initializer="zeros", trainable=False)

    def call(self, x, training=None):
        if training:
            self.calls.assign_add(1.0)
        return x


HIDDEN_COUPLING = {
    "BN inside a custom layer": (
        lambda: [L.Input((4,)), _DenseBatchNormBlock(), L.Dense(1)],
        "'hidden_norm' \\(BatchNormalization\\) normalises with batch statistics"),
    "TimeDistributed(BN)": (
        lambda: [L.Input((4,)), L.Reshape((1, 4)),
                 L.TimeDistributed(L.BatchNormalization(name="wrapped_norm")), L.Flatten(),
                 L.Dense(1)],
        "'wrapped_norm' \\(BatchNormalization\\) normalises with batch statistics"),
    "Lambda centring over the batch": (
        lambda: [L.Input((4,)), L.Dense(3),
                 L.Lambda(lambda t: t - tf.reduce_mean(t, axis=0, keepdims=True),
                          name="batch_mean"), L.Dense(1)],
        "other examples .* layer 'batch_mean' \\(Lambda\\) mixes the examples"),
    "Lambda scaling by the batch's largest magnitude": (
        lambda: [L.Input((4,)), L.Dense(3),
                 L.Lambda(lambda t: t / tf.reduce_max(tf.abs(t)), name="batch_max"),
                 L.Dense(1)],
        "one example NaN in a batch .* layer 'batch_max' \\(Lambda\\) mixes the examples"),
    "Lambda scaling by the batch's largest magnitude, NaN aside": (
        lambda: [L.Input((4,)), L.Dense(3),
                 L.Lambda(lambda t: t / tf.reduce_max(
                     tf.where(tf.math.is_nan(t), tf.zeros_like(t), tf.abs(t))),
                          name="batch_nanmax"), L.Dense(1)],
        "beyond every value in a batch .* 'batch_nanmax' \\(Lambda\\) mixes the examples"),
    "running sum of the inputs": (
        lambda: [L.Input((4,)), L.Dense(3), _RunningSum(name="running"), L.Dense(1)],
        "'running/seen:0' of layer 'running' \\(_RunningSum\\) .* depends on the input data"),
    "token ids, then a division by the batch's largest magnitude": (
        lambda: [L.Input((4,), dtype="int32"), L.Embedding(10, 4),
                 L.Lambda(lambda t: t / tf.reduce_max(tf.abs(t)), name="ids_batch_max"),
                 L.Flatten(), L.Dense(1)],
        "NaN \\(in its first float activations\\) .* 'ids_batch_max' \\(Lambda\\) mixes"),
    "a count of non-finite inputs": (
        lambda: [L.Input((4,)), _NonFiniteCounter(name="counting"), L.Dense(1)],
        "'counting/count:0' of layer 'counting' \\(_NonFiniteCounter\\) .* depends on the"),
    "the largest outlier": (
        lambda: [L.Input((4,)), _OutlierMaximum(name="outlier"), L.Dense(1)],
        "'outlier/largest:0' of layer 'outlier' \\(_OutlierMaximum\\) .* depends on the"),
    "a count of non-finite activations behind token ids": (
        lambda: [L.Input((4,), dtype="int32"), L.Embedding(10, 4),
                 _NonFiniteCounter(name="id_counting"), L.Flatten(), L.Dense(1)],
        "'id_counting/count:0' of layer 'id_counting' .* depends on the input data"),
    "training-only centring behind a noise layer": (
        lambda: [L.Input((4,)), L.Dense(3), _TrainingBatchCentring(name="centring"),
                 L.GaussianNoise(1e-4), L.Dense(1)],
        "layer 'centring' \\(_TrainingBatchCentring\\) mixes the examples"),
    "a trainable weight assigned from the batch mean": (
        lambda: [L.Input((4,)), _RunningMeanWeight(name="drifting"), L.Dense(1)],
        "'drifting/offset:0' of layer 'drifting' .* in a training-mode forward pass"),
    "a custom gradient recording its largest cotangent": (
        lambda: [L.Input((4,)), L.Dense(3), _CotangentMaximum(name="recording"), L.Dense(1)],
        "'recording/largest:0' of layer 'recording' .* in a training-mode backward pass"),
    "Normalization adapted on the data": (
        lambda: [L.Input((4,)), _adapted_normalization(), L.Dense(1)],
        "'adapted' \\(Normalization\\) was adapted on data"),
}


def _adapted_normalization():
    """A Normalization whose mean and variance `adapt` computed from (training) data: saved
    with the model without noise (found by an audit), and no forward pass changes them."""
    layer = L.Normalization(name="adapted")
    layer.adapt(np.random.default_rng(0).normal(size=(32, 4)).astype(np.float32))
    return layer


@pytest.mark.parametrize("engine", ["ghost", "vectorized"])
@pytest.mark.parametrize("case", sorted(HIDDEN_COUPLING))
def test_hidden_batch_coupling_and_data_written_state_are_refused_at_compile(case, engine):
    """Batch statistics below the top level (a custom layer's sub-layer, a wrapped layer)
    are found by type; a Lambda reducing over the batch axis by the probe (replacing example
    0 moves the other examples' outputs: 9x the sensitivity through the ghost engine; a
    division by the batch's largest magnitude, which the replacement rarely moves, by
    example 0 made NaN, or, when the maximum leaves NaN aside, beyond every value; behind
    integer inputs, in its first float activations); state
    written from the data in training by the probe (two batches give two values, or one
    batch with an example made NaN or moved beyond every value: a count of non-finite inputs,
    the largest outlier; a trainable weight assigned from the batch, or a custom gradient
    recording its cotangents, which only the non-trainable state after forward passes was
    compared for: an audit) is released without noise, by either engine."""
    make_layers, message = HIDDEN_COUPLING[case]
    with pytest.raises(BatchCouplingError, match=message):
        _compiled(make_layers, "flat", engine, "mse", shape=(4,), k=1)


def test_the_coupling_probe_accepts_per_example_models_and_has_no_side_effect():
    """Input-independent state (a call counter, SpectralDense's power iteration, both updated
    by a training pass), dropout (random: held in inference mode, the rest in training mode),
    a centring over the feature axis and a check refusing NaN inputs (its probes skipped)
    pass; after compile every variable holds its value from before."""
    from deel.lip.layers import SpectralDense

    tf.keras.utils.set_random_seed(7)
    model = DP_Sequential(
        [L.Input((4,)), SpectralDense(5), _CallCounter(name="counter"), L.Dropout(0.5),
         L.Lambda(lambda t: t - tf.reduce_mean(t, axis=-1, keepdims=True)),
         L.Lambda(lambda t: tf.debugging.check_numerics(t, "a NaN input")), L.Dense(1)],
        dp_parameters=_params(1.0, engine="vectorized"), dataset_metadata=_metadata((4,), 1))
    before = [v.numpy().copy() for v in model.variables]
    model.compile(loss="mse", optimizer=tf.keras.optimizers.SGD(0.1))
    for b, v in zip(before, model.variables):
        np.testing.assert_array_equal(b, v.numpy(), err_msg=v.name)
    model(tf.ones((2, 4)), training=True)  # the state a training pass does move
    assert model.get_layer("counter").calls.numpy() == 1.0
    assert any(not np.array_equal(b, v.numpy()) for b, v in zip(before, model.variables)
               if "spectral" in v.name)


@pytest.mark.parametrize("clip", [1e-7, 1e-20, 1e-40, 1e39, [1.0, 1e-9]])
def test_a_threshold_outside_what_float32_clips_soundly_is_refused(clip):
    """Squared norms are float32 in both engines: a gradient of entries below 1e-19 has a
    computed norm of 0 and passed unclipped at C = 1e-20 (10 C; 1e6 C at C = 1e-30: an
    audit, 2026-12-06), a C below float32's range became 0 (NaN clip factors on such
    records) and one above it inf (NaN on every step)."""
    with pytest.raises(ValueError, match="l2_norm_clip"):
        _params(clip, "per-layer" if isinstance(clip, list) else "flat")
    assert _params(1e-6, "flat").l2_norm_clip == 1e-6
