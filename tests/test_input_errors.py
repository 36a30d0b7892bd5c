"""Bad input gets an early error that names what is wrong; NumPy scalars are numbers.

Each case was found by an audit (2026-12-05) raising an error that named neither the argument
nor the fix (numpy's "inhomogeneous shape", "unhashable type", deel-lip's "self.n has to be a
divisor"), or refusing a NumPy scalar with a message showing the value it refused
("Received: noise_multiplier=2.0").
"""

import warnings

import numpy as np
import pytest
import tensorflow as tf

import lipdp
from lipdp import losses
from lipdp.layers import DP_BoundedInput, DP_GroupSort, DP_QuickSpectralDense
from lipdp.losses import DP_MulticlassHKR, DP_TauCategoricalCrossentropy

N, BATCH, DIM, K = 32, 8, 6, 3


@pytest.mark.parametrize("scalar", [np.float32, np.float64, np.int64])
def test_numpy_scalars_are_the_numbers_they_hold(scalar):
    assert lipdp.DPParameters(scalar(2), scalar(1) / 4) == lipdp.DPParameters(2.0, 0.25)
    metadata = lipdp.DatasetMetadata((DIM,), K, N, 8, np.int64(BATCH), max_norm=scalar(2))
    assert metadata == lipdp.DatasetMetadata((DIM,), K, N, 8, BATCH, max_norm=2.0)
    assert type(metadata.batch_size) is int and type(metadata.max_norm) in (int, float)
    clipping = lipdp.AdaptiveClipping(np.float32(0.5), learning_rate=scalar(1))
    assert clipping == lipdp.AdaptiveClipping(0.5, learning_rate=1.0)
    assert DP_TauCategoricalCrossentropy(scalar(5)).get_config()["tau"] == 5.0
    assert DP_MulticlassHKR(alpha=scalar(10)).lipschitz(K) == DP_MulticlassHKR(10.0).lipschitz(K)


@pytest.mark.parametrize("bad", [None, float("nan"), -1.0, True])
def test_an_invalid_noise_multiplier_is_named(bad):
    with pytest.raises(ValueError, match=r"`noise_multiplier`.*Received: noise_multiplier="):
        lipdp.DPParameters(noise_multiplier=bad)


def _model():
    metadata = lipdp.DatasetMetadata((DIM,), K, N, 8, BATCH, 1.0, "shuffle")
    model = lipdp.DP_Sequential(
        [DP_BoundedInput(1.0, input_shape=(DIM,)), DP_QuickSpectralDense(8), DP_GroupSort(2),
         DP_QuickSpectralDense(K)],
        dp_parameters=lipdp.DPParameters(1.0, 1e-5), dataset_metadata=metadata)
    model.compile(loss=DP_TauCategoricalCrossentropy(1.0), optimizer="sgd")
    return model


def test_fit_names_inputs_and_labels_of_different_lengths_or_lists():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(N, DIM)).astype("float32")
    y = np.eye(K, dtype="float32")[rng.integers(0, K, N)]
    model = _model()
    with pytest.raises(ValueError, match=r"inputs and labels of different lengths, \[32, 10\]"):
        model.fit(x, y[:10], verbose=0)
    with pytest.raises(TypeError, match=r"pass np.asarray"):
        model.fit(x.tolist(), y.tolist(), verbose=0)
    assert model.dp_steps_taken == 0
    model.fit(x, y, verbose=0)
    assert model.dp_steps_taken == N // BATCH


def test_load_dataset_takes_a_name():
    with pytest.raises(TypeError, match="take a dataset's name"):
        lipdp.data.load_dataset(np.zeros((10, 4)), 2, bound_clip_value=1.0)


@pytest.mark.parametrize("n, width", [(2, 15), (3, 16)])
def test_group_sort_names_a_width_its_groups_do_not_divide(n, width):
    layer = DP_GroupSort(n, name="sorting")
    with pytest.raises(ValueError, match=f"'sorting'.*do not divide its input's {width}"):
        layer.build((None, width))
    DP_GroupSort(n).build((None, 2 * 3 * n))  # divides
    assert DP_GroupSort(4).build((None, 2)) is None  # n above the width: one group (deel-lip)


def test_a_group_sort_layer_still_sorts():
    out = DP_GroupSort(2)(tf.constant([[3.0, 1.0, 2.0, 4.0]]))
    assert sorted(out.numpy().ravel().tolist()) == [1.0, 2.0, 3.0, 4.0]


def test_train_on_batch_refuses_a_batch_larger_than_the_step_allows_before_it():
    """It came from inside the step as an InvalidArgumentError holding lipdp's message."""
    rng = np.random.default_rng(1)
    x = rng.normal(size=(BATCH + 1, DIM)).astype("float32")
    y = np.eye(K, dtype="float32")[rng.integers(0, K, BATCH + 1)]
    model = _model()
    with pytest.raises(ValueError, match=r"batch of 9 examples, more than "
                                         r"dataset_metadata.batch_size allows \(8;"):
        model.train_on_batch(x, y)
    assert model.dp_steps_taken == 0
    model.train_on_batch(x[:BATCH], y[:BATCH])
    assert model.dp_steps_taken == 1


def test_an_unbuilt_model_is_named_by_the_certificates_and_the_plan():
    """certified_radii raised AttributeError 'kernel', get_max_epochs named an internal
    'nb_noised_variables=0'."""
    model = lipdp.DP_Sequential(
        [DP_BoundedInput(1.0), DP_QuickSpectralDense(8), DP_GroupSort(2), DP_QuickSpectralDense(K)],
        dp_parameters=lipdp.DPParameters(1.0, 1e-5),
        dataset_metadata=lipdp.DatasetMetadata((DIM,), K, N, 8, BATCH, 1.0))
    x = np.zeros((4, DIM), np.float32)
    for call in (lambda: lipdp.certify.certified_radii(model, x),
                 lambda: lipdp.bounds.gradient_bounds(model),
                 lambda: lipdp.get_max_epochs(3.0, model)):
        with pytest.raises(ValueError, match="is not built"):
            call()
    model.build((None, DIM))
    assert lipdp.get_max_epochs(3.0, model) >= 0  # no error once built
    assert lipdp.certify.certified_radii(model, x).shape == (4,)


@pytest.mark.parametrize("shape", [(4.7,), (-4,), (), 4, (None, 4), (True,)])
def test_metadata_refuses_an_input_shape_that_is_not_positive_integers(shape):
    """(4.7,) was truncated to (4,), (-4,) and () accepted, 4 and (None, 4) raised TypeErrors
    that named nothing."""
    with pytest.raises(ValueError, match=r"`input_shape`, expected a tuple of positive"):
        lipdp.DatasetMetadata(shape, K, N, 8, BATCH)
    with pytest.raises(ValueError, match=r"`nb_samples_test`"):
        lipdp.DatasetMetadata((DIM,), K, N, -1, BATCH)
    assert lipdp.DatasetMetadata([np.int64(DIM)], K, N, 0, BATCH).input_shape == (DIM,)


@pytest.mark.parametrize("seed", ["abc", 1.5, -3, True, 2**63])
def test_load_dataset_names_a_seed_that_is_not_an_integer(seed):
    with pytest.raises(ValueError, match="`seed`"):
        lipdp.data.load_dataset("digits", 16, bound_clip_value=1.0, seed=seed)


def test_certificates_refuse_inputs_holding_nan():
    """certified_radii returned NaN radii, and certified_accuracy counted a NaN row's arg-max
    as class 0."""
    model = _model()
    x = np.zeros((5, DIM), np.float32)
    x[3, 2] = np.nan
    for call in (lambda: lipdp.certify.certified_radii(model, x),
                 lambda: lipdp.certify.certified_accuracy(model, (x, np.zeros(5, int)), [0.0])):
        with pytest.raises(ValueError, match=r"1 inputs hold NaN or inf values \(e.g. row 3"):
            call()
    assert np.all(np.isfinite(lipdp.certify.certified_radii(model, x[:3])))


@pytest.mark.parametrize("labels", ["one-hot of K + 2 columns", "(N, 2, 1)", "strings"])
@pytest.mark.parametrize("data", ["arrays", "dataset"])
def test_labels_the_loss_cannot_take_are_refused_before_training(labels, data):
    """Refused with the loss's message when the step was traced (the last line of Keras'
    traceback), strings as an UnimplementedError from a Cast."""
    rng = np.random.default_rng(2)
    x = rng.normal(size=(N, DIM)).astype("float32")
    y = {"one-hot of K + 2 columns": np.eye(K + 2, dtype="float32")[rng.integers(0, K, N)],
         "(N, 2, 1)": np.zeros((N, 2, 1), "float32"),
         "strings": np.array(["a"] * N)}[labels]
    model = _model()
    given = ((tf.data.Dataset.from_tensor_slices((x, y)).shuffle(N).batch(BATCH),)
             if data == "dataset" else (x, y))
    with pytest.raises(ValueError, match="training labels"):
        model.fit(*given, epochs=1, verbose=0)
    assert model.dp_steps_taken == 0


@pytest.mark.parametrize("data", ["arrays", "dataset"])
def test_inputs_of_another_shape_than_the_model_s_are_refused_before_training(data):
    """Keras' error came when the step was traced, the last line of a 24-line traceback
    through lipdp's step (a usability audit, 2026-12-07)."""
    rng = np.random.default_rng(3)
    x = rng.normal(size=(N, DIM - 1)).astype("float32")
    y = np.eye(K, dtype="float32")[rng.integers(0, K, N)]
    model = _model()
    given = ((tf.data.Dataset.from_tensor_slices((x, y)).shuffle(N).batch(BATCH),)
             if data == "dataset" else (x, y))
    with pytest.raises(ValueError, match=r"fit received training inputs of shape \((32|None), "
                                         r"5\): the model takes examples of shape \(6,\)"):
        model.fit(*given, epochs=1, verbose=0)
    assert model.dp_steps_taken == 0


def test_a_dataset_of_single_examples_is_told_to_batch():
    """The message named the same shape twice, "(6,)" received and "(6,)" taken (a
    usability audit, 2026-12-07)."""
    rng = np.random.default_rng(4)
    x = rng.normal(size=(N, DIM)).astype("float32")
    y = np.eye(K, dtype="float32")[rng.integers(0, K, N)]
    with pytest.raises(ValueError, match=r"\+ \(6,\)\)\. The dataset yields single "
                                         r"examples: batch it"):
        _model().fit(tf.data.Dataset.from_tensor_slices((x, y)), epochs=1, verbose=0)


@pytest.mark.parametrize("epochs", [1.5, -1, True, "2"])
def test_epochs_that_are_not_a_count_are_refused(epochs):
    """1.5 failed inside Keras' loop (converting it to a tensor), -1 trained nothing, silently
    (a usability audit, 2026-12-07)."""
    x = np.zeros((N, DIM), "float32")
    y = np.eye(K, dtype="float32")[np.arange(N) % K]
    with pytest.raises(ValueError, match=f"epochs={epochs!r}: give a whole number of epochs"):
        _model().fit(x, y, batch_size=BATCH, epochs=epochs, verbose=0)


@pytest.mark.parametrize("loss, labels, makes", [
    (DP_TauCategoricalCrossentropy(1.0), [[0.5, 0.8, 0.0], [-1.0, 1.0, 0.0]], "its entries "
                                                                               "above 0"),
    (DP_MulticlassHKR(), [[0.2, 0.7, 0.1], [0.0, 5.0, 0.0]], "the one-hot row of its largest"),
    (losses.DP_MulticlassHinge(), [[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]], "the one-hot row of"),
])
def test_labels_a_loss_would_train_as_others_are_refused(loss, labels, makes):
    """A lipdp loss maps every label onto its domain (no record breaks the bound or stops
    a step): soft labels under a one-vs-all loss trained as their arg-max class, rows of 5
    or summing to 2 as others, silently (a usability audit, 2026-12-07). Smoothed labels
    stay valid for the cross-entropy."""
    x = np.zeros((N, DIM), "float32")
    y = np.eye(K, dtype="float32")[np.arange(N) % K]
    y[[3, 7]] = labels
    model = _model()
    model.compile(loss=loss, optimizer="sgd")
    with pytest.raises(lipdp.records.LabelDomainError,
                       match=rf"2 of {N} training records hold labels {type(loss).__name__} does "
                             rf"not take as they are \(by index in the arrays given to fit\): 3, "
                             rf"7\. It takes .* would train each of these as {makes}"):
        model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    assert model.dp_steps_taken == 0
    smoothed = 0.9 * np.eye(K)[np.arange(N) % K] + 0.1 / K
    signs = 2.0 * np.eye(K)[np.arange(N) % K] - 1.0  # deel-lip's +-1 labels: one-hot to it
    if isinstance(loss, DP_TauCategoricalCrossentropy):  # float16 sums round above 1 (a review)
        for labels in (smoothed.astype("float32"), smoothed.astype("float16")):
            model.fit(x, labels, batch_size=BATCH, epochs=1, verbose=0)
    else:
        model.fit(x, signs.astype("float32"), batch_size=BATCH, epochs=1, verbose=0)


def test_binary_targets_other_than_signs_are_refused():
    """DP_TauBCE maps a target above 0 to 1: probabilities of 0.3 or pixels of 255 trained as
    1 (a usability audit, 2026-12-07). 0/1 and -1/1 targets train, the second of shape
    (N, 1) after (N,): Keras retraced the step for both label ranks at once, and the step
    stopped on labels of unknown rank (found while writing this test)."""
    metadata = lipdp.DatasetMetadata((DIM,), 1, N, 8, BATCH, 1.0, "shuffle")
    model = lipdp.DP_Sequential([DP_BoundedInput(1.0, input_shape=(DIM,)),
                                 DP_QuickSpectralDense(1)],
                                dp_parameters=lipdp.DPParameters(1.0, 1e-5),
                                dataset_metadata=metadata)
    model.compile(loss=losses.DP_TauBCE(1.0), optimizer="sgd")
    x = np.zeros((N, DIM), "float32")
    targets = (np.arange(N) % 2).astype("float32")
    with pytest.raises(lipdp.records.LabelDomainError, match=r"targets 0 or 1 \(or -1 for 0\)"):
        model.fit(x, np.where(np.arange(N) == 4, 0.3, targets), batch_size=BATCH, verbose=0)
    model.fit(x, targets, batch_size=BATCH, epochs=1, verbose=0)
    model.fit(x, 2 * targets[:, None] - 1, batch_size=BATCH, epochs=1, verbose=0)
    model.train_on_batch(x[:BATCH], targets[:BATCH])  # another rank again (a review)


def test_inputs_mostly_far_beyond_the_bound_warn():
    """Pixels in 0-255 against a bound of 1: every input clipped to norm 1, silently (a
    usability audit, 2026-12-07). Inputs around the bound, as clipping is meant for, train
    without a word."""
    rng = np.random.default_rng(6)
    pixels = rng.integers(0, 256, size=(N, DIM)).astype("uint8")
    y = np.eye(K, dtype="float32")[rng.integers(0, K, N)]
    with pytest.warns(UserWarning, match=rf"{N} of {N} training inputs have an L2 norm above "
                                         r"twice DP_BoundedInput's bound 1 \(median norm "):
        _model().fit(pixels, y, batch_size=BATCH, epochs=1, verbose=0)
    scaled = (pixels / 255.0 / np.sqrt(DIM)).astype("float32") * 1.5  # norms up to 1.5
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _model().fit(scaled, y, batch_size=BATCH, epochs=1, verbose=0)
    assert not [w for w in caught if "training inputs have an L2 norm" in str(w.message)]


def test_a_dataset_with_sample_weights_is_refused_before_tracing():
    rng = np.random.default_rng(5)
    x = rng.normal(size=(N, DIM)).astype("float32")
    y = np.eye(K, dtype="float32")[rng.integers(0, K, N)]
    weighted = tf.data.Dataset.from_tensor_slices((x, y, np.ones(N, "float32"))).batch(BATCH)
    model = _model()
    with pytest.raises(ValueError, match=r"^The training dataset yields \(inputs, labels, "
                                         r"sample weights\)"):
        model.fit(weighted, epochs=1, verbose=0)
    assert model.dp_steps_taken == 0


@pytest.mark.parametrize("call", ["evaluate", "predict"])
@pytest.mark.parametrize("data", ["arrays", "dataset"])
def test_evaluate_and_predict_refuse_inputs_of_another_shape_first(call, data):
    """Keras' error came at the trace of the evaluation or prediction step, through lipdp's
    state guard (left for later by a usability audit, 2026-12-07)."""
    rng = np.random.default_rng(4)
    x = rng.normal(size=(N, DIM - 1)).astype("float32")
    y = np.eye(K, dtype="float32")[rng.integers(0, K, N)]
    model = _model()
    pairs = call == "evaluate"
    given = ((tf.data.Dataset.from_tensor_slices((x, y) if pairs else x).batch(BATCH),)
             if data == "dataset" else (x, y) if pairs else (x,))
    with pytest.raises(ValueError, match=rf"{call} received inputs of shape \((32|None), 5\)"
                                         r": the model takes examples of shape \(6,\)"):
        getattr(model, call)(*given, verbose=0)
    good = np.zeros((N, DIM), "float32")
    if pairs:
        assert np.isfinite(model.evaluate(good, y, verbose=0)).all()
    else:
        assert model.predict(good, verbose=0).shape == (N, K)


@pytest.mark.parametrize("mode", ["clipless", "clipped"])
def test_a_model_for_other_examples_than_the_metadata_s_is_refused_at_compile(mode):
    """A model of 6 inputs under metadata of 8 compiled and trained (a usability audit),
    while a disagreeing number of outputs was refused."""
    metadata = lipdp.DatasetMetadata((DIM + 2,), K, N, 8, BATCH, 1.0, "shuffle")
    parameters = lipdp.DPParameters(1.0, 1e-5) if mode == "clipless" else \
        lipdp.DPParameters(1.0, 1e-5, mode="clipped", l2_norm_clip=1.0)
    model = lipdp.DP_Sequential(
        [DP_BoundedInput(1.0, input_shape=(DIM,)), DP_QuickSpectralDense(K)],
        dp_parameters=parameters, dataset_metadata=metadata)
    with pytest.raises(ValueError, match=r"The model takes inputs of shape \(6,\) but "
                                         r"dataset_metadata declares input_shape=\(8,\)"):
        model.compile(loss=DP_TauCategoricalCrossentropy(1.0), optimizer="sgd")


@pytest.mark.parametrize("mode", ["clipless", "clipped"])
@pytest.mark.parametrize("loss", [
    DP_TauCategoricalCrossentropy(1.0), losses.DP_MulticlassHinge(), DP_MulticlassHKR(),
    losses.DP_KCosineSimilarity()], ids=lambda loss: type(loss).__name__)
def test_a_loss_over_classes_on_one_output_is_refused_at_compile(mode, loss):
    """With one logit these losses (or their gradients) do not depend on the label: a
    one-output model with the cross-entropy and 0/1 labels trained on noise alone, loss 0
    (a usability audit). Binary losses keep one output."""
    metadata = lipdp.DatasetMetadata((DIM,), 1, N, 8, BATCH, 1.0, "shuffle")
    parameters = lipdp.DPParameters(1.0, 1e-5) if mode == "clipless" else \
        lipdp.DPParameters(1.0, 1e-5, mode="clipped", l2_norm_clip=1.0)

    def one_output():
        return lipdp.DP_Sequential([DP_BoundedInput(1.0, input_shape=(DIM,)),
                                    DP_QuickSpectralDense(1)],
                                   dp_parameters=parameters, dataset_metadata=metadata)

    with pytest.raises(ValueError, match=f"{type(loss).__name__} is a loss over classes: with 1 "
                                         "output its gradient does not depend on the labels"):
        one_output().compile(loss=loss, optimizer="sgd")
    for binary in (losses.DP_TauBCE(1.0), losses.DP_MulticlassKR()):
        one_output().compile(loss=binary, optimizer="sgd")
    if mode == "clipped":  # classic DP-SGD takes Keras' losses too (a review)
        keras = tf.keras.losses
        for loss in (keras.CategoricalCrossentropy(), "categorical_crossentropy",
                     keras.sparse_categorical_crossentropy, keras.CategoricalHinge()):
            with pytest.raises(ValueError, match="is a loss over classes: with 1 output"):
                one_output().compile(loss=loss, optimizer="sgd")
        one_output().compile(loss=keras.BinaryCrossentropy(from_logits=True), optimizer="sgd")


def test_no_noise_warns_at_compile_from_the_user_s_line():
    """``noise_multiplier=0`` trained silently, the accountant logging epsilon inf (a
    usability audit): allowed, warned at compile, at the caller's line."""
    import warnings

    def compiled(sigma):
        metadata = lipdp.DatasetMetadata((DIM,), K, N, 8, BATCH, 1.0, "shuffle")
        model = lipdp.DP_Sequential([DP_BoundedInput(1.0, input_shape=(DIM,)),
                                     DP_QuickSpectralDense(K)],
                                    dp_parameters=lipdp.DPParameters(sigma, 1e-5),
                                    dataset_metadata=metadata)
        model.compile(loss=DP_TauCategoricalCrossentropy(1.0), optimizer="sgd")

    with pytest.warns(UserWarning, match=r"noise_multiplier=0: the steps add no noise") as got:
        compiled(0.0)
    assert {w.filename for w in got if "noise_multiplier=0" in str(w.message)} == {__file__}
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        compiled(1.0)
