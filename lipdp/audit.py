"""Empirical privacy checks: membership inference, and a one-run canary audit.

Both tools attack a trained model with methods that do not use lipdp's bounds, so they can
catch a wrong bound, a wrong accountant or a wrong noise scale. Their numbers are of two kinds:

* `membership_inference` *measures* attacks (AUROC, attacker advantage, TPR at low FPR) on a
  given split into members and non-members. These are descriptive statistics of one model on
  one split, with no guarantee in either direction: a weak attack proves nothing about privacy,
  a strong one shows leakage of that model (Yeom et al. 2018; Shokri et al. 2017; the paper's
  Table 1 columns "AUROC" and "Adv.").
* `canary_audit` *proves* a lower bound on epsilon at a stated confidence (Steinke, Nasr &
  Jagielski 2023, "Privacy auditing with one (1) training run", arXiv 2305.08846): if the
  training procedure is (eps, delta)-DP with respect to each canary, the reported
  ``epsilon_lower_bound`` exceeds eps with probability at most ``1 - confidence``. A lower
  bound above the accountant's epsilon therefore means that lipdp's epsilon is wrong (or that an
  event of probability ``<= 1 - confidence`` happened).

The one-run bound
-----------------
m canaries are each included in the training set independently with probability 1/2
(``S_i`` in {in, out}). After training, the auditor scores every canary, guesses "in" for the
``k+`` highest scores and "out" for the ``k-`` lowest (r = k+ + k- guesses, fixed in advance)
and counts the correct guesses V. Steinke et al.'s main theorem (for delta = 0: V is
stochastically dominated by Binomial(r, e^eps / (1 + e^eps))) and its delta > 0 version, in the
form their appendix D code evaluates (``p_value_DP_audit``): if the training procedure is
(eps, delta)-DP with respect to adding/removing any one canary (everything else fixed), then
for every v::

    P[V >= v] <= beta + 2 m delta alpha,
    beta  = P[W >= v],                             W ~ Binomial(r, e^eps / (1 + e^eps)),
    alpha = max_{i = 1..v} P[v - i <= W < v] / i.

`one_run_p_value` computes the right-hand side to float64 precision (binomial coefficients as
exact integers, probabilities in log space, summed with ``math.fsum``), and
`one_run_epsilon_lower_bound` returns ``sup {eps : p(eps) < 1 - confidence}``. With r guesses the
bound never exceeds ``-log((1 - confidence)^(-1/r) - 1)`` (every guess right; 3.27 for r = 80 at
95%, 4.19 for r = 200): an accountant epsilon above that cannot be contradicted by the audit.

*Why that is a valid lower bound.* ``p(eps)`` is non-decreasing in eps whenever
``2 m delta <= 1`` (the functions here refuse a larger product): write q for the accuracy
``e^eps / (1 + e^eps)`` and ``pmf`` for the Binomial(r - 1, q) mass; then
``d beta / dq = r pmf(v - 1)`` and ``d/dq P[v - i <= W < v] = r (pmf(v - i - 1) - pmf(v - 1))``
(the identity ``d/dq P[W <= k] = -r pmf(k)``), so each term ``beta + 2 m delta P[..] / i`` of the
maximum has derivative ``>= r pmf(v - 1) (1 - 2 m delta / i) >= 0``. Hence if the procedure is
(eps*, delta)-DP, ``lower bound > eps*`` implies ``p(eps*) < 1 - confidence``, an event of
probability at most ``1 - confidence``. The bisection returns the low end of its bracket
(relative width 1e-12), never above the supremum.

What the audit assumes (the caller's side of the contract):

* the guesses depend on the trained model and the canaries only, never on which canaries
  were included (`canary_audit` draws the inclusion bits itself and does not show them to
  ``score_fn``); k+ and k- are chosen before looking at the scores;
* the privacy parameters of ``train_fn`` (sampling rate, number of steps, noise) do not depend
  on how many canaries were included: with lipdp, build the `DatasetMetadata` with a fixed
  public N (e.g. ``len(x_train) + nb_canaries // 2``) and sample each example with
  probability ``batch_size / N`` (Poisson), rather than ``N = len(x)``;
* the accountant's epsilon is for the add/remove relation, as is the audit.

The audit is a *lower* bound and typically far below the accountant's epsilon (it sees only the
final model, through one score per canary; Steinke et al. report the same gap for black-box
audits of DP-SGD). Its use is to catch an epsilon that is too small, not to certify tightness.

scikit-learn (the ``audit`` extra: ``pip install lipdp[audit]``) is needed only for the
shadow-model attack; it is imported when that attack runs.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import math
import numbers
from statistics import NormalDist
from typing import Callable, Dict, Optional, Sequence, Tuple, Union

import numpy as np
import tensorflow as tf

from lipdp.accounting import epsilon_spent, format_epsilon
from lipdp.clipping.validation import per_example_loss
from lipdp.evaluation import roc_auc
from lipdp.state_guard import guarded_call

__all__ = [
    "AttackResult",
    "CanaryAuditResult",
    "MembershipInferenceResult",
    "attack_features",
    "attacker_advantage",
    "canary_audit",
    "loss_scores",
    "membership_inference",
    "one_run_epsilon_lower_bound",
    "one_run_p_value",
    "random_canaries",
    "roc_curve_points",
    "tpr_at_fpr",
]

ArrayPair = Tuple[np.ndarray, np.ndarray]

DEFAULT_LOW_FPRS = (1e-3, 1e-2)


# --------------------------------------------------------------------------- #
# Argument validation (errors echo the bad value).
# --------------------------------------------------------------------------- #
def _invalid(argname, expected, value):
    return ValueError(f"Received an invalid value for `{argname}`, expected {expected}. "
                      f"Received: {argname}={value!r}")


def _check_int(value, argname, minimum=0):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise _invalid(argname, f"an integer >= {minimum}", value)
    return int(value)


def _check_confidence(value):
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 < value < 1:
        raise _invalid("confidence", "a number in (0, 1)", value)
    return float(value)


def _check_audit_delta(value, nb_canaries):
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 <= value < 1:
        raise _invalid("delta", "a number in [0, 1)", value)
    if 2 * nb_canaries * value > 1:
        raise ValueError(
            f"2 * nb_canaries * delta = {2 * nb_canaries * value:g} > 1: the delta term of the "
            "one-run bound (2 m delta alpha) is then too large for the bound to mean anything, "
            "and the p-value is no longer monotone in epsilon. Use fewer canaries or a smaller "
            f"delta. Received: delta={value!r}, nb_canaries={nb_canaries}")
    return float(value)


def _require_sklearn():
    try:
        importlib.import_module("sklearn")
    except ImportError as e:
        raise ImportError(
            "The shadow-model attack of lipdp.audit trains its attack classifier with "
            "scikit-learn, which is not installed: pip install 'lipdp[audit]' (or "
            "pip install scikit-learn), or call membership_inference without `shadow_fn`."
        ) from e


def _as_pair(data, argname) -> ArrayPair:
    if not isinstance(data, (tuple, list)) or len(data) != 2:
        raise TypeError(f"`{argname}` must be an (x, y) pair of arrays, each example once. "
                        f"Received: {type(data).__name__}")
    x, y = np.asarray(data[0]), np.asarray(data[1])
    if len(x) != len(y):
        raise ValueError(f"`{argname}`: x and y have different lengths, {len(x)} and {len(y)}.")
    return x, y


# --------------------------------------------------------------------------- #
# ROC statistics (checked against scikit-learn's roc_curve in tests/test_audit.py).
# --------------------------------------------------------------------------- #
def _scores_and_labels(scores, labels):
    scores = np.asarray(scores, np.float64).reshape(-1)
    raw = np.asarray(labels).reshape(-1)
    if len(scores) != len(raw):
        raise ValueError(f"{len(scores)} scores but {len(raw)} labels.")
    if raw.dtype != bool and not np.all((raw == 0) | (raw == 1)):
        odd = np.unique(raw[(raw != 0) & (raw != 1)])[:5]
        raise ValueError("Membership labels must be 1 (member) or 0 (non-member); received "
                         f"other values, e.g. {odd.tolist()}.")
    labels = raw.astype(bool)
    if not np.all(np.isfinite(scores)):
        bad = ~np.isfinite(scores)
        raise ValueError(
            f"The attack scores contain NaN or inf: {int(bad.sum())} of {len(scores)} "
            f"({int((bad & labels).sum())} of members, {int((bad & ~labels).sum())} of "
            "non-members).")
    if labels.all() or not labels.any():
        raise ValueError("ROC statistics need both members (label 1) and non-members (label 0).")
    return scores, labels


def roc_curve_points(scores, labels) -> Tuple[np.ndarray, np.ndarray]:
    """``(fpr, tpr)`` of the rule "member iff score >= t" for every distinct threshold t,
    from the highest threshold down, starting at ``(0, 0)`` (no member guessed) and ending at
    ``(1, 1)``. Tied scores are one threshold (they are guessed together)."""
    scores, labels = _scores_and_labels(scores, labels)
    order = np.argsort(-scores, kind="mergesort")
    scores, labels = scores[order], labels[order]
    ends = np.r_[np.flatnonzero(np.diff(scores)), len(scores) - 1]  # last index of each tie run
    tp, fp = np.cumsum(labels)[ends], np.cumsum(~labels)[ends]
    return (np.r_[0.0, fp / fp[-1]], np.r_[0.0, tp / tp[-1]])


def attacker_advantage(scores, labels) -> float:
    """``max_t TPR(t) - FPR(t)`` over thresholds t (Yeom et al. 2018's membership advantage,
    the paper's "Adv."): the best accuracy gain over guessing of a threshold attack when
    members and non-members are equally likely. The threshold is chosen on the evaluated
    examples themselves, so this is the advantage of the best threshold in hindsight."""
    fpr, tpr = roc_curve_points(scores, labels)
    return float(np.max(tpr - fpr))


def tpr_at_fpr(scores, labels, fpr_levels: Sequence[float] = DEFAULT_LOW_FPRS) -> Dict[float, float]:
    """``{f: max TPR over thresholds with FPR <= f}`` (Carlini et al. 2022's low-FPR view).
    With ``n`` non-members an FPR below ``1/n`` is 0: the value is then the TPR at FPR = 0."""
    fpr, tpr = roc_curve_points(scores, labels)
    result = {}
    for level in fpr_levels:
        if isinstance(level, bool) or not isinstance(level, numbers.Real) or not 0 <= level <= 1:
            raise _invalid("fpr_levels", "numbers in [0, 1]", tuple(fpr_levels))
        result[float(level)] = float(np.max(tpr[fpr <= level]))
    return result


def _auroc_null_std(scores, labels) -> float:
    """Standard deviation of the AUROC when the scores carry no membership information (the
    members a uniformly random subset): the Mann-Whitney null variance with tie correction,
    ``Var(U) = n1 n0 / 12 * (n + 1 - sum_t (t^3 - t) / (n (n - 1)))``, divided by ``n1 n0``."""
    scores, labels = _scores_and_labels(scores, labels)
    n1, n0 = int(labels.sum()), int((~labels).sum())
    n = n1 + n0
    _, ties = np.unique(scores, return_counts=True)
    tie_term = float(np.sum(ties.astype(np.float64) ** 3 - ties)) / (n * (n - 1))
    return math.sqrt(n1 * n0 / 12.0 * ((n + 1) - tie_term)) / (n1 * n0)


# --------------------------------------------------------------------------- #
# Per-example scores of a model.
# --------------------------------------------------------------------------- #
def _logits(model, x, batch_size) -> np.ndarray:
    outputs = [np.asarray(guarded_call(model, tf.convert_to_tensor(x[i:i + batch_size])),
                          np.float64) for i in range(0, len(x), batch_size)]
    logits = np.concatenate(outputs) if outputs else np.zeros((0, int(model.output_shape[-1])))
    if logits.ndim != 2:
        raise ValueError(f"Expected (batch, K) outputs; the model returned shape {logits.shape}.")
    return logits


def _per_example_loss(model):
    loss = getattr(model, "dp_loss", None) or getattr(model, "loss", None)
    if loss is None:
        raise ValueError("The model has no compiled loss to score examples with: compile it, or "
                         "pass a `score_fn(model, x, y)` returning one score per example.")
    # Each example's loss from its own label and output (a label of shape (B,) broadcast
    # against outputs (B, 1) scored every example with every label).
    return per_example_loss(loss)


def loss_scores(model, x, y, batch_size: int = 1024) -> np.ndarray:
    """Minus the per-example loss of ``(x, y)`` under the model's compiled loss (higher means
    "more likely a member"): the score of the loss-threshold attack (Yeom et al. 2018; Song &
    Mittal 2021). Labels are passed to the loss as given (the format the model was trained on).
    """
    x, y = np.asarray(x), np.asarray(y)
    loss_fn = _per_example_loss(model)
    values = []
    for i in range(0, len(x), batch_size):
        logits = guarded_call(model, tf.convert_to_tensor(x[i:i + batch_size]))
        values.append(np.asarray(loss_fn(tf.convert_to_tensor(y[i:i + batch_size]), logits),
                                 np.float64).reshape(-1))
    return -np.concatenate(values) if values else np.zeros(0)


def _class_indices(y, nb_outputs) -> np.ndarray:
    y = np.asarray(y)
    if y.ndim == 2 and y.shape[1] > 1:
        return np.argmax(y, axis=1)
    y = y.reshape(len(y))
    return (y > 0).astype(np.int64) if nb_outputs == 1 else y.astype(np.int64)


def attack_features(model, x, y, batch_size: int = 1024) -> np.ndarray:
    """Class-agnostic features of each example for the shadow-model attack, shape ``(n, 4)``:
    minus the loss (`loss_scores`), the logit margin of the true class
    (``logit_y - max_{j != y} logit_j``), the log-softmax of the true class, and the entropy of
    the softmax. A single output z is read as the two logits ``(0, z)``."""
    x, y = np.asarray(x), np.asarray(y)
    logits = _logits(model, x, batch_size)
    if logits.shape[1] == 1:
        logits = np.concatenate([np.zeros_like(logits), logits], axis=1)
    labels = _class_indices(y, int(model.output_shape[-1]))
    rows = np.arange(len(labels))
    true = logits[rows, labels]
    others = logits.copy()
    others[rows, labels] = -np.inf
    log_softmax = logits - np.logaddexp.reduce(logits, axis=1, keepdims=True)
    entropy = -np.sum(np.exp(log_softmax) * log_softmax, axis=1)
    return np.stack([loss_scores(model, x, y, batch_size), true - others.max(axis=1),
                     log_softmax[rows, labels], entropy], axis=1)


# --------------------------------------------------------------------------- #
# Membership inference.
# --------------------------------------------------------------------------- #
@dataclasses.dataclass(frozen=True)
class AttackResult:
    """What one membership-inference attack achieved on members vs non-members.

    Attributes:
        name: the attack (``"loss_threshold"`` or ``"shadow"``).
        auroc: P(score of a random member > score of a random non-member), ties one half.
        advantage: ``max_t TPR - FPR`` (`attacker_advantage`), threshold chosen in hindsight.
        tpr_at_fpr: ``{f: TPR}`` at the largest threshold set with FPR <= f (`tpr_at_fpr`).
        chance_interval: the central interval, at ``confidence``, of the AUROC of an attack whose
            scores carry no membership information (normal approximation of the Mann-Whitney
            null distribution, tie-corrected). An AUROC inside it is consistent with chance.
        confidence: the level of ``chance_interval``.
        nb_members, nb_nonmembers: the examples scored.
        scores, labels: the scores (higher = "member") and the 0/1 truth, for plots.

    No guarantee either way: these describe one attack on one model and one split.
    """

    name: str
    auroc: float
    advantage: float
    tpr_at_fpr: Dict[float, float]
    chance_interval: Tuple[float, float]
    confidence: float
    nb_members: int
    nb_nonmembers: int
    scores: np.ndarray = dataclasses.field(repr=False, compare=False)
    labels: np.ndarray = dataclasses.field(repr=False, compare=False)

    @classmethod
    def from_scores(cls, name, scores, labels, fpr_levels=DEFAULT_LOW_FPRS, confidence=0.95):
        scores, labels = _scores_and_labels(scores, labels)
        half_width = NormalDist().inv_cdf(0.5 + _check_confidence(confidence) / 2.0) \
            * _auroc_null_std(scores, labels)
        return cls(name=name, auroc=roc_auc(scores, labels),
                   advantage=attacker_advantage(scores, labels),
                   tpr_at_fpr=tpr_at_fpr(scores, labels, fpr_levels),
                   chance_interval=(max(0.0, 0.5 - half_width), min(1.0, 0.5 + half_width)),
                   confidence=confidence,
                   nb_members=int(labels.sum()), nb_nonmembers=int((~labels).sum()),
                   scores=scores, labels=labels.astype(np.int64))

    def as_dict(self) -> dict:
        """JSON-ready summary (without the per-example arrays)."""
        return {"name": self.name, "auroc": self.auroc, "advantage": self.advantage,
                "tpr_at_fpr": {str(k): v for k, v in self.tpr_at_fpr.items()},
                "chance_interval": list(self.chance_interval), "confidence": self.confidence,
                "nb_members": self.nb_members, "nb_nonmembers": self.nb_nonmembers}

    def summary(self) -> str:
        lows = ", ".join(f"TPR@FPR<={k:g} {v:.3f}" for k, v in self.tpr_at_fpr.items())
        lo, hi = self.chance_interval
        return (f"{self.name}: AUROC {self.auroc:.3f} (chance: [{lo:.3f}, {hi:.3f}] at "
                f"{self.confidence:.0%}), advantage {self.advantage:.3f}, {lows} "
                f"({self.nb_members} members, {self.nb_nonmembers} non-members)")


@dataclasses.dataclass(frozen=True)
class MembershipInferenceResult:
    """The attacks `membership_inference` ran: ``loss_threshold`` always, ``shadow`` when
    shadow models were given (else None)."""

    loss_threshold: AttackResult
    shadow: Optional[AttackResult] = None

    @property
    def attacks(self) -> Tuple[AttackResult, ...]:
        return tuple(a for a in (self.loss_threshold, self.shadow) if a is not None)

    def as_dict(self) -> dict:
        return {a.name: a.as_dict() for a in self.attacks}

    def summary(self) -> str:
        return "\n".join(a.summary() for a in self.attacks)


def membership_inference(
    model,
    train: ArrayPair,
    holdout: ArrayPair,
    *,
    shadow_fn: Optional[Callable[[np.ndarray, np.ndarray], tf.keras.Model]] = None,
    shadow_data: Optional[ArrayPair] = None,
    nb_shadows: int = 2,
    score_fn: Optional[Callable] = None,
    features_fn: Optional[Callable] = None,
    fpr_levels: Sequence[float] = DEFAULT_LOW_FPRS,
    confidence: float = 0.95,
    seed: Optional[int] = None,
    batch_size: int = 1024,
) -> MembershipInferenceResult:
    """Membership-inference attacks on a trained model: members ``train`` vs ``holdout``.

    * **Loss threshold** (Yeom et al. 2018; Song & Mittal 2021): score ``score_fn(model, x, y)``,
      by default `loss_scores` (minus the per-example compiled loss).
    * **Shadow models** (Shokri et al. 2017, with one class-agnostic attack classifier as in
      Salem et al. 2019): ``nb_shadows`` times, ``shadow_fn(x_in, y_in)`` trains a model the way
      the target was trained on a random half of ``shadow_data`` (the other half is its
      non-members); a logistic regression on ``features_fn(shadow, x, y)`` (default
      `attack_features`, standardised) learns "member or not" from the shadows, and scores the
      target's ``train`` and ``holdout``. ``shadow_data`` must come from the target's data
      distribution and be disjoint from ``train`` and ``holdout``; the shadows should see as
      many examples as the target did (``len(shadow_data) ~ 2 len(train)``). Needs
      scikit-learn (the ``audit`` extra).

    Args:
        model: the trained target model (logits output).
        train, holdout: ``(x, y)`` arrays, each example once: members and non-members, in the
            label format the model was trained with. Any sizes (the statistics do not depend on
            the balance).
        shadow_fn, shadow_data, nb_shadows: the shadow attack (skipped if ``shadow_fn`` is None).
        score_fn: ``(model, x, y) -> scores``, higher meaning "member".
        features_fn: ``(model, x, y) -> (n, d)`` features of the shadow attack.
        fpr_levels: the FPRs of ``tpr_at_fpr``.
        confidence: level of each result's ``chance_interval``.
        seed: seeds the shadow splits.

    Returns:
        `MembershipInferenceResult` with one `AttackResult` per attack. These are measurements,
        not guarantees: a DP model bounds any attack's advantage by ``(e^eps - 1 + 2 delta) /
        (e^eps + 1)`` (Humphries et al. 2023), but a weak attack proves nothing.
    """
    x_in, y_in = _as_pair(train, "train")
    x_out, y_out = _as_pair(holdout, "holdout")
    labels = np.r_[np.ones(len(x_in), np.int64), np.zeros(len(x_out), np.int64)]
    score_fn = score_fn or (lambda m, x, y: loss_scores(m, x, y, batch_size))
    scores = np.r_[np.asarray(score_fn(model, x_in, y_in), np.float64).reshape(-1),
                   np.asarray(score_fn(model, x_out, y_out), np.float64).reshape(-1)]
    loss_attack = AttackResult.from_scores("loss_threshold", scores, labels, fpr_levels,
                                           confidence)
    if shadow_fn is None:
        return MembershipInferenceResult(loss_attack)

    _require_sklearn()
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    if shadow_data is None:
        raise ValueError("The shadow-model attack needs `shadow_data`: (x, y) from the target's "
                         "distribution, disjoint from `train` and `holdout`.")
    x_sh, y_sh = _as_pair(shadow_data, "shadow_data")
    nb_shadows = _check_int(nb_shadows, "nb_shadows", 1)
    if len(x_sh) < 4:
        raise ValueError(f"`shadow_data` has {len(x_sh)} examples; the shadows need at least 4.")
    features_fn = features_fn or (lambda m, x, y: attack_features(m, x, y, batch_size))
    rng = np.random.default_rng(seed)
    feats, truth = [], []
    for _ in range(nb_shadows):
        member = np.zeros(len(x_sh), bool)
        member[rng.permutation(len(x_sh))[:len(x_sh) // 2]] = True
        shadow = shadow_fn(x_sh[member], y_sh[member])
        for mask, label in ((member, 1), (~member, 0)):
            feats.append(np.asarray(features_fn(shadow, x_sh[mask], y_sh[mask]), np.float64))
            truth.append(np.full(int(mask.sum()), label))
    attack = make_pipeline(StandardScaler(), LogisticRegression(max_iter=1000))
    attack.fit(np.concatenate(feats), np.concatenate(truth))
    target = np.concatenate([np.asarray(features_fn(model, x_in, y_in), np.float64),
                             np.asarray(features_fn(model, x_out, y_out), np.float64)])
    shadow_attack = AttackResult.from_scores("shadow", attack.decision_function(target), labels,
                                             fpr_levels, confidence)
    return MembershipInferenceResult(loss_attack, shadow_attack)


# --------------------------------------------------------------------------- #
# The one-run bound (Steinke, Nasr & Jagielski 2023).
# --------------------------------------------------------------------------- #
@functools.lru_cache(maxsize=32)
def _log_binomial_coefficients(r: int) -> Tuple[float, ...]:
    """``log C(r, k)`` for k = 0..r, to a few ulps: the coefficients are exact integers
    (``C(r, k + 1) = C(r, k) (r - k) / (k + 1)``, the values of ``math.comb``) and ``math.log``
    takes exact integers. About 1 s for r = 100,000."""
    logs, coefficient = [0.0], 1
    for k in range(r):
        coefficient = coefficient * (r - k) // (k + 1)
        logs.append(math.log(coefficient))
    return tuple(logs)


def _binomial_log_pmf(r: int, log_q: float, log_1mq: float) -> np.ndarray:
    log_comb = np.asarray(_log_binomial_coefficients(r))
    k = np.arange(r + 1, dtype=np.float64)
    with np.errstate(over="ignore"):  # a huge epsilon: -inf, a probability of 0
        return log_comb + k * log_q + (r - k) * log_1mq


def _check_counts(nb_correct, nb_guesses, nb_canaries):
    v = _check_int(nb_correct, "nb_correct")
    r = _check_int(nb_guesses, "nb_guesses")
    m = _check_int(nb_canaries, "nb_canaries", 1)
    if not v <= r <= m:
        raise ValueError("Expected nb_correct <= nb_guesses <= nb_canaries. Received: "
                         f"nb_correct={v}, nb_guesses={r}, nb_canaries={m}")
    return v, r, m


def one_run_p_value(nb_correct: int, nb_guesses: int, nb_canaries: int, epsilon: float,
                    delta: float = 0.0) -> float:
    """Upper bound on the probability that an (epsilon, delta)-DP procedure lets the auditor make
    at least ``nb_correct`` correct guesses out of ``nb_guesses`` (``nb_canaries`` canaries, each
    in with probability 1/2): ``min(1, beta + 2 m delta alpha)`` with beta and alpha as in the module
    docstring (Steinke et al. 2023; their appendix D's ``p_value_DP_audit``). Non-decreasing in
    ``epsilon`` (module docstring); needs ``2 * nb_canaries * delta <= 1``.
    """
    v, r, m = _check_counts(nb_correct, nb_guesses, nb_canaries)
    if isinstance(epsilon, bool) or not isinstance(epsilon, numbers.Real) or not epsilon >= 0:
        raise _invalid("epsilon", "a number >= 0", epsilon)
    delta = _check_audit_delta(delta, m)
    if math.isinf(epsilon):
        return 1.0  # q = 1: all r >= v guesses are right
    # q = e^eps / (1 + e^eps), the accuracy of eps-DP randomised response, in log space.
    log_q = -math.log1p(math.exp(-epsilon))
    log_1mq = -epsilon + log_q
    pmf = np.exp(_binomial_log_pmf(r, log_q, log_1mq))
    lower = math.fsum(pmf[:v])  # P[W < v]; the smaller tail is summed, the larger is 1 minus it
    beta = 1.0 - lower if lower <= 0.5 else math.fsum(pmf[v:])
    alpha = 0.0
    if delta > 0 and v > 0:
        below = np.cumsum(pmf[v - 1::-1])  # P[v - i <= W < v] for i = 1..v
        alpha = float(np.max(below / np.arange(1, v + 1)))
    return min(1.0, beta + 2.0 * m * delta * alpha)


def one_run_epsilon_lower_bound(nb_correct: int, nb_guesses: int, nb_canaries: int, *,
                                confidence: float = 0.95, delta: float = 0.0) -> float:
    """``sup {eps >= 0 : one_run_p_value(eps) < 1 - confidence}``: with probability at least
    ``confidence`` the audited procedure is not (eps, delta)-DP for any eps below it.

    Returns 0.0 when even eps = 0 cannot be rejected (e.g. at most half the guesses correct).
    Closed form when every guess is right and delta = 0:
    ``-log((1 - confidence)^(-1/r) - 1)`` (``beta = q^r``).
    """
    v, r, m = _check_counts(nb_correct, nb_guesses, nb_canaries)
    level = 1.0 - _check_confidence(confidence)
    delta = _check_audit_delta(delta, m)

    def rejected(eps):
        return one_run_p_value(v, r, m, eps, delta) < level

    if r == 0 or not rejected(0.0):
        return 0.0
    lo, hi = 0.0, 1.0
    while rejected(hi):  # p -> 1 as eps -> inf (v <= r), so this ends
        lo, hi = hi, 2.0 * hi
    while hi - lo > 1e-12 * hi:
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if rejected(mid) else (lo, mid)
    return lo


# --------------------------------------------------------------------------- #
# The canary audit.
# --------------------------------------------------------------------------- #
def random_canaries(nb_canaries: int, input_shape: Sequence[int], nb_classes: int,
                    input_bound: float, *, rng: Optional[np.random.Generator] = None) -> ArrayPair:
    """``(x, y)``: inputs uniform on the sphere of radius ``input_bound`` (the largest inputs a
    bounded model accepts, hence the largest gradient bounds) and labels uniform in
    ``[0, nb_classes)`` (int64). Independent of any data."""
    m = _check_int(nb_canaries, "nb_canaries", 1)
    k = _check_int(nb_classes, "nb_classes", 1)
    if isinstance(input_bound, bool) or not isinstance(input_bound, numbers.Real) \
            or not 0 < input_bound < math.inf:
        raise _invalid("input_bound", "a finite positive number", input_bound)
    rng = rng if rng is not None else np.random.default_rng()
    shape = tuple(int(d) for d in input_shape)
    x = rng.normal(size=(m, int(np.prod(shape))))
    x *= input_bound / np.linalg.norm(x, axis=1, keepdims=True)
    return x.reshape((m,) + shape).astype(np.float32), rng.integers(0, k, m).astype(np.int64)


@dataclasses.dataclass(frozen=True)
class CanaryAuditResult:
    """Outcome of `canary_audit`.

    Attributes:
        epsilon_lower_bound: with probability >= ``confidence`` (over the canaries' inclusion and
            the training randomness), ``train_fn`` is not (eps, delta)-DP w.r.t. one canary for
            any eps below this; 0.0 when nothing could be shown.
        confidence, delta: the level and the delta of that statement.
        epsilon_accountant: ``lipdp.accounting.epsilon_spent(model, delta)`` of the trained
            model when it has a privacy ledger and delta > 0, else None (inf without noise).
        nb_canaries, nb_included: m, and how many of them were trained on.
        k_positive, k_negative: guesses "in" (highest scores) and "out" (lowest scores).
        nb_guesses, nb_correct: r = k_positive + k_negative, and the correct ones (v).
        scores, included: per-canary score and inclusion bit, for plots.
        model: the model ``train_fn`` returned.
    """

    epsilon_lower_bound: float
    confidence: float
    delta: float
    epsilon_accountant: Optional[float]
    nb_canaries: int
    nb_included: int
    k_positive: int
    k_negative: int
    nb_guesses: int
    nb_correct: int
    scores: np.ndarray = dataclasses.field(repr=False, compare=False)
    included: np.ndarray = dataclasses.field(repr=False, compare=False)
    model: object = dataclasses.field(default=None, repr=False, compare=False)

    def as_dict(self) -> dict:
        """JSON-ready summary (without arrays and model)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name not in ("scores", "included", "model")}

    def summary(self) -> str:
        accountant = ("no accountant" if self.epsilon_accountant is None
                      else f"accountant: epsilon = {format_epsilon(self.epsilon_accountant)}")
        lower = format_epsilon(self.epsilon_lower_bound, upward=False)
        return (f"canary audit: epsilon >= {lower} at "
                f"{self.confidence:.0%} confidence (delta = {self.delta:g}; "
                f"{self.nb_correct}/{self.nb_guesses} correct guesses on {self.nb_canaries} "
                f"canaries, {self.nb_included} included); {accountant}")


def _labels_like(y_canaries: np.ndarray, y_train: np.ndarray) -> np.ndarray:
    """Canary class indices ``(m,)`` in the label format of ``y_train``: one-hot for one-hot
    labels ``(n, K > 1)``, else the rank and dtype of ``y_train``. Labels already in another
    format, or with no training labels to copy, are returned as they are."""
    if y_canaries.ndim != 1 or y_canaries.dtype.kind not in "iu" or not len(y_train):
        return y_canaries
    if y_train.ndim == 2 and y_train.shape[1] > 1:
        dtype = y_train.dtype if y_train.dtype.kind == "f" else np.float32
        return np.eye(y_train.shape[1], dtype=dtype)[y_canaries]
    return y_canaries.reshape((len(y_canaries),) + y_train.shape[1:]).astype(y_train.dtype)


def canary_audit(
    train_fn: Callable[[np.ndarray, np.ndarray], tf.keras.Model],
    x_train,
    y_train,
    *,
    nb_canaries: int = 1000,
    canaries: Union[None, ArrayPair, Callable[[int, np.random.Generator], ArrayPair]] = None,
    input_bound: Optional[float] = None,
    nb_classes: Optional[int] = None,
    k_positive: Optional[int] = None,
    k_negative: Optional[int] = None,
    confidence: float = 0.95,
    delta: Optional[float] = None,
    score_fn: Optional[Callable] = None,
    seed: Optional[int] = None,
    batch_size: int = 1024,
) -> CanaryAuditResult:
    """One-run privacy audit (Steinke, Nasr & Jagielski 2023): an epsilon lower bound at a
    stated confidence, from a single training run, beside the accountant's epsilon.

    Each of m canaries joins ``(x_train, y_train)`` independently with probability 1/2; the
    union, shuffled, is passed to ``train_fn`` once. The canaries are scored with
    ``score_fn(model, x_canaries, y_canaries)`` (default `loss_scores`, minus the loss), the
    ``k_positive`` highest are guessed "in" and the ``k_negative`` lowest "out", and the correct
    guesses give `one_run_epsilon_lower_bound`.

    **Guarantee.** If ``train_fn`` is (eps, delta)-DP with respect to adding or removing one
    canary (``x_train`` fixed), then ``P[result.epsilon_lower_bound > eps] <= 1 - confidence``.
    See the module docstring for the caller's side: fixed privacy parameters whatever the
    number of included canaries (a fixed public N for lipdp's sampling rate), nothing in
    ``score_fn`` that depends on the inclusion bits.

    Args:
        train_fn: ``(x, y) -> trained model``; any training algorithm (lipdp or not).
        x_train, y_train: the fixed, non-canary training data (may be empty).
        nb_canaries: m (ignored when ``canaries`` is an array pair).
        canaries: an ``(x, y)`` pair, or ``(m, rng) -> (x, y)``; labels as class indices or in
            the format of ``y_train``. Default `random_canaries` on the sphere of radius
            ``input_bound`` with uniform labels.
        input_bound: default canaries' norm; default the largest L2 norm in ``x_train``
            (the model's declared input bound is the natural choice).
        nb_classes: default canaries' classes; default the width of one-hot ``y_train``, or
            ``max(y_train) + 1``.
        k_positive, k_negative: number of "in" / "out" guesses; default ``m // 10`` each.
        confidence: level of the lower bound.
        delta: delta of the audited claim; default the trained model's
            ``dp_parameters.delta`` if it has one, else 0. Needs ``2 m delta <= 1``.
        score_fn: ``(model, x, y) -> scores``, higher meaning "member".
        seed: seeds the canaries, their inclusion and the shuffling (the training's own
            randomness is ``train_fn``'s).

    Returns:
        `CanaryAuditResult`.
    """
    confidence = _check_confidence(confidence)
    rng = np.random.default_rng(seed)
    x_train, y_train = np.asarray(x_train), np.asarray(y_train)
    if len(x_train) != len(y_train):
        raise ValueError(f"x_train and y_train have different lengths, {len(x_train)} and "
                         f"{len(y_train)}.")

    if isinstance(canaries, (tuple, list)):
        x_c, y_c = _as_pair(canaries, "canaries")
    elif canaries is not None:
        x_c, y_c = _as_pair(canaries(_check_int(nb_canaries, "nb_canaries", 1), rng),
                            "canaries(m, rng)")
    else:
        if nb_classes is None:
            if y_train.ndim == 2 and y_train.shape[1] > 1:
                nb_classes = int(y_train.shape[1])
            elif len(y_train):
                nb_classes = int(np.max(y_train)) + 1
            else:
                raise ValueError("Give `nb_classes` (y_train is empty).")
        if input_bound is None:
            if not len(x_train):
                raise ValueError("Give `input_bound` (x_train is empty).")
            input_bound = float(np.max(np.linalg.norm(
                x_train.reshape(len(x_train), -1).astype(np.float64), axis=1)))
        x_c, y_c = random_canaries(_check_int(nb_canaries, "nb_canaries", 1), x_train.shape[1:],
                                   nb_classes, input_bound, rng=rng)
    y_c = _labels_like(y_c, y_train)
    m = len(x_c)
    if m == 0:
        raise ValueError("The audit needs at least one canary.")
    if len(x_train) and x_c.shape[1:] != x_train.shape[1:]:
        raise ValueError(f"Canaries of shape {x_c.shape[1:]} but training inputs of shape "
                         f"{x_train.shape[1:]}.")
    k_pos = m // 10 if k_positive is None else _check_int(k_positive, "k_positive")
    k_neg = m // 10 if k_negative is None else _check_int(k_negative, "k_negative")
    if k_pos + k_neg > m or k_pos + k_neg == 0:
        raise ValueError(f"Expected 0 < k_positive + k_negative <= nb_canaries = {m}. Received: "
                         f"k_positive={k_pos}, k_negative={k_neg}")
    if delta is not None:
        _check_audit_delta(delta, m)
    # Before training: guesses too few for any outcome to show epsilon > 0 (all right, with
    # the audit's delta or, still unknown, 0) make the run an audit that cannot fail.
    best = one_run_epsilon_lower_bound(k_pos + k_neg, k_pos + k_neg, m, confidence=confidence,
                                       delta=delta or 0.0)
    if best <= 0:
        raise ValueError(
            f"{k_pos + k_neg} guesses (k_positive={k_pos}, k_negative={k_neg}) cannot show "
            f"epsilon > 0 at {confidence:.0%} confidence, even all right: the audit would "
            "report epsilon >= 0 whatever the training leaks. Use more canaries or guesses "
            "(the default guesses nb_canaries // 10 each way).")

    included = rng.random(m) < 0.5
    x = np.concatenate([x_train.astype(x_c.dtype, copy=False), x_c[included]]) \
        if len(x_train) else x_c[included]
    y = np.concatenate([y_train.astype(y_c.dtype, copy=False), y_c[included]]) \
        if len(y_train) else y_c[included]
    order = rng.permutation(len(x))
    model = train_fn(x[order], y[order])

    score_fn = score_fn or (lambda mdl, xs, ys: loss_scores(mdl, xs, ys, batch_size))
    scores = np.asarray(score_fn(model, x_c, y_c), np.float64).reshape(-1)
    if len(scores) != m or not np.all(np.isfinite(scores)):
        raise ValueError(f"`score_fn` must return {m} finite scores, one per canary.")
    # Rank by score, ties in a random order (independent of the inclusion bits).
    shuffled = rng.permutation(m)
    ranked = shuffled[np.argsort(-scores[shuffled], kind="stable")]
    guessed_in, guessed_out = ranked[:k_pos], ranked[m - k_neg:]
    nb_correct = int(included[guessed_in].sum() + (~included[guessed_out]).sum())

    if delta is None:
        parameters = getattr(model, "dp_parameters", None)
        delta = float(parameters.delta) if parameters is not None else 0.0
    delta = _check_audit_delta(delta, m)
    lower_bound = one_run_epsilon_lower_bound(nb_correct, k_pos + k_neg, m,
                                              confidence=confidence, delta=delta)
    epsilon_accountant = None
    if delta > 0 and getattr(model, "privacy_ledger", None) is not None:
        epsilon_accountant = float(epsilon_spent(model, delta))
    return CanaryAuditResult(
        epsilon_lower_bound=lower_bound, confidence=confidence, delta=delta,
        epsilon_accountant=epsilon_accountant, nb_canaries=m, nb_included=int(included.sum()),
        k_positive=k_pos, k_negative=k_neg, nb_guesses=k_pos + k_neg, nb_correct=nb_correct,
        scores=scores, included=included, model=model)
