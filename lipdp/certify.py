"""Certified robustness of Lipschitz classifiers: radii, certified accuracy and AUROC.

Let F be the exact-arithmetic network on the stored float32 weights: it is
``Lip``-Lipschitz w.r.t. the L2 norm, where ``Lip = lipdp.bounds.lipschitz_bound(model)``
is a *certified* upper bound (product of proven per-layer bounds, recomputed from
the current weights; never a power-iteration estimate). The model answers with
F^, the float32 evaluation of F, and

    E = float_error_bound(model) >= sup_z ||F^(z) - F(z)||_2   (raw inputs ||z|| <= 2^62)

bounds the rounding (`lipdp.rounding`: its arithmetic model, and how the layers'
own errors compose). Write ``m(x) = F^_k(x) - max_{j != k} F^_j(x)`` for the
margin of the float32 logits at x, ``k = argmax_j F^_j(x)`` the predicted class.

**Theorem.** If ``||delta||_2 < r(x) := (m(x) - 2 sqrt(2) E) / (sqrt(2) Lip)`` (and
x, x + delta have norm <= 2^62) then ``argmax_j F^_j(x + delta) = k``, the unique maximiser.

*Proof.* For ``j != k`` the difference of two logits is the inner product with
``e_k - e_j``, of norm ``sqrt(2)``. By Cauchy-Schwarz, at any z,
``|(F^_k - F^_j)(z) - (F_k - F_j)(z)| <= sqrt(2) E``, and Lipschitz continuity gives
``(F_k - F_j)(x + delta) >= (F_k - F_j)(x) - sqrt(2) Lip ||delta||``. Chaining the
three (at x + delta, from x + delta to x, at x):

    (F^_k - F^_j)(x + delta) >= (F^_k - F^_j)(x) - 2 sqrt(2) E - sqrt(2) Lip ||delta||
                              >= m(x) - 2 sqrt(2) E - sqrt(2) Lip ||delta|| > 0.

Hence ``F^_k`` stays strictly larger than every other float32 logit. (Without
rounding, E = 0, this is the classic ``margin / (sqrt(2) Lip)``.)

For a single-output (binary) model the decision is ``F^(x) > 0`` and the radius
is ``(|F^(x)| - 2 E) / Lip`` (same chain with ``|F^ - F| <= E`` and
``|F(x + delta) - F(x)| <= Lip ||delta||``).

**Why E matters.** Logits near 1e7 (reached, e.g., by a VGG with biases after
noisy training at a large learning rate) are rounded to whole units: a
perturbation of norm 0.0035 flipped a prediction with ``margin / (sqrt(2) Lip)``
of 0.707. On ordinary models E is small: for Fashion-MNIST's main job
(784-1024-10 MLP, X0 = 10) radii shrink by about 3e-3 (``2 E / Lip``).

**Input clipping.** `DP_BoundedInput` projects every input onto the L2 ball of
radius X0 in the forward pass. The projection onto a convex set is
1-Lipschitz, so the model *as deployed* (clipping included) is still
``Lip``-Lipschitz on the whole input space, and the certificate holds for
perturbations of the raw input, even ones that leave the ball (up to the norm
2^62, beyond which float32 squares overflow).

Radii are expressed in the model's input space: for the image datasets of
`lipdp.data`, pixels scaled to [0, 1].

**Floating point of the radius itself.** Margins are differences of float32
logits taken in float64, then r is computed in float64: the margin is shrunk and
``E`` and the denominator are grown by a relative 2^-50, which dominates the few
float64 roundings (2^-53 each) of that arithmetic, so the value returned never
exceeds the real-valued r. ``Lip`` and the norm bounds E is built from are
lipdp's certified bounds, taken as they are (`lipdp.bounds`).
"""

from __future__ import annotations

import math
import weakref
from typing import Dict, Iterable, Optional, Tuple

import numpy as np
import tensorflow as tf

from lipdp.bounds import dp_layers, lipschitz_bound
from lipdp.clipping.validation import leaf_layers
from lipdp.layers.base import (chain_rounding_error, check_float32, check_float32_inputs,
                               operator_norm_cache)
from lipdp.operator_norms import float32_products_rounded_to_nearest
from lipdp.state_guard import guarded_call

__all__ = ["CertifiableAccuracy", "certified_accuracy", "certified_auroc", "certified_radii",
           "certified_radius", "float_error_bound", "margins"]

# Relative slack on the float64 radius arithmetic (see the module docstring).
_FLOAT64_SLACK = 2.0 ** -50
# Relative slack on E for the float64 arithmetic of the bound (lipdp.rounding).
_BOUND_SLACK = 2.0 ** -20


def float_error_bound(model) -> float:
    """Bound E of the float32 rounding error of the model's outputs.

    Formal guarantee: for every raw input z with ``||z||_2 <= 2^62``,
    ``||F^(z) - F(z)||_2 <= E``, where F^ is the model evaluated in float32 under
    the arithmetic model of `lipdp.rounding` (IEEE float32, one summation order per
    matrix product, stated accuracy of tanh / sigmoid / softplus) and F the same
    network in exact arithmetic on the stored float32 weights, the map whose
    Lipschitz constant `lipdp.bounds.lipschitz_bound` certifies. Computed from the
    current weights, layer by layer (`DPLayer.propagate_error`): inputs are clipped
    to norm X0 by the first layer, so every activation norm is bounded.

    Returns:
        E as a python float; ``inf`` when no bound is available (a layer without
        a rounding bound, activation norms too large to exclude overflow, or arithmetic
        that is not float32 rounded to nearest: a layer computing in float16 / bfloat16,
        whose rounding an audit used to flip a prediction 341 times inside its radius, a
        float16 / bfloat16 model input (`check_float32_inputs`), or matrix products in
        TensorFloat-32 or oneDNN's bfloat16 mode).
    """
    layers = dp_layers(model)
    try:
        check_float32(leaf_layers(model))
        check_float32_inputs(model)
    except ValueError:
        return math.inf
    if not float32_products_rounded_to_nearest(device_products=True):
        return math.inf
    with operator_norm_cache():
        error = chain_rounding_error(layers, tf.constant(float("inf")), 0.0)
    error = float(error)
    return error * (1.0 + _BOUND_SLACK) if math.isfinite(error) and error >= 0 else math.inf


def _lipschitz_constant(model) -> float:
    lip = float(lipschitz_bound(model))
    if not math.isfinite(lip) or lip < 0:
        raise ValueError(f"The model's Lipschitz bound is not a finite non-negative number: {lip!r}")
    return lip


def _logits(model, x, batch_size: int) -> np.ndarray:
    """Model outputs on the array `x`, computed batch by batch in inference mode.

    Raises:
        ValueError: inputs holding NaN or inf (their radii were NaN, and a NaN row's arg-max
            counted as class 0 in the accuracies: an audit), or outputs holding NaN (a
            diverged model: its accuracy counted every label-0 row as correct, and its AUROC
            was 1.0 or 0.0 by the rows' order: an audit, 2026-12-07).
    """
    x = np.asarray(x, dtype=np.float32)
    bad = np.flatnonzero(~np.isfinite(x.reshape(len(x), -1)).all(axis=1)) if x.ndim else []
    if len(bad):
        raise ValueError(f"{len(bad)} inputs hold NaN or inf values (e.g. row {bad[0]} of its "
                         "batch): no prediction or radius is defined for them.")
    if len(x) == 0:
        return np.zeros((0, int(model.output_shape[-1])), np.float64)
    outputs = np.concatenate([guarded_call(model, x[start:start + batch_size]).numpy()
                              for start in range(0, len(x), batch_size)]).astype(np.float64)
    bad = np.flatnonzero(np.isnan(outputs).any(axis=1))
    if len(bad):
        raise ValueError(f"The model's outputs hold NaN for {len(bad)} of {len(x)} inputs (e.g. "
                         f"row {bad[0]} of its batch): a diverged model has no accuracy, AUROC "
                         "or radius.")
    return outputs


def margins(logits: np.ndarray) -> np.ndarray:
    """Decision margin of each row of `logits` (float64).

    ``K >= 2``: top-1 logit minus top-2 logit (0 on ties, never negative).
    ``K = 1``: ``|logit|`` (distance of the binary decision ``logit > 0`` to 0).
    """
    logits = np.asarray(logits, dtype=np.float64)
    if logits.ndim != 2:
        raise ValueError(f"Expected logits of shape (n, K). Received shape {logits.shape}.")
    if logits.shape[1] == 1:
        return np.abs(logits[:, 0])
    top2 = np.sort(logits, axis=1)[:, -2:]
    return top2[:, 1] - top2[:, 0]


def _radii_from_margins(margin: np.ndarray, nb_outputs: int, lip: float,
                        error: float) -> np.ndarray:
    """``max(0, m - c E) / scale`` with ``(c, scale) = (2, Lip)`` for one output and
    ``(2 sqrt(2), sqrt(2) Lip)`` otherwise, rounded towards 0 (module docstring)."""
    if nb_outputs == 1:
        rounding, scale = 2.0 * error, lip
    else:
        rounding, scale = 2.0 * math.sqrt(2.0) * error, math.sqrt(2.0) * lip
    margin = margin * (1.0 - _FLOAT64_SLACK) - rounding * (1.0 + _FLOAT64_SLACK)
    if scale == 0.0:  # F is constant: only rounding can change the decision
        return np.where(margin > 0, np.inf, 0.0)
    return np.maximum(margin, 0.0) / (scale * (1.0 + _FLOAT64_SLACK))


def _check_batch_size(batch_size):
    if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) \
            or batch_size <= 0:
        raise ValueError("Received an invalid value for `batch_size`, expected a positive "
                         f"integer. Received: batch_size={batch_size!r}")


def certified_radii(model, x, batch_size: int = 1024) -> np.ndarray:
    """Certified L2 radius of the prediction on each input.

    ``r(x) = max(0, top-1 logit - top-2 logit - 2 sqrt(2) E) / (sqrt(2) * Lip)`` with
    ``Lip = float(lipdp.bounds.lipschitz_bound(model))`` and ``E =
    float_error_bound(model)`` (``max(0, |logit| - 2 E) / Lip`` for a single-output
    model), rounded towards 0. See the module docstring for the proof.

    Formal guarantee: for every ``delta`` with ``||delta||_2 < r(x)`` (x and
    ``x + delta`` of norm <= 2^62), the model evaluated in float32 (input clipping
    included; arithmetic model of `lipdp.rounding`) predicts the same class on
    ``x + delta`` as on ``x``, as the unique arg-max.

    Args:
        model: a DP model (its first layer `DP_BoundedInput`).
        x: inputs, array-like of shape ``(n,) + input_shape``.
        batch_size: inference batch size.

    Returns:
        float64 array of shape ``(n,)``; 0 where the margin is at most the
        rounding allowance ``2 sqrt(2) E`` (ties included).
    """
    _check_batch_size(batch_size)
    lip = _lipschitz_constant(model)
    error = float_error_bound(model)
    logits = _logits(model, x, batch_size)
    return _radii_from_margins(margins(logits), logits.shape[1], lip, error)


#: The per-example certified radius ``r(x)``: the same function as `certified_radii`
#: (one radius per row of `x`, same theorem and rounding treatment), under the name
#: of issue 11's API.
certified_radius = certified_radii


def _check_radii(radii) -> Tuple[float, ...]:
    if isinstance(radii, (int, float, np.integer, np.floating)):
        radii = [radii]
    checked = []
    for r in radii:
        if isinstance(r, bool) or not isinstance(r, (int, float, np.integer, np.floating)) \
                or not math.isfinite(float(r)) or float(r) < 0:
            raise ValueError("Received an invalid value in `radii`, expected finite non-negative "
                             f"numbers. Received: radii={list(radii)!r}")
        checked.append(float(r))
    return tuple(checked)


def labelled_batches(dataset_or_xy, batch_size) -> Iterable[Tuple[np.ndarray, np.ndarray]]:
    """``(x, y)`` numpy batches of a batched dataset of pairs, or of an ``(x, y)`` pair of
    arrays cut into `batch_size` pieces (checked: pairs, equal lengths)."""
    if isinstance(dataset_or_xy, tf.data.Dataset):
        for element in dataset_or_xy:
            if not isinstance(element, (tuple, list)) or len(element) < 2:
                raise ValueError("certified_accuracy needs a dataset of (x, y) pairs.")
            yield np.asarray(element[0]), np.asarray(element[1])
        return
    if not isinstance(dataset_or_xy, (tuple, list)) or len(dataset_or_xy) != 2:
        raise TypeError("`dataset_or_xy` must be a batched tf.data.Dataset of (x, y) or an "
                        f"(x, y) tuple of arrays. Received: {type(dataset_or_xy).__name__}")
    x, y = (np.asarray(a) for a in dataset_or_xy)
    if len(x) != len(y):
        raise ValueError(f"x and y have different lengths: {len(x)} and {len(y)}.")
    for start in range(0, len(x), batch_size):
        yield x[start:start + batch_size], y[start:start + batch_size]


def first_examples(dataset_or_xy, count: int) -> Tuple[np.ndarray, np.ndarray]:
    """The first `count` examples ``(x, y)`` of a batched dataset of pairs (a new iterator)
    or of an ``(x, y)`` pair of arrays, as arrays (fewer if there are fewer).

    Raises:
        ValueError: no example at all.
    """
    xs, ys, total = [], [], 0
    for x, y in labelled_batches(dataset_or_xy, count):
        xs.append(x)
        ys.append(y)
        total += len(x)
        if total >= count:
            break
    if total == 0:
        raise ValueError("The dataset yielded no examples.")
    return np.concatenate(xs)[:count], np.concatenate(ys)[:count]


def _correct(logits: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Whether the predicted class is the label: one-hot labels ``(n, K)``, integer labels
    ``(n,)`` or ``(n, 1)`` (the rank Keras gives metrics), or for one output (decision
    ``logit > 0``) the label ``y > 0`` of ``(n,)`` / ``(n, 1)`` targets, or the class of
    one-hot rows ``(n, 2)``, as `lipdp.evaluation.binary_scores` reads them.

    Raises:
        ValueError: labels of another shape, or class indices outside ``[0, K)``.
    """
    y = np.asarray(y)
    if logits.shape[1] == 1:
        # One-hot rows (n, 2) were read by their first column, class 0's: every label
        # flipped, and a model wrong on every example certified at 90% (an audit,
        # 2026-12-07); rows of other widths were scored too.
        if y.ndim == 2 and y.shape[1] == 2:
            positive = np.argmax(y, axis=1) == 1
        elif y.ndim == 1 or (y.ndim == 2 and y.shape[1] == 1):
            positive = y.reshape(len(y)) > 0
        else:
            raise ValueError(f"Labels of shape {y.shape} for a one-output model: expected "
                             "targets (n,) / (n, 1) (positive above 0) or one-hot rows (n, 2).")
        return (logits[:, 0] > 0) == positive
    k = logits.shape[1]
    if y.ndim == 2 and y.shape[1] == 1:
        y = y[:, 0]
    if y.ndim == 2 and y.shape[1] == k:
        return np.argmax(logits, axis=1) == np.argmax(y, axis=-1)
    # A mismatch scored silently: one-hot rows of 5 columns for 3 outputs, or class
    # indices 1..K, gave an accuracy against the wrong classes (an audit).
    if y.ndim != 1:
        raise ValueError(f"Labels of shape {y.shape} for {k} model outputs: expected one-hot "
                         f"labels (n, {k}) or class indices (n,) / (n, 1).")
    with np.errstate(invalid="ignore"):
        bad = np.flatnonzero(~((y >= 0) & (y < k) & (np.floor(y) == y)))
    if len(bad):
        raise ValueError(f"{len(bad)} labels are not class indices in [0, {k}) ({k} model "
                         f"outputs), e.g. {y[bad[0]]!r} at position {bad[0]} (of its batch).")
    return np.argmax(logits, axis=1) == y.astype(np.int64)


def _certified(logits: np.ndarray, y: np.ndarray, radii: Tuple[float, ...],
               lip: Optional[float], error: Optional[float]) -> np.ndarray:
    """``(n, len(radii))`` booleans: example i is certified correct at ``radii[j]``
    (the convention of `certified_accuracy`)."""
    correct = _correct(logits, y)
    if not any(r > 0 for r in radii):  # clean accuracy only: no radius needed
        return np.stack([correct] * len(radii), axis=1)
    radius = _radii_from_margins(margins(logits), logits.shape[1], lip, error)
    return np.stack([correct if r == 0 else correct & (radius > r) for r in radii], axis=1)


def certified_accuracy(model, dataset_or_xy, radii, batch_size: int = 1024) -> Dict[float, float]:
    """Fraction of examples correctly classified with a certified radius above each r.

    Convention (closed threat balls ``||delta|| <= r``):

    - ``r = 0``: plain (clean) accuracy: the arg-max of the logits is the label
      (the same as Keras' categorical accuracy, first index on ties);
    - ``r > 0``: the example is correctly classified **and** ``radius > r``
      (strictly). By the theorem in the module docstring, every perturbation
      with ``||delta|| <= r < radius`` then keeps the correct class. An example
      whose radius equals r exactly is not counted: a perturbation of norm r
      could create a tie.

    Args:
        model: a DP model (for radii ``[0.0]`` alone, any Keras classifier: clean
            accuracy needs no Lipschitz constant).
        dataset_or_xy: a batched `tf.data.Dataset` yielding ``(x, y)`` (further
            elements are ignored) or a tuple ``(x, y)`` of arrays; ``y`` one-hot
            of shape ``(n, K)`` or integer labels of shape ``(n,)``.
        radii: iterable of non-negative L2 radii (in input space).
        batch_size: inference batch size for array inputs.

    Returns:
        ``{float(r): fraction}`` in the order of `radii` (NaN for an empty set).
    """
    _check_batch_size(batch_size)
    radii = _check_radii(radii)
    lip = error = None
    if any(r > 0 for r in radii):
        lip, error = _lipschitz_constant(model), float_error_bound(model)
    counts = np.zeros(len(radii), np.int64)
    total = 0
    for x, y in labelled_batches(dataset_or_xy, batch_size):
        logits = _logits(model, x, batch_size)
        counts += np.sum(_certified(logits, y, radii, lip, error), axis=0)
        total += len(logits)
    return {r: (counts[i] / total if total else float("nan")) for i, r in enumerate(radii)}


def _worst_case_scores(scores: np.ndarray, labels: np.ndarray, nb_outputs: int, radius: float,
                       lip: float, error: float) -> np.ndarray:
    """Lower bounds of the positives' scores and upper bounds of the negatives' scores
    over ``||delta|| <= radius`` (see `certified_auroc`), rounded outwards."""
    if radius == 0:  # no perturbation: the score is the model's own float32 answer
        return scores
    if nb_outputs == 1:
        rounding, scale = 2.0 * error, lip
    else:
        rounding, scale = 2.0 * math.sqrt(2.0) * error, math.sqrt(2.0) * lip
    shift = (scale * radius + rounding) * (1.0 + _FLOAT64_SLACK)
    # The float64 subtraction rounds by at most 2^-53 (|s| + shift); widen by 2^-50 of it.
    slack = _FLOAT64_SLACK * (np.abs(scores) + shift)
    sign = np.where(labels.astype(bool), 1.0, -1.0)
    return scores - sign * (shift + slack)


def certified_auroc(model, dataset_or_xy, radii, batch_size: int = 1024) -> Dict[float, float]:
    """Certified AUROC of a binary classifier: a lower bound of its AUROC under attack.

    The score of an example is what the model thresholds at 0
    (`lipdp.evaluation.binary_scores`): its logit ``s = F^(x)`` for one output,
    ``s = F^_1(x) - F^_0(x)`` for two. An adversary may move **every** test example
    anywhere in its closed ball ``||delta_i|| <= r`` (each its own perturbation).

    **Definition.** The certified AUROC at r is the AUROC (`lipdp.evaluation.roc_auc`,
    ties count one half) of the worst-case scores

        s_i - (c E + l r)   for positive examples,   s_i + (c E + l r)   for negatives,

    with ``(l, c) = (Lip, 2)`` for one output and ``(sqrt(2) Lip, 2 sqrt(2))`` for
    two (``Lip = lipdp.bounds.lipschitz_bound(model)``, ``E = float_error_bound(model)``;
    at ``r = 0`` no shift: the clean AUROC).

    **Guarantee.** For all perturbations with ``||delta_i||_2 <= r`` (x_i and
    x_i + delta_i of norm <= 2^62), the AUROC of the scores of the perturbed test set
    is at least the certified AUROC at r. *Proof.* By the chain of the module
    docstring, ``|s^(x + delta) - s^(x)| <= c E + l ||delta||`` (for two outputs the
    score is the inner product of the logits with ``e_1 - e_0``, of norm sqrt(2)).
    The AUROC, ``sum_{i pos, j neg} [1(s_i > s_j) + 1/2 1(s_i = s_j)] / (P N)``, is
    non-decreasing in every positive's score and non-increasing in every negative's,
    so it is smallest at the corner above. The float64 arithmetic of the shifted
    scores is rounded outwards (relative 2^-50, as for the radii; it also covers the
    float64 difference of two float32 logits). The bound is reached when the score
    is affine with gradient norm ``l`` on the balls: for a single dense layer,
    moving each example by ``-+ r w / ||w||`` gives exactly the certified AUROC
    (`tests/test_certify.py`).

    In particular an example whose worst-case score keeps the sign of its label is
    one that the decision ``s > 0`` classifies correctly with a certified radius
    ``> r`` (up to the rounding slack): the certified AUROC extends certified
    accuracy from the threshold 0 to every threshold.

    Args:
        model: a DP model with one or two outputs.
        dataset_or_xy: as for `certified_accuracy`; binary labels, one-hot of
            shape ``(n, 2)`` or one value per example (positive when ``y > 0``).
        radii: iterable of non-negative L2 radii (input space).
        batch_size: inference batch size for array inputs.

    Returns:
        ``{float(r): certified AUROC}`` in the order of `radii`.

    Raises:
        ValueError: more than two outputs, or the labels do not hold both classes.
    """
    from lipdp.evaluation import binary_scores, roc_auc  # lipdp.evaluation imports this module

    _check_batch_size(batch_size)
    radii = _check_radii(radii)
    lip = _lipschitz_constant(model)
    error = float_error_bound(model)
    scores, labels = binary_scores(model, dataset_or_xy, batch_size)
    nb_outputs = int(model.output_shape[-1])
    return {r: roc_auc(_worst_case_scores(scores, labels, nb_outputs, r, lip, error), labels)
            for r in radii}


@tf.keras.utils.register_keras_serializable("lipdp")
class CertifiableAccuracy(tf.keras.metrics.Mean):
    """Keras metric: the fraction of examples certified correct at `radius`.

    The same quantity as ``certified_accuracy(model, data, [radius])`` (same
    convention: at ``radius = 0`` clean accuracy, above it correct **and**
    certified radius ``> radius``), accumulated batch by batch in ``fit`` /
    ``evaluate``: for each batch the certified radii are computed with the
    model's *current* certified Lipschitz constant ``lipdp.bounds.lipschitz_bound``
    and float error bound `float_error_bound`, by the code of `certified_radii`
    (one bound pass on the host per batch, through ``tf.py_function``: in ``fit``
    that is one more per training step; `certified_accuracy` after training costs
    one pass in all).

    The metric needs the model whose Lipschitz constant certifies the logits it
    receives. A DP model's ``compile`` binds the metrics given without one (also
    when `load_model` re-compiles a saved model); for another model pass it at
    construction or call `bind` (the metric keeps a weak reference, so that it
    neither tracks the model's weights nor keeps it alive)::

        model.compile(..., metrics=[CertifiableAccuracy(0.1)])  # a DP model

    Guarantee: in ``evaluate`` and on validation data, the weights are fixed while
    the metric runs, so the value is exactly the certified accuracy of the model
    at those weights. In the *training* logs Keras updates metrics after the
    optimizer step: the logits come from the weights before the step and the
    Lipschitz constant from the weights after it (and the projection), so the
    training value is a progress indicator, not a certificate. (Training-set
    metrics are also not covered by epsilon; see `lipdp.model`.)

    Args:
        radius: finite non-negative L2 radius (input space).
        model: the DP model (optional here; then `bind` it before use).
        name: defaults to ``"certifiable_accuracy_<radius>"``.
        dtype: of the result.
    """

    def __init__(self, radius, model=None, name=None, dtype=None):
        if isinstance(radius, bool) \
                or not isinstance(radius, (int, float, np.integer, np.floating)) \
                or not math.isfinite(float(radius)) or radius < 0:
            raise ValueError("Received an invalid value for `radius`, expected one finite "
                             f"non-negative number. Received: radius={radius!r}")
        radius = float(radius)
        super().__init__(name=name or f"certifiable_accuracy_{radius:g}", dtype=dtype)
        self.radius = radius
        self._model_ref = None
        if model is not None:
            self.bind(model)

    def bind(self, model) -> "CertifiableAccuracy":
        """Use `model`'s Lipschitz constant and error bound (returns the metric)."""
        if not isinstance(model, tf.keras.Model):
            raise TypeError(f"`model` must be a Keras model. Received: {type(model).__name__}")
        self._model_ref = weakref.ref(model)
        return self

    @property
    def bound_model(self):
        """The bound model, or None."""
        return None if self._model_ref is None else self._model_ref()

    def _model_or_raise(self):
        model = self.bound_model
        if model is None:
            raise RuntimeError(
                f"CertifiableAccuracy '{self.name}' is not bound to a model: construct it with "
                "CertifiableAccuracy(radius, model) or call metric.bind(model) (a metric "
                "restored by load_model needs binding again).")
        return model

    def _certified_values(self, y_true, y_pred):
        model = self._model_or_raise()
        logits = np.asarray(y_pred, np.float64)
        certified = _certified(logits, np.asarray(y_true), (self.radius,),
                               _lipschitz_constant(model), float_error_bound(model))
        return certified[:, 0].astype(np.float32)

    def update_state(self, y_true, y_pred, sample_weight=None):
        self._model_or_raise()  # at trace time: a plain error rather than one from the graph
        y_pred = tf.convert_to_tensor(y_pred)
        values = tf.py_function(self._certified_values, [y_true, y_pred], tf.float32)
        values.set_shape(y_pred.shape[:1])
        return super().update_state(values, sample_weight=sample_weight)

    def get_config(self):
        return {**super().get_config(), "radius": self.radius}
