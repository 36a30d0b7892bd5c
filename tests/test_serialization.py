"""The serialization contract, applied to every layer lipdp exports.

Each layer is registered with Keras, has a complete `get_config` (from_config of
it gives the same config back), keeps its cached power-iteration vectors as
non-trainable weights, and survives a `.keras` round trip inside a DP model with
the same outputs, weights and gradient bounds.
"""

import inspect

import numpy as np
import pytest
import tensorflow as tf

import lipdp
import lipdp.layers as dp
from lipdp.bounds import gradient_bounds, lipschitz_bound
from lipdp.losses import DP_TauCategoricalCrossentropy
from tests._soundness import assert_same_gradient_bounds

SHAPE = (6, 6, 2)

# name -> (layers before, the layer under test, layers after); the head maps to 3 logits.
CASES = {
    "DP_AddBias": ([], lambda: dp.DP_AddBias(0.7), []),
    "DP_BoundedActivation": ([], lambda: dp.DP_BoundedActivation(1.5), []),
    "DP_BoundedInput": ([], lambda: dp.DP_BoundedInput(1.5), []),
    "DP_ClipGradient": ([], lambda: dp.DP_ClipGradient(0.3), []),
    "DP_Flatten": ([], lambda: dp.DP_Flatten(), []),
    "DP_GlobalL2NormPooling2D": ([], lambda: dp.DP_GlobalL2NormPooling2D(eps_grad_sqrt=1e-3), []),
    "DP_GroupSort": ([], lambda: dp.DP_GroupSort(2), []),
    "DP_LayerCentering": ([], lambda: dp.DP_LayerCentering((1, 2)), []),
    "DP_MaxPool2D": ([], lambda: dp.DP_MaxPool2D(3, strides=2, padding="same"), []),
    "DP_Patches": ([], lambda: dp.DP_Patches(3), []),
    "DP_Permute": ([], lambda: dp.DP_Permute((3, 1, 2)), []),
    "DP_QuickFrobeniusDense": ([dp.DP_Flatten], lambda: dp.DP_QuickFrobeniusDense(5), []),
    "DP_QuickSpectralConv2D": ([], lambda: dp.DP_QuickSpectralConv2D(4, 3, strides=2,
                                                                      eps_bjorck=1e-3), []),
    "DP_QuickSpectralDense": ([dp.DP_Flatten], lambda: dp.DP_QuickSpectralDense(
        5, maxiter_spectral=3), []),
    "DP_ReLU": ([], lambda: dp.DP_ReLU(), []),
    "DP_Reshape": ([], lambda: dp.DP_Reshape((36, 2)), []),
    "DP_ScaledL2NormPooling2D": ([], lambda: dp.DP_ScaledL2NormPooling2D(2, eps_grad_sqrt=1e-3),
                                 []),
    "DP_Scattering": ([], lambda: dp.DP_Scattering(J=1, angles=4, order_weights=(1.0, 2.0, 3.0)),
                      []),
    "DP_MultiscaleScattering": ([], lambda: dp.DP_MultiscaleScattering(  # 6 x 6: J = 1 only
        scales=(1,), angles=4, order_weights=(1.0, 2.0, 3.0), scale_weights=(0.5,)), []),
    "DP_Sigmoid": ([], lambda: dp.DP_Sigmoid(), []),
    "DP_Softplus": ([], lambda: dp.DP_Softplus(), []),
    "DP_SpectralConv2D": ([], lambda: dp.DP_SpectralConv2D(4, 3, padding="valid"), []),
    "DP_SpectralDense": ([dp.DP_Flatten], lambda: dp.DP_SpectralDense(6, use_bias=False), []),
    "DP_Tanh": ([], lambda: dp.DP_Tanh(), []),
    "DP_SplitResidual": ([], lambda: dp.DP_SplitResidual(),
                         [lambda: dp.DP_WrappedResidual(dp.DP_ReLU()), dp.DP_MergeResidual]),
    "DP_WrappedResidual": ([dp.DP_SplitResidual], lambda: dp.DP_WrappedResidual(
        [dp.DP_QuickSpectralConv2D(2, 3), dp.DP_GroupSort(2), dp.DP_AddBias(1.0)]),
        [dp.DP_MergeResidual]),
    "DP_MergeResidual": ([dp.DP_SplitResidual, lambda: dp.DP_WrappedResidual(
        dp.DP_QuickSpectralConv2D(2, 1))], lambda: dp.DP_MergeResidual("add"), []),
}

EXPORTED = sorted(name for name, obj in vars(dp).items()
                  if inspect.isclass(obj) and issubclass(obj, dp.DPLayer) and obj is not dp.DPLayer)


def test_every_exported_layer_has_a_contract_case():
    assert sorted(CASES) == EXPORTED


def _model(name):
    before, make, after = CASES[name]
    layer = make()
    layers = ([dp.DP_BoundedInput(4.0, input_shape=SHAPE)] + [f() for f in before] + [layer]
              + [f() for f in after] + [dp.DP_Flatten(), dp.DP_QuickSpectralDense(3)])
    metadata = lipdp.DatasetMetadata(SHAPE, 3, 32, 8, 8, 4.0, "shuffle")
    model = lipdp.DP_Sequential(layers, dp_parameters=lipdp.DPParameters(2.0, 1e-6, "per-layer"),
                                dataset_metadata=metadata, name=f"contract_{name.lower()}")
    model.compile(loss=DP_TauCategoricalCrossentropy(4.0, margin=0.1),
                  optimizer=tf.keras.optimizers.SGD(0.5))
    return model, layer


def _settings(layer) -> dict:
    """A layer's public attributes of plain values (numbers, strings, tuples of them)."""
    return {key: value for key, value in vars(layer).items()
            if not key.startswith("_") and isinstance(value, (bool, int, float, str, tuple))}


@pytest.mark.parametrize("name", EXPORTED)
def test_layer_serialization_contract(name, tmp_path):
    model, layer = _model(name)
    cls = type(layer)
    assert tf.keras.utils.get_registered_object(f"lipdp>{cls.__name__}") is cls
    config = layer.get_config()
    assert cls.from_config(config).get_config() == config
    if hasattr(layer, "u"):
        assert any(w is layer.u for w in layer.non_trainable_weights)

    rng = np.random.default_rng(0)
    x = rng.normal(size=(32,) + SHAPE).astype("float32")
    y = np.eye(3, dtype="float32")[rng.integers(0, 3, 32)]
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)  # weights off their initial values
    path = str(tmp_path / "model.keras")
    model.save(path)
    loaded = tf.keras.models.load_model(path)

    assert type(loaded) is lipdp.DP_Sequential
    assert loaded.dp_parameters == model.dp_parameters
    assert loaded.dataset_metadata == model.dataset_metadata
    assert loaded.dp_steps_taken == model.dp_steps_taken == 4
    assert [type(layer).__name__ for layer in loaded.layers] == \
        [type(layer).__name__ for layer in model.layers]
    for a, b in zip(model.weights, loaded.weights):
        np.testing.assert_array_equal(a.numpy(), b.numpy(), err_msg=a.name)
    np.testing.assert_array_equal(model(x).numpy(), loaded(x).numpy())
    assert_same_gradient_bounds(gradient_bounds(loaded), gradient_bounds(model))
    assert float(lipschitz_bound(loaded)) == float(lipschitz_bound(model))
    for a, b in zip(model.layers, loaded.layers):  # what get_config leaves out comes back
        assert _settings(b) == _settings(a), a.name  # at its default (eps_grad_sqrt did)
    assert type(loaded.dp_loss) is DP_TauCategoricalCrossentropy
    assert (float(loaded.dp_loss.tau.numpy()), loaded.dp_loss.margin) == (4.0, 0.1)


@pytest.mark.parametrize("extension", [".keras", ".h5"])
def test_dp_model_round_trip_and_training_resumes(tmp_path, extension):
    """Also Keras' legacy HDF5 format, which names classes without their package prefix:
    `lipdp.load_model` loads it (it raised "Unknown layer: 'DP_Model'"), ledger included."""
    inputs = tf.keras.Input(SHAPE)
    h = dp.DP_BoundedInput(4.0)(inputs)
    h = dp.DP_Flatten()(h)
    h = dp.DP_SpectralDense(8)(h)
    h = dp.DP_GroupSort(2)(h)
    outputs = dp.DP_QuickSpectralDense(3)(h)
    metadata = lipdp.DatasetMetadata(SHAPE, 3, 32, 8, 8, 4.0, "shuffle")
    model = lipdp.DP_Model(inputs, outputs, dp_parameters=lipdp.DPParameters(1.0),
                           dataset_metadata=metadata)
    model.compile(loss=DP_TauCategoricalCrossentropy(4.0), optimizer="adam")
    rng = np.random.default_rng(1)
    x = rng.normal(size=(32,) + SHAPE).astype("float32")
    y = np.eye(3, dtype="float32")[rng.integers(0, 3, 32)]
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    path = str(tmp_path / f"m{extension}")
    model.save(path)
    loaded = lipdp.load_model(path)
    assert type(loaded) is lipdp.DP_Model and loaded.dp_steps_taken == 4
    assert loaded.privacy_ledger.describe(1e-5) == model.privacy_ledger.describe(1e-5)
    assert lipdp.accounting.epsilon_spent(loaded) == lipdp.accounting.epsilon_spent(model)
    np.testing.assert_array_equal(model(x).numpy(), loaded(x).numpy())
    assert_same_gradient_bounds(gradient_bounds(loaded), gradient_bounds(model))
    loaded.fit(x, y, batch_size=8, epochs=1, verbose=0)  # re-compiled from the saved config
    assert loaded.dp_steps_taken == 8


def test_groupsort2_saved_before_the_pairing_argument_loads_with_its_adjacent_pairing(tmp_path):
    """A `.keras` file written when GroupSort2 always paired adjacent channels (its config
    has no `pairing`) loads with that layout, hence the same outputs; new files keep theirs."""
    import json
    import zipfile

    model = lipdp.DP_Sequential(
        [dp.DP_BoundedInput(4.0, input_shape=SHAPE), dp.DP_QuickSpectralConv2D(4, 3),
         dp.DP_GroupSort(2, pairing="interleaved"), dp.DP_Flatten(), dp.DP_QuickSpectralDense(8),
         dp.DP_GroupSort(2, pairing="interleaved"), dp.DP_QuickSpectralDense(3)],
        dp_parameters=lipdp.DPParameters(1.0),
        dataset_metadata=lipdp.DatasetMetadata(SHAPE, 3, 32, 8, 8, 4.0, "shuffle"))
    model.save(str(tmp_path / "new.keras"))
    with zipfile.ZipFile(tmp_path / "new.keras") as new, \
            zipfile.ZipFile(tmp_path / "old.keras", "w") as old:
        for item in new.infolist():
            data = new.read(item.filename)
            if item.filename == "config.json":
                config = json.loads(data)
                for layer in config["config"]["layers"]:
                    assert layer["config"].pop("pairing", "interleaved") == "interleaved"
                data = json.dumps(config).encode()
            old.writestr(item, data)
    x = np.random.default_rng(0).normal(size=(5,) + SHAPE).astype("float32")
    for name in ("old.keras", "new.keras"):
        loaded = tf.keras.models.load_model(str(tmp_path / name))
        assert [layer.pairing for layer in loaded.layers
                if isinstance(layer, dp.DP_GroupSort)] == ["interleaved", "interleaved"]
        np.testing.assert_array_equal(loaded(x).numpy(), model(x).numpy())
    assert dp.DP_GroupSort(2).pairing == "halves"


@pytest.mark.parametrize("form", [".keras", ".h5", "SavedModel", "clone_model"])
def test_a_loaded_model_keeps_lipdp_s_compile_arguments(tmp_path, form):
    """Keras' HDF5 and SavedModel files compile a loaded model from its loss, optimizer and
    metrics alone: one compiled with ``private_logs_only=True`` came back logging training
    losses, and ``bjorck_every=4`` came back as 1 (an audit, 2026-12-07). They travel in
    the model's config to its first compile (a later compile takes the defaults again)."""
    inputs = tf.keras.Input(SHAPE)  # functional: clone_model of a DP_Sequential is Keras'
    h = dp.DP_Flatten()(dp.DP_BoundedInput(4.0)(inputs))  # Sequential (README, sharp edges)
    model = lipdp.DP_Model(inputs, dp.DP_QuickSpectralDense(3)(h),
                           dp_parameters=lipdp.DPParameters(1.0),
                           dataset_metadata=lipdp.DatasetMetadata(SHAPE, 3, 32, 8, 8, 4.0,
                                                                  "shuffle"))
    model.compile(loss=DP_TauCategoricalCrossentropy(4.0), optimizer="sgd",
                  private_logs_only=True, bjorck_every=4)
    rng = np.random.default_rng(2)
    x = rng.normal(size=(32,) + SHAPE).astype("float32")
    y = np.eye(3, dtype="float32")[rng.integers(0, 3, 32)]
    assert model.fit(x, y, batch_size=8, epochs=1, verbose=0).history == {}
    if form == "clone_model":
        loaded = tf.keras.models.clone_model(model)
        loaded.compile(loss=DP_TauCategoricalCrossentropy(4.0), optimizer="sgd")
    else:
        path = str(tmp_path / ("model" + (form if form.startswith(".") else "")))
        model.save(path)
        loaded = lipdp.load_model(path)
    assert (loaded._private_logs_only, loaded._bjorck_every) == (True, 4)
    assert loaded.fit(x, y, batch_size=8, epochs=1, verbose=0).history == {}
    loaded.compile(loss=DP_TauCategoricalCrossentropy(4.0), optimizer="sgd")
    assert (loaded._private_logs_only, loaded._bjorck_every) == (False, 1)
    if form == ".h5":  # loaded without compiling, then saved again: still carried (a review)
        path = str(tmp_path / "model.h5")
        model.save(path)
        uncompiled = lipdp.load_model(path, compile=False)
        again = str(tmp_path / "again.h5")
        uncompiled.save(again)
        for copy in (lipdp.load_model(again), tf.keras.models.clone_model(uncompiled)):
            copy.compile(loss=DP_TauCategoricalCrossentropy(4.0), optimizer="sgd")
            assert (copy._private_logs_only, copy._bjorck_every) == (True, 4)


def test_keras_clone_of_a_dp_sequential_is_plain_and_the_accountant_says_so():
    """Keras' clone_model builds a plain Sequential of a Sequential subclass's layers: its
    fit is non-private. DP_Accountant raised AttributeError on it (an audit, 2026-12-07)."""
    model, _ = _model("DP_ReLU")
    clone = tf.keras.models.clone_model(model)
    assert type(clone) is tf.keras.Sequential
    clone.compile(loss=DP_TauCategoricalCrossentropy(4.0), optimizer="sgd")
    x = np.zeros((8,) + SHAPE, "float32")
    with pytest.raises(TypeError, match="DP_Accountant accounts a lipdp DP model's private "
                                        "steps, and this Sequential takes none"):
        clone.fit(x, np.eye(3, dtype="float32")[np.arange(8) % 3], verbose=0,
                  callbacks=[lipdp.DP_Accountant()])
    same = lipdp.DP_Sequential.from_config(model.get_config())
    assert type(same) is lipdp.DP_Sequential and same.dp_parameters == model.dp_parameters


def test_a_model_saved_as_a_saved_model_keeps_its_bounds(tmp_path):
    """Keras' SavedModel saving leaves each layer's own ``call``, bound, set on the layer:
    the bounds of the model saved refused it as a patched call (an audit, 2026-12-07)."""
    model, _ = _model("DP_ClipGradient")
    before = gradient_bounds(model)
    model.save(str(tmp_path / "saved"))
    assert_same_gradient_bounds(gradient_bounds(model), before)
    layer = model.layers[1]

    class Impostor:  # a bound method's attributes, not one (a review)
        __self__, __func__ = layer, type(layer).call

        def __call__(self, inputs, *args, **kwargs):
            return 100.0 * inputs

    for patch in (lambda inputs: 100.0 * inputs, Impostor()):  # patches are still ones
        layer.call = patch
        with pytest.raises(ValueError, match="has its `call` replaced on the instance"):
            gradient_bounds(model)
