"""Inputs `fit` accepts: each one either keeps the sensitivity bound or is refused.

The reference is the definition of sensitivity itself, independent of any
per-example computation: with the noise off, the train step's averaged
gradient of a batch and of the same batch without example i differ by at most
``bound(v) / D`` for every variable v (add/remove-one). Labels in every format a
Keras user passes (one-hot, integer of shape (B,) or (B, 1), float class
indices, binary of shape (B,)) go through the same train step.
"""

import os
import warnings

import numpy as np
import pytest
import tensorflow as tf

import lipdp
from lipdp.bounds import gradient_bounds
from lipdp.layers.base import DPLayer
from lipdp.layers import (DP_BoundedInput, DP_GroupSort, DP_MergeResidual, DP_QuickSpectralDense,
                          DP_Reshape, DP_SplitResidual, DP_WrappedResidual, make_residuals)
from lipdp.losses import (DP_KCosineSimilarity, DP_MeanAbsoluteError, DP_MulticlassHinge,
                          DP_MulticlassHKR, DP_MulticlassKR, DP_TauBCE,
                          DP_TauCategoricalCrossentropy)
from lipdp.records import NonFiniteRecordError

X0, DIM, N, BATCH = 2.0, 6, 64, 8
# Per-variable leave-one-out differences and bounds are float32 sums of a few
# terms; 1e-4 relative is far below any real violation (>= 1.4x).
REL_TOL = 1e-4

MULTICLASS = [
    ("cce", lambda: DP_TauCategoricalCrossentropy(3.0)),
    ("hinge", lambda: DP_MulticlassHinge(1.0)),
    ("kr", lambda: DP_MulticlassKR()),
    ("hkr", lambda: DP_MulticlassHKR(alpha=5.0, min_margin=1.0)),
    ("cosine", lambda: DP_KCosineSimilarity(0.5)),
]
BINARY = [
    ("bce", lambda: DP_TauBCE(3.0)),
    ("kr", lambda: DP_MulticlassKR()),
    ("mae", lambda: DP_MeanAbsoluteError()),
]


def _model(nb_outputs, layers=None, sigma=0.0):
    metadata = lipdp.DatasetMetadata((DIM,), nb_outputs, N, 8, BATCH, X0, "shuffle")
    layers = layers or [DP_QuickSpectralDense(8), DP_GroupSort(2), DP_QuickSpectralDense(nb_outputs)]
    return lipdp.DP_Sequential([DP_BoundedInput(X0, input_shape=(DIM,))] + layers,
                               dp_parameters=lipdp.DPParameters(sigma, 1e-5),
                               dataset_metadata=metadata)


def _inputs(rng, n=BATCH):
    x = rng.normal(size=(n, DIM))
    return (x / np.linalg.norm(x, axis=1, keepdims=True) * X0).astype("float32")


def _leave_one_out_ratios(model, x, y):
    """max over i and v of ||D (grad(batch) - grad(batch without i))_v|| / bound(v)."""
    bounds = gradient_bounds(model)
    names = list(bounds)
    full = model.private_gradients(tf.constant(x), tf.constant(y))[0]
    worst = 0.0
    for i in range(len(x)):
        keep = np.arange(len(x)) != i
        rest = model.private_gradients(tf.constant(x[keep]), tf.constant(y[keep]))[0]
        for name, a, b in zip(names, full, rest):
            change = float(tf.norm(a - b)) * BATCH
            worst = max(worst, change / bounds[name])
    return worst


@pytest.mark.parametrize("name,make", MULTICLASS, ids=[m[0] for m in MULTICLASS])
@pytest.mark.parametrize("label_format", ["int (B,)", "int (B, 1)", "float class (B,)"])
def test_sparse_labels_keep_the_bound_and_mean_the_same_as_one_hot(name, make, label_format):
    """Integer labels are mapped to one-hot *per example* (today's code took the arg-max
    over the batch axis: every example got the same class, 23x the bound)."""
    rng = np.random.default_rng(0)
    model = _model(4)
    model.compile(loss=make(), optimizer="sgd")
    x, classes = _inputs(rng), rng.integers(0, 4, BATCH)
    sparse = {"int (B,)": classes.astype("int32"), "int (B, 1)": classes[:, None].astype("int64"),
              "float class (B,)": classes.astype("float32")}[label_format]
    one_hot = np.eye(4, dtype="float32")[classes]
    assert _leave_one_out_ratios(model, x, sparse) <= 1 + REL_TOL
    logits = model(x)
    np.testing.assert_allclose(model.dp_loss.call(tf.constant(sparse), logits).numpy(),
                               model.dp_loss.call(tf.constant(one_hot), logits).numpy(), rtol=1e-6)


@pytest.mark.parametrize("name,make", BINARY, ids=[b[0] for b in BINARY])
def test_binary_labels_of_shape_b_keep_the_bound(name, make):
    """A single output with labels of shape (B,): today's KR broadcast them to (B, B), so each
    loss depended on every label (31x the bound)."""
    rng = np.random.default_rng(1)
    model = _model(1)
    model.compile(loss=make(), optimizer="sgd")
    x, y = _inputs(rng), rng.integers(0, 2, BATCH).astype("float32")
    assert _leave_one_out_ratios(model, x, y) <= 1 + REL_TOL
    logits = model(x)
    np.testing.assert_allclose(model.dp_loss.call(tf.constant(y), logits).numpy(),
                               model.dp_loss.call(tf.constant(y[:, None]), logits).numpy(),
                               rtol=1e-6)


@pytest.mark.parametrize("name,make", MULTICLASS + BINARY[:1],
                         ids=[m[0] for m in MULTICLASS] + ["bce"])
def test_labels_of_the_wrong_shape_are_refused(name, make):
    loss = make()
    logits = tf.zeros((BATCH, 4))
    for bad in (tf.zeros((BATCH, 3)), tf.zeros((BATCH, 4, 1)), tf.zeros((BATCH, 2, 4))):
        with pytest.raises(ValueError, match="labels"):
            loss.call(bad, logits)


def test_sparse_labels_out_of_range_are_mapped_not_raised():
    """A malformed label is private data: it changes its own loss, never the bound, and
    raises nothing (a crash would reveal it)."""
    loss = DP_MulticlassHinge(1.0)
    logits = tf.constant(np.random.default_rng(2).normal(size=(4, 3)), tf.float32)
    values = loss.call(tf.constant([-5, 0, 2, 99]), logits).numpy()
    assert np.all(np.isfinite(values)) and values.shape == (4,)


@pytest.mark.parametrize("make", [lambda: DP_MulticlassKR(), lambda: DP_TauCategoricalCrossentropy(1.0)],
                         ids=["kr", "cce"])
def test_logits_of_rank_3_are_refused(make):
    """Per-token logits (B, T, K) give T losses per example while the bound assumes one
    (3.0x with KR, T = 9): refused at compile, and by the loss itself."""
    model = _model(4, [DP_QuickSpectralDense(9 * 4), DP_Reshape((9, 4))])
    with pytest.raises(ValueError, match="one loss per example"):
        model.compile(loss=make(), optimizer="sgd")
    with pytest.raises(ValueError, match="rank 2"):
        make().call(tf.zeros((2, 9, 4)), tf.zeros((2, 9, 4)))


@pytest.mark.parametrize("mode", ["clipless", "clipped"])
def test_several_outputs_are_refused_by_name(mode):
    """Two output tensors failed in the step's arithmetic with "int() argument must be ... not
    'tuple'" (clipless, 2026-12-05)."""
    inputs = tf.keras.Input((DIM,))
    logits = DP_QuickSpectralDense(3)(DP_BoundedInput(X0)(inputs))
    parameters = lipdp.DPParameters(1.0, 1e-5, mode=mode,
                                    l2_norm_clip=1.0 if mode == "clipped" else None)
    model = lipdp.DP_Model(inputs, [logits, logits], dp_parameters=parameters,
                           dataset_metadata=lipdp.DatasetMetadata((DIM,), 3, 64, 8, 8, X0,
                                                                  "shuffle"))
    with pytest.raises(ValueError, match="2 output tensors, a DP model one"):
        model.compile(loss=DP_TauCategoricalCrossentropy(1.0), optimizer="sgd")


def _shared(case):
    dense = DP_QuickSpectralDense(DIM, use_bias=False)
    head = [DP_QuickSpectralDense(3)]
    return {
        "twice in a chain": [dense, DP_GroupSort(2), dense, *head],
        "twice in a branch": make_residuals([dense, DP_GroupSort(2), dense]) + head,
        "in two sections": make_residuals([dense]) + make_residuals([dense]) + head,
        "inside and outside a section": [dense] + make_residuals([dense]) + head,
        "twice in one wrapped chain": [DP_SplitResidual(),
                                       DP_WrappedResidual([dense, DP_GroupSort(2), dense]),
                                       DP_MergeResidual(), *head],
    }[case]


@pytest.mark.parametrize("case", ["twice in a chain", "twice in a branch", "in two sections",
                                  "inside and outside a section", "twice in one wrapped chain"])
def test_a_layer_used_twice_is_refused(case):
    """The bound keeps one entry per variable while the gradient sums both uses (2.0x)."""
    model = _model(3, _shared(case))
    with pytest.raises(ValueError, match="used more than once"):
        model.compile(loss=DP_TauCategoricalCrossentropy(1.0), optimizer="sgd")
    with pytest.raises(ValueError, match="used more than once"):
        gradient_bounds(model, DP_TauCategoricalCrossentropy(1.0))



# --------------------------------------------------------------------------- #
# Non-finite records and gradients: refused before the first step, not mid-training.
# --------------------------------------------------------------------------- #
def _arrays(rng, n=N, k=3):
    return _inputs(rng, n), np.eye(k, dtype="float32")[rng.integers(0, k, n)]


@pytest.mark.parametrize("mode", ["clipless", "clipped"])
def test_an_unbuilt_model_is_refused_at_compile_with_how_to_build_it(mode):
    parameters = (lipdp.DPParameters(1.0, 1e-5) if mode == "clipless"
                  else lipdp.DPParameters(1.0, 1e-5, mode="clipped", l2_norm_clip=1.0))
    model = lipdp.DP_Sequential(
        [DP_BoundedInput(X0), DP_QuickSpectralDense(4), DP_GroupSort(2), DP_QuickSpectralDense(3)],
        dp_parameters=parameters,
        dataset_metadata=lipdp.DatasetMetadata((DIM,), 3, N, 16, BATCH, X0, "shuffle"))
    with pytest.raises(ValueError, match="is not built.*input_shape"):
        model.compile(loss=DP_TauCategoricalCrossentropy(3.0),
                      optimizer=tf.keras.optimizers.SGD(0.1))
    model.build((None, DIM))  # what the message says: then it compiles and trains
    model.compile(loss=DP_TauCategoricalCrossentropy(3.0), optimizer=tf.keras.optimizers.SGD(0.1))
    x = np.random.default_rng(0).normal(size=(N, DIM)).astype(np.float32)
    model.fit(x, np.eye(3, dtype=np.float32)[np.arange(N) % 3], batch_size=BATCH, verbose=0)
    assert model.dp_steps_taken == N // BATCH


@pytest.mark.parametrize("where", ["x nan", "x inf", "y nan"])
def test_non_finite_arrays_are_refused_before_the_first_step(where):
    rng = np.random.default_rng(4)
    model = _model(3, sigma=1.0)
    model.compile(loss=DP_TauCategoricalCrossentropy(1.0), optimizer="sgd")
    x, y = _arrays(rng)
    target = x if where.startswith("x") else y
    target[[5, 41], 0] = np.inf if where.endswith("inf") else np.nan
    with pytest.raises(NonFiniteRecordError, match=r"2 of 64 .*: 5, 41"):
        model.fit(x, y, epochs=1, verbose=0)
    assert model.dp_steps_taken == 0


def test_non_finite_dataset_records_are_refused_before_the_first_step():
    rng = np.random.default_rng(5)
    model = _model(3, sigma=1.0)
    model.compile(loss=DP_TauCategoricalCrossentropy(1.0), optimizer="sgd")
    x, y = _arrays(rng)
    x[60, 2] = np.nan  # the last batch: training would have stopped after 7 steps
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)
    with pytest.raises(NonFiniteRecordError, match="batch 7 row 4"):
        model.fit(dataset, epochs=1, verbose=0)
    assert model.dp_steps_taken == 0


class _NaNBackward(tf.keras.layers.Layer, DPLayer):
    """Identity forward, NaN backward: a finite loss with a non-finite gradient."""

    def call(self, inputs):
        @tf.custom_gradient
        def identity(t):
            return tf.identity(t), lambda g: g * float("nan")
        return identity(inputs)

    def propagate_inputs(self, input_bound):
        return input_bound

    def backpropagate_inputs(self, input_bound, gradient_bound):
        return gradient_bound


def _assert_fit_stops_before_the_update(model, rng, match):
    """`fit` raises InvalidArgumentError matching `match` with every weight and the step count
    as they were."""
    before = [v.numpy() for v in model.trainable_variables]
    with pytest.raises(tf.errors.InvalidArgumentError, match=match):
        model.fit(*_arrays(rng), epochs=1, verbose=0)
    for v, b in zip(model.trainable_variables, before):
        np.testing.assert_array_equal(v.numpy(), b)
    assert model.dp_steps_taken == 0


def test_non_finite_gradient_stops_the_step_before_the_update():
    """Today's code only checked the loss: a NaN gradient was noised and applied, and every
    weight became NaN."""
    rng = np.random.default_rng(6)
    model = _model(3, [DP_QuickSpectralDense(8), _NaNBackward(), DP_QuickSpectralDense(3)], 1.0)
    model.compile(loss=DP_TauCategoricalCrossentropy(1.0), optimizer="sgd")
    _assert_fit_stops_before_the_update(model, rng, "Non-finite gradient")


def test_inputs_of_another_shape_than_the_built_one_are_refused():
    """Every bound is computed for the shape a model was built with (a convolution's
    certified norm on its H x W torus, the sqrt(P) of a bias shared by P positions). A model
    built with `model.build((None, 4, 4, 1))`, as compile's own message suggests, trained on
    16 x 16 images: a global pooling hid the size from the rest, and the bias gradient
    reached 4x its bound (found by an audit). The first layer pins the shape."""
    metadata = lipdp.DatasetMetadata((4, 4, 1), 2, 16, 16, 4, 1.0, "shuffle")
    model = lipdp.DP_Sequential(
        [DP_BoundedInput(1.0), lipdp.layers.DP_QuickSpectralConv2D(2, 3),
         lipdp.layers.DP_GlobalL2NormPooling2D()],
        dp_parameters=lipdp.DPParameters(1.0, 1e-5), dataset_metadata=metadata)
    model.build((None, 4, 4, 1))
    model.compile(loss=DP_MulticlassKR(), optimizer="sgd")
    x, y = np.zeros((16, 16, 16, 1), np.float32), np.tile([[1.0, 0.0]], (16, 1))
    for train, message in [
            (lambda: model.fit(x, y, batch_size=4, epochs=1, verbose=0),
             r"fit received training inputs of shape \(16, 16, 16, 1\): the model takes "
             r"examples of shape \(4, 4, 1\)"),  # before the first step (a usability audit)
            (lambda: model.train_on_batch(x[:4], y[:4]), r"expected shape=\(None, 4, 4, 1\)"),
            (lambda: model(x[:4]), r"expected shape=\(None, 4, 4, 1\)")]:
        with pytest.raises(ValueError, match=message):
            train()
    assert model.dp_steps_taken == 0


@pytest.mark.parametrize("make, built, other", [
    (lambda: lipdp.layers.DP_QuickSpectralConv2D(2, 3), (4, 4, 1), (16, 16, 1)),
    (lambda: DP_QuickSpectralDense(3), (5, 4), (7, 4)),
    (lambda: lipdp.layers.DP_AddBias(), (3, 3, 2), (6, 6, 2)),
    (lambda: lipdp.layers.DP_Softplus(), (6,), (8,)),
    (lambda: lipdp.layers.DP_LayerCentering(), (4, 2), (9, 2)),
    (lambda: DP_BoundedInput(1.0), (4,), (9,)),
], ids=["conv", "dense positions", "add bias", "softplus", "layer centering", "bounded input"])
def test_layers_whose_bounds_depend_on_the_input_shape_pin_it(make, built, other):
    layer = make()
    layer(tf.zeros((2,) + built))
    with pytest.raises(ValueError, match="is incompatible with the layer"):
        layer(tf.zeros((2,) + other))


def test_convolutions_are_channels_last_whatever_keras_global_image_data_format():
    """`data_format=None` resolved to Keras' global format, channels_first where keras.json
    says so, while the layer convolves NHWC: the bias bound counted the pixels of the wrong
    axes (1.41x on a (6, 2, 6) input; found by an audit)."""
    tf.keras.backend.set_image_data_format("channels_first")
    try:
        conv = lipdp.layers.DP_QuickSpectralConv2D(3, 1)
        conv.build((None, 6, 2, 6))
    finally:
        tf.keras.backend.set_image_data_format("channels_last")
    assert conv.data_format == "channels_last" and conv._output_pixels == 12
    assert tuple(conv.kernel.shape) == (1, 1, 6, 3)


class _SignFlip(tf.keras.layers.Layer, DPLayer):
    """Identity forward whose bound methods negate the cotangent bound: the error a second
    sign error cancels, leaving every reported variable bound positive and wrong."""

    def call(self, inputs):
        return inputs

    def propagate_inputs(self, input_bound):
        return input_bound

    def backpropagate_inputs(self, input_bound, gradient_bound):
        return -gradient_bound


def test_a_negative_bound_from_a_layer_is_refused():
    """Two layers whose bound methods negate the cotangent bound give positive variable
    bounds (the two signs cancel) that nothing else would notice; the bound pass asserts
    that every value a layer returns is >= 0 and names the layers: at compile (which runs
    the pass once), in `gradient_bounds`, and in the step, before any update."""
    rng = np.random.default_rng(8)
    layers = [DP_QuickSpectralDense(8), _SignFlip(name="flip_a"), DP_QuickSpectralDense(8),
              _SignFlip(name="flip_b"), DP_QuickSpectralDense(3)]
    model = _model(3, layers, 1.0)
    loss = DP_TauCategoricalCrossentropy(1.0)
    with pytest.raises(tf.errors.InvalidArgumentError, match="flip_b.backpropagate_inputs"):
        model.compile(loss=loss, optimizer="sgd")
    with pytest.raises(tf.errors.InvalidArgumentError, match="negative or NaN bounds"):
        gradient_bounds(model, loss)
    # The step's own check: the layers turn wrong after compile.
    _SignFlip.backpropagate_inputs, saved = (lambda self, x, g: g), _SignFlip.backpropagate_inputs
    try:
        model.compile(loss=loss, optimizer="sgd")
    finally:
        _SignFlip.backpropagate_inputs = saved
    _assert_fit_stops_before_the_update(model, rng, "flip_b.backpropagate_inputs")


# --------------------------------------------------------------------------- #
# Outputs computed on training data outside the noisy gradient.
# --------------------------------------------------------------------------- #
def test_private_logs_only_omits_training_metrics(tmp_path):
    rng = np.random.default_rng(7)
    x, y = _arrays(rng)
    logged = _model(3, sigma=1.0)
    logged.compile(loss=DP_TauCategoricalCrossentropy(1.0), optimizer="sgd", metrics=["accuracy"])
    history = logged.fit(x, y, epochs=1, verbose=0, callbacks=[lipdp.DP_Accountant()])
    assert {"loss", "accuracy", "epsilon"} <= set(history.history)
    private = _model(3, sigma=1.0)
    private.compile(loss=DP_TauCategoricalCrossentropy(1.0), optimizer="sgd", metrics=["accuracy"],
                    private_logs_only=True)
    history = private.fit(x, y, epochs=1, verbose=0, callbacks=[lipdp.DP_Accountant()],
                          validation_data=_arrays(np.random.default_rng(107), n=8))
    assert set(history.history) == {"epsilon", "delta", "val_loss", "val_accuracy"}
    assert private.dp_steps_taken == N // BATCH
    path = str(tmp_path / "private.keras")
    private.save(path)
    assert tf.keras.models.load_model(path).get_compile_config()["private_logs_only"] is True


def test_private_logs_only_runs_several_steps_per_execution():
    """Keras' loop of several steps per execution carries the train step's outputs: an empty
    dict failed to trace (an audit). The step count, public, is carried instead."""
    rng = np.random.default_rng(8)
    x, y = _arrays(rng)
    model = _model(3, sigma=1.0)
    model.compile(loss=DP_TauCategoricalCrossentropy(1.0), optimizer="sgd",
                  metrics=["accuracy"], private_logs_only=True, steps_per_execution=2)
    history = model.fit(x, y, epochs=2, verbose=0, callbacks=[lipdp.DP_Accountant()])
    assert set(history.history) == {"dp_steps_taken", "epsilon", "delta"}
    assert history.history["dp_steps_taken"] == [N // BATCH, 2 * N // BATCH]
    assert model.dp_steps_taken == int(model.optimizer.iterations.numpy()) == 2 * N // BATCH


def _saved_metric_values(path):
    """Every value stored under a 'metrics' group of a Keras weights file (or of the
    weights file inside a .keras archive)."""
    import zipfile

    import h5py

    if path.endswith(".keras"):
        with zipfile.ZipFile(path) as archive:
            archive.extract("model.weights.h5", os.path.dirname(path))
        path = os.path.join(os.path.dirname(path), "model.weights.h5")
    values = []
    with h5py.File(path, "r") as f:
        f.visititems(lambda name, item: values.append(np.asarray(item))
                     if isinstance(item, h5py.Dataset) and "metrics" in name.split("/") else None)
    return values


def test_saved_models_leave_out_the_training_metrics_state(tmp_path):
    """After a fit whose last epoch was not validated, Keras' .keras and .weights.h5 files
    held the training loss and accuracy totals, computed on the training data without
    noise: an audit told two datasets differing in one label apart from the saved file
    alone. fit leaves them reset, and save / save_weights write them at their initial
    values, keeping the model's."""
    rng = np.random.default_rng(9)
    model = _model(3, sigma=1.0)
    model.compile(loss=DP_TauCategoricalCrossentropy(1.0), optimizer="sgd", metrics=["accuracy"])
    x, y = _arrays(rng)
    model.fit(x, y, epochs=1, verbose=0)
    assert all(np.all(v.numpy() == 0) for m in model.metrics for v in m.variables)  # reset
    tf.keras.models.save_model(model, str(tmp_path / "f.keras"))  # does not call model.save
    assert all(np.all(v == 0) for v in _saved_metric_values(str(tmp_path / "f.keras")))
    model.train_on_batch(x[:BATCH], y[:BATCH])  # its values returned, its state reset
    assert all(np.all(v.numpy() == 0) for m in model.metrics for v in m.variables)
    model.train_on_batch(x[:BATCH], y[:BATCH], reset_metrics=False)  # a state to leave out
    before = [v.numpy() for m in model.metrics for v in m.variables]
    assert any(np.any(b != 0) for b in before)
    for name, save in [("m.keras", model.save), ("w.weights.h5", model.save_weights)]:
        path = str(tmp_path / name)
        save(path)
        saved = _saved_metric_values(path)
        assert saved and all(np.all(v == 0) for v in saved), name
    after = [v.numpy() for m in model.metrics for v in m.variables]
    for b, a in zip(before, after):
        np.testing.assert_array_equal(a, b)


# --------------------------------------------------------------------------- #
# Poisson sampling, which the accountant assumes: checked where lipdp can, said where not.
# --------------------------------------------------------------------------- #
def _poisson_model(nb_samples, batch, dim=DIM, k=3):
    metadata = lipdp.DatasetMetadata((dim,), k, nb_samples, 16, batch, X0, "poisson")
    model = lipdp.DP_Sequential(
        [DP_BoundedInput(X0, input_shape=(dim,)), DP_QuickSpectralDense(4), DP_GroupSort(2),
         DP_QuickSpectralDense(k)],
        dp_parameters=lipdp.DPParameters(1.0, 1e-5), dataset_metadata=metadata)
    model.compile(loss=DP_TauCategoricalCrossentropy(3.0), optimizer=tf.keras.optimizers.SGD(0.1))
    return model


def _poisson_warnings(record):
    return [str(w.message) for w in record
            if issubclass(w.category, lipdp.data.ShuffleSamplingWarning)]


@pytest.mark.parametrize("sampling", ["poisson", "shuffle"])
def test_a_pipeline_sampling_another_training_set_than_the_metadata_is_refused(sampling):
    """Metadata of breast_cancer's 456 training examples, a load_dataset pipeline over 201
    of them in batches of 200: its batch count (2 of 3) passed, and every example was drawn at
    0.995 where the accountant counted 0.44 (epsilon 3.05 reported for 5.5-6.0; found by an
    audit). The pipeline's sampler records N and D; fit compares them with the metadata."""
    kwargs = dict(bound_clip_value=1.0, sampling=sampling)
    own, _, metadata = lipdp.data.load_dataset("breast_cancer", 200, **kwargs)
    subset, _, _ = lipdp.data.load_dataset("breast_cancer", 200, nb_samples_train=201, **kwargs)
    assert metadata.nb_samples_train == 456 and int(subset.cardinality()) == 2
    model = lipdp.DP_Sequential(
        [DP_BoundedInput(1.0, input_shape=metadata.input_shape), DP_QuickSpectralDense(4),
         DP_GroupSort(2), DP_QuickSpectralDense(2)],
        dp_parameters=lipdp.DPParameters(2.0, 1e-5), dataset_metadata=metadata)
    model.compile(loss=DP_TauCategoricalCrossentropy(2.0), optimizer="sgd")
    with pytest.raises(ValueError, match="pipeline over 201 training examples in batches of 200"):
        model.fit(subset, epochs=1, verbose=0)
    assert model.dp_steps_taken == 0
    model.fit(own, epochs=1, verbose=0)
    assert model.dp_steps_taken == metadata.steps_per_epoch


def test_a_dataset_that_lipdp_cannot_check_to_be_poisson_sampled_is_said_so(recwarn):
    """With metadata declaring Poisson sampling (the accountant's assumption), `fit` on a
    dataset of shuffled fixed batches used to train silently with a Poisson epsilon. It warns
    now, as for arrays; not on `load_dataset`'s Poisson pipeline, nor on a map of it whose
    sampler was carried over as the warning says (nor on the paper library's augmented
    pipeline, which carries it)."""
    x, y = _arrays(np.random.default_rng(7))
    model = _poisson_model(N, BATCH)
    fixed = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(N, seed=0).batch(BATCH)
    model.fit(fixed, epochs=1, verbose=0)
    assert any("not lipdp.data.load_dataset's Poisson pipeline" in m and "sampling='shuffle'" in m
               for m in _poisson_warnings(recwarn)), _poisson_warnings(recwarn)

    recwarn.clear()
    ds_train, _, metadata = lipdp.data.load_dataset("digits", 64, bound_clip_value=8.0, seed=1,
                                                    nb_samples_train=256)
    model = _poisson_model(metadata.nb_samples_train, 64, dim=64, k=10)
    model.dataset_metadata = metadata
    model.compile(loss=DP_TauCategoricalCrossentropy(3.0), optimizer=tf.keras.optimizers.SGD(0.1))
    model.fit(ds_train.map(lambda a, b: (a, b)), epochs=1, verbose=0)
    assert len(_poisson_warnings(recwarn)) == 1
    recwarn.clear()
    mapped = ds_train.map(lambda a, b: (a, b))
    mapped.lipdp_sampler = ds_train.lipdp_sampler
    model.fit(mapped, epochs=1, verbose=0)
    model.fit(ds_train, epochs=1, verbose=0)
    from lipdp.pipeline import _augmented, bound_clip_value

    model.fit(_augmented(ds_train, lambda a, b: (a, b), bound_clip_value(8.0)), epochs=1,
              verbose=0)
    assert _poisson_warnings(recwarn) == []


def test_a_batch_no_poisson_sample_of_the_declared_size_holds_is_refused_at_its_step():
    """Poisson metadata with D = 8 and N = 64, a dataset of batches of 48 (the whole set in
    batches 6 times the declared size: an accountant told q = 1/8 under-states the loss). 48
    exceeds `largest_poisson_batch(8)` = 41; the step fails before any update or count, with
    a message saying why. Batches up to the limit train."""
    x, y = _arrays(np.random.default_rng(8))
    model = _poisson_model(N, BATCH)
    assert lipdp.model.largest_poisson_batch(BATCH) == 41
    before = [v.numpy() for v in model.trainable_variables]
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match="more examples than a Poisson sample of expected size 8"):
        model.fit(tf.data.Dataset.from_tensor_slices((x[:48], y[:48])).batch(48), epochs=1,
                  verbose=0, steps_per_epoch=1)
    for v, b in zip(model.trainable_variables, before):
        np.testing.assert_array_equal(v.numpy(), b)
    assert model.dp_steps_taken == 0
    model.fit(tf.data.Dataset.from_tensor_slices((x[:41], y[:41])).batch(41), epochs=1,
              verbose=0, steps_per_epoch=1)
    assert model.dp_steps_taken == 1


@pytest.mark.parametrize("expected", [1, 8, 64, 1000, 5000, 60000])
def test_largest_poisson_batch_is_exceeded_with_probability_below_2_to_the_minus_40(expected):
    """Against the exact binomial tail (scipy), for sampling rates from 1/2 to 1/60000: the
    limit is exceeded with probability <= 2^-40; and it is not loose: at the smallest rate
    (the heaviest tail), a limit halfway to D is exceeded with probability above 2^-40."""
    from scipy.stats import binom

    limit = lipdp.model.largest_poisson_batch(expected)
    for n in (2 * expected, 10 * expected, 60000 * expected):
        assert binom.sf(limit, n, expected / n) <= 2.0 ** -40, (n, limit)
    halfway = expected + (limit - expected) // 2
    assert binom.sf(halfway, 60000 * expected, 1 / 60000) > 2.0 ** -40, halfway


@pytest.mark.parametrize("case", ["rate 2q", "each example twice"])
def test_poisson_batches_drawn_at_a_higher_rate_than_declared_stop_fit(case):
    """Metadata: Poisson at q = D / N = 8 / 64. The data: a pipeline of its own drawing each
    example with probability 2q (exact Poisson batches, of unknown number), or lipdp's own
    Poisson pipeline with every example appended twice by a map, its sampler carried over by
    hand. Each batch is within `largest_poisson_batch` (41), but the fit's count after 3
    epochs is about twice the 3 x 8 x 8 = 192 expected, beyond its limit (305): fit stops
    with a message saying why (before, it trained on, accounted at rate q)."""
    rng = np.random.default_rng(9)
    x, y = _arrays(rng)
    model = _poisson_model(N, BATCH)
    if case == "rate 2q":
        masks = [rng.random(N) < 2 * BATCH / N for _ in range(8 * 3)]
        dataset = tf.data.Dataset.from_generator(
            lambda: ((x[m], y[m]) for m in masks), output_signature=(
                tf.TensorSpec((None, DIM), tf.float32), tf.TensorSpec((None, 3), tf.float32)))
        steps = None
    else:
        ds_train, _, metadata = lipdp.data.load_dataset("digits", 8, bound_clip_value=8.0,
                                                        seed=2, nb_samples_train=64)
        model = _poisson_model(64, 8, dim=64, k=10)
        dataset = ds_train.map(lambda a, b: (tf.concat([a, a], 0), tf.concat([b, b], 0)))
        dataset.lipdp_sampler = ds_train.lipdp_sampler
        steps = 8
    with pytest.raises(RuntimeError, match="drawn at a higher rate than the accountant assumes"):
        model.fit(dataset, epochs=3, verbose=0, steps_per_epoch=steps, validate_data=False)


@pytest.mark.parametrize("where", ["arrays", "dataset"])
def test_float64_records_beyond_float32_range_are_refused_before_the_first_step(where):
    """1e300 is finite in float64 but an infinity once Keras casts it to the model's float32:
    the step that sampled it would have failed ("Non-finite loss"), revealing when it was
    sampled. Refused before training, as NaN is; 3e38 (within float32's range) is not."""
    rng = np.random.default_rng(10)
    x, y = _arrays(rng)
    x = x.astype(np.float64)
    x[[3, 50], 1] = 1e300
    x[7, 1] = 3e38
    model = _model(3, sigma=1.0)
    model.compile(loss=DP_TauCategoricalCrossentropy(1.0), optimizer="sgd")
    with pytest.raises(NonFiniteRecordError, match=r"2 of 64 .*beyond the range"):
        if where == "arrays":
            model.fit(x, y, epochs=1, verbose=0)
        else:
            model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH), epochs=1, verbose=0)
    assert model.dp_steps_taken == 0


def test_a_keras_sequence_or_a_generator_is_refused_with_what_to_use():
    """They reached the array checks: a Sequence of 8 batches was refused as 'fit received 8
    training examples', a generator with a bare TypeError."""
    x, y = _arrays(np.random.default_rng(11))

    class Batches(tf.keras.utils.Sequence):
        def __len__(self):
            return N // BATCH

        def __getitem__(self, i):
            return x[BATCH * i:BATCH * (i + 1)], y[BATCH * i:BATCH * (i + 1)]

    def batches():
        yield from (Batches()[i] for i in range(N // BATCH))

    model = _model(3)
    model.compile(loss=DP_TauCategoricalCrossentropy(1.0), optimizer="sgd")
    for data in (Batches(), batches()):
        with pytest.raises(ValueError, match=f"received a {type(data).__name__}.*"
                                             "from_generator"):
            model.fit(data, epochs=1, verbose=0)
    distributed = tf.distribute.MirroredStrategy(["/cpu:0"]).experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH))
    with pytest.raises(ValueError, match="DistributedDataset hides the pipeline"):
        model.fit(distributed, epochs=1, verbose=0)  # was a TypeError: "has no len()"
    assert model.dp_steps_taken == 0


@pytest.mark.parametrize("case", ["clipless add_loss", "clipped kernel", "clipped activity",
                                  "clipped add_loss"])
def test_regularization_terms_are_refused_at_compile(case):
    """The private step differentiates the per-example losses only: a kernel_regularizer of
    L2(10) was logged in the loss (28.5 against 1.27) but left the kernel as without it.
    Refused by name when the model is compiled (lipdp's layers refuse regularizer arguments
    themselves; a loss added to a clipless model is refused too)."""
    l2 = tf.keras.regularizers.L2(10.0)
    if case == "clipless add_loss":
        model = _model(3)
        kernel = model.layers[1].kernel
        model.add_loss(lambda: 10.0 * tf.reduce_sum(tf.square(kernel)))
        loss, found = DP_TauCategoricalCrossentropy(1.0), "1 losses added by add_loss"
    else:
        inputs = tf.keras.Input((DIM,))
        dense = tf.keras.layers.Dense(3, name="dense_under_test",
                                      kernel_regularizer=l2 if case == "clipped kernel" else None,
                                      activity_regularizer="l2" if "activity" in case else None)
        outputs = dense(inputs)
        model = lipdp.DP_Model(inputs, outputs, dp_parameters=lipdp.DPParameters(
            0.0, 1e-5, mode="clipped", l2_norm_clip=1.0), dataset_metadata=lipdp.DatasetMetadata(
            (DIM,), 3, N, 8, BATCH, None, "shuffle"))
        if case == "clipped add_loss":
            model.add_loss(tf.reduce_sum(outputs))
        loss = "categorical_crossentropy"
        found = {"clipped kernel": "dense_under_test.kernel_regularizer",
                 "clipped activity": "dense_under_test.activity_regularizer",
                 "clipped add_loss": "1 losses added by add_loss"}[case]
    with pytest.raises(ValueError, match=f"regularization terms \\({found}"):
        model.compile(loss=loss, optimizer="sgd")


@pytest.mark.parametrize("shuffle", [False, "batch"])
def test_arrays_are_refused_without_shuffling(shuffle):
    """Keras cuts unshuffled arrays into the same batches every epoch ('batch' reorders fixed
    chunks): a record's batch is known in advance, and the epsilon of random batches was
    reported for it without a word."""
    rng = np.random.default_rng(12)
    model = _model(3)
    model.compile(loss=DP_TauCategoricalCrossentropy(1.0), optimizer="sgd")
    with pytest.raises(ValueError, match=rf"fit\(shuffle={shuffle!r}\) on arrays"):
        model.fit(*_arrays(rng), epochs=1, verbose=0, shuffle=shuffle)
    assert model.dp_steps_taken == 0


@pytest.mark.parametrize("pipeline,warned", [
    (lambda d: d.batch(BATCH), "without shuffling them first"),
    (lambda d: d.batch(BATCH).shuffle(8), "without shuffling them first"),  # fixed batches
    (lambda d: d.shuffle(1).batch(BATCH), f"a buffer of 1 records, fewer than the {N}"),
    (lambda d: d.shuffle(N - 1).batch(BATCH), f"a buffer of {N - 1} records"),
    (lambda d: d.shuffle(N, reshuffle_each_iteration=False).batch(BATCH),
     "reshuffle_each_iteration=False"),
    # A cache after the shuffle replays the first epoch's order (an audit, 2026-12-06).
    (lambda d: d.shuffle(N).batch(BATCH).cache(), "caches its records after shuffling"),
    (lambda d: d.shuffle(N).cache().batch(BATCH), "caches its records after shuffling"),
    (lambda d: d.cache().shuffle(N).batch(BATCH), None),
    # batches an unbatch undoes are not the training batches (a review, 2026-12-06)
    (lambda d: d.shuffle(N).batch(BATCH).cache().unbatch().shuffle(N).batch(BATCH), None),
    (lambda d: d.batch(BATCH).unbatch().shuffle(N).batch(BATCH), None),
    (lambda d: d.shuffle(N).batch(BATCH).unbatch().batch(BATCH), None),
    # a shuffle of whole batches, unbatched and batched again (an audit, 2026-12-07)
    (lambda d: d.batch(BATCH).shuffle(4).unbatch().batch(BATCH), "shuffles whole batches"),
    (lambda d: d.batch(BATCH).shuffle(N).unbatch().batch(BATCH), "shuffles whole batches"),
    (lambda d: d.batch(BATCH, num_parallel_calls=2), "without shuffling them first"),
    (lambda d: d.shuffle(N).batch(BATCH, num_parallel_calls=2), None),
    (lambda d: d.shuffle(N, seed=0).map(lambda x, y: (x, y)).batch(BATCH).prefetch(1), None),
    (lambda d: d.shuffle(N).shuffle(4).batch(BATCH), None),  # one shuffle of every record
    (lambda d: d.shuffle(4).shuffle(2 * N).batch(BATCH), None),
    # sample_from_datasets batches its random selector stream: not a batch of records
    (lambda d: tf.data.Dataset.sample_from_datasets(
        [d.take(N // 2).shuffle(N), d.skip(N // 2).shuffle(N)], seed=0).batch(BATCH), None),
])
def test_a_dataset_batching_unshuffled_records_warns(pipeline, warned):
    """The same for a tf.data pipeline, read from its graph (`lipdp.data.unshuffled_batching`):
    no shuffle before the batching, a shuffle buffer smaller than the training set (a record
    only trades places with its neighbours: `shuffle(1)` changes nothing), or a shuffle that
    replays its order every epoch. A warning, since randomness of another kind is not seen."""
    rng = np.random.default_rng(13)
    model = _model(3)
    model.compile(loss=DP_TauCategoricalCrossentropy(1.0), optimizer="sgd")
    dataset = pipeline(tf.data.Dataset.from_tensor_slices(_arrays(rng)))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        model.fit(dataset, epochs=1, verbose=0)
    unshuffled = [str(w.message) for w in record
                  if issubclass(w.category, lipdp.data.ShuffleSamplingWarning)
                  and "a record's batch is not random" in str(w.message)]
    assert len(unshuffled) == (warned is not None)
    assert warned is None or warned in unshuffled[0]


@pytest.mark.parametrize("pipeline", ["rows cut by a map", "pre-batched tensors",
                                      "shuffled records batched"])
def test_batches_no_batching_step_makes_warn(pipeline):
    """`unshuffled_batching` has no verdict on batches a map, a generator or pre-batched
    tensors yield: ``range(8).shuffle(64).map(rows 8k..8k+7)`` trained on the same 8 batches
    every epoch, silently (an audit, 2026-12-07). It warns that lipdp cannot see them; batched
    shuffled records do not."""
    x, y = _arrays(np.random.default_rng(24))

    def rows(k):
        window = tf.range(k * BATCH, (k + 1) * BATCH)
        return tf.gather(x, window), tf.gather(y, window)

    dataset = {
        "rows cut by a map": lambda: tf.data.Dataset.range(N // BATCH).shuffle(N).map(rows),
        "pre-batched tensors": lambda: tf.data.Dataset.from_tensor_slices((
            x.reshape(N // BATCH, BATCH, -1), y.reshape(N // BATCH, BATCH, -1))),
        "shuffled records batched": lambda: tf.data.Dataset.from_tensor_slices(
            (x, y)).shuffle(N).batch(BATCH),
    }[pipeline]()
    model = _model(3)
    model.compile(loss=DP_TauCategoricalCrossentropy(1.0), optimizer="sgd")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        model.fit(dataset, epochs=1, verbose=0)
    unseen = [w for w in record if "whose batches no batching step makes" in str(w.message)]
    assert len(unseen) == (pipeline != "shuffled records batched")
    assert model.dp_steps_taken == N // BATCH


def test_a_snapshot_after_the_shuffle_is_read_as_fixed_batches(tmp_path):
    """``snapshot`` replays its first epoch's records, in their first order, like ``cache``."""
    records = tf.data.Dataset.range(N)
    after = records.shuffle(N).snapshot(str(tmp_path / "after")).batch(BATCH)
    before = records.snapshot(str(tmp_path / "before")).shuffle(N).batch(BATCH)
    assert "caches its records after shuffling" in lipdp.data.unshuffled_batching(after, N)
    assert lipdp.data.unshuffled_batching(before, N) is None


# --------------------------------------------------------------------------- #
# Callbacks that would act on the non-private training loss and metrics.
# --------------------------------------------------------------------------- #
_K = tf.keras.callbacks
_FEEDBACK = {
    "EarlyStopping loss": lambda path: _K.EarlyStopping(monitor="loss"),
    "EarlyStopping accuracy": lambda path: _K.EarlyStopping(monitor="accuracy"),
    "ReduceLROnPlateau loss": lambda path: _K.ReduceLROnPlateau(monitor="loss"),
    "ModelCheckpoint best loss": lambda path: _K.ModelCheckpoint(
        path, monitor="loss", save_best_only=True, save_weights_only=True),
    "TerminateOnNaN": lambda path: _K.TerminateOnNaN(),
}


def _metric_model(private_logs_only=False):
    model = _model(3, sigma=1.0)
    model.compile(loss=DP_TauCategoricalCrossentropy(1.0), optimizer="sgd",
                  metrics=["accuracy"], private_logs_only=private_logs_only)
    return model


@pytest.mark.parametrize("case", list(_FEEDBACK))
def test_callbacks_deciding_from_the_training_metrics_are_refused(case, tmp_path):
    """Keras computes the training loss and metrics on the training records outside the noisy
    gradient (not private): a callback stopping the run, changing the learning rate, keeping
    the best weights or ending on a NaN loss from them made the model depend on the data
    beyond epsilon, silently. Refused before the first step."""
    model = _metric_model()
    x, y = _arrays(np.random.default_rng(12))
    with pytest.raises(ValueError, match="training (metric|loss).*outside the noisy gradient"):
        model.fit(x, y, epochs=1, verbose=0,
                  callbacks=[_FEEDBACK[case](str(tmp_path / "w.weights.h5"))])
    assert model.dp_steps_taken == 0


def test_callbacks_deciding_from_private_or_validation_values_run(tmp_path):
    """Validation metrics (held-out records), epsilon, a value a callback writes itself, a
    checkpoint of every epoch, and TerminateOnNaN when the training metrics are not logged."""
    x, y = _arrays(np.random.default_rng(13))
    held_out = _arrays(np.random.default_rng(113), n=8)
    model = _metric_model()
    for callbacks in ([_K.EarlyStopping(monitor="val_loss")],
                      [lipdp.DP_Accountant(), _K.EarlyStopping(monitor="epsilon")],
                      [_K.ModelCheckpoint(str(tmp_path / "w.weights.h5"), monitor="loss",
                                          save_weights_only=True)]):
        model.fit(x, y, epochs=1, verbose=0, callbacks=callbacks, validation_data=held_out)
    assert model.dp_steps_taken == 3 * N // BATCH
    quiet = _metric_model(private_logs_only=True)
    quiet.fit(x, y, epochs=1, verbose=0, callbacks=[_K.TerminateOnNaN()])
    assert quiet.dp_steps_taken == N // BATCH


@pytest.mark.parametrize("validation", ["the training arrays", "a copy of a slice",
                                        "the training dataset", "a load_dataset pipeline",
                                        "a dataset of the arrays", "float64 inputs",
                                        "float64 labels", "a filtered dataset of the arrays",
                                        "two batches of the training dataset",
                                        "the training dataset mapped"])
def test_validation_metrics_on_the_training_records_count_as_training_metrics(validation):
    """`validation_data` holding training records (the arrays or dataset fit trains on, a
    slice of them) gives val_ metrics computed on the training records outside the noisy
    gradient: EarlyStopping on 'val_loss' then decided from them, silently. Refused, and so
    is such validation under private_logs_only=True (the logs would not be private). The
    training arrays in a dataset of their own or in another dtype were not recognised (an
    audit)."""
    x, y = _arrays(np.random.default_rng(15))
    model = _metric_model()
    train, validation_data = (x, y), {
        "the training arrays": (x, y), "a copy of a slice": (x[5:13].copy(), y[5:13].copy()),
        "a dataset of the arrays": tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH),
        "float64 inputs": (x.astype(np.float64), y), "float64 labels": (x, y.astype(np.float64)),
        "a filtered dataset of the arrays": tf.data.Dataset.from_tensor_slices((x, y)).filter(
            lambda *_: True).batch(BATCH),
    }.get(validation)
    if validation.startswith(("the training dataset", "two batches")):
        train = (tf.data.Dataset.from_tensor_slices((x, y)).shuffle(N).batch(BATCH),)
        # Made from the training dataset by tf.data: passed until 2026-12-07 (an audit).
        validation_data = {"two batches of the training dataset": train[0].take(2),
                           "the training dataset mapped": train[0].map(lambda a, b: (a, b)),
                           }.get(validation, train[0])
    if validation == "a load_dataset pipeline":  # its training pipeline: a Poisson sampler
        validation_data = lipdp.data.load_dataset("digits", 50, bound_clip_value=8.0,
                                                  nb_samples_train=100)[0]
    with pytest.raises(ValueError, match=r"monitors 'val_loss', a training metric \(validation"):
        model.fit(*train, epochs=1, verbose=0, validation_data=validation_data,
                  callbacks=[_K.EarlyStopping(monitor="val_loss")])
    with pytest.raises(ValueError, match="validation_data holds the training records"):
        _metric_model(private_logs_only=True).fit(*train, epochs=1, verbose=0,
                                                  validation_data=validation_data)
    assert model.dp_steps_taken == 0


def test_validation_data_sharing_some_training_records_warns():
    """A validation set that only overlaps the training set (2 of its 10 examples) is not
    refused (a held-out set can hold copies of training records, duplicates in the source
    data); fit says how many of its examples are training examples. Held-out data: no
    warning."""
    x, y = _arrays(np.random.default_rng(17))
    held_out = _arrays(np.random.default_rng(117), n=10)
    overlapping = (np.concatenate([held_out[0][:8], x[3:5]]),
                   np.concatenate([held_out[1][:8], y[3:5]]))
    model = _metric_model()
    for validation_data, warned in [(overlapping, True), (held_out, False)]:
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            model.fit(x, y, epochs=1, verbose=0, validation_data=validation_data)
        shared = [str(w.message) for w in record if "validation_data shares" in str(w.message)]
        assert shared == (["validation_data shares 2 of its 10 examples with the training "
                           "arrays: its val_ metrics depend on those training records outside "
                           "the noisy gradient (not private), and so would anything decided "
                           "from them."] if warned else [])


def test_callbacks_deciding_from_a_monitor_of_training_records_are_refused():
    """BoundMonitor and SignalToNoise compute per-example gradients of the examples they are
    given: a callback acting on those logs (the tightness, the signal-to-noise ratio) acts
    on the training records outside the noisy gradient when the monitor was given them.
    Refused; the same callbacks on a monitor of held-out records, or on the logs that are
    functions of the weights (the bound, the noise std), train."""
    from lipdp.bounds import variable_names

    x, y = _arrays(np.random.default_rng(16))
    held_out = _arrays(np.random.default_rng(116), n=16)
    model = _metric_model()
    name = next(iter(variable_names(model).values()))
    for monitor, key, callback in [
            (lipdp.BoundMonitor((x, y), sample_size=8), f"tightness_max/{name}",
             _K.EarlyStopping),
            (lipdp.SignalToNoise((x[:32], y[:32]), sample_size=8), f"signal_to_noise/{name}",
             _K.ReduceLROnPlateau)]:
        with pytest.raises(ValueError, match="computed from training records .*BoundMonitor"):
            model.fit(x, y, epochs=1, verbose=0, callbacks=[monitor, callback(monitor=key)])
    assert model.dp_steps_taken == 0
    for monitor, key in [(lipdp.BoundMonitor(held_out, sample_size=8), f"tightness_max/{name}"),
                         (lipdp.BoundMonitor((x, y), sample_size=8), f"gradient_bound/{name}")]:
        model.fit(x, y, epochs=1, verbose=0,
                  callbacks=[monitor, _K.EarlyStopping(monitor=key)])
    assert model.dp_steps_taken == 2 * N // BATCH


@pytest.mark.parametrize("pipeline", ["records repeated", "batches repeated", "declared set",
                                      "half-size batches repeated", "filtered batches",
                                      "filtered records", "filtered declared set"])
def test_a_repeated_pipeline_must_go_through_the_declared_training_set(pipeline):
    """`.repeat()` with `steps_per_epoch` hides the pipeline's size from the batch count: 32
    records repeated under metadata of 64 trained silently, each record drawn twice as often
    as the accountant assumed. Refused before the first step, whether the repeat comes
    before the batching or after it; the declared 64 records train. The records of a pass
    of batches are counted (4 batches of 8 passed as the 4 batches of 16 declared), and of
    a pass of unknown size (a `filter` keeping half the records ran silently: audits)."""
    x, y = _arrays(np.random.default_rng(14))
    n = N if "declared set" in pipeline else N // 2
    if pipeline.startswith("filtered"):  # all N records, a filter keeping the first n
        indexed = tf.data.Dataset.from_tensor_slices((np.arange(N), x, y))
        records = indexed.filter(lambda i, *_: i < n).map(lambda i, a, b: (a, b)).shuffle(N)
    else:
        records = tf.data.Dataset.from_tensor_slices((x[:n], y[:n])).shuffle(n)
    batch = BATCH // 2 if pipeline.startswith("half-size") else BATCH
    dataset = (records.batch(batch).repeat() if "batches" in pipeline
               else records.repeat().batch(BATCH))
    model = _model(3, sigma=1.0)
    model.compile(loss=DP_TauCategoricalCrossentropy(1.0), optimizer="sgd")
    fit = dict(epochs=1, verbose=0, steps_per_epoch=N // BATCH)
    if "declared set" in pipeline:
        model.fit(dataset, **fit)
        assert model.dp_steps_taken == N // BATCH
        return
    with pytest.raises(ValueError, match=f"repeats a pass of {n} records"):
        model.fit(dataset, **fit)
    assert model.dp_steps_taken == 0


def _most_copies_in_a_batch(dataset, batches):
    """The most times one record (a row of inputs) appears in one of `dataset`'s first
    `batches` batches."""
    most = 0
    for inputs, _ in dataset.take(batches):
        _, counts = np.unique(inputs.numpy(), axis=0, return_counts=True)
        most = max(most, int(counts.max()))
    return most


_REPEATS = {  # what each refused pipeline is refused for
    "shuffles after a repeat": [
        "repeat, shuffle, batch", "repeat, map, shuffle, batch, prefetch",
        "shuffled batches of a repeat re-cut", "repeat, shuffle, repeat, batch",
        "repeat, shuffle, map_and_batch"],
    "repeats a dataset it zips, concatenates or samples from": [
        "zip of repeats, shuffle, batch", "sample_from_datasets of repeats, batch"],
    "batches a repeat of 60 records in batches of 8": [
        "pass of 60 in batches of 8", "filtered pass of 60 in batches of 8"],
    "repeats its records before batching them with a step between them that does not keep": [
        "shuffle, repeat, take, batch", "shuffle, repeat, unordered map, prefetch, batch"],
    "repeats its records before batching them in batches whose size lipdp cannot read": [
        "pass of 60, repeat, group_by_window"],
    # a tf.compat.v1 pipeline was read as adapters only (a review)
    "shuffles after a repeat: one shuffle buffer": ["v1: repeat, shuffle, batch"],
}


@pytest.mark.parametrize("pipeline", [p for refused in _REPEATS.values() for p in refused] + [
    "shuffle, repeat, batch", "shuffle, batch, repeat", "pass of 60, batch, repeat",
    "pass of 60, repeat(1), batch", "zip with counter seeds, shuffle, batch"])
def test_a_repeat_that_puts_a_record_twice_in_a_batch_is_refused(pipeline):
    """A repeat before the batching, with a shuffle between them (``repeat().shuffle(N)``, a
    common idiom) or a pass that is not a whole number of batches, puts some record twice in
    one batch, while the sensitivity counts each record once: an audit's
    ``repeat().shuffle(64).batch(16)`` held a record more than once in 69% of its batches
    (up to 3 times) and one record moved the noiseless update by 2.01 times the sensitivity,
    trained silently; so did repeats inside a ``zip`` or ``sample_from_datasets`` (a review).
    Refused before the first step (the copies are shown to be there); shuffling, then
    repeating, trains (and holds none)."""
    n = 60 if "60" in pipeline else N
    x, y = _arrays(np.random.default_rng(23), n=n)
    records = tf.data.Dataset.from_tensor_slices((x, y))
    if pipeline.startswith("filtered"):  # tf.data does not know the pass's size: counted
        indexed = tf.data.Dataset.from_tensor_slices((np.arange(n + 4), np.concatenate(
            [x, x[:4]]), np.concatenate([y, y[:4]])))
        records = indexed.filter(lambda i, *_: i < n).map(lambda i, a, b: (a, b))
    dataset = {
        "repeat, shuffle, batch": lambda: records.repeat().shuffle(n).batch(BATCH),
        "repeat, map, shuffle, batch, prefetch": lambda: records.repeat().map(
            lambda a, b: (a, b)).shuffle(n).batch(BATCH).prefetch(2),
        "shuffled batches of a repeat re-cut": lambda: records.shuffle(n).repeat().batch(
            BATCH // 2).shuffle(8).unbatch().batch(BATCH),
        "pass of 60 in batches of 8": lambda: records.shuffle(n).repeat().batch(BATCH),
        "filtered pass of 60 in batches of 8": lambda: records.shuffle(n).repeat().batch(
            BATCH),
        "repeat, shuffle, repeat, batch": lambda: records.repeat().shuffle(n).repeat().batch(
            BATCH),
        "repeat, shuffle, map_and_batch": lambda: records.repeat().shuffle(n).apply(
            tf.data.experimental.map_and_batch(lambda a, b: (a, b), BATCH)),
        "zip of repeats, shuffle, batch": lambda: tf.data.Dataset.zip((
            tf.data.Dataset.from_tensor_slices(x).repeat(),
            tf.data.Dataset.from_tensor_slices(y).repeat())).shuffle(n).batch(BATCH),
        "sample_from_datasets of repeats, batch": lambda: tf.data.Dataset.sample_from_datasets(
            [records.take(8).shuffle(8).repeat(), records.skip(8).shuffle(n).repeat()],
            seed=0).batch(BATCH),
        "shuffle, repeat, take, batch": lambda: records.shuffle(n).repeat().take(
            100 * n).batch(BATCH),
        "shuffle, repeat, unordered map, prefetch, batch": lambda: records.shuffle(n).repeat(
            ).map(lambda a, b: (a, b), num_parallel_calls=8, deterministic=False).prefetch(
                1).batch(BATCH),
        "pass of 60, repeat, group_by_window": lambda: records.shuffle(n).repeat(
            ).group_by_window(lambda a, b: tf.constant(0, tf.int64),
                              lambda key, window: window.batch(BATCH), window_size=BATCH),
        "v1: repeat, shuffle, batch": lambda: tf.compat.v1.data.Dataset.from_tensor_slices(
            (x, y)).repeat().shuffle(n).batch(BATCH),
        "shuffle, repeat, batch": lambda: records.shuffle(n).repeat().batch(BATCH),
        "shuffle, batch, repeat": lambda: records.shuffle(n).batch(BATCH).repeat(),
        "pass of 60, batch, repeat": lambda: records.shuffle(n).batch(BATCH).repeat(),
        "pass of 60, repeat(1), batch": lambda: records.shuffle(n).repeat(1).batch(BATCH),
        "zip with counter seeds, shuffle, batch": lambda: tf.data.Dataset.zip((
            records.shuffle(n), tf.data.Dataset.counter())).map(lambda r, s: r).batch(BATCH),
    }[pipeline]()
    metadata = lipdp.DatasetMetadata((DIM,), 3, n, 8, BATCH, X0, "shuffle")
    model = lipdp.DP_Sequential(
        [DP_BoundedInput(X0, input_shape=(DIM,)), DP_QuickSpectralDense(3)],
        dp_parameters=lipdp.DPParameters(1.0, 1e-5), dataset_metadata=metadata)
    model.compile(loss=DP_TauCategoricalCrossentropy(1.0), optimizer="sgd")
    steps = -(-n // BATCH)
    reason = next((r for r, refused in _REPEATS.items() if pipeline in refused), None)
    copies = _most_copies_in_a_batch(dataset, 20 * steps)
    # (a take of whole passes holds no copies; an unordered map, only when it reorders)
    if "take" not in pipeline and "unordered" not in pipeline:
        assert (copies > 1) == (reason is not None), copies
    if reason is None:
        with warnings.catch_warnings():
            warnings.simplefilter("error", lipdp.data.ShuffleSamplingWarning)
            model.fit(dataset, epochs=1, verbose=0, steps_per_epoch=steps)
        assert model.dp_steps_taken == steps
        return
    with pytest.raises(ValueError, match=f"The dataset {reason}"):
        model.fit(dataset, epochs=1, verbose=0, steps_per_epoch=steps)
    assert model.dp_steps_taken == 0


@pytest.mark.parametrize("labels", ["numbered 1..K", "numbered 1..K, (N, 1)", "negative",
                                    "numbered 0..K-1", "numbered 0..K-1, (N, 1)"])
@pytest.mark.parametrize("data", ["arrays", "dataset"])
def test_class_indices_outside_the_classes_are_refused_before_training(labels, data):
    """A lipdp loss of classes clips a class index outside [0, K) into it (its bound holds for
    any label): labels numbered 1..K trained silently against wrong classes, as did -1 (an
    audit). Refused before the first step, naming the records; 0..K-1 train."""
    rng = np.random.default_rng(22)
    x, one_hot = _arrays(rng)
    indices = np.argmax(one_hot, axis=1).astype(np.int64)
    if "1..K" in labels and "0..K-1" not in labels:
        indices = indices + 1
    elif labels == "negative":
        indices[[3, 40]] = -1
    y = indices[:, None] if labels.endswith("(N, 1)") else indices
    model = _model(3, sigma=1.0)
    model.compile(loss=DP_TauCategoricalCrossentropy(1.0), optimizer="sgd")
    given = ((tf.data.Dataset.from_tensor_slices((x, y)).shuffle(N).batch(BATCH),)
             if data == "dataset" else (x, y))
    fit = dict(epochs=1, verbose=0) if data == "dataset" else dict(epochs=1, verbose=0,
                                                                   batch_size=BATCH)
    if "0..K-1" in labels:
        model.fit(*given, **fit)
        assert model.dp_steps_taken == N // BATCH
        return
    with pytest.raises(lipdp.records.OutOfRangeIdError,
                       match=r"class indices outside \[0, K\) \(K model outputs\)"):
        model.fit(*given, **fit)
    assert model.dp_steps_taken == 0


@pytest.mark.parametrize("pipeline", ["filter keeping half", "generator of half",
                                      "filter keeping all", "filter keeping all, half batches"])
def test_a_pass_of_unknown_size_must_hold_the_declared_records(pipeline):
    """Under shuffle sampling an epoch is one pass, which must hold the declared N records. A
    pass whose size tf.data does not know (a `filter`, a generator), not repeated, was
    caught only at the epoch's end, its steps taken at twice the accountant's rate (an
    audit: a filter keeping 200 of 400 declared records). Refused before the first step; N
    records train, in batches of D or smaller."""
    x, y = _arrays(np.random.default_rng(21))
    n = N // 2 if "half" in pipeline.split(",")[0] else N
    if pipeline.startswith("generator"):
        def records():
            yield from zip(x[:n], y[:n])

        dataset = tf.data.Dataset.from_generator(records, output_signature=(
            tf.TensorSpec(x.shape[1:], tf.float32), tf.TensorSpec(y.shape[1:], tf.float32)))
    else:
        indexed = tf.data.Dataset.from_tensor_slices((np.arange(N), x, y))
        dataset = indexed.filter(lambda i, *_: i < n).map(lambda i, a, b: (a, b))
    assert int(dataset.cardinality()) == tf.data.UNKNOWN_CARDINALITY
    batch = BATCH // 2 if pipeline.endswith("half batches") else BATCH
    model = _model(3, sigma=1.0)
    model.compile(loss=DP_TauCategoricalCrossentropy(1.0), optimizer="sgd")
    if n < N:
        with pytest.raises(ValueError, match=f"One pass over the dataset holds {n} records"):
            model.fit(dataset.shuffle(N).batch(batch), epochs=1, verbose=0)
        assert model.dp_steps_taken == 0
        return
    model.fit(dataset.shuffle(N).batch(batch), epochs=1, verbose=0)
    assert model.dp_steps_taken == N // batch


@pytest.mark.parametrize("pipeline", ["Poisson pipeline", "generator of batches"])
def test_repeated_pipelines_at_the_declared_rate_train(pipeline):
    """Counting a repeated pass's records refused honest pipelines when it took batches for
    records (a load_dataset Poisson pipeline repeated, a generator of batches: '4 records');
    a Poisson pipeline's random pass sizes are left to its sampler's own check."""
    x, y = _arrays(np.random.default_rng(20))
    if pipeline == "Poisson pipeline":
        dataset, _, metadata = lipdp.data.load_dataset(
            "digits", BATCH, bound_clip_value=8.0, nb_samples_train=N, sampling="poisson")
        model = lipdp.DP_Sequential(
            [DP_BoundedInput(8.0, input_shape=(64,)), DP_QuickSpectralDense(10)],
            dp_parameters=lipdp.DPParameters(1.0, 1e-5), dataset_metadata=metadata)
    else:
        def batches():
            for start in range(0, N, BATCH):
                yield x[start:start + BATCH], y[start:start + BATCH]

        dataset = tf.data.Dataset.from_generator(batches, output_signature=(
            tf.TensorSpec((None,) + x.shape[1:], tf.float32),
            tf.TensorSpec((None,) + y.shape[1:], tf.float32)))
        model = _model(3, sigma=1.0)
    model.compile(loss=DP_TauCategoricalCrossentropy(1.0), optimizer="sgd")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.fit(dataset.repeat(), epochs=1, verbose=0, steps_per_epoch=N // BATCH)
    assert model.dp_steps_taken == N // BATCH


def test_monitors_of_training_records_are_refused_under_private_logs_only():
    """BoundMonitor and SignalToNoise write logs computed from the examples they are given
    into the History: under private_logs_only=True, which promises logs that epsilon covers,
    they ran on the training records unrefused (an audit). Refused; on held-out records they
    train."""
    x, y = _arrays(np.random.default_rng(18))
    held_out = _arrays(np.random.default_rng(118), n=16)
    model = _metric_model(private_logs_only=True)
    for monitor in (lipdp.BoundMonitor((x, y), sample_size=8),
                    lipdp.SignalToNoise((x[:32].astype(np.float64), y[:32]), sample_size=8)):
        with pytest.raises(ValueError, match="from the training records it was given"):
            model.fit(x, y, epochs=1, verbose=0, callbacks=[monitor])
    assert model.dp_steps_taken == 0
    model.fit(x, y, epochs=1, verbose=0,
              callbacks=[lipdp.BoundMonitor(held_out, sample_size=8)])
    assert model.dp_steps_taken == N // BATCH


def test_monitors_of_training_inputs_with_other_labels_or_from_a_dataset_s_arrays_are_refused():
    """A monitor's logs are gradients at the inputs it is given: the training inputs with
    class indices for labels, or the arrays a training dataset was made from, passed under
    private_logs_only=True in silence (an audit, 2026-12-07)."""
    x, y = _arrays(np.random.default_rng(20))
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(N).batch(BATCH)
    model = _metric_model(private_logs_only=True)
    for data, monitor in (((x, y), lipdp.BoundMonitor((x, y.argmax(1)), sample_size=8)),
                          ((dataset,), lipdp.SignalToNoise((x, y), sample_size=8)),
                          ((dataset,), lipdp.BoundMonitor((x[:8], y[:8] * 0), sample_size=8))):
        with pytest.raises(ValueError, match="from the training records it was given"):
            model.fit(*data, epochs=1, verbose=0, callbacks=[monitor])
    assert model.dp_steps_taken == 0


def test_monitors_of_data_made_from_the_training_set_are_refused_or_warned():
    """Under private_logs_only=True a monitor given two batches of the training dataset, or
    the dataset mapped, computed its logs from training records unrefused; one given the
    training arrays and one more example, in silence (an audit, 2026-12-07). The first are
    refused; data holding training records among others warns, as validation data does."""
    x, y = _arrays(np.random.default_rng(19))
    extra = _arrays(np.random.default_rng(119), n=1)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(N).batch(BATCH)
    model = _metric_model(private_logs_only=True)
    for monitor in (lipdp.BoundMonitor(dataset.take(2), sample_size=8),
                    lipdp.SignalToNoise(dataset.map(lambda a, b: (a, b)), sample_size=8)):
        with pytest.raises(ValueError, match="from the training records it was given"):
            model.fit(dataset, epochs=1, verbose=0, callbacks=[monitor])
    assert model.dp_steps_taken == 0
    superset = (np.concatenate([x, extra[0]]), np.concatenate([y, extra[1]]))
    with pytest.warns(UserWarning, match=f"BoundMonitor shares {N} of its {N + 1} examples"):
        model.fit(x, y, epochs=1, verbose=0,
                  callbacks=[lipdp.BoundMonitor(superset, sample_size=8)])
    other = tf.data.Dataset.from_tensor_slices(extra).batch(BATCH)
    with pytest.warns(UserWarning, match="validation_data shares examples of the training"):
        model.fit(dataset, epochs=1, verbose=0, validation_data=dataset.concatenate(other))
    assert model.dp_steps_taken == 2 * N // BATCH


_STREAMS = {  # pipeline: what fit does (a warning, a refusal's message, or silence)
    "a second epoch of copies": "Epoch 2 of the dataset read as one stream",
    "passes straddling epochs": "Epoch 2 of the dataset read as one stream",
    "two shuffled passes": None,
    "more steps than one pass holds, one epoch": None,
    "a NaN in the second epoch": f"batch {2 * N // BATCH - 1} row 5",
    "epochs of half the records": "Epoch 1 of the dataset read as one stream .* holds 32 records",
    "two passes in one epoch": "One pass over the dataset holds 128 records",
    "the data running out in an epoch": "Epoch 1 of .* holds 32 records, but",
    "no data for the last epoch": "Epoch 2 of .* holds no records: the data runs out after 1",
}


@pytest.mark.parametrize("pipeline", list(_STREAMS))
def test_a_dataset_read_as_one_stream_is_checked_epoch_by_epoch(pipeline):
    """Given a ``steps_per_epoch`` other than its length, Keras reads a dataset without a
    repeat as one stream across epochs. fit checked the stream's first epoch only: a second
    epoch holding 32 records twice, or passes of 60 records read in epochs of 56 (a batch
    straddling two passes held a record twice in 23% of draws), trained silently (an audit,
    2026-12-07). Every epoch the fit will read is checked now, before the first step: its
    copies warn, a record that is not finite, an epoch of other than N records, or one
    the data runs out in, is refused (each was stopped at its epoch's end, after its steps;
    the first version of the check missed the last: a review). Two shuffled passes written
    out, one an epoch, train silently, and so does one pass given more steps than it holds
    (Keras stops when it runs out)."""
    n = 60 if pipeline == "passes straddling epochs" else N
    x, y = _arrays(np.random.default_rng(29), n=n)
    records = tf.data.Dataset.from_tensor_slices((x, y))
    x_nan = x.copy()
    x_nan[n - 3, 1] = np.nan  # read in the second epoch only, at batch 15 row 5
    half = records.take(N // 2)
    data, steps, epochs = {
        "a second epoch of copies": (
            records.shuffle(N).concatenate(half.concatenate(half).shuffle(N)), N // BATCH, 2),
        "passes straddling epochs": (
            records.shuffle(n).concatenate(records.shuffle(n)).concatenate(records.shuffle(n)),
            n // BATCH, 3),
        "two shuffled passes": (records.shuffle(N).concatenate(records.shuffle(N)),
                                N // BATCH, 2),
        "more steps than one pass holds, one epoch": (records.shuffle(N), N // BATCH + 1, 1),
        "a NaN in the second epoch": (
            records.shuffle(N).concatenate(tf.data.Dataset.from_tensor_slices((x_nan, y))),
            N // BATCH, 2),
        "epochs of half the records": (records.shuffle(N), N // BATCH // 2, 2),
        "two passes in one epoch": (records.shuffle(N).concatenate(records.shuffle(N)),
                                    2 * N // BATCH, 1),
        "the data running out in an epoch": (half.shuffle(N), N // BATCH, 1),
        "no data for the last epoch": (  # a filter: tf.data does not know its length
            records.shuffle(N).filter(lambda a, b: True), N // BATCH, 2),
    }[pipeline]
    metadata = lipdp.DatasetMetadata((DIM,), 3, n, 8, BATCH, X0, "shuffle")
    model = lipdp.DP_Sequential(
        [DP_BoundedInput(X0, input_shape=(DIM,)), DP_QuickSpectralDense(3)],
        dp_parameters=lipdp.DPParameters(1.0, 1e-5), dataset_metadata=metadata)
    model.compile(loss=DP_TauCategoricalCrossentropy(1.0), optimizer="sgd")
    fit = dict(steps_per_epoch=steps, epochs=epochs, verbose=0)
    expected = _STREAMS[pipeline]
    if expected is None or expected.startswith("Epoch 2 of the dataset read"):
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            model.fit(data.batch(BATCH), **fit)
        copies = [str(w.message) for w in record if "distinct ones" in str(w.message)]
        if expected is None:
            batches = int(data.batch(BATCH).cardinality())
            assert copies == [] and model.dp_steps_taken == min(steps * epochs, batches)
        else:  # the first epoch holds no copies: the second does
            assert copies and copies[0].startswith(expected), copies
        return
    error = NonFiniteRecordError if pipeline == "a NaN in the second epoch" else ValueError
    with pytest.raises(error, match=expected):
        model.fit(data.batch(BATCH), **fit)
    assert model.dp_steps_taken == 0


@pytest.mark.parametrize("steps", [-1, 0, 2.5, True])
def test_a_steps_per_epoch_that_is_not_a_count_is_refused(steps):
    """Keras' ``steps_per_epoch=-1`` trains one epoch until the data runs out: the checks
    before the first step read nothing, and copies and a NaN record trained unseen (a
    review, 2026-12-07)."""
    x, y = _arrays(np.random.default_rng(31))
    model = _model(3, sigma=1.0)
    model.compile(loss=DP_TauCategoricalCrossentropy(1.0), optimizer="sgd")
    data = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(N).batch(BATCH)
    with pytest.raises(ValueError, match=f"steps_per_epoch={steps!r}: a DP model trains"):
        model.fit(data, steps_per_epoch=steps, epochs=1, verbose=0)
    assert model.dp_steps_taken == 0


@pytest.mark.parametrize("steps", [2, 5, 9])
def test_arrays_refuse_a_steps_per_epoch_other_than_one_pass_before_any_step(steps):
    """With shuffled batches of arrays an epoch must see every declared example: 2 steps of
    a 4-step epoch trained, then were refused at the epoch's end (a usability audit,
    2026-12-07). One pass (ceil or floor of N / D) trains."""
    x, y = _arrays(np.random.default_rng(32))
    model = _model(3, sigma=1.0)
    model.compile(loss=DP_TauCategoricalCrossentropy(1.0), optimizer="sgd")
    passes = model.dataset_metadata.steps_per_epoch
    with pytest.raises(ValueError, match=f"steps_per_epoch={steps} on arrays of "
                                         f"nb_samples_train={N} examples in batches of {BATCH}: "
                                         f"one pass over them is {passes} steps"):
        model.fit(x, y, batch_size=BATCH, steps_per_epoch=steps, epochs=1, verbose=0)
    assert model.dp_steps_taken == 0
    model.fit(x, y, batch_size=BATCH, steps_per_epoch=passes, epochs=1, verbose=0)
    assert model.dp_steps_taken == passes


def test_a_shuffled_load_dataset_pipeline_refuses_epochs_other_than_its_pass():
    """A `load_dataset` pipeline of shuffled batches given another ``steps_per_epoch`` than
    its pass was read by Keras as one stream and stopped by the epoch-size check only after
    the first epoch's steps (a review, 2026-12-07): refused before the first step; its own
    length trains."""
    from lipdp.layers import DP_Flatten

    ds_train, _, md = lipdp.data.load_dataset("digits", 50, bound_clip_value=1.0, seed=0,
                                              sampling="shuffle", nb_samples_train=200)
    model = lipdp.DP_Sequential(
        [DP_BoundedInput(1.0, input_shape=md.input_shape), DP_Flatten(),
         DP_QuickSpectralDense(md.nb_classes)],
        dp_parameters=lipdp.DPParameters(1.0, 1e-5), dataset_metadata=md)
    model.compile(loss=DP_TauCategoricalCrossentropy(1.0), optimizer="sgd")
    for steps in (3, 5):
        with pytest.raises(ValueError, match=f"steps_per_epoch={steps} for a load_dataset "
                                             "pipeline of shuffled batches, which makes one "
                                             "pass of 4 batches"):
            model.fit(ds_train, steps_per_epoch=steps, epochs=2, verbose=0)
        assert model.dp_steps_taken == 0
    model.fit(ds_train, steps_per_epoch=4, epochs=1, verbose=0)
    assert model.dp_steps_taken == 4


@pytest.mark.parametrize("sampling", ["shuffle", "poisson"])
@pytest.mark.parametrize("store", ["cache()", "cache(file)", "snapshot", "cache().map"])
def test_a_cached_load_dataset_pipeline_is_refused(sampling, store, tmp_path):
    """A cache (or snapshot) of a `load_dataset` pipeline replays its first pass every epoch.
    Since shuffled pipelines permute inside a function (each pass the permutation of its
    seed and first step), the graph check of a cache after a shuffle no longer saw one:
    ``fit(ds.cache(), epochs=3)`` trained one permutation three times, silently (an audit,
    2026-12-07); a cached Poisson pipeline replayed its draws with only a generic warning."""
    from lipdp.layers import DP_Flatten

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # shuffle sampling's and the known seed's
        ds_train, _, md = lipdp.data.load_dataset("digits", 50, bound_clip_value=1.0, seed=0,
                                                  sampling=sampling, nb_samples_train=200)
    stored = {"cache()": lambda: ds_train.cache(),
              "cache(file)": lambda: ds_train.cache(str(tmp_path / "cache")),
              "snapshot": lambda: ds_train.snapshot(str(tmp_path / "snapshot")),
              "cache().map": lambda: ds_train.cache().map(lambda x, y: (x, y))}[store]()
    model = lipdp.DP_Sequential(
        [DP_BoundedInput(1.0, input_shape=md.input_shape), DP_Flatten(),
         DP_QuickSpectralDense(md.nb_classes)],
        dp_parameters=lipdp.DPParameters(1.0, 1e-5), dataset_metadata=md)
    model.compile(loss=DP_TauCategoricalCrossentropy(1.0), optimizer="sgd")
    with pytest.raises(ValueError, match=rf"load_dataset pipeline \({sampling} sampling\) "
                                         "followed by a cache or snapshot"):
        model.fit(stored, epochs=2, verbose=0)
    assert model.dp_steps_taken == 0


@pytest.mark.parametrize("pipeline", ["concatenated with itself", "copies by flat_map",
                                      "the declared records", "arrays concatenated",
                                      "the declared arrays", "concatenated with itself, repeated",
                                      "the declared records, repeated",
                                      "concatenated with itself, repeat(1)"])
def test_an_epoch_holding_copies_of_records_warns(pipeline):
    """The accountant counts each record once an epoch: 32 records concatenated with
    themselves under metadata of 64 (a dataset, or arrays) ran silently at twice its rate
    (audits: epsilon 1.67 reported for 3.40, 7.39 for 13.16). fit warns with the counts;
    the declared records once each, no warning. A trailing ``repeat()`` switched the count
    off (an audit, 2026-12-07): the pass it repeats is counted. (A repeat before the shuffle,
    which mixes two passes in an epoch's batches, is refused: `test_a_repeat_that_puts_a_
    record_twice_in_a_batch_is_refused`.)"""
    x, y = _arrays(np.random.default_rng(19))
    half = tf.data.Dataset.from_tensor_slices((x[:N // 2], y[:N // 2]))
    data = {
        "concatenated with itself": half.concatenate(half),
        "copies by flat_map": half.flat_map(
            lambda a, b: tf.data.Dataset.from_tensors((a, b)).repeat(2)),
        "the declared records": tf.data.Dataset.from_tensor_slices((x, y)),
        "arrays concatenated": (np.concatenate([x[:N // 2]] * 2),
                                np.concatenate([y[:N // 2]] * 2)),
        "the declared arrays": (x, y),
        "concatenated with itself, repeated": half.concatenate(half),
        "concatenated with itself, repeat(1)": half.concatenate(half),
        "the declared records, repeated": tf.data.Dataset.from_tensor_slices((x, y)),
    }[pipeline]
    arrays = isinstance(data, tuple)
    fit = dict(epochs=1, verbose=0) if arrays else dict(epochs=1, verbose=0,
                                                        steps_per_epoch=N // BATCH)
    model = _model(3, sigma=1.0)
    model.compile(loss=DP_TauCategoricalCrossentropy(1.0), optimizer="sgd")
    if not arrays:
        data = data.shuffle(N).batch(BATCH)
        data = data.repeat() if pipeline.endswith("repeated") else data
        data = data.repeat(1) if pipeline.endswith("repeat(1)") else data  # no repeat
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        model.fit(*(data if arrays else (data,)), **fit)
    repeated = [str(w.message) for w in record if "distinct ones" in str(w.message)]
    assert len(repeated) == ("declared" not in pipeline)
    source = ("The training arrays" if arrays else
              f"One pass of the repeated dataset ({N // BATCH} batches)"
              if pipeline.endswith("repeated") else
              # tf.data does not know the flat_map's length: Keras reads it as one stream
              f"Epoch 1 of the dataset read as one stream ({N // BATCH} batches an epoch: "
              "steps_per_epoch without a repeat)" if pipeline == "copies by flat_map" else
              f"One epoch of the dataset ({N // BATCH} batches)")
    assert all(m.startswith(f"{source} holds {N} records but only {N // 2} distinct ones")
               for m in repeated)
