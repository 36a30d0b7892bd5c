"""Classic DP-SGD on a record whose loss or gradient norm is not finite.

A model in clipped mode need not bound its inputs. A record with huge finite features passes
the check before the first step (it refuses NaN and inf only) and then overflows in the
forward pass or in its norms. Before 2026-12-04 `fit` stopped at the step that sampled it
(features of 1e30 with the ghost engine, 3e38 with the vectorized one), which tells when it
was sampled. Such an example now contributes zero (`lipdp.clipping.engine.usable_examples`),
an allowed clipped contribution: the step releases the clipped sum of the other examples.

Token ids outside an Embedding's vocabulary make TensorFlow's CPU lookup fail, which no
step can absorb: `fit` refuses them before the first step (`lipdp.records`).

Reference: exact per-example gradients of the usable records, one tape each, clipped with
the flat rule written out here and divided by D. Tolerances: rtol 1e-5 for the vectorized
engine, 1e-3 for the ghost engines (their norms are upper bounds up to 1e-3 above,
`tests/test_ghost.py`).
"""

import warnings
from functools import partial

import numpy as np
import pytest
import tensorflow as tf

from lipdp.clipping import GhostFallbackWarning
from lipdp.metadata import DatasetMetadata, DPParameters
from lipdp.model import DP_Model, DP_Sequential
from lipdp.records import OutOfRangeIdError
from tests._models import weights_of_the_run
from tests._soundness import per_example_gradients

L = tf.keras.layers
CCE = tf.keras.losses.CategoricalCrossentropy(from_logits=True)
D, CLIP, BAD = 8, 1.0, 3  # public denominator, threshold, the unusable record's row


def _conv_layers():
    """Conv2D (Gram norms with engine "ghost"), pooling, Dense (tanh saturates: a huge input
    can still give a finite loss, and then its norms overflow)."""
    return [L.Input((6, 6, 2)), L.Conv2D(3, 3, padding="same", activation="relu"),
            L.MaxPooling2D(2), L.Flatten(), L.Dense(5, activation="tanh"), L.Dense(4)]


def _model(engine, layers=_conv_layers, shape=(6, 6, 2), classes=4, samples=64):
    tf.keras.utils.set_random_seed(5)
    params = DPParameters(0.0, 1e-5, mode="clipped", clipping="flat", l2_norm_clip=CLIP,
                          engine=engine)
    metadata = DatasetMetadata(shape, classes, samples, 16, D, None, "shuffle")
    model = DP_Sequential(layers(), dp_parameters=params, dataset_metadata=metadata)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GhostFallbackWarning)
        model.compile(loss=CCE, optimizer=tf.keras.optimizers.SGD(0.1))
    return model


def _batch(bad_value, n=D, shape=(6, 6, 2), seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n,) + shape).astype(np.float32)
    x[BAD] = bad_value
    return tf.constant(x), tf.one_hot(rng.integers(0, 4, n), 4)


def _flat_reference(model, x, y):
    """``sum_i min(1, C / ||g_i||) g_i / D`` over every record but `BAD`."""
    keep = [i for i in range(len(x)) if i != BAD]
    x, y = tf.gather(x, keep), tf.gather(y, keep)
    sums = None
    for grads in per_example_gradients(model, CCE, x, y):
        norm = np.sqrt(sum(np.sum(g.astype(np.float64) ** 2) for g in grads))
        scaled = [min(1.0, CLIP / norm) * g.astype(np.float64) for g in grads]
        sums = scaled if sums is None else [s + g for s, g in zip(sums, scaled)]
    return [s / D for s in sums]


@pytest.mark.parametrize("engine,bad_value", [
    *[(engine, value) for engine in ("ghost", "mixed-ghost", "vectorized")
      for value in (3e38, np.nan)],
    ("ghost", 1e30)])
def test_an_unusable_record_contributes_nothing(engine, bad_value):
    """Its loss (3e38 overflows the forward pass; NaN) or its norms (1e30: the loss is
    finite, tanh saturates, but the ghost engine's Gram matrix of the first layer's input
    overflows) are not finite; the update is the other records' clipped sum, eagerly and
    traced, and no error is raised. (With 1e30 the direct forms and exact gradients of the
    other engines stay finite: the record is then clipped like any other.)"""
    model = _model(engine)
    x, y = _batch(bad_value)
    expected = _flat_reference(model, x, y)
    rtol = 1e-5 if engine == "vectorized" else 1e-3
    for private_gradients in (model.private_gradients, tf.function(model.private_gradients)):
        clean, noisy, _, losses, _ = private_gradients(x, y)
        for c, e, v in zip(clean, expected, model.trainable_variables):
            np.testing.assert_allclose(c.numpy(), e, rtol=rtol, atol=1e-7, err_msg=v.name)
        norms = np.array([float(tf.reduce_sum(tf.square(s - n))) for s, n in zip(clean, noisy)])
        assert np.all(norms == 0.0)  # sigma = 0: the released gradient is the clean one
        finite = np.isfinite(losses.numpy())
        assert finite[np.arange(D) != BAD].all()


def _log_layers():
    """A model that makes a finite input non-finite: log|0| = -inf."""
    return [L.Input((3,)), L.Lambda(lambda t: tf.math.log(tf.abs(t))),
            L.Dense(4, activation="tanh"), L.Dense(4)]


@pytest.mark.parametrize("engine", ["ghost", "mixed-ghost", "vectorized"])
@pytest.mark.parametrize("unusable", ["one record", "every record"])
def test_a_finite_record_the_model_makes_non_finite_contributes_nothing(engine, unusable):
    """A record of zeros through log|x|: its loss is not finite, so it contributes zero. The
    ghost engines passed the batch again with its inputs zeroed, which the model makes -inf
    again, and 0 times inf made the sum NaN: the step stopped on a finite record, which
    tells when it was sampled (a review, 2026-12-07). With every record unusable the sums
    are 0."""
    model = _model(engine, _log_layers, (3,))
    x, y = _batch(0.0, shape=(3,))
    if unusable == "every record":
        x = tf.zeros_like(x)
        expected = [np.zeros(v.shape) for v in model.trainable_variables]
    else:
        expected = _flat_reference(model, x, y)
    rtol = 1e-5 if engine == "vectorized" else 1e-3
    for private_gradients in (model.private_gradients, tf.function(model.private_gradients)):
        clean = private_gradients(x, y)[0]
        for c, e, v in zip(clean, expected, model.trainable_variables):
            np.testing.assert_allclose(c.numpy(), e, rtol=rtol, atol=1e-7, err_msg=v.name)


def _mlp_layers():
    return [L.Input((30,)), L.Dense(20, activation="relu"), L.Dense(3)]


@pytest.mark.parametrize("engine", ["ghost", "vectorized"])
def test_fit_trains_through_a_record_with_huge_finite_features(engine):
    """The README's sharp edge of 2026-12-04 (a 30-20-3 ReLU MLP, one record among 64): `fit`
    used to stop at the step that sampled it, from features of 1e30 with the ghost engine
    (its norms overflowed; they are float64 bounds since, and inf gives a factor of 0) and
    3e38 with both (the forward pass overflows). Every step now runs and the weights stay
    finite."""
    rng = np.random.default_rng(1)
    x = rng.normal(size=(64, 30)).astype(np.float32)
    x[17] = 3e38
    y = np.eye(3, dtype=np.float32)[rng.integers(0, 3, 64)]
    model = _model(engine, _mlp_layers, (30,), classes=3)
    model.fit(x, y, batch_size=D, epochs=1, verbose=0)
    assert model.dp_steps_taken == 64 // D
    assert all(np.all(np.isfinite(v.numpy())) for v in model.trainable_variables)


def _text_model(two_inputs=False):
    """Token ids (5 per record, vocabulary 10) -> Embedding -> Dense; with `two_inputs`, a
    functional model whose second input holds the ids."""
    tf.keras.utils.set_random_seed(6)
    params = DPParameters(0.0, 1e-5, mode="clipped", clipping="flat", l2_norm_clip=CLIP)
    metadata = DatasetMetadata((5,), 3, 64, 16, D, None, "shuffle")
    if two_inputs:
        dense, ids = L.Input((2,), name="dense"), L.Input((5,), dtype="int32", name="ids")
        hidden = L.Concatenate()([dense, L.Flatten()(L.Embedding(10, 4)(ids))])
        model = DP_Model([dense, ids], L.Dense(3)(hidden), dp_parameters=params,
                         dataset_metadata=metadata)
    else:
        model = DP_Sequential([L.Input((5,), dtype="int32"), L.Embedding(10, 4), L.Flatten(),
                               L.Dense(3)], dp_parameters=params, dataset_metadata=metadata)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GhostFallbackWarning)
        model.compile(loss=CCE, optimizer=tf.keras.optimizers.SGD(0.1))
    return model


@pytest.mark.parametrize("where", ["arrays", "dataset", "second input", "dict"])
def test_ids_outside_an_embeddings_vocabulary_are_refused_before_the_first_step(where):
    """TensorFlow's CPU lookup fails on them: `fit` stopped at the step that sampled the
    record (its fourth step here, with both engines). Refused before training, listing the
    records: 17 >= 10 in record 37, -1 in record 50."""
    rng = np.random.default_rng(2)
    ids = rng.integers(0, 10, (64, 5)).astype(np.int32)
    ids[37, 2], ids[50, 0] = 17, -1
    y = np.eye(3, dtype=np.float32)[rng.integers(0, 3, 64)]
    model = _text_model(two_inputs=where in ("second input", "dict"))
    inputs = ([np.zeros((64, 2), np.float32), ids] if where == "second input" else
              {"dense": np.zeros((64, 2), np.float32), "ids": ids} if where == "dict" else ids)
    refused = r"2 of 64 training records hold ids outside \[0, input_dim\)"
    if where == "dataset":
        dataset = tf.data.Dataset.from_tensor_slices((ids, y)).batch(D)
        with pytest.raises(OutOfRangeIdError, match=refused + r".*batch 4 row 5, batch 6 row 2"):
            model.fit(dataset, epochs=1, verbose=0)
    else:
        with pytest.raises(OutOfRangeIdError, match=refused + r".*: 37, 50"):
            model.fit(inputs, y, batch_size=D, epochs=1, verbose=0)
    assert model.dp_steps_taken == 0
    ids[37, 2], ids[50, 0] = 9, 0  # in range: trains
    model.fit(inputs, y, batch_size=D, epochs=1, verbose=0)
    assert model.dp_steps_taken == 64 // D


@pytest.mark.parametrize("loss,where", [
    ("sparse_categorical_crossentropy", "arrays"),
    (tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True), "arrays"),
    (tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True), "dataset")])
def test_class_indices_outside_a_sparse_cross_entropy_are_refused_before_the_first_step(loss,
                                                                                         where):
    """Keras' sparse cross-entropy fails on them on the CPU: `fit` stopped at the step that
    sampled the record (the fourth, with both engines). Refused before training: 17 and -2
    for 3 classes."""
    rng = np.random.default_rng(3)
    x = rng.normal(size=(64, 6)).astype(np.float32)
    y = rng.integers(0, 3, 64).astype(np.int32)
    y[37], y[50] = 17, -2
    tf.keras.utils.set_random_seed(7)
    model = DP_Sequential([L.Input((6,)), L.Dense(3)], dp_parameters=DPParameters(
        0.0, 1e-5, mode="clipped", l2_norm_clip=CLIP), dataset_metadata=DatasetMetadata(
        (6,), 3, 64, 16, D, None, "shuffle"))
    model.compile(loss=loss, optimizer=tf.keras.optimizers.SGD(0.1))
    refused = r"2 of 64 training records hold class indices outside \[0, K\)"
    if where == "dataset":
        with pytest.raises(OutOfRangeIdError, match=refused + r".*batch 4 row 5, batch 6 row 2"):
            model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(D), epochs=1, verbose=0)
    else:
        with pytest.raises(OutOfRangeIdError, match=refused + r".*: 37, 50"):
            model.fit(x, y, batch_size=D, epochs=1, verbose=0)
    assert model.dp_steps_taken == 0
    y[37], y[50] = 2, 0
    model.fit(x, y, batch_size=D, epochs=1, verbose=0)
    assert model.dp_steps_taken == 64 // D


def _sparse_label_model(engine):
    tf.keras.utils.set_random_seed(7)
    model = DP_Sequential([L.Input((6,)), L.Dense(3)], dp_parameters=DPParameters(
        0.0, 1e-5, mode="clipped", l2_norm_clip=CLIP, engine=engine),
        dataset_metadata=DatasetMetadata((6,), 3, 64, 16, D, None, "shuffle"))
    model.compile(loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  optimizer=tf.keras.optimizers.SGD(0.1))
    return model


@pytest.mark.parametrize("case,engine", [("ids", "ghost"), ("ids second input", "vectorized"),
                                         ("ids dict", "ghost"), ("labels", "ghost"),
                                         ("labels", "vectorized")])
def test_ids_and_labels_the_check_does_not_see_are_mapped_into_range(case, engine):
    """Records `fit`'s check does not see (`validate_data=False` here; a Poisson pipeline's
    checking pass samples about 63% of the records) used to stop the step that sampled them.
    The step maps each id into the vocabulary and each class index into [0, K) (clipped):
    its update equals that of the same batch clipped by hand, and `fit` runs every step."""
    rng = np.random.default_rng(9)
    y_hot = np.eye(3, dtype=np.float32)[rng.integers(0, 3, 64)]
    if case == "labels":
        x = rng.normal(size=(64, 6)).astype(np.float32)
        y = rng.integers(0, 3, 64).astype(np.int32)
        y[3], y[50] = 17, -2
        mapped = x, np.clip(y, 0, 2)
        build = partial(_sparse_label_model, engine)
    else:
        ids = rng.integers(0, 10, (64, 5)).astype(np.int32)
        ids[3, 2], ids[50, 0] = 17, -1
        two, dense, clipped = case != "ids", np.zeros((64, 2), np.float32), np.clip(ids, 0, 9)
        if case == "ids dict":
            x, mapped = {"dense": dense, "ids": ids}, ({"dense": dense, "ids": clipped}, y_hot)
        else:
            x = [dense, ids] if two else ids
            mapped = ([dense, clipped] if two else clipped), y_hot
        y = y_hot
        build = partial(_text_model, two_inputs=two)
    first, by_hand = build(), build()
    first.train_on_batch(tf.nest.map_structure(lambda a: a[:D], x), y[:D])
    by_hand.train_on_batch(tf.nest.map_structure(lambda a: a[:D], mapped[0]), mapped[1][:D])
    for a, b in zip(weights_of_the_run(first), weights_of_the_run(by_hand)):
        np.testing.assert_array_equal(a, b)
    first.fit(x, y, batch_size=D, epochs=1, verbose=0, validate_data=False)
    assert first.dp_steps_taken == 1 + 64 // D


def _fallback_model(engine):
    """A Dense called twice (exact per-example gradients of the whole model in the ghost
    engines), a LayerNormalization (replayed from its input and cotangent), a Dense (ghost
    rule)."""
    tf.keras.utils.set_random_seed(8)
    inputs = L.Input((6,))
    shared = L.Dense(6, activation="tanh")
    outputs = L.Dense(3)(L.LayerNormalization()(shared(shared(inputs))))
    params = DPParameters(0.0, 1e-5, mode="clipped", clipping="flat", l2_norm_clip=CLIP,
                          engine=engine)
    model = DP_Model(inputs, outputs, dp_parameters=params,
                     dataset_metadata=DatasetMetadata((6,), 3, 64, 16, D, None, "shuffle"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GhostFallbackWarning)
        model.compile(loss=CCE, optimizer=tf.keras.optimizers.SGD(0.1))
    return model


@pytest.mark.parametrize("bad_value", [None, np.nan, 3e38])
@pytest.mark.parametrize("engine", ["ghost", "vectorized"])
def test_a_batch_update_is_the_sum_of_its_examples_updates(engine, bad_value):
    """No example's contribution depends on another: the noiseless update of a batch equals
    the sum of the updates of its examples, one batch each, with or without an unusable
    record in it. Before 2026-12-05 the ghost engine took the shared layer's per-example
    gradients from the Jacobian of the batch's losses, which sums 0 x NaN over the other
    rows: one NaN record made every example unusable, and the step released 0 for all of
    them (0.13 from the other records' update, above the C / D = 0.125 one record may move
    it). A 3e38 record is usable here (tanh saturates: finite loss and norms)."""
    model = _fallback_model(engine)
    rng = np.random.default_rng(4)
    x = rng.normal(size=(D, 6)).astype(np.float32)
    if bad_value is not None:
        x[BAD] = bad_value
    y = np.eye(3, dtype=np.float32)[np.arange(D) % 3]
    step = tf.function(model.private_gradients)
    whole = step(tf.constant(x), tf.constant(y))[0]
    singles = [step(tf.constant(x[i:i + 1]), tf.constant(y[i:i + 1]))[0] for i in range(D)]
    for v, total, parts in zip(model.trainable_variables, whole, zip(*singles)):
        np.testing.assert_allclose(total.numpy(), np.sum([p.numpy() for p in parts], axis=0),
                                   atol=1e-6, err_msg=v.name)
