"""Loading files a DP model saved before it kept ``poisson_draws_until`` (2026-12-06).

A DP model's last weight, ``poisson_draws_until`` (`DP_Model.poisson_draws_until`), is newer
than lipdp's first saved files. `DP_Model.set_weights` and `DP_Model.load_own_variables`
(``.keras`` and ``.weights.h5`` files) take a list or file without it, and TensorFlow
checkpoints leave a variable they lack as it is. Two of Keras' legacy formats refuse such a
file instead:

* HDF5 (``model.save_weights("w.h5")``, ``model.save("m.h5")``): "Weight count mismatch for
  top-level weights". `hdf5_with_draw_mark` gives Keras a temporary copy of the file with the
  mark added at 0.
* SavedModel directories (``model.save("dir")``): "Found 1 Python objects that were not
  bound to checkpointed values". `load_saved_model` loads such a directory again, allowing
  that one variable, and only it, to stay unrestored.

A mark of 0 is what such a model had: it drew step t's batch from draw t, and
``poisson_draws_until`` then reads its step count, which the file holds. Nothing else of the
file is changed or skipped: any other mismatch still fails as Keras reports it.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile

import numpy as np
import tensorflow as tf

__all__ = ["hdf5_with_draw_mark", "load_saved_model"]

MARK = "poisson_draws_until"
# A variable every DP model saves beside the mark: what tells a DP model's file apart.
_LEDGER = "dp_ledger"


def _as_bytes(name) -> bytes:
    return bytes(name) if isinstance(name, bytes) else str(name).encode("utf8")


def _leaf(name) -> str:
    return _as_bytes(name).decode("utf8").rsplit("/", 1)[-1]


def _top_level_group_lacking_the_mark(f):
    """The HDF5 group of a DP model's own weights in `f` if it lacks the mark, else None."""
    root = f["model_weights"] if "layer_names" not in f.attrs and "model_weights" in f else f
    group = root.get("top_level_model_weights")
    if group is None or "weight_names" not in group.attrs:
        return None
    names = [_leaf(name) for name in group.attrs["weight_names"]]
    if any(name.startswith(_LEDGER) for name in names) and \
            not any(name.startswith(MARK) for name in names):
        return group.name
    return None


def _is_legacy_hdf5(path) -> bool:
    if not isinstance(path, (str, os.PathLike)):
        return False
    path = os.fspath(path)
    if path.endswith((".keras", ".weights.h5")) or not os.path.isfile(path):
        return False
    import h5py

    return h5py.is_hdf5(path)


@contextlib.contextmanager
def hdf5_with_draw_mark(path):
    """Yields `path`, or, for a legacy HDF5 file of a DP model saved without
    ``poisson_draws_until``, a temporary copy of it with that weight added last among the
    model's own weights, at 0 (where Keras' loader expects it). The copy is deleted on exit;
    the file at `path` is only read."""
    if not _is_legacy_hdf5(path):
        yield path
        return
    import h5py

    with h5py.File(path, "r") as f:
        group = _top_level_group_lacking_the_mark(f)
    if group is None:
        yield path
        return
    with tempfile.TemporaryDirectory(prefix="lipdp-legacy-") as folder:
        copy = os.path.join(folder, os.path.basename(os.fspath(path)))
        shutil.copyfile(path, copy)
        with h5py.File(copy, "r+") as f:
            weights = f[group]
            name = f"{MARK}:0"
            weights.create_dataset(name, data=np.zeros((), np.int64))
            names = [_as_bytes(saved) for saved in weights.attrs["weight_names"]]
            weights.attrs["weight_names"] = np.asarray(names + [name.encode("utf8")])
        yield copy


# TensorFlow 2.15's message when a SavedModel's checkpoint lacks exactly one variable of the
# objects Keras rebuilt (`tensorflow/python/checkpoint/checkpoint.py`).
_ONLY_THE_MARK_UNBOUND = re.compile(
    r"^Found 1 Python objects that were not bound to checkpointed values.*"
    r"Showing 1 of 1 unmatched objects: \[<tf\.Variable '" + MARK + r":0' ", re.DOTALL)


def load_saved_model(load, path, **kwargs):
    """``load(path, **kwargs)`` (``tf.keras.models.load_model``); a SavedModel directory
    whose checkpoint lacks ``poisson_draws_until`` and nothing else is loaded again with
    ``tf.saved_model.LoadOptions(allow_partial_checkpoint=True)``, the mark left at 0. The
    first attempt's error says what was missing: any other unmatched object, an error worded
    otherwise (another TensorFlow version), or `options` of the caller's own, and the error
    is raised as it was."""
    try:
        return load(path, **kwargs)
    except AssertionError as error:
        if not _ONLY_THE_MARK_UNBOUND.search(str(error)) or kwargs.get("options") is not None:
            raise
    options = tf.saved_model.LoadOptions(allow_partial_checkpoint=True)
    return load(path, **kwargs, options=options)
