"""lipdp.evaluation: the AUROC against scikit-learn's, and the scores of binary models."""

import numpy as np
import pytest
import tensorflow as tf
from sklearn.metrics import roc_auc_score

from lipdp.evaluation import binary_scores, roc_auc


@pytest.mark.parametrize("seed", range(5))
def test_roc_auc_matches_scikit_learn_with_and_without_ties(seed):
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 2, 200)
    scores = rng.normal(size=200) + labels
    assert roc_auc(scores, labels) == pytest.approx(roc_auc_score(labels, scores), abs=1e-12)
    tied = np.round(scores)  # many ties
    assert roc_auc(tied, labels) == pytest.approx(roc_auc_score(labels, tied), abs=1e-12)


def test_roc_auc_extremes_and_errors():
    assert roc_auc([0.1, 0.9], [0, 1]) == 1.0
    assert roc_auc([0.9, 0.1], [0, 1]) == 0.0
    assert roc_auc([0.5, 0.5], [0, 1]) == 0.5
    with pytest.raises(ValueError, match="both"):
        roc_auc([0.1, 0.2], [1, 1])


def test_binary_scores_of_one_and_two_output_models():
    x = np.array([[1.0, 0.0], [0.0, 1.0], [2.0, -1.0]], np.float32)
    two = tf.keras.Sequential([tf.keras.layers.Input((2,)),
                               tf.keras.layers.Dense(2, use_bias=False, kernel_initializer="identity")])
    scores, labels = binary_scores(two, (x, np.eye(2)[[0, 1, 1]]))
    np.testing.assert_allclose(scores, [-1.0, 1.0, -3.0])
    np.testing.assert_array_equal(labels, [0, 1, 1])
    one = tf.keras.Sequential([tf.keras.layers.Input((2,)), tf.keras.layers.Dense(
        1, use_bias=False, kernel_initializer=tf.keras.initializers.Constant([[1.0], [0.0]]))])
    dataset = tf.data.Dataset.from_tensor_slices((x, np.array([1, 0, 1]))).batch(2)
    scores, labels = binary_scores(one, dataset)
    np.testing.assert_allclose(scores, [1.0, 0.0, 2.0])
    np.testing.assert_array_equal(labels, [1, 0, 1])
    three = tf.keras.Sequential([tf.keras.layers.Input((2,)), tf.keras.layers.Dense(3)])
    with pytest.raises(ValueError, match="binary"):
        binary_scores(three, (x, np.zeros(3)))
