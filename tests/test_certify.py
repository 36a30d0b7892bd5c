"""Tests of lipdp.certify: radius formula, soundness against attacks, accuracy.

Soundness is tested against an independent adversary: for each input, random
perturbations and a projected-gradient attack on the runner-up margin, both
restricted to the L2 ball of radius 0.99 * r(x), must never change the
predicted class. The 1% slack covers float32 rounding of the logits (relative
~1e-6), far below it. The attack is checked to be strong: with a budget of
2 r(x) it must flip most decisions, and inside 0.99 r(x) it must consume a
large part of the margin, so a loose or wrong radius would be caught.
"""

import math

import numpy as np
import pytest
import tensorflow as tf

from lipdp import certify
from lipdp.bounds import lipschitz_bound
from lipdp.layers import (DP_BoundedInput, DP_Flatten, DP_GroupSort, DP_QuickSpectralConv2D,
                          DP_QuickSpectralDense, DP_ReLU, DP_ScaledL2NormPooling2D,
                          make_residuals)
from lipdp.metadata import DatasetMetadata, DPParameters
from lipdp.model import DP_Sequential

DIM, NB_CLASSES, X0 = 8, 3, 2.0


def make_model(nb_outputs=NB_CLASSES, seed=0):
    tf.keras.utils.set_random_seed(seed)
    metadata = DatasetMetadata(input_shape=(DIM,), nb_classes=nb_outputs, nb_samples_train=100,
                               nb_samples_test=10, batch_size=10, max_norm=X0)
    model = DP_Sequential(
        layers=[
            DP_BoundedInput(input_shape=(DIM,), upper_bound=X0),
            DP_Flatten(),
            DP_QuickSpectralDense(16, use_bias=True),
            DP_GroupSort(2),
            DP_QuickSpectralDense(nb_outputs, use_bias=True),
        ],
        dp_parameters=DPParameters(noise_multiplier=1.0, delta=1e-5),
        dataset_metadata=metadata,
    )
    # Non-zero biases, so that the certificate covers affine layers too.
    for layer in model.layers:
        if getattr(layer, "use_bias", False):
            layer.bias.assign(tf.random.normal(layer.bias.shape, stddev=0.3, seed=seed))
    return model


def sample_inputs(n, seed=1):
    """Inputs of norm in [0.2, 3]: inside the clipping ball, on it and outside it."""
    rng = np.random.RandomState(seed)
    x = rng.normal(size=(n, DIM))
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    return (x * rng.uniform(0.2, 3.0, size=(n, 1))).astype(np.float32)


def predict(model, x):
    return np.argmax(model(x, training=False).numpy(), axis=1)


@pytest.fixture(scope="module")
def model():
    return make_model()


def test_radius_formula_matches_hand_computation(model):
    x = sample_inputs(50)
    radii = certify.certified_radii(model, x, batch_size=7)  # several batches
    logits = model(x, training=False).numpy().astype(np.float64)
    lip = float(lipschitz_bound(model))
    assert 0.99 < lip < 1.01  # spectrally normalised layers, 1-Lipschitz activations
    rounding = 2.0 * math.sqrt(2.0) * certify.float_error_bound(model)
    expected = []
    for row in logits:
        top, second = sorted(row)[-1], sorted(row)[-2]
        expected.append(max(top - second - rounding, 0.0) / (math.sqrt(2.0) * lip))
    # The reference logits come from one batch of 50, the radii from batches of
    # 7: float32 matmuls of different shapes round differently (relative ~1e-7
    # on the logits, amplified by the subtraction), hence atol 1e-6.
    np.testing.assert_allclose(radii, expected, rtol=1e-5, atol=1e-6)
    assert radii.shape == (50,) and np.all(radii >= 0)


def test_radius_of_a_tie_is_zero_and_binary_formula():
    np.testing.assert_array_equal(certify.margins(np.array([[1.0, 1.0, 0.0]])), [0.0])
    binary = make_model(nb_outputs=1)
    x = sample_inputs(20)
    lip = float(lipschitz_bound(binary))
    logit = binary(x, training=False).numpy()[:, 0].astype(np.float64)
    rounding = 2.0 * certify.float_error_bound(binary)
    np.testing.assert_allclose(certify.certified_radii(binary, x),
                               np.maximum(np.abs(logit) - rounding, 0.0) / lip, rtol=1e-12)


def _norms(t):
    """Per-example L2 norms, shaped to broadcast against `t` (inputs of any rank)."""
    return tf.sqrt(tf.reduce_sum(tf.square(t), axis=list(range(1, t.shape.rank)), keepdims=True))


def _project(delta, eps):
    return delta * tf.minimum(1.0, eps / tf.maximum(_norms(delta), 1e-12))


def pgd_attack(model, x, labels, eps, steps=300, seed=0):
    """L2 PGD on ``max_{j != k} f_j - f_k`` (per-example step eps/20 decayed to eps/200).

    Returns the perturbations (each of norm <= eps) that reached the largest
    objective along the way.
    """
    x = tf.constant(x)
    eps = tf.constant(eps.reshape((-1,) + (1,) * (x.shape.rank - 1)), tf.float32)
    mask = tf.one_hot(labels, int(model.output_shape[-1]))
    rng = tf.random.Generator.from_seed(seed)
    delta = tf.Variable(_project(rng.normal(x.shape) * eps, eps))
    best_delta = tf.Variable(delta)
    best_obj = tf.Variable(tf.fill([x.shape[0]], -np.inf))

    def objective(d):
        logits = model(x + d, training=False)
        runner_up = tf.reduce_max(logits - 1e9 * mask, axis=1)
        return runner_up - tf.reduce_sum(logits * mask, axis=1)

    def keep_best(obj):
        better = obj > best_obj
        best_obj.assign(tf.where(better, obj, best_obj))
        best_delta.assign(tf.where(tf.reshape(better, eps.shape), delta, best_delta))

    @tf.function  # one trace per attack; eager steps would dominate the test time
    def step(size):
        with tf.GradientTape() as tape:
            tape.watch(delta)
            obj = objective(delta)
        keep_best(obj)
        grad = tape.gradient(obj, delta)
        delta.assign(_project(delta + size * eps * grad / tf.maximum(_norms(grad), 1e-12), eps))

    for t in range(steps):
        step(tf.constant(0.1 ** (t / steps) / 20.0, tf.float32))
    keep_best(objective(delta))
    return best_delta.numpy()


def attack_certificates(model, x):
    """Random and PGD attacks inside 0.99 r(x), which must never change a prediction, and
    the attacks' strength: returns (mean fraction of the margin left by PGD inside 0.99 r,
    fraction of decisions PGD flips with a budget of 2 r)."""
    labels = predict(model, x)
    radii = certify.certified_radii(model, x)
    assert np.all(radii > 0)
    eps = (0.99 * radii).astype(np.float32)
    shape = (-1,) + (1,) * (x.ndim - 1)

    # Random directions, on the sphere of radius eps.
    rng = np.random.RandomState(3)
    for _ in range(20):
        u = rng.normal(size=x.shape)
        u /= np.linalg.norm(u.reshape(len(x), -1), axis=1).reshape(shape)
        np.testing.assert_array_equal(
            predict(model, x + (u * eps.reshape(shape)).astype(np.float32)), labels,
            err_msg="a random perturbation inside 0.99 r(x) changed a prediction")

    # Gradient attack inside the certified ball: never succeeds ...
    delta = pgd_attack(model, x, labels, eps)
    assert np.all(np.linalg.norm(delta.reshape(len(x), -1), axis=1) <= eps * (1 + 1e-5))
    np.testing.assert_array_equal(predict(model, x + delta), labels,
                                  err_msg="PGD inside 0.99 r(x) changed a prediction")
    margin_before = certify.margins(model(x, training=False).numpy())
    margin_after = certify.margins(model(x + delta, training=False).numpy())
    delta_big = pgd_attack(model, x, labels, (2.0 * radii).astype(np.float32))
    return (float(np.mean(margin_after / margin_before)),
            float(np.mean(predict(model, x + delta_big) != labels)))


def test_soundness_random_and_gradient_attacks(model):
    margin_left, flipped_at_2r = attack_certificates(model, sample_inputs(64, seed=2))
    # The attack is strong: it eats most of the margin on average (a sound but loose
    # radius would leave it untouched) ...
    assert margin_left < 0.6
    # ... and with a budget of 2 r(x) it flips most decisions (measured: > 90% for two
    # seeds), so the certified radius is within a factor 2 of tight.
    assert flipped_at_2r > 0.5


IMAGE = (8, 8, 1)


def _conv_model(kind, natural):
    """A conv model ("conv") or a conv model with a residual section ("residual"), 3 classes.

    natural: random (projected) weights; their certificate is loose (the product of the
    layers' norms; a Lipschitz lower bound reaches 0.53 (conv) and 0.28 (residual) of it),
    so only soundness and a weak strength can be asserted. Otherwise every convolution's kernel is a single centre tap (a scaled
    identity, whose certified operator norm is exact) followed by ReLU on positive inputs,
    so the certificate is attained (logits ~ W (1 + c) c x in the active region, W with
    orthonormal rows): a radius 1.4x too large is then found by the attack.
    """
    tf.keras.utils.set_random_seed(5)
    bound = 2.0 if natural else 8.0
    metadata = DatasetMetadata(input_shape=IMAGE, nb_classes=NB_CLASSES, nb_samples_train=100,
                               nb_samples_test=10, batch_size=10, max_norm=bound)
    filters, activation = (4, lambda: DP_GroupSort(2)) if natural else (1, DP_ReLU)
    convs = [DP_QuickSpectralConv2D(filters, 3, use_bias=natural) for _ in range(2)]
    layers = [DP_BoundedInput(input_shape=IMAGE, upper_bound=bound), convs[0], activation()]
    if kind == "residual":
        layers += make_residuals([convs[1], activation()], "add")
    if natural:
        layers.append(DP_ScaledL2NormPooling2D(2))
    layers += [DP_Flatten(), DP_QuickSpectralDense(NB_CLASSES)]
    model = DP_Sequential(layers, dp_parameters=DPParameters(noise_multiplier=1.0, delta=1e-5),
                          dataset_metadata=metadata)
    for layer in model.layers:
        if getattr(layer, "use_bias", False):
            layer.bias.assign(tf.random.normal(layer.bias.shape, stddev=0.3, seed=5))
    if not natural:
        centre = np.zeros((3, 3, 1, 1), np.float32)
        centre[1, 1] = 1.0
        for conv in convs:
            if conv.built:
                conv.kernel.assign(centre)
    return model


def _images(n, natural, seed=7):
    """natural: Gaussian images of norms in [0.2, 3] (inside, on and beyond the bound 2);
    otherwise positive images (pixels in [0.5, 1], norms <= 8), where ReLU is active."""
    rng = np.random.RandomState(seed)
    if not natural:
        return rng.uniform(0.5, 1.0, size=(n,) + IMAGE).astype(np.float32)
    x = rng.normal(size=(n,) + IMAGE)
    x /= np.linalg.norm(x.reshape(n, -1), axis=1).reshape(-1, 1, 1, 1)
    return (x * rng.uniform(0.2, 3.0, size=(n, 1, 1, 1))).astype(np.float32)


@pytest.mark.parametrize("natural", [False, True], ids=["attained", "natural"])
@pytest.mark.parametrize("kind", ["conv", "residual"])
def test_soundness_of_conv_and_residual_certificates(kind, natural):
    """The attacks of `attack_certificates` on conv and residual models. Where the
    certificate is attained by construction, the attack must eat >= 90% of the margin
    inside 0.99 r (measured 99%) and flip >= 90% of the decisions with 2 r (measured
    100%; at 1.3 r still >= 98%), so radii 1.4x too large would be caught. With natural
    weights (certificate loose, 2 r flips nothing) it must still eat >= 10% of the margin
    (measured 36% conv, 19% residual)."""
    model = _conv_model(kind, natural)
    margin_left, flipped_at_2r = attack_certificates(model, _images(64, natural))
    if natural:
        assert margin_left < 0.9
    else:
        assert margin_left < 0.1 and flipped_at_2r > 0.9


def test_certified_accuracy_radius_zero_is_accuracy(model):
    x = sample_inputs(200, seed=4)
    rng = np.random.RandomState(5)
    labels = np.where(rng.uniform(size=200) < 0.7, predict(model, x),
                      rng.randint(0, NB_CLASSES, size=200))
    y = np.eye(NB_CLASSES, dtype=np.float32)[labels]
    acc = float(np.mean(predict(model, x) == labels))
    radii = [0.0, 0.01, 0.05, 0.1, 10.0]
    result = certify.certified_accuracy(model, (x, y), radii, batch_size=33)
    assert list(result) == radii
    assert result[0.0] == pytest.approx(acc, abs=1e-12)
    values = list(result.values())
    assert all(a >= b for a, b in zip(values, values[1:]))  # non-increasing in r
    assert result[10.0] == 0.0
    # Same numbers from a batched tf.data pipeline and from integer labels.
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(64)
    assert certify.certified_accuracy(model, ds, radii) == result
    assert certify.certified_accuracy(model, (x, labels), radii) == result
    # Independent computation of the r > 0 entries (strict inequality).
    r = certify.certified_radii(model, x)
    correct = predict(model, x) == labels
    for radius in radii[1:]:
        assert result[radius] == pytest.approx(np.mean(correct & (r > radius)), abs=1e-12)


@pytest.mark.parametrize("labels", ["one-hot of K + 2 columns", "indices 1..K", "negative",
                                    "fractional", "rank 3"])
def test_labels_that_are_not_the_models_classes_are_refused(model, labels):
    """Scored silently before: one-hot rows of K + 2 columns, or class indices numbered 1..K,
    gave an accuracy against the wrong classes (an audit)."""
    x = sample_inputs(20, seed=8)
    indices = predict(model, x)
    y = {"one-hot of K + 2 columns": np.eye(NB_CLASSES + 2, dtype=np.float32)[indices],
         "indices 1..K": indices + 1, "negative": np.where(np.arange(20) == 7, -1, indices),
         "fractional": indices + 0.5,
         "rank 3": np.eye(NB_CLASSES, dtype=np.float32)[indices][:, :, None]}[labels]
    with pytest.raises(ValueError, match="labels|Labels"):
        certify.certified_accuracy(model, (x, y), [0.0, 0.1])
    assert certify.certified_accuracy(model, (x, indices), [0.0]) == {0.0: 1.0}


def test_clean_accuracy_of_a_model_without_certificate():
    """Radius 0 alone is clean accuracy: any Keras classifier (no Lipschitz constant needed);
    a positive radius still needs a DP model."""
    from lipdp.bounds import NonDPLayerError

    tf.keras.utils.set_random_seed(21)
    plain = tf.keras.Sequential([tf.keras.layers.Input((DIM,)), tf.keras.layers.Dense(NB_CLASSES)])
    x = sample_inputs(60, seed=22)
    labels = np.random.RandomState(23).randint(0, NB_CLASSES, size=60)
    expected = float(np.mean(np.argmax(plain(x).numpy(), axis=1) == labels))
    assert certify.certified_accuracy(plain, (x, labels), [0.0]) == {0.0: expected}
    # named for what a certificate needs, not only the noise (a usability audit, 2026-12-07)
    with pytest.raises(NonDPLayerError, match="nor for its Lipschitz constant"):
        certify.certified_accuracy(plain, (x, labels), [0.0, 0.1])


def test_certified_accuracy_strict_at_the_radius(model):
    x = sample_inputs(1, seed=6)
    labels = predict(model, x)
    r = float(certify.certified_radii(model, x)[0])
    res = certify.certified_accuracy(model, (x, labels), [0.0, r, np.nextafter(r, 0)])
    assert res == {0.0: 1.0, r: 0.0, float(np.nextafter(r, 0)): 1.0}


@pytest.mark.parametrize("bad", [[-0.1], [float("nan")], ["0.5"], [True]])
def test_certified_accuracy_rejects_bad_radii(model, bad):
    x = sample_inputs(3)
    with pytest.raises(ValueError, match="radii"):
        certify.certified_accuracy(model, (x, predict(model, x)), bad)


# --------------------------------------------------------------------------- #
# certified_radius, the CertifiableAccuracy metric, certified AUROC.
# --------------------------------------------------------------------------- #
def test_certified_radius_is_certified_radii(model):
    assert certify.certified_radius is certify.certified_radii
    x = sample_inputs(5)
    np.testing.assert_array_equal(certify.certified_radius(model, x),
                                  certify.certified_radii(model, x))


def _labelled(model, n, seed):
    """Inputs and one-hot labels, 70% of them the model's prediction (so that some examples
    are certified correct at each radius and some are wrong)."""
    x = sample_inputs(n, seed=seed)
    rng = np.random.RandomState(seed + 1)
    labels = np.where(rng.uniform(size=n) < 0.7, predict(model, x),
                      rng.randint(0, NB_CLASSES, size=n))
    return x, labels


RADII = [0.0, 0.02, 0.1, 0.3]


def test_certifiable_accuracy_metric_equals_certified_accuracy():
    """In `evaluate` the metric is certified_accuracy on the same data: same numbers for
    one-hot and integer labels (Keras hands integer labels to metrics as (n, 1)) and for
    several batch sizes. A float32 logit could round differently in another batch shape;
    the counts here are integers out of 90 and come out equal."""
    from lipdp.losses import DP_TauCategoricalCrossentropy

    model = make_model(seed=3)
    metrics = [certify.CertifiableAccuracy(r, model) for r in RADII]
    model.compile(tf.keras.optimizers.SGD(0.01), DP_TauCategoricalCrossentropy(8.0),
                  metrics=metrics)
    x, labels = _labelled(model, 90, seed=8)
    one_hot = np.eye(NB_CLASSES, dtype=np.float32)[labels]
    expected = certify.certified_accuracy(model, (x, labels), RADII)
    assert len(set(expected.values())) == len(RADII)  # the radii tell examples apart
    for y, batch_size in [(one_hot, 90), (one_hot, 16), (labels, 32)]:
        result = model.evaluate(x, y, batch_size=batch_size, verbose=0, return_dict=True)
        for r, metric in zip(RADII, metrics):
            assert result[metric.name] == pytest.approx(expected[r], abs=1e-6), (r, batch_size)


@pytest.mark.filterwarnings("ignore:fit received arrays")  # Poisson metadata, array inputs
def test_certifiable_accuracy_in_fit_follows_the_current_weights():
    """During `fit` the validation value is computed at the weights of the epoch's end:
    it equals certified_accuracy of the trained model, which has moved from the start."""
    from lipdp.losses import DP_TauCategoricalCrossentropy

    model = make_model(seed=4)
    metric = certify.CertifiableAccuracy(0.05, model)
    model.compile(tf.keras.optimizers.SGD(0.5), DP_TauCategoricalCrossentropy(8.0),
                  metrics=[metric])
    x, labels = _labelled(model, 100, seed=9)
    x_val, labels_val = _labelled(model, 40, seed=10)
    before = certify.certified_accuracy(model, (x_val, labels_val), [0.05])[0.05]
    history = model.fit(x, labels, epochs=1, verbose=0,
                        validation_data=(x_val, labels_val)).history
    after = certify.certified_accuracy(model, (x_val, labels_val), [0.05])[0.05]
    assert history[f"val_{metric.name}"][-1] == pytest.approx(after, abs=1e-6)
    assert after != before
    assert 0.0 <= history[metric.name][-1] <= 1.0


def test_certifiable_accuracy_binding_config_and_errors(model):
    metric = certify.CertifiableAccuracy(0.1)
    assert metric.name == "certifiable_accuracy_0.1" and metric.bound_model is None
    x = sample_inputs(4)
    with pytest.raises(RuntimeError, match="not bound"):
        metric.update_state(predict(model, x), model(x))
    metric.bind(model).update_state(predict(model, x), model(x))  # eager use, bound
    assert metric.result().numpy() == pytest.approx(
        certify.certified_accuracy(model, (x, predict(model, x)), [0.1])[0.1], abs=1e-6)
    assert not metric.variables or all(v.shape == () for v in metric.variables)  # no weights
    config = metric.get_config()
    assert config["radius"] == 0.1 and config["name"] == "certifiable_accuracy_0.1"
    restored = tf.keras.metrics.deserialize(tf.keras.metrics.serialize(metric))
    assert isinstance(restored, certify.CertifiableAccuracy) and restored.radius == 0.1
    assert restored.bound_model is None
    for bad in (-1.0, float("inf"), [0.1, 0.2]):
        with pytest.raises(ValueError, match="radius"):
            certify.CertifiableAccuracy(bad)
    with pytest.raises(TypeError, match="model"):
        metric.bind("model")


def _binary_data(model, n, seed):
    x = sample_inputs(n, seed=seed)
    rng = np.random.RandomState(seed)
    logits = model(x, training=False).numpy()
    score = logits[:, 0] if logits.shape[1] == 1 else logits[:, 1] - logits[:, 0]
    # Labels correlated with the score (AUROC well above 1/2) but not equal to its sign.
    labels = (score + rng.normal(scale=np.std(score), size=n) > 0).astype(np.int64)
    return x, labels


@pytest.mark.parametrize("nb_outputs", [1, 2])
def test_certified_auroc_matches_scikit_learn(nb_outputs):
    """certified_auroc against scikit-learn's roc_auc_score of worst-case scores computed
    here from the logits, Lip and E: ``s -+ (l r + c E)`` with ``(l, c) = (Lip, 2)`` for one
    output and ``(sqrt 2 Lip, 2 sqrt 2)`` for two, no shift at r = 0."""
    from sklearn.metrics import roc_auc_score

    model = make_model(nb_outputs=nb_outputs, seed=6)
    x, labels = _binary_data(model, 120, seed=11)
    y = labels if nb_outputs == 1 else np.eye(2, dtype=np.float32)[labels]
    result = certify.certified_auroc(model, (x, y), RADII, batch_size=50)
    logits = model(x, training=False).numpy().astype(np.float64)
    score = logits[:, 0] if nb_outputs == 1 else logits[:, 1] - logits[:, 0]
    lip, error = float(lipschitz_bound(model)), certify.float_error_bound(model)
    factor = 1.0 if nb_outputs == 1 else math.sqrt(2.0)
    values = []
    for r in RADII:
        shift = factor * (lip * r + 2.0 * error) if r > 0 else 0.0
        expected = roc_auc_score(labels, score - np.where(labels == 1, shift, -shift))
        assert result[r] == pytest.approx(expected, abs=1e-12), r
        values.append(result[r])
    assert all(a > b for a, b in zip(values, values[1:]))  # strictly decreasing here
    assert values[0] > 0.7
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(32)
    assert certify.certified_auroc(model, ds, RADII) == result


def test_a_one_output_model_reads_one_hot_labels_by_their_class():
    """One-hot rows (n, 2) were read by their first column, class 0's: every label flipped,
    and labels opposite to every decision scored as certified correct (an audit,
    2026-12-07). Targets (n,) and one-hot rows now give the same result, as in
    binary_scores; rows of another width are refused."""
    model = make_model(nb_outputs=1, seed=6)
    x = sample_inputs(80, seed=14)
    decision = (model(x, training=False).numpy()[:, 0] > 0).astype(np.int64)
    for labels, expected in ((decision, 1.0), (1 - decision, 0.0)):
        as_targets = certify.certified_accuracy(model, (x, labels), [0.0, 0.05])
        one_hot = np.eye(2, dtype=np.float32)[labels]
        assert certify.certified_accuracy(model, (x, one_hot), [0.0, 0.05]) == as_targets
        assert as_targets[0.0] == expected
    with pytest.raises(ValueError, match=r"Labels of shape \(80, 3\) for a one-output model"):
        certify.certified_accuracy(model, (x, np.eye(3, dtype=np.float32)[decision]), [0.0])


def test_certified_auroc_is_attained_on_a_linear_model():
    """A single spectrally normalised dense output: the attack moving each positive by
    ``-r w / ||w||`` and each negative by ``+r w / ||w||`` (inputs kept inside the clipping
    ball) reaches the worst-case scores, so the attacked AUROC is >= the certified one and
    within 1% of it."""
    tf.keras.utils.set_random_seed(12)
    metadata = DatasetMetadata(input_shape=(DIM,), nb_classes=1, nb_samples_train=100,
                               nb_samples_test=10, batch_size=10, max_norm=X0)
    model = DP_Sequential([DP_BoundedInput(input_shape=(DIM,), upper_bound=X0),
                           DP_QuickSpectralDense(1, use_bias=True)],
                          dp_parameters=DPParameters(1.0, 1e-5), dataset_metadata=metadata)
    model.layers[-1].bias.assign([0.1])
    rng = np.random.RandomState(13)
    x = rng.normal(size=(200, DIM))
    x = (x / np.linalg.norm(x, axis=1, keepdims=True) * rng.uniform(0.1, 1.2, (200, 1)))
    x = x.astype(np.float32)  # norms <= 1.2, so x +- 0.3 w/||w|| stays inside X0 = 2
    score = model(x, training=False).numpy()[:, 0]
    labels = (score + rng.normal(scale=0.3, size=200) > 0).astype(np.int64)
    w = model.layers[-1].kernel.numpy()[:, 0]
    from lipdp.evaluation import roc_auc

    for r in (0.1, 0.3):
        certified = certify.certified_auroc(model, (x, labels), [r])[r]
        direction = np.where(labels == 1, -1.0, 1.0)[:, None] * w / np.linalg.norm(w)
        attacked_x = (x + r * direction).astype(np.float32)
        attacked = roc_auc(model(attacked_x, training=False).numpy()[:, 0], labels)
        assert certified <= attacked <= certified + 0.01, (r, certified, attacked)
        assert attacked < roc_auc(score, labels) - 0.05  # the attack does bite


def test_certified_auroc_refuses_multiclass_models(model):
    x = sample_inputs(4)
    with pytest.raises(ValueError, match="binary"):
        certify.certified_auroc(model, (x, np.array([0, 1, 0, 1])), [0.1])


def test_certifiable_accuracy_after_load_model(tmp_path):
    """A DP model's compile binds the metrics given without a model, so the metric works
    when written as ``CertifiableAccuracy(r)`` in compile and after `load_model` (which
    re-compiles from the saved config), with the value before saving."""
    from lipdp.losses import DP_TauCategoricalCrossentropy

    model = make_model(seed=7)
    metric = certify.CertifiableAccuracy(0.05)
    model.compile(tf.keras.optimizers.SGD(0.01), DP_TauCategoricalCrossentropy(8.0),
                  metrics=[metric])
    assert metric.bound_model is model
    x, labels = _labelled(model, 30, seed=14)
    before = model.evaluate(x, labels, verbose=0, return_dict=True)["certifiable_accuracy_0.05"]
    assert before == pytest.approx(
        certify.certified_accuracy(model, (x, labels), [0.05])[0.05], abs=1e-6)
    model.save(str(tmp_path / "model.keras"))
    loaded = tf.keras.models.load_model(str(tmp_path / "model.keras"))
    after = loaded.evaluate(x, labels, verbose=0, return_dict=True)["certifiable_accuracy_0.05"]
    assert after == pytest.approx(before, abs=1e-6)
    restored = [m for m in tf.nest.flatten(loaded.compiled_metrics._user_metrics)
                if isinstance(m, certify.CertifiableAccuracy)]
    assert [m.bound_model for m in restored] == [loaded]


@pytest.mark.parametrize("nb_outputs", [1, 2, 3])
def test_a_diverged_model_s_statistics_are_refused(nb_outputs):
    """A model with a NaN weight (diverged) printed accuracy 1/K (a NaN row's arg-max is class
    0) and a test AUROC of 1.0 or 0.0 by the rows' order (each NaN score took a rank of its
    own): an audit, 2026-12-07. scikit-learn refuses NaN scores too."""
    from lipdp.evaluation import binary_scores, roc_auc

    model = make_model(nb_outputs=nb_outputs)
    bias = model.layers[-1].bias
    bias.assign(tf.fill(bias.shape, float("nan")))
    x = sample_inputs(12)
    y = np.arange(12) % max(nb_outputs, 2)
    with pytest.raises(ValueError, match=r"outputs hold NaN for 12 of 12 inputs"):
        certify.certified_accuracy(model, (x, y), [0.0])
    with pytest.raises(ValueError, match=r"outputs hold NaN"):
        certify.certified_radii(model, x)
    if nb_outputs <= 2:
        scores, labels = binary_scores(model, (x, y))
        with pytest.raises(ValueError, match=r"12 of 12 scores are NaN"):
            roc_auc(scores, labels)
        with pytest.raises(ValueError, match=r"scores are NaN"):
            certify.certified_auroc(model, (x, y), [0.0])
    labels = np.r_[np.zeros(5), np.ones(5)]
    for order in (labels, labels[::-1]):  # 1.0 and 0.0 before
        with pytest.raises(ValueError, match=r"10 of 10 scores are NaN"):
            roc_auc(np.full(10, np.nan), order)
