"""Each DP loss: Lipschitz constant w.r.t. the logits, and per-example independence."""

import numpy as np
import pytest
import tensorflow as tf

from lipdp.losses import (DP_KCosineSimilarity, DP_MeanAbsoluteError, DP_MulticlassHinge,
                          DP_MulticlassHKR, DP_MulticlassKR, DP_TauBCE,
                          DP_TauCategoricalCrossentropy)

LOSSES = [
    ("cce tau=1", lambda: DP_TauCategoricalCrossentropy(1.0), 10),
    ("cce tau=30", lambda: DP_TauCategoricalCrossentropy(30.0), 10),
    ("cce tau=0.1 two classes", lambda: DP_TauCategoricalCrossentropy(0.1), 2),
    ("cce tau=100 margin=0.2", lambda: DP_TauCategoricalCrossentropy(100.0, margin=0.2), 10),
    ("cce tau=1 margin=30", lambda: DP_TauCategoricalCrossentropy(1.0, margin=30.0), 3),
    ("bce one output", lambda: DP_TauBCE(5.0), 1),
    ("bce multilabel", lambda: DP_TauBCE(2.0), 6),
    ("hinge", lambda: DP_MulticlassHinge(1.0), 10),
    ("hinge big margin", lambda: DP_MulticlassHinge(100.0), 4),
    ("kr", lambda: DP_MulticlassKR(), 10),
    ("kr binary", lambda: DP_MulticlassKR(), 1),
    ("hkr", lambda: DP_MulticlassHKR(alpha=5.0, min_margin=100.0), 10),
    ("k-cosine K=1", lambda: DP_KCosineSimilarity(1.0), 10),
    ("k-cosine K=0.05", lambda: DP_KCosineSimilarity(0.05), 3),
    ("mae", lambda: DP_MeanAbsoluteError(), 10),
    ("mae one output", lambda: DP_MeanAbsoluteError(), 1),
]
IDS = [c[0] for c in LOSSES]


def _labels(rng, n, k):
    """Valid and malformed labels: one-hot, smoothed, multi-hot, negative, huge."""
    if k == 1:
        return np.concatenate([rng.integers(0, 2, (n - 3, 1)), [[-1.0], [7.0], [0.5]]]).astype("float32")
    one_hot = np.eye(k, dtype="float32")[rng.integers(0, k, n - 4)]
    malformed = np.stack([np.ones(k), -np.ones(k), 50 * rng.random(k), np.full(k, 1.0 / k)])
    return np.concatenate([one_hot, malformed.astype("float32")])


def _logit_gradient_norms(loss, logits, labels):
    logits = tf.constant(logits, tf.float32)
    with tf.GradientTape() as tape:
        tape.watch(logits)
        value = tf.reduce_sum(loss.call(tf.constant(labels), logits))
    # The loss is a sum of per-example terms, so row i of the gradient is example i's.
    return tf.norm(tape.gradient(value, logits), axis=-1).numpy()


@pytest.mark.parametrize("name,make,k", LOSSES, ids=IDS)
def test_logit_gradient_never_exceeds_lipschitz_constant(name, make, k):
    loss, rng = make(), np.random.default_rng(0)
    bound = loss.lipschitz(k)
    for scale in (0.01, 1.0, 10.0, 1000.0):
        labels = _labels(rng, 64, k)
        norms = _logit_gradient_norms(loss, rng.normal(scale=scale, size=(64, k)), labels)
        assert np.all(norms <= bound * (1 + 1e-5)), (name, scale, norms.max(), bound)
    # Gradient ascent on the logits, to look for the worst case.
    labels = _labels(rng, 16, k)
    logits = tf.Variable(rng.normal(size=(16, k)).astype("float32"))

    @tf.function  # traced once: 100 eager steps of nested tapes took ~1 s per loss
    def ascent_step():
        with tf.GradientTape() as outer:
            with tf.GradientTape() as inner:
                value = tf.reduce_sum(loss.call(labels, logits))
            objective = tf.reduce_sum(tf.square(inner.gradient(value, logits)))
        direction = outer.gradient(objective, logits)
        if direction is None:  # at trace time: the gradient does not depend on the logits
            return False
        logits.assign_add(0.1 * direction / (tf.norm(direction) + 1e-12))
        return True

    for _ in range(100):
        if not ascent_step():
            break
    norms = _logit_gradient_norms(loss, logits.numpy(), labels)
    assert np.all(norms <= bound * (1 + 1e-5)), (name, norms.max(), bound)


TIGHT = ("cce tau=1", "hinge", "kr", "hkr", "k-cosine K=1", "mae")


@pytest.mark.parametrize("name,make,k", [c for c in LOSSES if c[0] in TIGHT], ids=TIGHT)
def test_constant_is_attained_on_valid_labels(name, make, k):
    """The constants are tight: some valid (logit, label) pair nearly reaches L."""
    loss = make()
    logits = np.zeros((1, k), np.float32)
    # wrong and confident / every hinge active / below the cosine floor / all errors non-zero
    logits[0, 1] = {"cce": 100.0, "k-c": 0.5, "mae": 3.0}.get(name[:3], -100.0)
    if name == "mae":
        logits[0] += 0.5
    labels = np.eye(k, dtype=np.float32)[[0]]
    norm = _logit_gradient_norms(loss, logits, labels)[0]
    assert norm == pytest.approx(loss.lipschitz(k), rel=1e-2)


@pytest.mark.parametrize("name,make,k", LOSSES, ids=IDS)
def test_loss_is_per_example(name, make, k):
    """One example's loss must not depend on the rest of the batch (no batch statistics)."""
    loss, rng = make(), np.random.default_rng(1)
    logits = rng.normal(size=(8, k)).astype("float32")
    labels = _labels(rng, 8, k)
    batch = loss.call(tf.constant(labels), tf.constant(logits)).numpy()
    single = [float(loss.call(tf.constant(labels[i:i + 1]), tf.constant(logits[i:i + 1]))[0])
              for i in range(8)]
    np.testing.assert_allclose(batch, single, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name,make,k", LOSSES, ids=IDS)
def test_float64_logits_give_the_float32_losses_and_gradients_within_the_constant(name, make, k):
    """Logits given directly in float64 (a model computes in float32): the same per-example
    losses, in float64, and gradients within the loss's constant. The capped losses failed
    on a float32 cap, the tau losses on deel-lip's float32 temperature."""
    loss, rng = make(), np.random.default_rng(2)
    logits = (5 * rng.normal(size=(8, k))).astype("float64")
    labels = _labels(rng, 8, k).astype("float64")
    single = loss.call(tf.constant(labels, tf.float32), tf.constant(logits, tf.float32))
    logits64 = tf.constant(logits)
    with tf.GradientTape() as tape:
        tape.watch(logits64)
        double = loss.call(tf.constant(labels), logits64)
        value = tf.reduce_sum(double)
    assert double.dtype == tf.float64
    np.testing.assert_allclose(double.numpy(), single.numpy(), rtol=1e-5, atol=1e-5)
    norms = tf.norm(tape.gradient(value, logits64), axis=-1).numpy()
    assert np.all(norms <= loss.lipschitz(k) * (1 + 1e-5))


def test_deel_lip_multiclass_kr_is_not_per_example():
    """Why lipdp does not wrap deel-lip's MulticlassKR: it normalises by batch class counts."""
    from deel.lip.losses import MulticlassKR

    rng = np.random.default_rng(2)
    logits = rng.normal(size=(8, 3)).astype("float32")
    labels = np.eye(3, dtype="float32")[rng.integers(0, 3, 8)]
    kr = MulticlassKR(reduction=tf.keras.losses.Reduction.NONE)
    batch = kr(labels, logits).numpy()
    single = np.array([kr(labels[i:i + 1], logits[i:i + 1]).numpy()[0] for i in range(8)])
    assert not np.allclose(batch, single)


@pytest.mark.parametrize("make,arg", [(DP_TauCategoricalCrossentropy, "tau"), (DP_TauBCE, "tau"),
                                      (DP_MulticlassHinge, "min_margin"), (DP_KCosineSimilarity, "K")])
@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), 1e-39, 1e39])
def test_bad_hyper_parameters_are_echoed(make, arg, bad):
    """Also outside float32's normal range, where the step computes: a temperature of 1e-39
    (subnormal, flushed to 0 by TensorFlow's threads) gave NaN gradients on every record, a
    K-cosine floor of 1e-39 on the all-zero record only (the step that sampled it stopped)."""
    with pytest.raises(ValueError, match=arg):
        make(bad)


@pytest.mark.parametrize("bad", [-1.0, float("nan"), 1e-39, 1e39, "0.2"])
def test_a_margin_is_zero_or_positive(bad):
    """The margin's refusal says 0 is allowed (it said "a positive number", while its
    default is 0: a usability audit)."""
    with pytest.raises(ValueError, match=r"`margin`, expected 0 or a positive number"):
        DP_TauCategoricalCrossentropy(1.0, margin=bad)
    assert DP_TauCategoricalCrossentropy(1.0, margin=0).margin == 0.0
    assert DP_TauCategoricalCrossentropy(1.0, margin=np.float32(0.25)).margin == 0.25


def test_one_vs_all_losses_need_two_classes():
    with pytest.raises(ValueError, match="at least 2"):
        DP_MulticlassHinge().lipschitz(1)


def test_margin_raises_the_other_logits_before_the_softmax():
    """``CE(y, softmax(tau (z + m (1 - y)))) / tau`` against numpy, on one-hot and soft labels."""
    rng = np.random.default_rng(3)
    tau, margin = 7.0, 0.3
    logits = rng.normal(size=(6, 4)).astype("float32")
    labels = np.concatenate([np.eye(4, dtype="float32")[[0, 1, 2, 3]],
                             [[0.5, 0.5, 0, 0], [0.1, 0.2, 0.3, 0.4]]]).astype("float32")
    shifted = tau * (logits.astype(np.float64) + margin * (1.0 - labels))
    log_softmax = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    expected = -(labels * log_softmax).sum(-1) / tau
    value = DP_TauCategoricalCrossentropy(tau, margin=margin).call(labels, logits).numpy()
    np.testing.assert_allclose(value, expected, rtol=1e-5, atol=1e-6)
    # An example whose true logit leads by exactly the margin sits where an unshifted one
    # with tied logits does.
    leading = np.array([[margin, 0.0, 0.0, 0.0]], np.float32)
    tied = np.zeros((1, 4), np.float32)
    np.testing.assert_allclose(
        DP_TauCategoricalCrossentropy(tau, margin=margin).call(labels[:1], leading).numpy(),
        DP_TauCategoricalCrossentropy(tau).call(labels[:1], tied).numpy(), rtol=1e-5)


@pytest.mark.parametrize("bad", [-0.1, float("nan"), float("inf")])
def test_bad_margin_is_echoed(bad):
    with pytest.raises(ValueError, match="margin"):
        DP_TauCategoricalCrossentropy(10.0, margin=bad)


def test_margin_config_round_trip():
    loss = DP_TauCategoricalCrossentropy(30.0, margin=0.25)
    config = loss.get_config()
    assert config["margin"] == 0.25 and config["tau"] == pytest.approx(30.0)
    again = DP_TauCategoricalCrossentropy.from_config(config)
    assert again.margin == 0.25
    logits, labels = np.array([[0.1, 0.3, -0.2]], np.float32), np.eye(3, dtype=np.float32)[[1]]
    np.testing.assert_allclose(again.call(labels, logits).numpy(),
                               loss.call(labels, logits).numpy())
    assert DP_TauCategoricalCrossentropy(30.0).get_config()["margin"] == 0.0


@pytest.mark.parametrize("name,make,k", LOSSES, ids=IDS)
def test_config_round_trip(name, make, k):
    """``from_config(get_config())`` rebuilds the same loss (deel-lip's temperature losses
    return their tau as a numpy float32, which the constructors refused)."""
    loss, rng = make(), np.random.default_rng(4)
    again = type(loss).from_config(loss.get_config())
    logits, labels = rng.normal(size=(5, k)).astype("float32"), _labels(rng, 5, k)
    np.testing.assert_allclose(again.call(labels, logits).numpy(),
                               loss.call(labels, logits).numpy(), rtol=1e-6)


def test_mean_absolute_error_of_finite_targets_is_finite_in_a_batch_sum():
    """A target of 3e38 passes the records' finiteness check; its error overflowed the loss to
    inf and the private step stopped at the step that sampled it (found by an audit). Errors
    are capped at 2^100: finite losses, a finite batch sum, gradients within 1 / sqrt(K)."""
    loss = DP_MeanAbsoluteError()
    y_true = tf.constant([[3.0e38, -3.0e38], [1.0, 2.0]] * 64)
    y_pred = tf.Variable(tf.zeros([128, 2]))
    with tf.GradientTape() as tape:
        values = loss.call(y_true, y_pred)
        total = tf.reduce_sum(values)
    gradient = tape.gradient(total, y_pred)
    assert np.isfinite(float(total))
    np.testing.assert_allclose(values.numpy()[:2], [2.0 ** 100, 1.5], rtol=1e-6)
    norms = np.linalg.norm(gradient.numpy(), axis=1)
    assert np.all(norms <= loss.lipschitz(2) * (1 + 1e-6))


@pytest.mark.parametrize("tau, margin", [(1.0, 0.0), (10.0, 0.0), (100.0, 0.5), (1e-9, 0.0),
                                        (1e-30, 1.0)])
def test_tau_cross_entropy_of_overflowing_logits_is_finite_and_within_its_constant(tau, margin):
    """Finite logits whose product with tau overflows float32 (about 3.4e38 / tau and up): the
    softmax gave NaN, and the private step stopped at the example that produced them. The
    logits are capped at 2^100 / tau: finite losses and a finite batch sum, each example's
    gradient within sqrt(2); ordinary logits keep their exact value."""
    loss = DP_TauCategoricalCrossentropy(tau, margin=margin)
    rows = [[1e38, -1e38, 0.0, 0.0], [3.4e38] * 4, [-3.4e38, 0.0, 0.0, 3.4e38],
            [0.5, -1.0, 2.0, 0.0]]
    y_pred = tf.Variable(np.array(rows * 32, np.float32))
    y_true = tf.constant(np.eye(4, dtype=np.float32)[np.arange(128) % 4])
    with tf.GradientTape() as tape:
        values = loss.call(y_true, y_pred)
        total = tf.reduce_sum(values)
    gradient = tape.gradient(total, y_pred).numpy()
    assert np.isfinite(float(total)) and np.all(np.isfinite(gradient))
    assert np.all(np.linalg.norm(gradient, axis=1) <= loss.lipschitz(4) * (1 + 1e-6))
    ordinary = np.array([rows[3]], np.float32)
    shifted = tau * (ordinary + margin * (1.0 - np.eye(4, dtype=np.float32)[[3]]))
    expected = (np.log(np.sum(np.exp(shifted.astype(np.float64)))) - shifted[0, 3]) / tau
    np.testing.assert_allclose(loss.call(np.eye(4, dtype=np.float32)[[3]], ordinary).numpy(),
                               [expected], rtol=1e-5)


@pytest.mark.parametrize("name,make,k", LOSSES, ids=IDS)
def test_overflowing_logits_give_finite_losses_and_gradients_within_the_constant(name, make, k):
    """Finite float32 logits up to 3.4e38 (the model's outputs, whatever its weights): every
    loss value, a 128-example batch's sum and each example's gradient are finite, and the
    gradients stay within the constant (logits beyond 2^100, or 2^100 / tau, are clipped:
    a linear loss overflowed to inf, tau times a logit to inf and the softmax to NaN, and the
    private step stopped at the example that produced them)."""
    loss, rng = make(), np.random.default_rng(5)
    huge = np.array([3.4e38, -3.4e38, 1e38, -1e38, 1e30, 0.0], np.float32)
    logits = tf.Variable(rng.choice(huge, size=(128, k)).astype(np.float32))
    labels = tf.constant(_labels(rng, 128, k))
    with tf.GradientTape() as tape:
        values = loss.call(labels, logits)
        total = tf.reduce_sum(values)
    gradient = tape.gradient(total, logits).numpy()
    assert np.all(np.isfinite(values.numpy())) and np.isfinite(float(total)), name
    assert np.all(np.isfinite(gradient)), name
    norms = np.linalg.norm(gradient, axis=1)
    assert np.all(norms <= loss.lipschitz(k) * (1 + 1e-5)), (name, norms.max())


def test_k_cosine_refuses_a_floor_below_which_underflow_breaks_its_constant():
    """The norm of logits near 1e-19 loses their squares to float32's flush: at K = 1.2e-19
    (an audit, 2026-12-06) the gradient reached 10 times 1/K. At the least K allowed the
    same logits keep it within 1/K; a smaller K is refused, set later too."""
    n = 1000
    logits = tf.constant(np.r_[2e-19, np.full(n - 1, 1.05e-19)][None], tf.float32)
    labels = tf.one_hot([0], n)

    def gradient_over_constant(loss):
        with tf.GradientTape() as tape:
            tape.watch(logits)
            value = loss.call(labels, logits)
        return float(tf.norm(tape.gradient(value, logits))) * loss.K

    assert gradient_over_constant(DP_KCosineSimilarity(DP_KCosineSimilarity.MIN_K)) <= 1 + 1e-6
    past_the_check = DP_KCosineSimilarity(1.0)
    past_the_check.K = 1.2e-19
    assert gradient_over_constant(past_the_check) > 2  # what the floor prevents
    with pytest.raises(ValueError, match="below 1e-06"):
        DP_KCosineSimilarity(1e-7)
    with pytest.raises(ValueError, match="below 1e-06"):
        past_the_check.lipschitz(n)
