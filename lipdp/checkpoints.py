"""Checkpoints that carry the privacy ledger, and resuming without restarting the count.

A DP model's privacy ledger (`lipdp.ledger`: the step counter and one row per
segment of training) is made of variables of the model, so every format that
saves the model's variables saves it: ``tf.train.Checkpoint(model=model)``,
``model.save_weights`` (TensorFlow checkpoints and HDF5 alike), Keras'
``ModelCheckpoint`` and ``BackupAndRestore``, and ``model.save`` (``.keras``).
Restoring any of them continues the epsilon count: `lipdp.DP_Accountant` composes
the restored ledger with the steps that follow, and an ``epsilon_budget`` holds
across restarts (it plans from the restored ledger).

Writes are atomic: TensorFlow writes a checkpoint's files under temporary names,
renames them, and only then points its ``checkpoint`` index at them, so a process
killed mid-write leaves the previous checkpoint in force, never a half-written one.

What a resumed run discards: the steps taken after the last checkpoint by the
process that died. Their noisy updates never reach the resumed model, so the
ledger (and epsilon) count the steps that make up the model, as if the run had
never passed its last checkpoint. TensorFlow's random ops draw lipdp's noise; a
process that seeds them (``tf.keras.utils.set_random_seed``) and is restarted draws
the noise of its first steps again: do not seed the noise of runs you resume.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time

import tensorflow as tf

from lipdp.ledger import LedgerMismatchError
from lipdp.legacy_files import hdf5_with_draw_mark, load_saved_model
from lipdp.reports import atomic_write

__all__ = ["BackupAndRestore", "BackupMismatchError", "FinishedTraining", "LedgerMismatchError",
           "check_resume", "finished_training", "load_model", "save_model_atomically"]

logger = logging.getLogger("lipdp")


def check_resume(model) -> None:
    """A compiled DP model restored from a checkpoint may resume training: its ledger is
    empty, or its last segment ran the mechanism the model is now compiled with.

    Raises:
        LedgerMismatchError: the restored ledger's last mechanism differs (noise
            multiplier, strategy, batch size, training-set size, sampling, number of
            noised variables, delta), naming each difference.
        RuntimeError: the model is not compiled.
    """
    if model.step_mechanism is None:
        raise RuntimeError("Compile the model before resuming: the ledger is checked against "
                           "the compiled mechanism.")
    model.privacy_ledger.check_resumes(model.step_mechanism)


class BackupMismatchError(ValueError):
    """A backup holds variables of other shapes than the model it is restored into."""


class BackupAndRestore(tf.keras.callbacks.BackupAndRestore):
    """Keras' `BackupAndRestore` for DP models: after restoring a backup (model,
    optimizer, privacy ledger, epoch), refuses to resume if the ledger ran another
    mechanism than the model is compiled with (`check_resume`), and names the backup when
    its variables do not fit the model (`BackupMismatchError`: Keras' own error came
    through `fit` with the variable's name only; `lipdp train --resume` of a run folder
    whose config's widths were edited, an audit, 2026-12-07).

    Arguments as for `tf.keras.callbacks.BackupAndRestore`; with the default
    ``save_freq="epoch"``, a run killed mid-epoch resumes at the start of that epoch.
    """

    def on_train_begin(self, logs=None):
        try:
            super().on_train_begin(logs)
        except ValueError as e:  # Keras' restore of a variable of another shape
            raise BackupMismatchError(
                f"The backup in {self.backup_dir} is not of this model: {e}") from None
        check_resume(self.model)


class FinishedTraining(tf.keras.callbacks.Callback):
    """Keeps the trained weights (privacy ledger included) and the epochs' logs in `folder`
    when `fit` ends -- before a `BackupAndRestore` placed after it in the callback list
    deletes its backup. A process killed after its training, while it evaluates, certifies,
    saves or reports, then leaves the finished training behind, and a resume completes the
    run from it (`finished_training`) instead of training a second model on the same
    records: two runs' privacy, one run's epsilon reported (found by an audit).

    Args:
        folder: where the weights (TensorFlow checkpoint format, written atomically) and
            ``history.json`` (the History's logs and 0-based epoch indices, and
            `train_seconds`, the wall time from the first epoch to the end) go.
    """

    HISTORY = "history.json"

    def __init__(self, folder: str):
        super().__init__()
        self.folder = folder
        self.epoch, self.history, self._start = [], {}, None

    def on_train_begin(self, logs=None):
        self.epoch, self.history, self._start = [], {}, time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        self.epoch.append(int(epoch))
        for key, value in (logs or {}).items():
            self.history.setdefault(key, []).append(float(value))

    def on_train_end(self, logs=None):
        os.makedirs(self.folder, exist_ok=True)
        record = {"epoch": self.epoch, "history": self.history,
                  "train_seconds": time.perf_counter() - self._start}
        atomic_write(os.path.join(self.folder, self.HISTORY),
                     lambda f: f.write(json.dumps(record).encode()))
        # Last: its checkpoint index, written after the weights' files, marks a whole record.
        self.model.save_weights(os.path.join(self.folder, "weights"))


def finished_training(folder: str, model):
    """The training a `FinishedTraining` callback kept in `folder`: its weights (and privacy
    ledger) loaded into `model` (built and compiled from the same config), and its History
    (``epoch``, ``history``, and ``train_seconds``); None when `folder` holds no whole record.

    Raises:
        LedgerMismatchError: the kept ledger ran another mechanism than `model` is compiled
            with (`check_resume`): a run folder whose config was edited after its training
            had finished was resumed without a step, and its report gave the edited noise
            multiplier beside the epsilon of the one that ran (an audit, 2026-12-07).
    """
    checkpoint = tf.train.latest_checkpoint(folder) if os.path.isdir(folder) else None
    if checkpoint is None:
        return None
    with open(os.path.join(folder, FinishedTraining.HISTORY)) as f:
        record = json.load(f)
    model.load_weights(checkpoint).expect_partial()
    check_resume(model)
    history = tf.keras.callbacks.History()
    history.epoch, history.history = record["epoch"], record["history"]
    history.train_seconds = float(record["train_seconds"])
    return history


def load_model(path, custom_objects=None, compile=True, **kwargs):
    """`tf.keras.models.load_model`, reporting the privacy spent by a DP model.

    Logs (logger ``"lipdp"``, level INFO) the number of private steps recorded in
    the model's ledger, each segment's mechanism and the composed epsilon at the
    model's delta.

    Legacy HDF5 files (``model.save("m.h5")``) name lipdp's classes without the package
    prefix they are registered under (``"DP_Sequential"``, not ``"lipdp>DP_Sequential"``):
    lipdp's and deel-lip's registered classes are passed by their bare names too, after
    `custom_objects`' own. Files a DP model saved before it kept ``poisson_draws_until``
    (legacy HDF5 and SavedModel; `lipdp.legacy_files`) load with that mark at 0.

    Returns:
        The model; for a DP model, ``lipdp.accounting.epsilon_spent(model)`` is the
        epsilon it was trained with.
    """
    with hdf5_with_draw_mark(path) as readable:
        model = load_saved_model(tf.keras.models.load_model, readable,
                                 custom_objects=_with_bare_names(custom_objects),
                                 compile=compile, **kwargs)
    if hasattr(model, "privacy_ledger"):
        delta = float(model.dp_parameters.delta)
        ledger = model.privacy_ledger
        logger.info("lipdp: %s was trained with %d private steps:\n%s", path, ledger.steps,
                    ledger.describe(delta))
    return model


def _with_bare_names(custom_objects):
    """`custom_objects` (or {}) with every class that lipdp and deel-lip register with Keras
    also under its bare name (entries of `custom_objects` win)."""
    bare = {name.split(">", 1)[1]: obj
            for name, obj in tf.keras.saving.get_custom_objects().items()
            if name.split(">", 1)[0] in ("lipdp", "deel-lip") and ">" in name}
    return {**bare, **(custom_objects or {})}


def save_model_atomically(model, path: str) -> str:
    """``model.save(path)`` whole or not at all: the model is saved under a temporary name
    in the same folder, then renamed over `path` (``os.replace``, atomic), so a process
    killed while saving leaves the previous model (or none), never half of one. (A
    SavedModel directory replacing an existing one is swapped in two renames.)"""
    folder, name = os.path.split(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    stem, extension = os.path.splitext(name)
    temporary = tempfile.mkdtemp(prefix=f".{stem}.", suffix=".tmp", dir=folder)
    saved = os.path.join(temporary, name)
    try:
        model.save(saved)
        if os.path.isdir(saved) and os.path.isdir(path):  # SavedModel over a SavedModel
            os.replace(path, os.path.join(temporary, "previous"))
        os.replace(saved, path)
    finally:
        shutil.rmtree(temporary, ignore_errors=True)
    return path
