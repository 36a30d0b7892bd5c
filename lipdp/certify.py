"""Certified robustness of Lipschitz classifiers: radii and certified accuracy.

A model ``f: R^d -> R^K`` built from DP layers is ``Lip``-Lipschitz w.r.t. the
L2 norm, where ``Lip = lipdp.bounds.lipschitz_bound(model)`` is a *certified*
upper bound (product of proven per-layer bounds, recomputed from the current
weights; never a power-iteration estimate). For an input ``x`` with predicted
class ``k = argmax_j f_j(x)``:

**Theorem.** If ``||delta||_2 < r(x) := (f_k(x) - max_{j != k} f_j(x)) / (sqrt(2) Lip)``
then ``argmax_j f_j(x + delta) = k`` (and it is the unique maximiser).

*Proof.* Lipschitz continuity in the L2 norm of the logit vector gives
``||f(x + delta) - f(x)||_2 <= Lip ||delta||_2``. For any ``j != k``, the
difference of two logits is the inner product with ``e_k - e_j``, whose norm
is ``sqrt(2)``, so by Cauchy-Schwarz

    (f_k - f_j)(x + delta) >= (f_k - f_j)(x) - sqrt(2) ||f(x + delta) - f(x)||_2
                           >= margin(x) - sqrt(2) Lip ||delta||_2 > 0,

where ``margin(x) = f_k(x) - max_{j != k} f_j(x) <= (f_k - f_j)(x)``. Hence
``f_k`` stays strictly larger than every other logit. (For a 1-Lipschitz network
this is the classic ``margin / sqrt(2)``.)

For a single-output (binary) model the decision is ``f(x) > 0`` and the radius
is ``|f(x)| / Lip`` (``|f(x + delta) - f(x)| <= Lip ||delta||``).

**Input clipping.** `DP_BoundedInput` projects every input onto the L2 ball of
radius X0 in the forward pass. The projection onto a convex set is
1-Lipschitz, so the model *as deployed* (clipping included) is still
``Lip``-Lipschitz on the whole input space, and the certificate holds for
perturbations of the raw input, even ones that leave the ball.

Radii are expressed in the model's input space: for the image datasets of
`lipdp.data`, pixels scaled to [0, 1].

**Floating point.** Logits are computed in float32 and the margin in float64;
a rounding error of the forward pass (relative ~1e-6 of the logits) can only
matter for perturbations within ~1e-6 of the radius.
"""

from __future__ import annotations

import math
from typing import Dict, Iterable, Tuple

import numpy as np
import tensorflow as tf

from lipdp.bounds import lipschitz_bound

__all__ = ["certified_radii", "certified_accuracy", "margins"]


def _lipschitz_constant(model) -> float:
    lip = float(lipschitz_bound(model))
    if not math.isfinite(lip) or lip < 0:
        raise ValueError(f"The model's Lipschitz bound is not a finite non-negative number: {lip!r}")
    return lip


def _logits(model, x, batch_size: int) -> np.ndarray:
    """Model outputs on the array `x`, computed batch by batch in inference mode."""
    x = np.asarray(x, dtype=np.float32)
    if len(x) == 0:
        return np.zeros((0, int(model.output_shape[-1])), np.float64)
    outputs = [model(x[start:start + batch_size], training=False).numpy()
               for start in range(0, len(x), batch_size)]
    return np.concatenate(outputs).astype(np.float64)


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


def _radii_from_margins(margin: np.ndarray, nb_outputs: int, lip: float) -> np.ndarray:
    scale = lip if nb_outputs == 1 else math.sqrt(2.0) * lip
    if scale == 0.0:  # a constant model: no perturbation changes its decision
        return np.where(margin > 0, np.inf, 0.0)
    return margin / scale


def _check_batch_size(batch_size):
    if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) \
            or batch_size <= 0:
        raise ValueError("Received an invalid value for `batch_size`, expected a positive "
                         f"integer. Received: batch_size={batch_size!r}")


def certified_radii(model, x, batch_size: int = 1024) -> np.ndarray:
    """Certified L2 radius of the prediction on each input.

    ``r(x) = (top-1 logit - top-2 logit) / (sqrt(2) * Lip)`` with
    ``Lip = float(lipdp.bounds.lipschitz_bound(model))`` (``|logit| / Lip`` for a
    single-output model). See the module docstring for the proof.

    Formal guarantee: for every ``delta`` with ``||delta||_2 < r(x)``, the model
    (input clipping included) predicts the same class on ``x + delta`` as on
    ``x``, as the unique arg-max.

    Args:
        model: a DP model (its first layer `DP_BoundedInput`).
        x: inputs, array-like of shape ``(n,) + input_shape``.
        batch_size: inference batch size.

    Returns:
        float64 array of shape ``(n,)``; 0 where the top two logits tie.
    """
    _check_batch_size(batch_size)
    lip = _lipschitz_constant(model)
    logits = _logits(model, x, batch_size)
    return _radii_from_margins(margins(logits), logits.shape[1], lip)


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


def _batches(dataset_or_xy, batch_size) -> Iterable[Tuple[np.ndarray, np.ndarray]]:
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


def _correct(logits: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Whether the predicted class is the label (one-hot or integer labels)."""
    y = np.asarray(y)
    if logits.shape[1] == 1:  # binary decision logit > 0, label y > 0
        return (logits[:, 0] > 0) == (y.reshape(len(y), -1)[:, 0] > 0)
    labels = np.argmax(y, axis=-1) if y.ndim == 2 else y.astype(np.int64)
    return np.argmax(logits, axis=1) == labels


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
        model: a DP model.
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
    lip = _lipschitz_constant(model)
    counts = np.zeros(len(radii), np.int64)
    total = 0
    for x, y in _batches(dataset_or_xy, batch_size):
        logits = _logits(model, x, batch_size)
        correct = _correct(logits, y)
        radius = _radii_from_margins(margins(logits), logits.shape[1], lip)
        for i, r in enumerate(radii):
            certified = correct if r == 0 else correct & (radius > r)
            counts[i] += int(np.sum(certified))
        total += len(logits)
    return {r: (counts[i] / total if total else float("nan")) for i, r in enumerate(radii)}
