"""Test-set scores of a trained binary classifier: decision scores and the AUROC.

The score of an example is what the model thresholds at 0: its single logit, or for two
outputs the difference ``logit_1 - logit_0`` (class 1 is predicted when it is positive).
The AUROC is the probability that a random positive example scores higher than a random
negative one, ties counting one half (the Mann–Whitney statistic, computed from average
ranks); `tests/test_evaluation.py` checks it against scikit-learn's ``roc_auc_score``.
"""

from __future__ import annotations

from typing import Tuple

import numpy as np
import tensorflow as tf

from lipdp.certify import labelled_batches
from lipdp.state_guard import guarded_call

__all__ = ["binary_scores", "roc_auc"]


def binary_scores(model, dataset_or_xy, batch_size: int = 1024) -> Tuple[np.ndarray, np.ndarray]:
    """``(scores, labels)`` of a one- or two-output model on a dataset of ``(x, y)`` batches
    or an ``(x, y)`` pair of arrays (cut into `batch_size` pieces); labels are 0/1 (one-hot or
    index labels).

    Raises:
        ValueError: the model has more than two outputs.
    """
    outputs = int(model.output_shape[-1])
    if outputs > 2:
        raise ValueError(f"An AUROC needs a binary classifier; the model has {outputs} outputs.")
    scores, labels = [], []
    for x, y in labelled_batches(dataset_or_xy, batch_size):
        logits = np.asarray(guarded_call(model, tf.convert_to_tensor(x)), np.float64)
        scores.append(logits[:, 0] if outputs == 1 else logits[:, 1] - logits[:, 0])
        labels.append(y.argmax(axis=-1) if y.ndim == 2 and y.shape[-1] == 2
                      else y.reshape(-1) > 0)
    return np.concatenate(scores), np.concatenate(labels).astype(np.int64)


def roc_auc(scores, labels) -> float:
    """Area under the ROC curve of ``scores`` for 0/1 ``labels`` (ties count one half).

    Raises:
        ValueError: the labels do not contain both classes, or a score is NaN (each NaN
            took a rank of its own by its position: a diverged model's scores gave 1.0 or
            0.0 by the rows' order, an audit, 2026-12-07).
    """
    scores = np.asarray(scores, np.float64).reshape(-1)
    if np.isnan(scores).any():
        raise ValueError(f"{int(np.isnan(scores).sum())} of {len(scores)} scores are NaN: the "
                         "AUROC has no value for them (a diverged model's outputs?).")
    labels = np.asarray(labels).reshape(-1).astype(bool)
    positives, negatives = int(labels.sum()), int((~labels).sum())
    if positives == 0 or negatives == 0:
        raise ValueError("The AUROC needs both positive and negative examples.")
    order = np.argsort(scores, kind="mergesort")
    ranks = np.empty(len(scores))
    sorted_scores = scores[order]
    start = 0
    while start < len(scores):  # average rank (1-based) over each run of tied scores
        end = start
        while end + 1 < len(scores) and sorted_scores[end + 1] == sorted_scores[start]:
            end += 1
        ranks[order[start:end + 1]] = (start + end) / 2.0 + 1.0
        start = end + 1
    u_statistic = ranks[labels].sum() - positives * (positives + 1) / 2.0
    return float(u_statistic / (positives * negatives))
