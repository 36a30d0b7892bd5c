"""DP losses: per-example losses with a proven Lipschitz constant w.r.t. the logits.

Every DP loss exposes

- ``call(y_true, y_pred)``: the per-example loss, shape ``(batch,)``. It depends
  on one example only (no batch statistics), so the train step can sum it and
  divide by a public denominator;
- ``lipschitz(nb_outputs)``: ``L`` such that ``||d loss(y_pred, y) / d y_pred||_2 <= L``
  for every logit vector and every label in the loss' label domain.

Labels come from the private data set, so each loss first maps any label onto its
domain (for a valid label this is the identity): a malformed record can change
the loss value but never the bound, and never raises (an error that depends on
one record would itself reveal it).

Shapes, which are public, are checked when the step is traced: logits must be
``(batch, K)`` -- one loss per example, which the sensitivity bound assumes --
and labels one of the forms below, mapped **per example** (a label never
interacts with another example's):

- class losses (cross-entropy, hinge, KR, HKR, K-cosine): one-hot or soft labels
  ``(batch, K)``, or integer class indices ``(batch,)`` / ``(batch, 1)`` (any
  numeric dtype; indices outside ``[0, K)`` are clipped into it);
- target losses (binary cross-entropy, MAE, binary KR): targets ``(batch, K)``,
  or ``(batch,)`` when ``K = 1``.

Anything else is refused with a ValueError naming the shapes.
"""

from __future__ import annotations

import math
from typing import Optional

import tensorflow as tf
from deel.lip.losses import TauBinaryCrossentropy, TauCategoricalCrossentropy, multiclass_hinge
from tensorflow.keras.losses import Reduction

from lipdp.layers.base import check_at_least, check_positive, check_zero_or_positive


class DP_Loss:
    """Mixin: a Keras loss with a Lipschitz constant w.r.t. the logits."""

    #: The fewest logits a model needs for the loss to depend on its labels: a loss over
    #: classes (softmax, one-vs-all, arg-max labels) is constant in them with one logit
    #: (`check_outputs`).
    min_outputs = 1

    def lipschitz(self, nb_outputs: int) -> float:
        raise NotImplementedError

    def label_domain(self, nb_outputs: int) -> Optional[str]:
        """The labels ``(batch, K)`` the loss takes as they are, as a key of `LABEL_DOMAINS`
        (`lipdp.records.check_label_domain` refuses the others before training: the loss
        maps them onto its domain, silently); None: any finite label."""
        return None


#: Label rows a loss takes as they are: what they are, and what the loss makes of others.
LABEL_DOMAINS = {
    "simplex": ("one-hot or soft labels (entries >= 0 summing to at most 1)",
                "its entries above 0, scaled down to sum 1 when they sum above it"),
    "one-hot": ("one-hot labels (or rows of one 1 and -1 elsewhere)",
                "the one-hot row of its largest entry"),
    "signs": ("targets 0 or 1 (or -1 for 0)", "its sign: 1 above 0, the other class else"),
}


_KERAS_CLASS_LOSSES = ("categorical_crossentropy", "sparse_categorical_crossentropy",
                       "categorical_hinge", "CategoricalCrossentropy",
                       "SparseCategoricalCrossentropy", "CategoricalHinge")


def _over_classes(loss) -> bool:
    """A lipdp loss of ``min_outputs`` 2, or Keras' categorical or sparse categorical
    cross-entropy or categorical hinge (by object, function or name: classic DP-SGD takes
    Keras' losses; a review found the one-output check missing them)."""
    if getattr(loss, "min_outputs", 1) > 1:
        return True
    keras = tf.keras.losses
    if isinstance(loss, (keras.CategoricalCrossentropy, keras.SparseCategoricalCrossentropy,
                         keras.CategoricalHinge)):
        return True
    if isinstance(loss, str):
        return loss in _KERAS_CLASS_LOSSES
    return any(loss is f for f in (keras.categorical_crossentropy,
                                   keras.sparse_categorical_crossentropy,
                                   keras.categorical_hinge))


def check_outputs(loss, nb_outputs: int) -> None:
    """Refuse a lipdp loss over classes on a model of one output: its value, or its gradient,
    does not depend on the label there (the softmax of one logit is 1, a one-vs-all loss has
    no other class, every label maps to class 0), so every step would train on noise alone
    (an audit, 2026-12-07: a one-output model with `DP_TauCategoricalCrossentropy` and 0/1
    labels trained with loss 0).

    Also Keras' losses over classes (`_over_classes`), which classic DP-SGD takes.

    Raises:
        ValueError: one output and a loss over classes.
    """
    if nb_outputs < 2 and _over_classes(loss):
        name = loss if isinstance(loss, str) else getattr(loss, "__name__", None) or \
            type(loss).__name__
        raise ValueError(
            f"{name} is a loss over classes: with {nb_outputs} output its "
            "gradient does not depend on the labels, so training would follow the noise alone. "
            "Give the model one output per class (2 for a binary task), or keep one output "
            "with a binary loss (DP_TauBCE, DP_MulticlassKR, which takes one output as binary "
            "KR, or in classic DP-SGD Keras' BinaryCrossentropy).")


#: The largest ``|logit|`` a loss computes with (``|tau logit|`` for the losses with a
#: temperature): beyond, a float32 loss overflowed to inf (or a softmax to NaN) and the
#: private step stopped at the example that produced the logit. Clipping to it is the identity
#: below, and its Jacobian is diagonal with entries 0 or 1, so no gradient leaves its loss's
#: constant; each loss value stays below about ``(1 + alpha) 2^102``, so a batch's sum stays
#: finite for fewer than ``2^26 / (1 + alpha)`` examples (alpha: HKR's, 0 for the others).
LOGIT_CAP = 2.0 ** 100


def _capped(y_pred, temperature=1.0) -> tf.Tensor:
    """`y_pred` clipped to ``[-c, c]``, ``c = LOGIT_CAP / max(temperature, 1)``: `temperature`
    times a logit stays below 2^100, and so does a loss of the size of a logit. With
    ``LOGIT_CAP / temperature`` alone, a temperature below 2^-27 let the loss (``CE / tau``,
    about a logit difference) overflow to inf, and below 2^-28 the cap itself was inf."""
    cap = LOGIT_CAP / tf.maximum(tf.cast(temperature, tf.float32), 1.0)
    cap = tf.cast(cap, y_pred.dtype)  # float64 logits given directly failed (a dtype error)
    return tf.clip_by_value(y_pred, -cap, cap)


def _in_float32(call, y_true, y_pred) -> tf.Tensor:
    """``call(y_true, y_pred)`` in float32, returned in `y_pred`'s dtype: deel-lip's tau
    losses multiply by a float32 variable, and float64 logits given directly failed."""
    value = call(tf.cast(y_true, tf.float32), tf.cast(y_pred, tf.float32))
    return tf.cast(value, y_pred.dtype)


def _checked_logits(loss, y_pred) -> tf.Tensor:
    """`y_pred` if it has rank 2 ``(batch, K)``; a ValueError otherwise."""
    y_pred = tf.convert_to_tensor(y_pred)
    if y_pred.shape.rank != 2:
        raise ValueError(
            f"{type(loss).__name__} takes logits of rank 2, (batch, K): one loss per example, "
            "which the per-example gradient bound assumes. Received logits of shape "
            f"{y_pred.shape}. Flatten per-position outputs into one vector per example "
            "(lipdp.layers.DP_Flatten) before the last dense layer.")
    return y_pred


def _refuse_labels(loss, y_true, y_pred, accepted):
    raise ValueError(
        f"{type(loss).__name__} cannot use labels of shape {y_true.shape} with logits of shape "
        f"{y_pred.shape}: expected {accepted}.")


def _same_batch(y_true, y_pred):
    """Labels and logits must have the same batch size (checked at run time if unknown)."""
    if y_true.shape[0] is not None and y_pred.shape[0] is not None:
        return y_true
    with tf.control_dependencies([tf.debugging.assert_equal(
            tf.shape(y_true)[0], tf.shape(y_pred)[0],
            message="labels and logits have different batch sizes")]):
        return tf.identity(y_true)


def class_labels(loss, y_true, y_pred) -> tf.Tensor:
    """Labels of a class loss as ``(batch, K)`` vectors, mapped per example.

    One-hot or soft labels ``(batch, K)`` are returned as they are (cast to the
    logits' dtype); class indices ``(batch,)`` or ``(batch, 1)`` become one-hot
    rows (float indices are rounded, indices outside ``[0, K)`` clipped into it).

    Raises:
        ValueError: logits not of rank 2, or labels of any other shape.
    """
    y_pred = _checked_logits(loss, y_pred)
    y_true = tf.convert_to_tensor(y_true)
    k = y_pred.shape[-1]
    accepted = f"one-hot labels (batch, {k}) or class indices (batch,) / (batch, 1)"
    shape = y_true.shape
    if shape.rank is None or k is None or not shape[:1].is_compatible_with(y_pred.shape[:1]):
        _refuse_labels(loss, y_true, y_pred, accepted)
    if shape.rank == 2 and shape[-1] == k and k != 1:
        return tf.cast(_same_batch(y_true, y_pred), y_pred.dtype)
    if shape.rank == 1 or (shape.rank == 2 and shape[-1] == 1):
        indices = tf.reshape(_same_batch(y_true, y_pred), [-1])
        if indices.dtype.is_floating:
            finite = tf.math.is_finite(indices)
            indices = tf.where(finite, tf.round(indices), tf.zeros_like(indices))
            indices = tf.clip_by_value(indices, 0.0, float(k - 1))
        indices = tf.clip_by_value(tf.cast(indices, tf.int64), 0, k - 1)
        return tf.one_hot(indices, k, dtype=y_pred.dtype)
    _refuse_labels(loss, y_true, y_pred, accepted)


def target_labels(loss, y_true, y_pred) -> tf.Tensor:
    """Targets of a per-output loss with the logits' shape ``(batch, K)``.

    ``(batch, K)`` is returned as it is (cast); ``(batch,)`` is accepted when K = 1.

    Raises:
        ValueError: logits not of rank 2, or targets of any other shape.
    """
    y_pred = _checked_logits(loss, y_pred)
    y_true = tf.convert_to_tensor(y_true)
    k = y_pred.shape[-1]
    shape = y_true.shape
    accepted = f"targets (batch, {k})" + (" or (batch,)" if k == 1 else "")
    if shape.rank is None or not shape[:1].is_compatible_with(y_pred.shape[:1]):
        _refuse_labels(loss, y_true, y_pred, accepted)
    if shape.rank == 1 and k == 1:
        y_true = tf.reshape(y_true, [-1, 1])
    elif not (shape.rank == 2 and shape[-1] == k):
        _refuse_labels(loss, y_true, y_pred, accepted)
    return tf.cast(_same_batch(y_true, y_pred), y_pred.dtype)


def _python_float(variable) -> float:
    """A deel-lip temperature (a tf.Variable) as a python float: its own get_config returns a
    numpy float32, which the constructors' checks (and JSON) refuse."""
    return float(variable.numpy())


def _to_simplex_subset(y):
    """Map label rows to {y >= 0, sum(y) <= 1}; one-hot and smoothed labels are unchanged."""
    y = tf.nn.relu(y)
    return y / tf.maximum(tf.reduce_sum(y, axis=-1, keepdims=True), 1.0)


def _to_one_hot(y):
    """Map label rows to the one-hot vector of their arg-max; one-hot labels are unchanged."""
    return tf.one_hot(tf.argmax(y, axis=-1), tf.shape(y)[-1], dtype=y.dtype)


@tf.keras.utils.register_keras_serializable("lipdp")
class DP_TauCategoricalCrossentropy(TauCategoricalCrossentropy, DP_Loss):
    """Softmax cross-entropy with temperature (deel-lip): ``CE(y, softmax(tau y_pred)) / tau``;
    with a `margin` m > 0, ``CE(y, softmax(tau (y_pred + m (1 - y)))) / tau``.

    The margin raises every other class's logit by m before the softmax (Lipschitz-margin
    training, Tsuzuku et al. 2018): the loss keeps pushing an example until its true logit
    leads the others by about m, and a margin m certifies an L2 radius of
    ``m / (sqrt(2) Lip)`` on a ``Lip``-Lipschitz network (`lipdp.certify`), so
    ``m = sqrt(2) Lip r`` aims the training at radius r.

    Gradient: ``(sum_j y_j) softmax(tau (y_pred + s)) - y`` with ``s = m (1 - y)`` constant
    in ``y_pred``. With labels mapped to ``{y >= 0, sum y <= 1}``, both terms lie in the unit
    simplex (scaled by at most 1) and have non-negative inner product, so its squared norm is
    at most ``||p||^2 + ||y||^2 <= 2``: ``L = sqrt(2)``, for every ``tau`` and every margin.

    The shifted logits are clipped to ``[-2^100 / tau, 2^100 / tau]`` first (2^100 for tau
    below 1, `LOGIT_CAP`): beyond, ``tau`` times a float32 logit overflowed to inf and the
    softmax to NaN, or the loss itself (a logit difference) overflowed.
    """

    min_outputs = 2  # `check_outputs`
    takes_class_indices = True  # `class_labels`: checked before training (lipdp.records)

    def __init__(self, tau=1.0, margin=0.0, reduction=Reduction.AUTO,
                 name="DP_TauCategoricalCrossentropy"):
        tau = check_positive(tau, "tau")
        margin = check_zero_or_positive(margin, "margin")
        super().__init__(tau=tau, reduction=reduction, name=name)
        self.margin = margin

    def call(self, y_true, y_pred, *args, **kwargs):
        y = _to_simplex_subset(class_labels(self, y_true, y_pred))
        if self.margin:
            y_pred = y_pred + self.margin * (1.0 - y)
        return _in_float32(super().call, y, _capped(y_pred, self.tau))

    def lipschitz(self, nb_outputs):
        return math.sqrt(2.0)

    def label_domain(self, nb_outputs):
        return "simplex"

    def get_config(self):
        return {**super().get_config(), "tau": _python_float(self.tau), "margin": self.margin}


@tf.keras.utils.register_keras_serializable("lipdp")
class DP_TauBCE(TauBinaryCrossentropy, DP_Loss):
    """Binary cross-entropy with temperature (deel-lip), averaged over the K outputs.

    deel-lip maps labels to {0, 1} (``y > 0``); the per-logit gradient is
    ``(sigmoid(tau y_pred) - y) / K``, in ``[-1/K, 1/K]``, so ``L = 1 / sqrt(K)``. Logits are
    clipped to ``[-2^100 / tau, 2^100 / tau]`` (2^100 for tau below 1, `LOGIT_CAP`).
    """

    def __init__(self, tau=1.0, reduction=Reduction.AUTO, name="DP_TauBCE"):
        tau = check_positive(tau, "tau")
        super().__init__(tau=tau, reduction=reduction, name=name)

    def call(self, y_true, y_pred):
        return _in_float32(super().call, target_labels(self, y_true, y_pred),
                           _capped(y_pred, self.tau))

    def lipschitz(self, nb_outputs):
        return 1.0 / math.sqrt(nb_outputs)

    def label_domain(self, nb_outputs):
        return "signs"

    def get_config(self):
        return {**super().get_config(), "tau": _python_float(self.tau)}


@tf.keras.utils.register_keras_serializable("lipdp")
class DP_MulticlassHinge(tf.keras.losses.Loss, DP_Loss):
    """deel-lip's multiclass hinge: ``mean_k w_k relu(m/2 - s_k y_pred_k)``.

    ``s_k = +1`` for the true class (weight ``w = K - 1``) and ``-1`` otherwise
    (weight 1). Labels are mapped to one-hot. Gradient: ``-(K-1)/K`` on the true
    class and ``+1/K`` on the others where active, so
    ``L = sqrt((K-1)^2 + (K-1)) / K = sqrt((K-1)/K)``. Logits are clipped to ``+-2^100``
    (`LOGIT_CAP`).
    """

    min_outputs = 2  # `check_outputs`
    takes_class_indices = True  # `class_labels`: checked before training (lipdp.records)

    def __init__(self, min_margin=1.0, reduction=Reduction.AUTO, name="DP_MulticlassHinge"):
        min_margin = check_positive(min_margin, "min_margin")
        super().__init__(reduction=reduction, name=name)
        self.min_margin = float(min_margin)

    def call(self, y_true, y_pred):
        return multiclass_hinge(_to_one_hot(class_labels(self, y_true, y_pred)),
                                _capped(y_pred), self.min_margin)

    def lipschitz(self, nb_outputs):
        return _one_vs_all_constant(self, nb_outputs)

    def label_domain(self, nb_outputs):
        return "one-hot"

    def get_config(self):
        return {**super().get_config(), "min_margin": self.min_margin}


def _one_vs_all_constant(loss, nb_outputs):
    """sqrt((K-1)/K): norm of the one-vs-all weights (K-1, -1, ..., -1) / K."""
    if nb_outputs < 2:
        raise ValueError(f"{type(loss).__name__} needs at least 2 outputs (one per class). "
                         f"Received: nb_outputs={nb_outputs}")
    return math.sqrt((nb_outputs - 1) / nb_outputs)


def _multiclass_kr(y_one_hot, y_pred):
    """Per-example one-vs-all Kantorovich-Rubinstein loss (no batch statistics).

    ``-((K-1) y_pred_true - sum_{k != true} y_pred_k) / K``: the same class
    weighting as deel-lip's multiclass hinge, but per example (deel-lip's
    `MulticlassKR` normalises by class counts *in the batch*, which makes one
    example's gradient depend on the others and breaks the sensitivity bound).
    """
    k = tf.cast(tf.shape(y_pred)[-1], y_pred.dtype)
    weights = y_one_hot * (k - 1.0) - (1.0 - y_one_hot)
    return -tf.reduce_sum(weights * y_pred, axis=-1) / k


@tf.keras.utils.register_keras_serializable("lipdp")
class DP_MulticlassKR(tf.keras.losses.Loss, DP_Loss):
    """Per-example multiclass KR loss; labels mapped to one-hot.

    Gradient: ``-(K-1)/K`` on the true class, ``+1/K`` elsewhere, hence
    ``L = sqrt((K-1)/K)``. Binary outputs (K = 1) use ``-s y_pred`` with
    ``s = +1`` if ``y > 0`` else ``-1``, and ``L = 1``. Logits are clipped to ``+-2^100``
    (`LOGIT_CAP`).
    """

    takes_class_indices = True  # `class_labels`: checked before training (lipdp.records)

    def __init__(self, reduction=Reduction.AUTO, name="DP_MulticlassKR"):
        super().__init__(reduction=reduction, name=name)

    def call(self, y_true, y_pred):
        y_pred = _checked_logits(self, y_pred)
        if y_pred.shape[-1] == 1:
            sign = tf.where(target_labels(self, y_true, y_pred) > 0, 1.0, -1.0)
            return -tf.reduce_sum(tf.cast(sign, y_pred.dtype) * _capped(y_pred), axis=-1)
        return _multiclass_kr(_to_one_hot(class_labels(self, y_true, y_pred)), _capped(y_pred))

    def lipschitz(self, nb_outputs):
        return math.sqrt((nb_outputs - 1) / nb_outputs) if nb_outputs > 1 else 1.0

    def label_domain(self, nb_outputs):
        return "one-hot" if nb_outputs > 1 else "signs"


@tf.keras.utils.register_keras_serializable("lipdp")
class DP_MulticlassHKR(tf.keras.losses.Loss, DP_Loss):
    """Hinge + KR: ``KR(y_pred, y) + alpha * Hinge(y_pred, y)``, per example.

    Both gradients have the same sign pattern (negative on the true class,
    positive elsewhere) and the hinge's is the KR one masked by its active set,
    so ``||grad|| <= (1 + alpha) sqrt((K-1)/K)``, which is attained. Logits are clipped to
    ``+-2^100`` (`LOGIT_CAP`).
    """

    min_outputs = 2  # `check_outputs`
    takes_class_indices = True  # `class_labels`: checked before training (lipdp.records)

    def __init__(self, alpha=10.0, min_margin=1.0, reduction=Reduction.AUTO,
                 name="DP_MulticlassHKR"):
        alpha = check_positive(alpha, "alpha")
        min_margin = check_positive(min_margin, "min_margin")
        super().__init__(reduction=reduction, name=name)
        self.alpha = float(alpha)
        self.min_margin = float(min_margin)

    def call(self, y_true, y_pred):
        y_one_hot = _to_one_hot(class_labels(self, y_true, y_pred))
        y_pred = _capped(y_pred)
        hinge = multiclass_hinge(y_one_hot, y_pred, self.min_margin)
        return _multiclass_kr(y_one_hot, y_pred) + self.alpha * hinge

    def lipschitz(self, nb_outputs):
        return (1.0 + self.alpha) * _one_vs_all_constant(self, nb_outputs)

    def label_domain(self, nb_outputs):
        return "one-hot"

    def get_config(self):
        return {**super().get_config(), "alpha": self.alpha, "min_margin": self.min_margin}


@tf.keras.utils.register_keras_serializable("lipdp")
class DP_KCosineSimilarity(tf.keras.losses.Loss, DP_Loss):
    """K-cosine similarity (appendix C.1): ``-<y_pred, y> / max(K, ||y_pred||)``, y one-hot.

    The paper's ``K X_min`` is the single parameter ``K`` here: the floor of the
    denominator. Where ``||y_pred|| < K`` the gradient is ``-y / K`` (norm 1/K);
    elsewhere it is ``-(y - <u, y> u) / ||y_pred||`` with ``u = y_pred / ||y_pred||``,
    of norm ``sqrt(1 - <u, y>^2) / ||y_pred|| <= 1/K``. Hence ``L = 1 / K``.
    Labels are mapped to one-hot.

    In float32, ``||y_pred||`` loses up to about ``2.7e-19 sqrt(n)`` to squares flushed below
    2^-126 (n logits), so the gradient's norm is at most ``(1 + 2.7e-19 sqrt(n) / K) / K``:
    K below `MIN_K` is refused (an audit, 2026-12-06: K = 1.5e-19 and logits near 1e-19 gave
    1.6 to 10 times 1/K).

    Args:
        K: the floor of the denominator, at least `MIN_K` = 1e-6; larger K means smaller
            gradients.
    """

    min_outputs = 2  # `check_outputs`
    takes_class_indices = True  # `class_labels`: checked before training (lipdp.records)
    MIN_K = 1e-6

    def __init__(self, K=1.0, reduction=Reduction.AUTO, name="DP_KCosineSimilarity"):
        K = self._checked(K)
        super().__init__(reduction=reduction, name=name)
        self.K = float(K)

    @classmethod
    def _checked(cls, K) -> float:
        return check_at_least(K, "K", cls.MIN_K, "float32's underflow of tiny logits' squares "
                              "would let the gradient exceed 1/K.")

    def call(self, y_true, y_pred):
        y_one_hot = _to_one_hot(class_labels(self, y_true, y_pred))
        norms = tf.maximum(self.K, tf.norm(y_pred, axis=-1))
        return -tf.reduce_sum(y_one_hot * y_pred, axis=-1) / norms

    def lipschitz(self, nb_outputs):
        return 1.0 / self._checked(self.K)  # K set after construction too

    def label_domain(self, nb_outputs):
        return "one-hot"

    def get_config(self):
        return {**super().get_config(), "K": self.K}


@tf.keras.utils.register_keras_serializable("lipdp")
class DP_MeanAbsoluteError(tf.keras.losses.Loss, DP_Loss):
    """``mean_k min(|y_pred_k - y_k|, 2^100)`` over the K outputs, for regression.

    Gradient ``sign(y_pred - y) / K`` (0 where equal or beyond the cap), of norm at most
    ``sqrt(K) / K``: ``L = 1 / sqrt(K)``, whatever the targets. The cap keeps the loss of a
    finite target finite, and a batch's sum of them below float32's range (for fewer than
    2^27 examples): a target of 3e38 made it infinite, and the step stopped at the one
    that sampled that record, which revealed when it was sampled.
    """

    #: The largest error one output contributes (`call`).
    ERROR_CAP = 2.0 ** 100

    def __init__(self, reduction=Reduction.AUTO, name="DP_MeanAbsoluteError"):
        super().__init__(reduction=reduction, name=name)

    def call(self, y_true, y_pred):
        errors = tf.abs(y_pred - target_labels(self, y_true, y_pred))
        return tf.reduce_mean(tf.minimum(errors, self.ERROR_CAP), axis=-1)

    def lipschitz(self, nb_outputs):
        return 1.0 / math.sqrt(nb_outputs)
