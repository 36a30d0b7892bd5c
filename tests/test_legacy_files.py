"""Files lipdp saved before a DP model kept ``poisson_draws_until`` load with that mark at 0.

The files in ``tests/data/saved_before_draw_mark`` were written by lipdp at edfc0f9 (their
README has the script): a 4-8-3 DP model after 4 private steps, in every format Keras 2.15
saves. Legacy HDF5 files and SavedModel directories of that age failed to load (an audit,
2026-12-07): Keras counts the model's own weights, and the new one was missing.
"""

import hashlib
import os
import shutil

import numpy as np
import pytest
import tensorflow as tf

import lipdp
import lipdp.layers as dp

OLD = os.path.join(os.path.dirname(__file__), "data", "saved_before_draw_mark")
STEPS = 4  # the private steps the saved model took


def _model():
    """The saved model's architecture, compiled as it was."""
    inputs = tf.keras.Input((4,))
    h = dp.DP_BoundedInput(4.0)(inputs)
    h = dp.DP_SpectralDense(8)(h)
    h = dp.DP_GroupSort(2)(h)
    outputs = dp.DP_QuickSpectralDense(3)(h)
    model = lipdp.DP_Model(
        inputs, outputs, dp_parameters=lipdp.DPParameters(1.0),
        dataset_metadata=lipdp.DatasetMetadata((4,), 3, 32, 8, 8, 4.0, "shuffle"))
    model.compile(loss=lipdp.losses.DP_TauCategoricalCrossentropy(4.0), optimizer="adam")
    return model


def _copy(tmp_path, name):
    """A copy of the saved file (or folder) `name` under `tmp_path`, and its path there (a
    TensorFlow checkpoint's path is its prefix: its folder is copied)."""
    top = name.split("/")[0]
    source = os.path.join(OLD, top)
    if os.path.isdir(source):
        shutil.copytree(source, tmp_path / top)
    else:
        shutil.copyfile(source, tmp_path / top)
    return str(tmp_path / name)


def _digest(path):
    path = os.path.join(os.path.dirname(path), "") if path.endswith("/weights") else path
    files = [path] if os.path.isfile(path) else sorted(
        os.path.join(folder, name) for folder, _, names in os.walk(path) for name in names)
    return hashlib.sha256(b"".join(open(f, "rb").read() for f in files)).hexdigest()


@pytest.mark.parametrize("name", ["weights.h5", "weights.weights.h5", "checkpoint/weights",
                                  "model.h5", "model.keras", "savedmodel"])
def test_a_file_saved_before_the_draw_mark_loads_and_trains_on(tmp_path, name):
    """The values, the ledger and the outputs come back; the mark reads the step count (such
    a model drew step t's batch from draw t), and training continues past it. The file is
    only read."""
    data = np.load(os.path.join(OLD, "data.npz"))
    path = _copy(tmp_path, name)
    before = _digest(path)
    if name.startswith("model") or name == "savedmodel":
        model = lipdp.load_model(path)
    else:
        model = _model()
        model.load_weights(path)
    assert _digest(path) == before
    # To float32 rounding: the saved outputs were computed on another CPU, whose kernels
    # round differently (2.4e-7 apart on an Intel Xeon for files written on an AMD EPYC);
    # weights that did not load give outputs apart by O(1).
    np.testing.assert_allclose(model(data["x"]).numpy(), data["outputs"], rtol=1e-5, atol=1e-6)
    assert model.dp_steps_taken == STEPS and model.poisson_draws_until == STEPS
    assert int(model._draws_until.numpy()) == 0
    assert model.privacy_ledger.steps == STEPS
    model.fit(data["x"], data["y"], batch_size=8, epochs=1, verbose=0)
    assert model.dp_steps_taken == 2 * STEPS and model.poisson_draws_until >= 2 * STEPS


def test_an_hdf5_file_lacking_another_weight_is_still_refused(tmp_path):
    """Only the mark is supplied: a file that also lacks another of the model's own weights
    fails as Keras reports it, and a by-name load as well."""
    import h5py

    for name, group in (("weights.h5", "top_level_model_weights"),
                        ("model.h5", "model_weights/top_level_model_weights")):
        path = _copy(tmp_path, name)
        with h5py.File(path, "r+") as f:
            weights = f[group]
            del weights["examples_seen:0"]
            weights.attrs["weight_names"] = np.asarray(
                [n.encode() for n in weights.attrs["weight_names"] if n != "examples_seen:0"])
        loads = ([lambda: lipdp.load_model(path)] if name == "model.h5" else
                 [lambda: _model().load_weights(path),
                  lambda: _model().load_weights(path, by_name=True)])
        for load in loads:
            with pytest.raises(ValueError, match="Weight count mismatch for top-level weights"):
                load()


def test_a_saved_model_loaded_with_options_of_the_callers_own_is_not_retried(tmp_path):
    """The retry that leaves the mark unrestored replaces the load options; a caller's own
    options are not replaced: TensorFlow's error stands."""
    options = tf.saved_model.LoadOptions(experimental_io_device="/job:localhost")
    with pytest.raises(AssertionError, match="poisson_draws_until"):
        lipdp.load_model(_copy(tmp_path, "savedmodel"), options=options)
