"""Clipless DP-SGD on a record whose features, labels or loss are not finite.

`fit` refuses NaN and inf records before the first step, but only those its check sees: a
Poisson pipeline's checking pass samples about 63% of the records, and `validate_data=False`
or a per-example transformation downstream of it sees none. Until 2026-12-05 the private step
stopped at the step that sampled such a record ("Non-finite loss"), which tells when it was
sampled. Such an example now contributes zero (`DP_Model._clipless_sums`), an allowed
contribution, as in clipped mode (`tests/test_clipping_unusable_records.py`); a record with
huge finite features is an ordinary record (the input clipping maps it into the ball), and a
float64 record finite there but beyond float32's range (an infinity in the model) is unusable.

Reference: exact per-example gradients of the usable records, one tape each, summed and
divided by D; sigma = 0, so the released gradient is the clean one.
"""

import numpy as np
import pytest
import tensorflow as tf

from lipdp.losses import DP_MeanAbsoluteError, DP_TauCategoricalCrossentropy
from tests import _models
from tests._soundness import per_example_gradients

D, BAD = 16, 5  # the models' public denominator (their metadata's batch), the record's row


def _cnn():
    tf.keras.utils.set_random_seed(3)
    model = _models.cnn(sigma=0.0)
    model.compile(loss=DP_TauCategoricalCrossentropy(2.0), optimizer=tf.keras.optimizers.SGD(0.1))
    return model


def _mlp_absolute_error():
    tf.keras.utils.set_random_seed(4)
    model = _models.mlp(sigma=0.0)
    model.compile(loss=DP_MeanAbsoluteError(), optimizer=tf.keras.optimizers.SGD(0.1))
    return model


def _batch(model, seed):
    rng = np.random.default_rng(seed)
    shape, classes = tuple(model.input_shape[1:]), model.output_shape[-1]
    x = rng.normal(size=(D,) + shape).astype(np.float32)
    return x, np.eye(classes, dtype=np.float32)[rng.integers(0, classes, D)]


def _reference(model, x, y, keep):
    rows = [i for i in range(D) if keep or i != BAD]
    grads = per_example_gradients(model, model.dp_loss, tf.gather(x, rows), tf.gather(y, rows),
                                  traced=True)
    return [sum(g[v].astype(np.float64) for g in grads) / D for v in range(len(grads[0]))]


def _set(array, index, value):
    array = array.copy()
    array[index] = value
    return array


# (what is changed in record BAD, whether the record still counts)
CNN_CASES = {
    "x nan": (lambda x, y: (_set(x, (BAD, 2, 3, 1), np.nan), y), False),
    "x inf": (lambda x, y: (_set(x, (BAD, 0, 0, 0), np.inf), y), False),
    "x -inf row": (lambda x, y: (_set(x, BAD, -np.inf), y), False),
    "y nan": (lambda x, y: (x, _set(y, (BAD, 1), np.nan)), False),
    "y inf": (lambda x, y: (x, _set(y, (BAD, 0), np.inf)), False),
    # Finite: the input clipping maps the record to the zero vector (its norm overflows).
    "x 3e38": (lambda x, y: (_set(x, BAD, 3e38), y), True),
    # float64 batches: finite there, but an infinity once cast to the model's float32 (the
    # step stopped on them until 2026-12-05); 3e38 stays finite in float32.
    "x 1e39 float64": (lambda x, y: (_set(x.astype(np.float64), (BAD, 1, 1, 0), 1e39), y),
                       False),
    "y -1e39 float64": (lambda x, y: (x, _set(y.astype(np.float64), (BAD, 2), -1e39)), False),
    "x 3e38 float64": (lambda x, y: (_set(x.astype(np.float64), BAD, 3e38), y), True),
}
MAE_CASES = {
    "y nan": (lambda x, y: (x, _set(y, (BAD, 2), np.nan)), False),
    "y inf": (lambda x, y: (x, _set(y, (BAD, 0), -np.inf)), False),
}


@pytest.mark.parametrize("build,cases", [(_cnn, CNN_CASES), (_mlp_absolute_error, MAE_CASES)],
                         ids=["cnn-cross-entropy", "mlp-absolute-error"])
def test_an_unusable_record_contributes_nothing(build, cases):
    """Eagerly and traced, the step releases the gradient of the other records (with
    every case, the old step raised InvalidArgumentError)."""
    model = build()
    traced = tf.function(model.private_gradients)
    for seed, (name, (spoil, keep)) in enumerate(cases.items()):
        x, y = spoil(*_batch(model, seed))
        expected = _reference(model, x, y, keep)
        for private_gradients in (model.private_gradients, traced):
            clean, noisy, _, _, _ = private_gradients(tf.constant(x), tf.constant(y))
            for c, n, e, v in zip(clean, noisy, expected, model.trainable_variables):
                np.testing.assert_allclose(c.numpy(), e, rtol=1e-4, atol=1e-6,
                                           err_msg=f"{name}: {v.name}")
                np.testing.assert_array_equal(n.numpy(), c.numpy())  # sigma = 0


def test_fit_trains_through_records_its_check_did_not_see():
    """`validate_data=False` (as for records a Poisson checking pass did not sample): every
    step runs, the weights stay finite; the same fit stopped at its second step before."""
    rng = np.random.default_rng(7)
    model = _models.mlp(sigma=1.0)
    model.compile(loss=DP_TauCategoricalCrossentropy(2.0), optimizer=tf.keras.optimizers.SGD(0.1))
    x = rng.normal(size=(64, 10)).astype(np.float32)
    y = np.eye(3, dtype=np.float32)[rng.integers(0, 3, 64)]
    x[17, 4], y[40, 1] = np.nan, np.inf
    model.fit(x, y, batch_size=D, epochs=1, verbose=0, validate_data=False)
    assert model.dp_steps_taken == 64 // D
    assert all(np.all(np.isfinite(v.numpy())) for v in model.trainable_variables)
