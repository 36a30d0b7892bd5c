"""lipdp.audit: membership-inference statistics and the one-run canary audit.

Independent references: scikit-learn's ``roc_curve`` / ``roc_auc_score`` for the attack
statistics, scipy's Mann-Whitney test for the chance interval, scipy's binomial distribution
(and the brute-force loop of Steinke et al.'s appendix D) for the one-run p-value, a closed form
and a root found by scipy's ``brentq`` for the epsilon lower bound, the loss formula written out
for the loss scores. The model-level tests train small lipdp models (seeded, Poisson sampling
for the audited runs, so the accountant's epsilon is a proof) and check the issue's claims: a
model trained without noise gives a lower bound far above a noisy one's, no lower bound exceeds
the accountant's epsilon, and a train step that adds less noise than it accounts is caught.
"""

import functools
import math

import warnings

import numpy as np
import pytest
import scipy.stats
import tensorflow as tf
from scipy.optimize import brentq
from sklearn.metrics import roc_auc_score, roc_curve

import lipdp
from lipdp import audit
from lipdp.accounting import compute_epsilon
from lipdp.layers import DP_BoundedInput, DP_GroupSort, DP_QuickSpectralDense
from lipdp.losses import DP_TauCategoricalCrossentropy


# --------------------------------------------------------------------------- #
# The one-run bound: pure math against independent computations.
# --------------------------------------------------------------------------- #
def _accuracy(eps):
    return 1.0 / (1.0 + math.exp(-eps))


def _reference_p_value(m, r, v, eps, delta):
    """Steinke, Nasr & Jagielski 2023, appendix D's ``p_value_DP_audit``, with scipy."""
    q = _accuracy(eps)
    beta = scipy.stats.binom.sf(v - 1, r, q)
    alpha, total = 0.0, 0.0
    for i in range(1, v + 1):
        total += scipy.stats.binom.pmf(v - i, r, q)
        if total > i * alpha:
            alpha = total / i
    return min(beta + alpha * delta * 2 * m, 1.0)


CASES = [(1, 1, 10), (7, 10, 10), (58, 80, 200), (80, 80, 200), (150, 200, 1000),
         (0, 5, 5), (400, 500, 1000)]


@pytest.mark.parametrize("v,r,m", CASES)
@pytest.mark.parametrize("eps", [0.0, 0.3, 1.0, 2.5, 6.0])
def test_p_value_is_the_binomial_tail_of_scipy(v, r, m, eps):
    """delta = 0: P[Binomial(r, e^eps / (1 + e^eps)) >= v]. Relative 1e-9: both sides sum
    float64 probabilities whose logs are exact to ~1e-15 per term."""
    expected = scipy.stats.binom.sf(v - 1, r, _accuracy(eps))
    assert audit.one_run_p_value(v, r, m, eps) == pytest.approx(expected, rel=1e-9, abs=1e-300)


@pytest.mark.parametrize("v,r,m", CASES)
@pytest.mark.parametrize("eps", [0.0, 1.0, 4.0])
@pytest.mark.parametrize("two_m_delta", [2e-3, 0.5])
def test_p_value_with_delta_matches_the_papers_code(v, r, m, eps, two_m_delta):
    delta = two_m_delta / (2 * m)
    expected = _reference_p_value(m, r, v, eps, delta)
    assert audit.one_run_p_value(v, r, m, eps, delta) == pytest.approx(expected, rel=1e-9,
                                                                       abs=1e-300)


def test_log_binomial_coefficients_are_math_comb():
    assert audit._log_binomial_coefficients(700) == tuple(
        math.log(math.comb(700, k)) for k in range(701))


@pytest.mark.parametrize("r", [1, 10, 80, 1000])
@pytest.mark.parametrize("confidence", [0.9, 0.95, 0.99])
def test_lower_bound_closed_form_when_every_guess_is_right(r, confidence):
    """v = r, delta = 0: p = q^r < 1 - c  <=>  eps < -log((1 - c)^(-1/r) - 1)."""
    expected = -math.log((1 - confidence) ** (-1.0 / r) - 1.0)
    got = audit.one_run_epsilon_lower_bound(r, r, r, confidence=confidence)
    assert got == pytest.approx(max(expected, 0.0), rel=1e-9, abs=1e-12)
    assert got <= max(expected, 0.0)  # the bisection returns the low end


@pytest.mark.parametrize("v,r,m", [(58, 80, 200), (150, 200, 1000), (19, 20, 20),
                                   (420, 500, 1000)])
@pytest.mark.parametrize("confidence", [0.95, 0.99])
def test_lower_bound_is_the_root_of_scipys_tail(v, r, m, confidence):
    """delta = 0: the eps where scipy's binomial tail crosses 1 - c (brentq, xtol 1e-13)."""
    root = brentq(lambda e: scipy.stats.binom.sf(v - 1, r, _accuracy(e)) - (1 - confidence),
                  0.0, 50.0, xtol=1e-13)
    got = audit.one_run_epsilon_lower_bound(v, r, m, confidence=confidence)
    assert got == pytest.approx(root, rel=1e-8)
    assert audit.one_run_p_value(v, r, m, got) < 1 - confidence


@pytest.mark.parametrize("v,r", [(40, 80), (30, 80), (0, 10), (0, 0)])
def test_lower_bound_is_zero_without_better_than_chance_guesses(v, r):
    assert audit.one_run_epsilon_lower_bound(v, r, 100, confidence=0.95, delta=1e-5) == 0.0


def test_delta_only_lowers_the_bound():
    without = audit.one_run_epsilon_lower_bound(70, 80, 200)
    with_delta = audit.one_run_epsilon_lower_bound(70, 80, 200, delta=1e-3)
    assert 0 < with_delta < without


@pytest.mark.parametrize("v,r,m", [(58, 80, 200), (10, 10, 10), (150, 200, 1000)])
def test_p_value_is_non_decreasing_in_epsilon_at_the_largest_delta(v, r, m):
    """The module docstring proves it for 2 m delta <= 1; checked on a grid at the edge, up to
    the rounding of sums of ~r float64 probabilities near p = 1 (measured: 3.4e-15)."""
    p = np.array([audit.one_run_p_value(v, r, m, e, 1.0 / (2 * m))
                  for e in np.linspace(0, 12, 400)])
    assert np.all(np.diff(p) >= -1e-13)


@pytest.mark.parametrize("v", [0, 1, 3])
def test_p_value_near_one_is_exact_to_rounding(v):
    """With few correct guesses p is 1 minus a small lower tail: exactly 1 at v = 0 and
    non-decreasing in epsilon to one rounding of 1 (a sum of r float64 probabilities gave
    0.9999999999999918 at v = 0, r = 200: an audit)."""
    p = np.array([audit.one_run_p_value(v, 200, 200, e) for e in np.linspace(0, 3, 300)])
    if v == 0:
        assert np.all(p == 1.0)
    assert np.all(np.diff(p) >= -2.3e-16)


def test_a_huge_epsilon_gives_p_one_without_a_warning():
    """e^-eps underflows to 0 and (r - k) log(1 - q) overflows to -inf: probabilities of 0,
    not a RuntimeWarning (an audit)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert audit.one_run_p_value(10, 10, 10, 1e308) == 1.0
        assert audit.one_run_p_value(3, 10, 10, 1e308) == 1.0


def test_refuses_what_the_theorem_does_not_cover():
    with pytest.raises(ValueError, match="2 \\* nb_canaries \\* delta"):
        audit.one_run_epsilon_lower_bound(5, 10, 100, delta=0.01)
    with pytest.raises(ValueError, match="nb_correct <= nb_guesses <= nb_canaries"):
        audit.one_run_p_value(11, 10, 100, 1.0)
    with pytest.raises(ValueError, match="confidence"):
        audit.one_run_epsilon_lower_bound(5, 10, 100, confidence=1.0)


def test_an_audit_that_cannot_show_a_positive_epsilon_is_refused_before_training():
    """20 canaries give 2 + 2 guesses by default: even all right, P = 2^-4 > 5%, so the
    audit would report epsilon >= 0 whatever the training leaks (a review, 2026-12-07: it
    trained and printed "2/2 correct ... epsilon >= 0"). Refused before `train_fn` runs; 3 + 3
    guesses can show a positive epsilon (2^-6 < 5%)."""
    def train(x, y):
        raise AssertionError("trained")

    x = np.ones((4, 3), np.float32)
    y = np.array([0, 1, 0, 1])
    with pytest.raises(ValueError, match="cannot show epsilon > 0 at 95% confidence"):
        audit.canary_audit(train, x, y, nb_canaries=20, seed=0)
    with pytest.raises(AssertionError, match="trained"):
        audit.canary_audit(train, x, y, nb_canaries=20, seed=0, k_positive=3, k_negative=3)


def test_attack_statistics_refuse_labels_other_than_0_and_1_and_count_non_finite_scores():
    for labels in ([0, 1, 0.5, 1], [-1, 1, -1, 1]):
        with pytest.raises(ValueError, match="must be 1 \\(member\\) or 0"):
            audit.roc_curve_points([0.1, 0.2, 0.3, 0.4], labels)
    with pytest.raises(ValueError, match="2 of 4 \\(1 of members, 1 of non-members\\)"):
        audit.roc_curve_points([np.nan, 0.2, np.inf, 0.4], [1, 1, 0, 0])
    fpr, tpr = audit.roc_curve_points([0.1, 0.2], [True, False])  # booleans are labels
    assert fpr.tolist() == [0.0, 1.0, 1.0] and tpr.tolist() == [0.0, 0.0, 1.0]


def test_chance_interval_stays_within_0_and_1():
    result = audit.AttackResult.from_scores("tiny", [0.1, 0.2], [1, 0])
    assert result.chance_interval == (0.0, 1.0)


# --------------------------------------------------------------------------- #
# Attack statistics against scikit-learn.
# --------------------------------------------------------------------------- #
def _sklearn_statistics(scores, labels, levels):
    fpr, tpr, _ = roc_curve(labels, scores, drop_intermediate=False)
    return (roc_auc_score(labels, scores), float(np.max(tpr - fpr)),
            {f: float(np.max(tpr[fpr <= f])) for f in levels})


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("ties", [False, True])
def test_attack_statistics_match_scikit_learn(seed, ties):
    """AUROC, advantage (max TPR - FPR) and TPR at FPR <= f equal scikit-learn's ROC curve's
    (to 1e-12: both are ratios of the same integer counts)."""
    rng = np.random.default_rng(seed)
    n1, n0 = rng.integers(5, 3000, 2)
    scores = np.r_[rng.normal(0.3 * (seed % 3), 1.0, n1), rng.normal(0.0, 1.0, n0)]
    if ties:
        scores = np.round(scores, 1)
    labels = np.r_[np.ones(n1, int), np.zeros(n0, int)]
    order = rng.permutation(len(labels))
    scores, labels = scores[order], labels[order]
    levels = (1e-3, 1e-2, 0.1)
    result = audit.AttackResult.from_scores("test", scores, labels, levels)
    auroc, advantage, tprs = _sklearn_statistics(scores, labels, levels)
    assert result.auroc == pytest.approx(auroc, abs=1e-12)
    assert result.advantage == pytest.approx(advantage, abs=1e-12)
    for f in levels:
        assert result.tpr_at_fpr[f] == pytest.approx(tprs[f], abs=1e-12)
    assert (result.nb_members, result.nb_nonmembers) == (n1, n0)


@pytest.mark.parametrize("seed", range(4))
def test_chance_interval_is_the_mann_whitney_null(seed):
    """z = (AUROC - 1/2) / null std reproduces scipy's asymptotic Mann-Whitney p-value
    (tie-corrected, no continuity correction) to 1e-9."""
    rng = np.random.default_rng(seed)
    scores = np.round(np.r_[rng.normal(0.2, 1, 150), rng.normal(0, 1, 90)], 1)
    labels = np.r_[np.ones(150, int), np.zeros(90, int)]
    result = audit.AttackResult.from_scores("test", scores, labels, confidence=0.95)
    half_width = result.chance_interval[1] - 0.5
    z = (result.auroc - 0.5) / (half_width / scipy.stats.norm.ppf(0.975))
    expected = scipy.stats.mannwhitneyu(scores[labels == 1], scores[labels == 0],
                                        method="asymptotic", use_continuity=False).pvalue
    assert 2 * scipy.stats.norm.sf(abs(z)) == pytest.approx(expected, rel=1e-9)


# --------------------------------------------------------------------------- #
# Small lipdp models.
# --------------------------------------------------------------------------- #
X0, TAU = 4.0, 1.0


def _model(metadata, sigma, width=64):
    model = lipdp.DP_Sequential(
        [DP_BoundedInput(X0, input_shape=metadata.input_shape), DP_QuickSpectralDense(width),
         DP_GroupSort(2), DP_QuickSpectralDense(metadata.nb_classes)],
        dp_parameters=lipdp.DPParameters(sigma, 1e-5), dataset_metadata=metadata)
    model.compile(loss=DP_TauCategoricalCrossentropy(TAU),
                  optimizer=tf.keras.optimizers.Adam(1e-2))
    return model


def _poisson_batches(x, y, metadata, seed):
    """Every example of (x, y) joins each of `steps_per_epoch` batches independently with
    probability ``metadata.sampling_rate`` (what the accountant assumes)."""
    x, y, q = tf.constant(x), tf.constant(y), metadata.sampling_rate

    def draw(pair):
        u = tf.random.stateless_uniform([len(x)], seed=pair, dtype=tf.float64)
        idx = tf.reshape(tf.where(u < q), [-1])
        return tf.gather(x, idx), tf.gather(y, idx)

    return (tf.data.Dataset.random(seed=seed, rerandomize_each_iteration=True).batch(2)
            .take(metadata.steps_per_epoch).map(draw))


@functools.lru_cache(maxsize=None)
def _digits():
    raw = lipdp.data.load_arrays("digits")
    return raw.x_train, raw.y_train, raw.x_test, raw.y_test


def test_loss_scores_are_minus_the_tau_cross_entropy():
    x, y, _, _ = _digits()
    metadata = lipdp.DatasetMetadata((64,), 10, 100, 10, 20, X0, "shuffle")
    model = _model(metadata, 1.0)
    logits = model(x[:50]).numpy().astype(np.float64)
    expected = -(np.logaddexp.reduce(TAU * logits, axis=1) - TAU * logits[np.arange(50), y[:50]])
    assert np.allclose(audit.loss_scores(model, x[:50], y[:50]), expected / TAU, atol=1e-5)
    one_hot = np.eye(10, dtype=np.float32)[y[:50]]
    assert np.allclose(audit.loss_scores(model, x[:50], one_hot), expected / TAU, atol=1e-5)


def test_loss_scores_take_each_example_with_its_own_label():
    """A Keras model compiled with "mse", one output, labels of shape (B,): the raw Keras
    function broadcast the labels to (B, B) and scored each example with the mean error over
    every label; each score is now minus the example's own squared error."""
    model = tf.keras.Sequential([tf.keras.layers.Dense(1, input_shape=(3,))])
    model.compile(loss="mse")
    rng = np.random.default_rng(3)
    x, y = rng.normal(size=(6, 3)).astype(np.float32), rng.normal(size=6).astype(np.float32)
    expected = -(model(x).numpy()[:, 0] - y) ** 2
    np.testing.assert_allclose(audit.loss_scores(model, x, y), expected, rtol=1e-5)


# --------------------------------------------------------------------------- #
# Membership inference on the same small data, with and without noise.
# --------------------------------------------------------------------------- #
N_MEMBERS = 100


def _mia_trainer(sigma, epochs):
    def train(x, y):
        tf.keras.utils.set_random_seed(len(x))
        metadata = lipdp.DatasetMetadata((64,), 10, len(x), 10, 20, X0, "shuffle")
        model = _model(metadata, sigma, width=128)
        model.fit(x, y, batch_size=20, epochs=epochs, verbose=0)
        return model
    return train


@pytest.mark.parametrize("sigma,expect_leak", [(0.0, True), (50.0, False)])
def test_membership_inference_tells_overfit_from_noisy(sigma, expect_leak):
    """Same 100 digits, 60 epochs. Without noise both attacks beat chance (measured: loss AUROC
    0.646, shadow 0.644, advantage 0.27; chance interval [0.42, 0.58]); with sigma = 50 the loss
    attack's AUROC lies inside its 95% chance interval (measured 0.511)."""
    x, y, x_test, y_test = _digits()
    members, holdout = (x[:N_MEMBERS], y[:N_MEMBERS]), (x_test[:N_MEMBERS], y_test[:N_MEMBERS])
    shadow_data = (x[N_MEMBERS:3 * N_MEMBERS], y[N_MEMBERS:3 * N_MEMBERS])
    train = _mia_trainer(sigma, epochs=60)
    model = train(*members)
    result = audit.membership_inference(model, members, holdout, shadow_fn=train,
                                        shadow_data=shadow_data, nb_shadows=1, seed=0)
    print(result.summary())
    loss, shadow = result.loss_threshold, result.shadow
    assert set(loss.tpr_at_fpr) == {1e-3, 1e-2}
    assert set(result.as_dict()) == {"loss_threshold", "shadow"}
    if expect_leak:
        assert loss.auroc > loss.chance_interval[1] and shadow.auroc > shadow.chance_interval[1]
        assert loss.advantage > 0.15
    else:
        assert loss.chance_interval[0] <= loss.auroc <= loss.chance_interval[1]


def test_membership_inference_without_shadows_needs_no_scikit_learn(monkeypatch):
    x, y, x_test, y_test = _digits()
    metadata = lipdp.DatasetMetadata((64,), 10, 100, 10, 20, X0, "shuffle")
    model = _model(metadata, 1.0)

    def no_sklearn():
        raise ImportError("scikit-learn is not installed (simulated)")

    monkeypatch.setattr(audit, "_require_sklearn", no_sklearn)
    result = audit.membership_inference(model, (x[:40], y[:40]), (x_test[:30], y_test[:30]))
    assert result.shadow is None and result.loss_threshold.nb_members == 40
    with pytest.raises(ImportError, match="simulated"):
        audit.membership_inference(model, (x[:40], y[:40]), (x_test[:30], y_test[:30]),
                                   shadow_fn=lambda a, b: model, shadow_data=(x[40:80], y[40:80]))


# --------------------------------------------------------------------------- #
# The canary audit.
# --------------------------------------------------------------------------- #
N_BASE, M, K, BATCH, EPOCHS = 100, 200, 40, 50, 30
CONFIDENCE = 0.95


def _audit_trainer(sigma, noise_scale=1.0):
    """Poisson-sampled lipdp training on a fixed public N = N_BASE + M/2 (so the sampling rate
    does not depend on which canaries are in). ``noise_scale`` < 1 breaks the train step on
    purpose: it adds ``noise_scale`` times the noise that the ledger records."""
    def train(x, y):
        tf.keras.utils.set_random_seed(1)
        metadata = lipdp.DatasetMetadata((64,), 10, N_BASE + M // 2, 10, BATCH, X0, "poisson")
        model = _model(metadata, sigma)
        if noise_scale != 1.0:
            honest = model._noise_stddevs
            model._noise_stddevs = lambda s: [noise_scale * std for std in honest(s)]
        model.fit(_poisson_batches(x, y, metadata, seed=2), epochs=EPOCHS, verbose=0)
        return model
    return train


@functools.lru_cache(maxsize=None)
def _canary_audit(sigma, noise_scale=1.0):
    x, y, _, _ = _digits()
    return audit.canary_audit(_audit_trainer(sigma, noise_scale), x[:N_BASE], y[:N_BASE],
                              nb_canaries=M, input_bound=X0, k_positive=K, k_negative=K,
                              confidence=CONFIDENCE, seed=3)


def test_canary_audit_noise_free_bound_far_above_noisy():
    """Measured: without noise 80/80 guesses right, epsilon >= 3.261 (the most a 95% bound on 80
    guesses can show, 3.266); sigma = 8 (accountant: 1.459): 42/80 right, epsilon >= 0."""
    free, noisy = _canary_audit(0.0), _canary_audit(8.0)
    print(free.summary(), noisy.summary(), sep="\n")
    assert free.epsilon_accountant == math.inf
    assert free.epsilon_lower_bound > 2.5
    assert noisy.epsilon_lower_bound < 1.0
    assert free.epsilon_lower_bound - noisy.epsilon_lower_bound > 2.0
    assert free.nb_guesses == 2 * K and free.delta == 1e-5
    assert 0 < free.nb_included < M and len(free.scores) == M


@pytest.mark.parametrize("sigma", [2.0, 8.0])
def test_canary_audit_never_exceeds_the_accountant(sigma):
    """The 95% lower bound stays below lipdp's epsilon of the same run (Poisson sampling, the
    accountant's own delta). Measured: sigma = 2, 0.425 <= 7.83; sigma = 8, 0 <= 1.459. (The
    audit sees only the final model; it catches gross errors, see the next test, not a 10x one.)
    """
    result = _canary_audit(sigma)
    print(result.summary())
    assert result.epsilon_accountant == pytest.approx(
        compute_epsilon(sigma, BATCH / (N_BASE + M // 2), EPOCHS * math.ceil((N_BASE + M // 2) / BATCH),
                        1e-5), rel=1e-9)
    assert result.epsilon_lower_bound <= result.epsilon_accountant


def test_canary_audit_catches_a_step_that_adds_less_noise_than_it_accounts():
    """The same run as sigma = 8, but the train step adds 1/100 of the noise the ledger records:
    the audit's lower bound then exceeds the (now false) accountant epsilon (measured: 3.261 >
    1.459; with 1/10 of the noise 1.368, not caught)."""
    broken = _canary_audit(8.0, noise_scale=0.01)
    print(broken.summary())
    assert broken.epsilon_lower_bound > broken.epsilon_accountant


def test_canary_audit_labels_follow_the_training_format():
    """One-hot training labels give one-hot canaries; integer ones give integer canaries."""
    seen = {}

    def train(x, y):
        seen["y"] = y
        metadata = lipdp.DatasetMetadata((64,), 10, len(x), 10, 20, X0, "shuffle")
        return _model(metadata, 1.0)

    x, y, _, _ = _digits()
    for labels in (y[:30], np.eye(10, dtype=np.float32)[y[:30]]):
        result = audit.canary_audit(train, x[:30], labels, nb_canaries=20, seed=0,
                                    k_positive=3, k_negative=3)
        assert seen["y"].shape[1:] == labels.shape[1:] and seen["y"].dtype == labels.dtype
        assert len(seen["y"]) == 30 + result.nb_included
        assert result.epsilon_lower_bound == 0.0  # untrained model: nothing to see
