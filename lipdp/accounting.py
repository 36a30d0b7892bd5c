"""Privacy accounting: epsilon of a training run, steps for a budget, noise for a budget.

The mechanism
-------------
One training step of lipdp releases ``g + N(0, Sigma)`` where ``g`` is the
averaged gradient of a **Poisson-subsampled** batch (every example joins with
probability ``q``, independently) and the noise is calibrated to the
sensitivity of ``g`` under the *add/remove one example* neighbouring relation.
`step_noise_multiplier` reduces the step to one isotropic Gaussian mechanism
with a noise multiplier ``s`` (std / L2-sensitivity). A run of ``T`` steps is the
``T``-fold adaptive composition of the Poisson-subsampled Gaussian mechanism
``SG(q, s)``.

Renyi DP, the way autodp computes it
------------------------------------
For an integer order ``alpha >= 2`` the RDP of ``SG(q, s)`` (add/remove) is
exactly (Mironov, Talwar & Zhang 2019, "Renyi DP of the Sampled Gaussian
Mechanism", Sec. 3.3; Zhu & Wang 2019, "Poisson subsampled RDP", Thm. 6)::

    eps_1(alpha) = 1/(alpha-1) * log( sum_{k=0}^{alpha} C(alpha,k) (1-q)^(alpha-k) q^k
                                      * exp(k (k-1) / (2 s^2)) )

autodp implements it in ``transformer_zoo.AmplificationBySampling(PoissonSampling=True)``
applied to ``mechanism_zoo.ExactGaussianMechanism`` with ``improved_bound_flag=True``
(the Gaussian satisfies the conditions of Zhu & Wang's Theorem 6, so the tight
formula applies). We evaluate that function on a fixed grid of integer orders
(below). RDP composes additively, so ``T`` steps have ``eps_T(alpha) = T * eps_1(alpha)``
(this is exactly what ``autodp.transformer_zoo.Composition`` computes; doing the
multiplication ourselves lets us evaluate autodp once per ``(s, q)`` and then
answer any ``T`` in microseconds, which the budget searches and per-epoch
callbacks need).

Conversion to (epsilon, delta)
------------------------------
For every order (Balle et al. 2020, "Hypothesis testing interpretations and
Renyi DP", Thm. 21; Canonne, Kamath & Steinke 2020, Prop. 12 -- the conversion
autodp uses by default, ``BBGHS_conversion=True``, and dp_accounting too)::

    epsilon = max(0, min_alpha  T eps_1(alpha) + log(1 - 1/alpha) - (log delta + log alpha) / (alpha - 1))

Any order gives a valid bound, so minimising over a grid is always sound; the
grid only affects tightness.

Why a grid of integer orders, and which one
-------------------------------------------
* autodp computes the subsampled-Gaussian RDP exactly only at integer orders.
  At fractional orders it linearly interpolates the cumulant generating function
  (a valid but looser upper bound) and for ``1 < alpha < 2`` it returns
  ``eps(2)``. Measured over the grid below: autodp's own ``get_approxDP``
  (Brent minimisation over those interpolated values) gives the same epsilon
  as all integer orders to 4-5 digits, at 30-500 ms per call (every call
  re-evaluates the curve) instead of microseconds once the curve is cached.
  Our grid is sparser above 64, which costs <= 1% on epsilons < 0.1.
* Grid: every integer in [2, 64], even integers in (64, 128], every 8th in
  (128, 256] (``_BASE_ORDERS``, ~0.2 s of autodp time per ``(s, q)``), and a
  geometric grid from 331 to 1e6 (``_HIGH_ORDERS``, ~0.45 s) that is only
  evaluated when the best order of a single step is the largest base order,
  i.e. in the very-low-epsilon regime (large ``s``, tiny ``q``). The decision is
  made per ``(s, q, delta)`` at ``T = 1`` (the optimal order decreases with
  ``T``), so for fixed ``(s, q, delta)`` the grid is fixed and epsilon is exactly
  non-decreasing in ``T``.
* Tightness (tests/test_accounting.py; ``python tests/test_accounting.py``
  prints the full table): at the same integer orders, autodp's RDP and
  dp_accounting's agree to 1e-7 relative (log-sum-exp rounding), so lipdp is
  never below dp_accounting given lipdp's orders too. Against dp_accounting with
  its default orders, over s in {0.7,1,2,3,5} x q in {0.001,0.01,0.1,0.25} x
  T in {1,10,100,1000} x delta in {1e-5,1e-6}: at most +1.8% for s >= 2 (lipdp's
  regime), +4.2% for s >= 1 and epsilon <= 10; looser where the optimal order is
  small and fractional, because autodp has no exact fractional-order formula:
  up to +9% at s = 0.7 (epsilon 1.3-4) and +98% once epsilon > 50 (s = 0.7,
  q = 0.25, T = 1000: 360 vs 181). lipdp is *lower* (by up to 55%) than
  dp_accounting with its default orders when the optimal order falls in a gap of
  that grid (64..127, 129..255): a valid, tighter bound (same value as
  dp_accounting evaluated at lipdp's orders, and above the PLD accountant).

Runs whose mechanism changes
----------------------------
A model's ledger (`lipdp.ledger`) records segments of steps with one mechanism
each (noise multiplier, strategy and number of noised variables, sampling
rate); `compose_epsilon` adds their RDP curves order by order (composition of
adaptive mechanisms) before the conversion, and `max_steps_after` finds how
many more steps of a given mechanism fit in a budget after them.

Assumptions
-----------
* Poisson sampling with rate ``q = batch_size / N``. With shuffled fixed-size
  batches the reported epsilon is the customary approximation, not a proof.
* The averaged gradient divides by a fixed public denominator, so its L2
  sensitivity is ``sqrt(sum_v Delta_v^2)`` (global) or ``Delta_v`` per variable
  (per-layer) under add/remove (see DESIGN.md, "The one invariant").

This module is pure Python + numpy + autodp: it never touches tensors.
"""

from __future__ import annotations

import contextlib
import decimal
import functools
import math
import numbers
import warnings
from typing import Optional, Tuple

import numpy as np

from lipdp.metadata import DPMode, NoiseStrategy, _parse_enum

__all__ = [
    "step_noise_multiplier",
    "joint_noise_multiplier",
    "compute_rdp",
    "compute_epsilon",
    "max_steps_for_budget",
    "compose_epsilon",
    "max_steps_after",
    "noise_for_budget",
    "model_step_noise_multiplier",
    "get_eps_delta",
    "get_max_epochs",
    "NoEpochFitsWarning",
    "epsilon_spent",
    "format_epsilon",
]


def format_epsilon(value, digits: int = 4, upward: bool = True) -> str:
    """`value` to `digits` significant digits, as ``format(value, ".4g")`` writes it, but
    rounded up (or down with ``upward=False``, for a lower bound) instead of to the nearest:
    an epsilon printed from the accountant stays an upper bound of the one computed (an
    audit, 2026-12-07: epsilon=0.4432 printed for 0.443241). Through the decimal expansion
    of the float, but for a value within 1e-12 of its nearest rounding (the float nearest
    0.1 lies above 0.1: it is written 0.1, not 0.1001); ``inf``, NaN and 0 as ``format``
    writes them."""
    value = float(value)
    nearest = format(value, f".{digits}g")
    if not math.isfinite(value) or math.isclose(float(nearest), value, rel_tol=1e-12,
                                                abs_tol=0.0):
        return nearest
    exact = decimal.Decimal(value)
    step = decimal.Decimal(1).scaleb(exact.adjusted() - digits + 1)
    rounded = exact.quantize(step, rounding=decimal.ROUND_CEILING if upward
                             else decimal.ROUND_FLOOR)
    return format(float(rounded), f".{digits}g")


# Integer RDP orders, see the module docstring.
_BASE_ORDERS = np.concatenate(
    [np.arange(2, 65), np.arange(66, 129, 2), np.arange(136, 257, 8)]
).astype(np.float64)
_HIGH_ORDERS = np.unique(np.round(np.geomspace(256.0, 1e6, 33)[1:])).astype(np.float64)

# Largest number of steps the accountant counts (and max_steps_for_budget considers).
MAX_STEPS = 2**62
# autodp's RDP of one step at integer order a is ``log(A_a) / (a - 1)``, with ``log(A_a)``
# the log-sum-exp of a + 1 positive terms: each term and the log round by about the unit
# roundoff u = 2^-53. Where ``A_a - 1`` is near u (a large noise multiplier, a tiny q) that
# is the whole value: 0 for 4.2e-17 at s = 100, q = 1e-6, a = 2, and T = 1e15 such steps
# gave an epsilon of 0.078 for a true ~0.097 (an audit, 2026-12-05). Every step's RDP is
# raised by ``2 (a + 1) u / (a - 1)``, 16x and 7x the errors measured at orders 2 and 118:
# an epsilon moves by under 1e-10 for 1e5 steps.
_LOG_SUM_EXP_ROUNDING = 2.0 ** -52
# Range of noise multipliers noise_for_budget will search.
_SIGMA_MIN, _SIGMA_MAX = 1e-3, 1e6


# --------------------------------------------------------------------------- #
# Argument validation (errors echo the bad value, Keras style).
# --------------------------------------------------------------------------- #
def _invalid(argname, expected, value):
    return ValueError(
        f"Received an invalid value for `{argname}`, expected {expected}. "
        f"Received: {argname}={value!r}"
    )


def _is_real(value):
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _check_noise_multiplier(value, argname="noise_multiplier"):
    if not _is_real(value) or not math.isfinite(value) or value < 0:
        raise _invalid(argname, "a finite non-negative number", value)
    return float(value)


def _check_sampling_rate(value, argname="sampling_rate"):
    if not _is_real(value) or not (0 < value <= 1):
        raise _invalid(argname, "a number in (0, 1]", value)
    return float(value)


def _check_delta(value, argname="delta"):
    if not _is_real(value) or not (0 < value < 1):
        raise _invalid(argname, "a number in (0, 1)", value)
    return float(value)


def _check_count(value, argname, positive=False):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) \
            or not int(positive) <= value <= MAX_STEPS:
        raise _invalid(argname, ("a positive" if positive else "a non-negative")
                       + " integer up to 2**62", value)
    return int(value)


def _check_budget(value, argname="epsilon_budget", allow_zero=True):
    ok = _is_real(value) and math.isfinite(value) and (value >= 0 if allow_zero else value > 0)
    if not ok:
        raise _invalid(argname, "a finite non-negative number" if allow_zero
                       else "a finite positive number", value)
    return float(value)


# --------------------------------------------------------------------------- #
# Mechanism of one step.
# --------------------------------------------------------------------------- #
def step_noise_multiplier(strategy, noise_multiplier, nb_noised_variables,
                          count_noise_multiplier: float = 0.0) -> float:
    """Noise multiplier of the single Gaussian mechanism that one step amounts to.

    Args:
        strategy: a `NoiseStrategy` or its value (``"global"``, ``"per-layer"``).
        noise_multiplier: sigma of `DPParameters` (>= 0).
        nb_noised_variables: V, the number of noised (trainable) variables (>= 1).
        count_noise_multiplier: sigma_b of the count an `AdaptiveClipping` step releases
            (sensitivity 1/2); 0 (default) when the step releases none.

    Returns:
        ``sigma`` for ``GLOBAL``; ``sigma / sqrt(V)`` for ``PER_LAYER``; with a count,
        that multiplier joint with the count's ``2 sigma_b`` (`joint_noise_multiplier`).

    Math:
        * ``GLOBAL``: the whole gradient gets isotropic noise of std
          ``sigma * sqrt(sum_v Delta_v^2)`` and its L2 sensitivity is
          ``sqrt(sum_v Delta_v^2)``: a Gaussian mechanism with multiplier sigma.
        * ``PER_LAYER``: variable v gets noise of std ``sigma * Delta_v`` and has
          sensitivity ``Delta_v``; the step releases all V blocks at once from the
          same (Poisson-sampled) batch, i.e. one *anisotropic* Gaussian
          ``g + N(0, diag(sigma^2 Delta_v^2 I_v))``. Rescaling block v by
          ``1 / (sigma Delta_v)`` is a fixed, data-independent bijection, so it
          changes nothing to privacy (post-processing, both ways) and turns the
          noise into ``N(0, I)``. A neighbouring dataset moves the mean by ``d``
          with ``||d_v|| <= Delta_v``; after rescaling its norm (the Mahalanobis
          norm of ``d`` w.r.t. the noise covariance) is
          ``sqrt(sum_v ||d_v||^2 / (sigma^2 Delta_v^2)) <= sqrt(V) / sigma``,
          with equality when every block is at its bound. A Gaussian of unit std
          and sensitivity ``sqrt(V) / sigma`` has the privacy loss distribution of
          an isotropic Gaussian with noise multiplier ``sigma / sqrt(V)``.
          Because a single subsample feeds all blocks, it is this *joint*
          mechanism that is subsampled, once per step (not V independently
          subsampled mechanisms). Variables with ``Delta_v = 0`` only make the
          bound conservative.
    """
    strategy = _parse_enum(NoiseStrategy, strategy, "strategy")
    sigma = _check_noise_multiplier(noise_multiplier)
    nb = _check_count(nb_noised_variables, "nb_noised_variables", positive=True)
    count = _check_noise_multiplier(count_noise_multiplier, "count_noise_multiplier")
    gradient = sigma if strategy is NoiseStrategy.GLOBAL else sigma / math.sqrt(nb)
    return gradient if count == 0 else joint_noise_multiplier(gradient, 2 * count)


def joint_noise_multiplier(*noise_multipliers: float) -> float:
    """Noise multiplier of Gaussian mechanisms run on the same subsample in one step.

    Query j, of sensitivity s_j, gets noise of std ``z_j s_j``. Dividing each block by
    its std (a fixed bijection) gives unit noise and a joint L2 sensitivity
    ``sqrt(sum_j z_j^-2)``: the isotropic Gaussian with multiplier
    ``z = (sum_j z_j^-2)^-1/2``, subsampled once per step (the argument of the
    per-layer strategy in `step_noise_multiplier`). A noise-free query (z_j = 0) makes
    the step non-private (0). Used for the count of
    `lipdp.AdaptiveClipping` (sensitivity 1/2, std sigma_b: z = 2 sigma_b) beside the
    gradient.
    """
    multipliers = [_check_noise_multiplier(z) for z in noise_multipliers]
    if not multipliers:
        raise ValueError("Give at least one noise multiplier.")
    if any(z == 0 for z in multipliers):
        return 0.0
    # Scaled by the smallest: 1 / z^2 overflowed (or z^2 underflowed to a division by zero)
    # for multipliers near 1e-170 or 1e200.
    smallest = min(multipliers)
    return smallest / math.sqrt(sum((smallest / z) ** 2 for z in multipliers))


# --------------------------------------------------------------------------- #
# RDP curves from autodp.
# --------------------------------------------------------------------------- #
@functools.lru_cache(maxsize=64)
def _subsampled_gaussian(noise_multiplier: float, sampling_rate: float):
    """autodp's Poisson-subsampled Gaussian mechanism (one step)."""
    from autodp import mechanism_zoo, transformer_zoo  # heavy-ish import, done lazily

    gaussian = mechanism_zoo.ExactGaussianMechanism(sigma=noise_multiplier)
    subsample = transformer_zoo.AmplificationBySampling(PoissonSampling=True)
    with _quiet():  # autodp precomputes log(1 - q), -inf for q = 1 (then unused)
        # improved_bound_flag=True: the tight bound of Zhu & Wang (2019), Thm. 6,
        # valid for the Gaussian mechanism (exact for integer orders).
        return subsample(gaussian, sampling_rate, improved_bound_flag=True)


@contextlib.contextmanager
def _quiet():
    """Silence numpy's overflow/invalid warnings inside autodp.

    autodp's log-sum-exp overflows to inf/nan on extreme orders; lipdp treats
    nan as inf (no bound at that order), so the warnings carry no information.
    """
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore", RuntimeWarning)
        yield


@functools.lru_cache(maxsize=512)
def _rdp_curve(noise_multiplier: float, sampling_rate: float, high: bool) -> np.ndarray:
    """RDP of one step at `_BASE_ORDERS` (or `_HIGH_ORDERS` if `high`), read-only array."""
    orders = _HIGH_ORDERS if high else _BASE_ORDERS
    with _quiet():
        values = np.array([_renyi_dp(noise_multiplier, sampling_rate, a) for a in orders])
    values = _with_rounding_allowance(values, orders)
    values.setflags(write=False)
    return values


def _with_rounding_allowance(rdp: np.ndarray, orders: np.ndarray) -> np.ndarray:
    """One step's RDP from autodp (NaN: no bound, inf), raised by the rounding of its
    log-sum-exp (`_LOG_SUM_EXP_ROUNDING`)."""
    rdp = np.maximum(np.where(np.isnan(rdp), np.inf, rdp), 0.0)
    return rdp + _LOG_SUM_EXP_ROUNDING * (orders + 1.0) / (orders - 1.0)


def _renyi_dp(noise_multiplier: float, sampling_rate: float, order) -> float:
    """autodp's RDP of one step at `order`; inf (no bound) where its arithmetic fails: a
    noise multiplier whose square underflows (1e-300) divided by zero there."""
    try:
        return float(_subsampled_gaussian(noise_multiplier, sampling_rate).RenyiDP(float(order)))
    except (ZeroDivisionError, OverflowError):
        return math.inf


def _conversion_offset(orders: np.ndarray, delta: float) -> np.ndarray:
    """``log(1 - 1/a) - (log(delta) + log(a)) / (a - 1)`` (BBGHS / CKS conversion)."""
    return np.log1p(-1.0 / orders) - (math.log(delta) + np.log(orders)) / (orders - 1.0)


@functools.lru_cache(maxsize=512)
def _orders_and_rdp(noise_multiplier: float, sampling_rate: float, delta: float):
    """The fixed order grid used for ``(sigma, q, delta)`` and the one-step RDP on it."""
    rdp = _rdp_curve(noise_multiplier, sampling_rate, False)
    one_step = rdp + _conversion_offset(_BASE_ORDERS, delta)
    if np.all(np.isinf(one_step)) or int(np.argmin(one_step)) == len(_BASE_ORDERS) - 1:
        # The optimum of a single step is at (or beyond) the largest base order:
        # extend the grid with large orders (only useful for tiny epsilons).
        orders = np.concatenate([_BASE_ORDERS, _HIGH_ORDERS])
        rdp = np.concatenate([rdp, _rdp_curve(noise_multiplier, sampling_rate, True)])
        return orders, rdp
    return _BASE_ORDERS, rdp


def compute_rdp(noise_multiplier, sampling_rate, steps, orders=None) -> Tuple[np.ndarray, np.ndarray]:
    """RDP of ``steps`` compositions of the Poisson-subsampled Gaussian, via autodp.

    Args:
        noise_multiplier: s >= 0 (std / L2 sensitivity of one step).
        sampling_rate: q in (0, 1].
        steps: T >= 0.
        orders: optional RDP orders (> 1). Default: lipdp's base integer grid.

    Returns:
        ``(orders, rdp)`` with ``rdp[i] = T * eps_1(orders[i])`` (inf where unbounded).
    """
    sigma = _check_noise_multiplier(noise_multiplier)
    q = _check_sampling_rate(sampling_rate)
    steps = _check_count(steps, "steps")
    if orders is None:
        orders = _BASE_ORDERS.copy()
    else:
        orders = np.asarray(orders, dtype=np.float64)
        if orders.ndim != 1 or not np.all(orders > 1):
            raise _invalid("orders", "a 1-D sequence of numbers > 1", orders)
    if steps == 0:
        return orders, np.zeros(len(orders))
    if sigma == 0:
        return orders, np.full(len(orders), np.inf)
    if np.array_equal(orders, _BASE_ORDERS):
        return orders, steps * np.asarray(_rdp_curve(sigma, q, False))
    mechanism = _subsampled_gaussian(sigma, q)
    with _quiet():
        rdp = np.array([float(mechanism.RenyiDP(float(a))) for a in orders])
    return orders, steps * _with_rounding_allowance(rdp, orders)


# --------------------------------------------------------------------------- #
# epsilon(delta), and its inverses.
# --------------------------------------------------------------------------- #
@functools.lru_cache(maxsize=4096)
def _epsilon(noise_multiplier: float, sampling_rate: float, steps: int, delta: float) -> float:
    if steps == 0:
        return 0.0
    if noise_multiplier == 0:
        return math.inf
    orders, rdp = _orders_and_rdp(noise_multiplier, sampling_rate, delta)
    with np.errstate(invalid="ignore", over="ignore"):
        eps = steps * rdp + _conversion_offset(orders, delta)
    eps = np.where(np.isnan(eps), np.inf, eps)
    return float(max(0.0, float(np.min(eps))))


def compute_epsilon(noise_multiplier, sampling_rate, steps, delta) -> float:
    """Epsilon of ``steps`` compositions of the Poisson-subsampled Gaussian mechanism.

    ``(epsilon, delta)``-DP under the add/remove relation, from autodp's RDP of
    the subsampled Gaussian at lipdp's integer order grid, composed additively
    over steps and converted with the BBGHS/CKS bound (module docstring)::

        epsilon = max(0, min_alpha T eps_1(alpha) + log(1 - 1/alpha)
                                    - (log delta + log alpha) / (alpha - 1))

    Args:
        noise_multiplier: s >= 0, std / L2-sensitivity of one step (use
            `step_noise_multiplier` for the per-layer strategy).
        sampling_rate: q in (0, 1], the Poisson sampling probability.
        steps: T >= 0, number of steps.
        delta: in (0, 1).

    Returns:
        epsilon (a Python float): 0.0 if ``steps == 0``, ``math.inf`` if
        ``noise_multiplier == 0`` (no noise, no privacy). Non-decreasing in
        ``steps`` and ``sampling_rate``, non-increasing in ``noise_multiplier``
        and ``delta``. Results are cached (callbacks call this every epoch).
    """
    sigma = _check_noise_multiplier(noise_multiplier)
    q = _check_sampling_rate(sampling_rate)
    steps = _check_count(steps, "steps")
    delta = _check_delta(delta)
    return _epsilon(sigma, q, steps, delta)


def max_steps_for_budget(epsilon_budget, noise_multiplier, sampling_rate, delta) -> int:
    """Largest T with ``compute_epsilon(noise_multiplier, sampling_rate, T, delta) <= epsilon_budget``.

    Returns 0 if even one step exceeds the budget (or ``noise_multiplier == 0``).
    Exponential search for a bracket then binary search; epsilon is
    non-decreasing in T, so ``eps(T) <= budget < eps(T + 1)`` for the result.

    Raises:
        ValueError: on invalid arguments, or if more than 2**62 steps fit in the
            budget (effectively unbounded).
    """
    budget = _check_budget(epsilon_budget)
    sigma = _check_noise_multiplier(noise_multiplier)
    q = _check_sampling_rate(sampling_rate)
    delta = _check_delta(delta)
    return _largest_fitting(lambda steps: _epsilon(sigma, q, steps, delta) <= budget,
                            lambda: (f"epsilon_budget={epsilon_budget!r}, noise_multiplier="
                                     f"{noise_multiplier!r}, sampling_rate={sampling_rate!r}, "
                                     f"delta={delta!r}"))


def _largest_fitting(fits, describe) -> int:
    """Largest T >= 0 with ``fits(T)`` for a predicate true at 0 and monotone (true then
    false); 0 if ``fits(1)`` is false. Exponential bracket, then bisection."""
    if not fits(1):
        return 0
    lo, hi = 1, 2  # invariant: fits(lo) and (hi unknown, then not fits(hi))
    while fits(hi):
        lo, hi = hi, hi * 2
        if hi > MAX_STEPS:
            raise ValueError(
                f"More than {MAX_STEPS} steps fit in the budget: the privacy budget is "
                f"effectively unbounded for this mechanism. Received: {describe()}")
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


# --------------------------------------------------------------------------- #
# Heterogeneous composition: runs whose mechanism changed between segments.
# --------------------------------------------------------------------------- #
def _check_segments(segments):
    checked = []
    for segment in segments:
        try:
            sigma, q, steps = segment
        except (TypeError, ValueError):
            raise _invalid("segments", "a sequence of (noise_multiplier, sampling_rate, steps)",
                           segments) from None
        checked.append((_check_noise_multiplier(sigma), _check_sampling_rate(q),
                        _check_count(steps, "steps")))
    return [segment for segment in checked if segment[2] > 0]


def _shared_grid(mechanisms, delta) -> Tuple[bool, np.ndarray]:
    """``(high, orders)``: whether the composition of `mechanisms` ``[(sigma, q)]`` needs
    the high orders, and the grid. Decided as for a single mechanism
    (`_orders_and_rdp`), per mechanism at one step, so that the grid does not depend
    on step counts (epsilon then stays non-decreasing in each count)."""
    high = any(len(_orders_and_rdp(sigma, q, delta)[0]) > len(_BASE_ORDERS)
               for sigma, q in mechanisms if sigma > 0)
    return high, np.concatenate([_BASE_ORDERS, _HIGH_ORDERS]) if high else _BASE_ORDERS


def _one_step_rdp(sigma, q, high) -> np.ndarray:
    if sigma == 0:
        return np.full(len(_BASE_ORDERS) + (len(_HIGH_ORDERS) if high else 0), np.inf)
    rdp = _rdp_curve(sigma, q, False)
    return np.concatenate([rdp, _rdp_curve(sigma, q, True)]) if high else rdp


def _composed_epsilon(terms, orders, delta) -> float:
    """``max(0, min_alpha sum_k T_k eps_k(alpha) + offset(alpha))`` for ``terms = [(T_k, rdp_k)]``."""
    with np.errstate(invalid="ignore", over="ignore"):
        rdp = sum(steps * curve for steps, curve in terms)
        eps = rdp + _conversion_offset(orders, delta)
    eps = np.where(np.isnan(eps), np.inf, eps)
    return float(max(0.0, float(np.min(eps))))


def compose_epsilon(segments, delta) -> float:
    """Epsilon of a run made of segments with different mechanisms.

    Segment k is ``T_k`` steps of the Poisson-subsampled Gaussian mechanism
    ``SG(q_k, s_k)``. RDP composes additively over adaptive mechanisms, so the
    run has ``eps(alpha) = sum_k T_k eps_k(alpha)`` at every order alpha (the
    same exact integer-order values as `compute_epsilon`, on one grid shared
    by all segments), converted to ``(epsilon, delta)`` as in `compute_epsilon`.
    With one segment the result equals ``compute_epsilon(s, q, T, delta)``.

    Args:
        segments: sequence of ``(noise_multiplier, sampling_rate, steps)``.
        delta: in (0, 1).

    Returns:
        epsilon: 0.0 without steps, ``math.inf`` if a segment with steps has no noise.
    """
    delta = _check_delta(delta)
    active = _check_segments(segments)
    if not active:
        return 0.0
    high, orders = _shared_grid([(sigma, q) for sigma, q, _ in active], delta)
    return _composed_epsilon([(t, _one_step_rdp(sigma, q, high)) for sigma, q, t in active],
                             orders, delta)


def max_steps_after(segments, epsilon_budget, noise_multiplier, sampling_rate, delta) -> int:
    """Largest T such that the run `segments` followed by T steps of ``SG(q, s)`` has
    ``compose_epsilon(...) <= epsilon_budget``; 0 if not even one more step fits
    (or ``s == 0``). With no past segments this is `max_steps_for_budget`.

    Raises:
        ValueError: on invalid arguments, or if the budget is effectively unbounded.
    """
    budget = _check_budget(epsilon_budget)
    sigma = _check_noise_multiplier(noise_multiplier)
    q = _check_sampling_rate(sampling_rate)
    delta = _check_delta(delta)
    active = _check_segments(segments)
    high, orders = _shared_grid([(s, p) for s, p, _ in active] + [(sigma, q)], delta)
    past = [(t, _one_step_rdp(s, p, high)) for s, p, t in active]
    current = _one_step_rdp(sigma, q, high)
    return _largest_fitting(
        lambda steps: _composed_epsilon(past + [(steps, current)], orders, delta) <= budget,
        lambda: (f"segments={list(segments)!r}, epsilon_budget={epsilon_budget!r}, "
                 f"noise_multiplier={noise_multiplier!r}, sampling_rate={sampling_rate!r}, "
                 f"delta={delta!r}"))


def noise_for_budget(epsilon_budget, sampling_rate, steps, delta, rtol: float = 1e-3) -> float:
    """Smallest noise multiplier s (within ``rtol`` relative) with epsilon <= budget.

    Returns an ``s`` such that ``compute_epsilon(s, sampling_rate, steps, delta)
    <= epsilon_budget`` and ``compute_epsilon(s / (1 + rtol), ...) > epsilon_budget``
    (geometric bisection; epsilon is non-increasing in s). ``steps == 0`` needs
    no noise and returns 0.0.

    Raises:
        ValueError: on invalid arguments, or if the budget needs s > 1e6 or is
            met by every s >= 1e-3.
    """
    budget = _check_budget(epsilon_budget, allow_zero=False)
    q = _check_sampling_rate(sampling_rate)
    steps = _check_count(steps, "steps")
    delta = _check_delta(delta)
    if not (_is_real(rtol) and 0 < rtol < 1):
        raise _invalid("rtol", "a number in (0, 1)", rtol)
    if steps == 0:
        return 0.0

    def fits(sigma):
        return _epsilon(sigma, q, steps, delta) <= budget

    def args():
        return (f"Received: epsilon_budget={epsilon_budget!r}, sampling_rate={sampling_rate!r}, "
                f"steps={steps!r}, delta={delta!r}")

    # Bracket: fits(hi) and not fits(lo).
    lo = hi = 1.0
    if fits(1.0):
        while fits(lo):
            hi, lo = lo, lo / 2
            if lo < _SIGMA_MIN:
                raise ValueError(f"Every noise multiplier >= {_SIGMA_MIN} meets the budget. {args()}")
    else:
        while not fits(hi):
            lo, hi = hi, hi * 2
            if hi > _SIGMA_MAX:
                raise ValueError(f"The budget needs a noise multiplier > {_SIGMA_MAX:g}. {args()}")
    while hi / lo > 1 + rtol:
        mid = math.sqrt(lo * hi)
        if fits(mid):
            hi = mid
        else:
            lo = mid
    return hi


# --------------------------------------------------------------------------- #
# Model-level helpers (duck-typed: python attributes only, no tensors).
# --------------------------------------------------------------------------- #
def _attr(model, name):
    try:
        return getattr(model, name)
    except AttributeError:
        raise TypeError(
            f"The model must expose `{name}` to be accounted for (dp_parameters, "
            f"dataset_metadata, nb_noised_variables, privacy_ledger). Received: "
            f"model={type(model).__name__} without `{name}`."
        ) from None


def model_step_noise_multiplier(model) -> float:
    """`step_noise_multiplier` of a model's `DPParameters` and number of noised variables
    (with the count of its `AdaptiveClipping`, if any).

    Classic DP-SGD (``mode="clipped"``) adds one isotropic Gaussian of std
    ``sigma * Delta`` where ``Delta`` is the L2 sensitivity of the whole clipped
    averaged gradient (``C / D`` flat or global, ``sqrt(sum_v C_v^2) / D``
    per-layer): a Gaussian mechanism with multiplier sigma, whatever the rule.
    """
    params = _attr(model, "dp_parameters")
    if getattr(params, "mode", DPMode.CLIPLESS) == DPMode.CLIPPED:
        return _check_noise_multiplier(params.noise_multiplier)
    clipping = getattr(params, "loss_gradient_clipping", None)
    count = (0.0 if clipping is None else
             clipping.count_noise_multiplier(_attr(model, "dataset_metadata").batch_size))
    return step_noise_multiplier(params.noisify_strategy, params.noise_multiplier,
                                 _attr(model, "nb_noised_variables"), count)


def _model_mechanism(model):
    params = _attr(model, "dp_parameters")
    metadata = _attr(model, "dataset_metadata")
    if not getattr(model, "built", True):  # "nb_noised_variables=0" said nothing (an audit)
        raise ValueError(
            f"Model '{model.name}' is not built: its mechanism (how many variables are noised) "
            "needs its weights. Give its first layer an input shape or call "
            "`model.build((None, ...))`.")
    return model_step_noise_multiplier(model), metadata.sampling_rate, params.delta


def get_eps_delta(model, epochs) -> Tuple[float, float]:
    """``(epsilon, delta)`` of a *planned* run: ``epochs`` epochs from scratch
    (``epochs * steps_per_epoch`` steps) with the model's current parameters.

    A plan, not a record: what a model has spent is `epsilon_spent` (its ledger),
    which stays right when parameters changed between `fit` calls.
    """
    epochs = _check_count(epochs, "epochs")
    sigma, q, delta = _model_mechanism(model)
    steps = epochs * _attr(model, "dataset_metadata").steps_per_epoch
    return compute_epsilon(sigma, q, steps, delta), delta


class NoEpochFitsWarning(UserWarning):
    """`get_max_epochs` planned 0 epochs: not one epoch fits the budget, and
    ``fit(epochs=0)`` would train nothing and say nothing."""


def get_max_epochs(epsilon_max, model, epochs_max: Optional[int] = None) -> int:
    """Largest integer number of epochs E with ``get_eps_delta(model, E)[0] <= epsilon_max``.

    A plan from scratch, like `get_eps_delta` (`lipdp.DP_Accountant` enforces a
    budget on what the ledger records).

    ``E = max_steps_for_budget(...) // steps_per_epoch``, capped at ``epochs_max``
    when given. 0 if not even one epoch fits, with a `NoEpochFitsWarning` (``fit(epochs=0)``
    trains nothing and says nothing).
    """
    epsilon_max = _check_budget(epsilon_max, "epsilon_max")
    if epochs_max is not None:
        epochs_max = _check_count(epochs_max, "epochs_max")
    sigma, q, delta = _model_mechanism(model)
    steps_per_epoch = _attr(model, "dataset_metadata").steps_per_epoch
    if epochs_max is not None and compute_epsilon(sigma, q, epochs_max * steps_per_epoch, delta) <= epsilon_max:
        return epochs_max
    epochs = max_steps_for_budget(epsilon_max, sigma, q, delta) // steps_per_epoch
    if epochs == 0 and epochs_max != 0:
        one_epoch = compute_epsilon(sigma, q, steps_per_epoch, delta)
        warnings.warn(NoEpochFitsWarning(
            f"not one epoch fits epsilon_max={epsilon_max:g} (delta={delta:g}): one epoch of "
            f"{steps_per_epoch} steps at noise multiplier {sigma:g} and sampling rate {q:g} "
            f"spends epsilon={format_epsilon(one_epoch)}, so the plan is 0 epochs, which train "
            "nothing. "
            "Raise epsilon_max or the noise multiplier, or lower the sampling rate."),
            stacklevel=2)
    return epochs if epochs_max is None else min(epochs, epochs_max)


def epsilon_spent(model, delta: Optional[float] = None) -> float:
    """Epsilon of every step recorded in the model's privacy ledger (`lipdp.ledger`).

    The composition of the mechanisms the train step actually ran, segment by
    segment (`compose_epsilon`), at `delta` (default: the model's
    ``dp_parameters.delta``); never a recomputation from today's parameters.
    """
    if delta is None:
        delta = _attr(model, "dp_parameters").delta
    return _attr(model, "privacy_ledger").epsilon(_check_delta(delta))
