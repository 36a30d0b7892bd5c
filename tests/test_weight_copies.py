"""Weights copied layer by layer bring the ledger of the run that trained them
(`lipdp.weight_copies`).

A model's ledger lives in its own variables, so ``target.set_weights(source.get_weights())``
layer by layer, or ``variable.assign``, moved trained values into a model whose ledger
counted only its own steps: a new model given every layer of a run of 8 steps reported 0,
then 4 after its own 4 (README, pitfalls). Reference: dp_accounting (`tests/test_ledger`).
"""

import math

import numpy as np
import pytest
import tensorflow as tf

import lipdp
from lipdp import accounting, weight_copies
from lipdp.layers import DP_QuickSpectralDense
from tests.test_ledger import (N, K, _assert_agrees, _compile, _data, _mixed_weights, _model,
                               _on_layers, _reference)

S, Q = 1.0 / math.sqrt(6), 16 / N  # `_model()`: per-layer noise over 6 variables, batch 16


def _copy_layers(source, target):
    for from_layer, to_layer in zip(source.layers, target.layers):
        to_layer.set_weights(from_layer.get_weights())


def test_layers_copied_one_by_one_bring_the_steps_that_trained_them():
    x, y = _data(20)
    a = _model()
    a.fit(x, y, epochs=2, verbose=0)
    b = _model()
    with pytest.warns(UserWarning, match="copied"):  # at the copy: b is compiled
        _copy_layers(a, b)
    assert b.dp_steps_taken == 8
    _assert_agrees(accounting.epsilon_spent(b), _reference([(S, Q, 8)]))
    b.fit(x, y, epochs=1, verbose=0)
    assert b.dp_steps_taken == 12
    _assert_agrees(accounting.epsilon_spent(b), _reference([(S, Q, 12)]))


def test_a_kernel_assigned_into_a_frozen_layer_brings_its_steps():
    """Transfer learning by hand: one trained kernel assigned into a new model's first layer,
    frozen there, a new head trained on it. The check runs at `compile`, before any step
    changes the model's other values."""
    x, y = _data(21)
    a = _model()
    a.fit(x, y, epochs=2, verbose=0)
    b = _model()
    b.layers[1].kernel.assign(a.layers[1].kernel)
    b.layers[1].trainable = False
    with pytest.warns(UserWarning, match="copied"):
        _compile(b)
    b.fit(x, y, epochs=1, verbose=0)
    assert b.dp_steps_taken == 12
    _assert_agrees(accounting.epsilon_spent(b), _reference([(S, Q, 8), (0.5, Q, 4)]))


def test_values_of_a_train_on_batch_loop_are_found_and_do_not_pile_up():
    x, y = _data(22)
    a = _model()
    for start in range(0, 48, 16):
        a.train_on_batch(x[start:start + 16], y[start:start + 16])
    entries = len(weight_copies._TRAINED_BY)
    a.train_on_batch(x[:16], y[:16])
    assert len(weight_copies._TRAINED_BY) == entries  # the previous call's values replaced
    b = _model()
    with pytest.warns(UserWarning, match="copied"):
        _copy_layers(a, b)
    assert b.privacy_ledger.steps == 4


def test_a_copy_made_between_epochs_counts_after_the_source_trained_on():
    x, y = _data(23)
    a, b = _model(), _model()

    class CopyAfterFirstEpoch(tf.keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            if epoch == 0:
                _copy_layers(a, b)

    with pytest.warns(UserWarning, match="copied"):
        a.fit(x, y, epochs=3, verbose=0, callbacks=[CopyAfterFirstEpoch()])
    assert b.dp_steps_taken == 4


def test_whole_weights_and_files_of_a_run_count_it_once(tmp_path):
    """A model given a run's whole weights holds its ledger already: its values, found among
    the run's, add nothing (neither when set whole, nor loaded from a file, nor when its
    ledger composed the run after weights of its own, nor copied again layer by layer)."""
    x, y = _data(24)
    a = _model()
    a.fit(x, y, epochs=2, verbose=0)
    a.save_weights(str(tmp_path / "a.h5"))
    whole = _model()
    whole.set_weights(a.get_weights())
    fresh = _model()
    fresh.load_weights(str(tmp_path / "a.h5"))
    assert whole.dp_steps_taken == fresh.dp_steps_taken == 8
    fresh.fit(x, y, epochs=1, verbose=0)
    _copy_layers(a, fresh)
    assert fresh.dp_steps_taken == 12

    mixed = _model()
    mixed.fit(x, y, epochs=1, verbose=0)
    with pytest.warns(UserWarning, match="did not replace"):
        mixed.set_weights(_mixed_weights(mixed, a, own=mixed.layers[-1].weights))
    assert mixed.dp_steps_taken == 12
    _copy_layers(a, mixed)
    assert mixed.dp_steps_taken == 12


def test_values_no_private_step_produced_bring_no_ledger():
    """Equal values that no private step of another model produced: the initial values of
    a model trained since, and a frozen public base shared by two models of a sweep."""
    x, y = _data(25)
    a = _model()
    initial = a.get_weights()
    a.fit(x, y, epochs=1, verbose=0)
    b = _model()
    b.set_weights(initial)
    assert b.dp_steps_taken == 0

    base = [layer.get_weights() for layer in _model().layers[:-1]]
    counts = []
    for seed in (26, 27):
        model = _model()
        for layer, weights in zip(model.layers, base):
            layer.set_weights(weights)
            layer.trainable = False
        _compile(model)
        model.fit(*_data(seed), epochs=1, verbose=0)
        counts.append(model.dp_steps_taken)
    assert counts == [4, 4]


def test_a_copy_of_layers_a_model_shares_counts_each_run_once():
    """A copy of a layer that two models trained (shared layers) composes the ledger of the
    one that trained it last, which includes the other's."""
    x, y = _data(28)
    a = _model()
    a.fit(x, y, epochs=1, verbose=0)
    shared = _on_layers(a.layers[:-1] + [DP_QuickSpectralDense(K)])
    shared.fit(x, y, epochs=1, verbose=0)
    b = _model()
    with pytest.warns(UserWarning, match="copied"):
        _copy_layers(shared, b)
    assert b.dp_steps_taken == 8
    assert np.isfinite(accounting.epsilon_spent(b))
    _assert_agrees(accounting.epsilon_spent(b), _reference([(S, Q, 8)]))



def test_a_ledger_includes_another_s_rows_as_one_shifted_block_of_as_many_steps():
    """`lipdp.ledger.includes`, which decides that a copied value's run is counted already:
    the run named and its segments found in order, every first step shifted by one number,
    and followed by at least as many steps; a block that names no run only at the start."""
    from lipdp.ledger import concatenated, includes, run_row

    def segment(start, sigma=1.0):
        row = np.zeros(len(run_row(1)))
        row[0], row[1] = start, sigma
        return row

    run = (8, np.stack([run_row(7), segment(0), segment(5, 2.0)]))
    other = (4, np.stack([run_row(9), segment(0)]))
    assert includes(run, run) and includes(concatenated(other, run), run)
    assert includes(concatenated(concatenated(other, run), other), run)
    assert not includes(concatenated(other, run), (9, run[1]))  # one step short
    assert includes(concatenated(run, other), run)
    renamed = (8, np.stack([run_row(8), segment(0), segment(5, 2.0)]))
    assert not includes(concatenated(other, renamed), run)
    shifted_apart = (8, np.stack([run_row(7), segment(0), segment(6, 2.0)]))
    assert not includes(concatenated(other, shifted_apart), run)
    unnamed = (8, run[1][1:])
    assert includes(unnamed, unnamed)
    assert not includes(concatenated(other, unnamed), unnamed)


class _CopyInto(tf.keras.callbacks.Callback):
    """Copies `source`'s layers into `target` at the hook named `when` (its first call
    only, or at every epoch with ``every_epoch``), then runs `then(target)`."""

    def __init__(self, source, target, when, then=None, every_epoch=False):
        super().__init__()
        self.source, self.target, self.when = source, target, when
        self.then, self.every_epoch, self.done = then, every_epoch, False

    def _copy(self, hook):
        if hook == self.when and (self.every_epoch or not self.done):
            self.done = True
            _copy_layers(self.source, self.target)
            if self.then is not None:
                self.then(self.target)

    def on_train_batch_end(self, batch, logs=None):
        self._copy("batch")
        if batch == 3:  # the last of `_model()`'s epochs
            self._copy("last batch")

    def on_epoch_end(self, epoch, logs=None):
        self._copy("epoch")

    def on_train_end(self, logs=None):
        self._copy("end")


@pytest.mark.parametrize("when", ["batch", "last batch", "epoch", "end"])
def test_a_callback_of_the_model_s_own_fit_copying_another_run_in_counts_it(when):
    """An audit of the first version (2026-12-06): a callback of B's fit copying A's layers
    into B at an epoch's end had them remembered as B's own values, never looked up: 4
    steps reported for 12 (at a step's end, the copy was trained on before any lookup; at
    the epoch's last step, the epoch's end remembered it as B's own)."""
    x, y = _data(30)
    a = _model()
    a.fit(x, y, epochs=2, verbose=0)
    b = _model()
    with pytest.warns(UserWarning, match="copied"):
        b.fit(x, y, epochs=1, verbose=0, callbacks=[_CopyInto(a, b, when)])
    assert b.dp_steps_taken >= 12


def test_the_budget_holds_when_a_callback_copies_another_run_in_during_fit():
    """The audit: a copy of 8 steps after the first epoch of a fit under a budget of 12
    steps trained on to 20 (epsilon 75.4 reported as 49.3)."""
    x, y = _data(31)
    a = _model()
    a.fit(x, y, epochs=2, verbose=0)
    b = _model()
    budget = _reference([(S, Q, 12)]) * 1.001
    with pytest.warns(UserWarning, match="copied"), \
            pytest.raises(ValueError, match="Cannot train within epsilon_budget"):
        b.fit(x, y, epochs=3, verbose=0,
              callbacks=[_CopyInto(a, b, "epoch"), lipdp.DP_Accountant(epsilon_budget=budget)])
    assert b.dp_steps_taken == 12 and accounting.epsilon_spent(b) <= budget


@pytest.mark.parametrize("how", ["train_on_batch", "mid-epoch"])
def test_a_copy_through_a_layer_s_get_weights_counts_after_the_source_trains_on(how):
    """The audit: an evaluation copy of a model trained by train_on_batch, taken after its
    third call, reported 0 steps once the model trained on (values between calls were kept
    until the next call only); a copy in a callback at a step's end of the source's fit, 0
    for 2. A DP layer's `get_weights` keeps its model's values for the process."""
    x, y = _data(32)
    a, b = _model(), _model()
    with pytest.warns(UserWarning, match="copied"):
        if how == "train_on_batch":
            for start in range(0, 48, 16):
                a.train_on_batch(x[start:start + 16], y[start:start + 16])
            _copy_layers(a, b)
            a.train_on_batch(x[:16], y[:16])
            expected = 3
        else:
            a.fit(x, y, epochs=1, verbose=0, callbacks=[_CopyInto(a, b, "batch")])
            expected = 1
    assert b.dp_steps_taken == expected


def test_a_copy_saved_inside_the_source_s_epoch_end_callback_writes_its_steps(tmp_path):
    """The audit: a callback of A's fit refreshing an evaluation model D from A at each
    epoch's end and saving D there wrote `dp_steps_taken` 0 (A's values were remembered
    after the user's callbacks)."""
    x, y = _data(33)
    a, d = _model(), _model()
    read = []
    a.fit(x, y, epochs=2, verbose=0, callbacks=[_CopyInto(
        a, d, "epoch", every_epoch=True,
        then=lambda m: (read.append(m.dp_steps_taken), m.save_weights(str(tmp_path / "d.h5"))))])
    assert read == [4, 8]
    saved = _model()
    saved.load_weights(str(tmp_path / "d.h5"))
    assert saved.dp_steps_taken == 8


def test_a_model_synchronised_with_a_run_after_each_epoch_counts_the_run_once(tmp_path):
    """The audit: a model given a training run's layers after each epoch counted 4, 12,
    then 24 steps for 12; a best checkpoint of a run that EarlyStopping rolled back, loaded
    into a new model, 24 for 16; a checkpoint of 8 steps loaded, then the run's last layers
    (16 steps) copied, 24 for 16."""
    x, y = _data(34)
    a, d = _model(), _model()
    read = []
    a.fit(x, y, epochs=3, verbose=0, callbacks=[_CopyInto(
        a, d, "epoch", every_epoch=True, then=lambda m: read.append(m.dp_steps_taken))])
    assert read == [4, 8, 12]

    g = _model()
    g.fit(x, y, epochs=2, verbose=0)
    g.save_weights(str(tmp_path / "g8.h5"))
    g.fit(x, y, epochs=2, verbose=0)
    h = _model()
    h.load_weights(str(tmp_path / "g8.h5"))
    _copy_layers(g, h)
    assert h.dp_steps_taken == 16

    e = _model()
    best = tf.keras.callbacks.ModelCheckpoint(str(tmp_path / "best.h5"), monitor="val_loss",
                                              save_best_only=True, save_weights_only=True)
    stop = tf.keras.callbacks.EarlyStopping(monitor="val_loss", patience=100,
                                            restore_best_weights=True)
    e.fit(x, y, epochs=4, verbose=0, callbacks=[best, stop], validation_data=_data(35))
    fresh = _model()
    fresh.load_weights(str(tmp_path / "best.h5"))
    assert fresh.dp_steps_taken <= 16


@pytest.mark.parametrize("how", ["layers, tf.train.Checkpoint", "variables, save_model"])
def test_a_file_written_right_after_a_copy_holds_its_steps(how, tmp_path):
    """A second audit (2026-12-06): layers copied into a model written at once by a path that
    does not read the ledger (``tf.train.Checkpoint(model=...).write``,
    ``tf.keras.models.save_model``) wrote 0 steps for 8. Read back with the process' values
    forgotten, as another process reads it."""
    x, y = _data(36)
    a, d = _model(), _model()
    a.fit(x, y, epochs=2, verbose=0)
    with pytest.warns(UserWarning, match="copied"):
        if how.startswith("layers"):
            _copy_layers(a, d)
            path = tf.train.Checkpoint(model=d).write(str(tmp_path / "d"))
        else:
            for target, source in zip(d.trainable_variables, a.trainable_variables):
                target.assign(source)
            tf.keras.models.save_model(d, str(tmp_path / "d.keras"))
    weight_copies.clear()
    if how.startswith("layers"):
        fresh = _model()
        tf.train.Checkpoint(model=fresh).read(path).expect_partial()
    else:
        fresh = lipdp.load_model(str(tmp_path / "d.keras"))
    assert fresh.dp_steps_taken == 8


class _AssignAtSecondStep(tf.keras.callbacks.Callback):
    """Assigns `source`'s variables into `target`'s, one by one (no DP layer's get_weights or
    set_weights runs), at the end of the fit's second step; `then(target)` runs next."""

    def __init__(self, source, target, then=None):
        super().__init__()
        self.source, self.target, self.then = source, target, then

    def on_train_batch_end(self, batch, logs=None):
        if batch == 1:
            for to_variable, from_variable in zip(self.target.trainable_variables,
                                                  self.source.trainable_variables):
                to_variable.assign(from_variable)
            if self.then is not None:
                self.then(self.target)


@pytest.mark.parametrize("direction", ["out of the fitting model", "into it"])
def test_variables_assigned_by_a_callback_between_two_steps_bring_their_steps(direction):
    """A callback assigning variables between two steps of a fit: out of the fitting model,
    into a model whose ledger is read at once, those values are found only if remembered
    after each step; into the fitting model, only if looked up before the next step trains
    them on."""
    x, y = _data(33)
    a, b = _model(), _model()
    counted = []
    with pytest.warns(UserWarning, match="copied"):
        if direction == "into it":
            a.fit(x, y, epochs=2, verbose=0)
            b.fit(x, y, epochs=1, verbose=0, callbacks=[_AssignAtSecondStep(a, b)])
            counted.append(b.dp_steps_taken)
            expected = 12
        else:
            a.fit(x, y, epochs=1, verbose=0, callbacks=[
                _AssignAtSecondStep(a, b, then=lambda m: counted.append(m.dp_steps_taken))])
            expected = 2
    assert counted == [expected]


@pytest.mark.filterwarnings("ignore::lipdp.noise.SeededNoiseWarning")
@pytest.mark.parametrize("callbacks", [[], [lipdp.DP_Accountant],
                                       [tf.keras.callbacks.LambdaCallback]])
def test_a_seeded_program_trains_two_models_to_the_same_values_each_with_its_own_steps(
        callbacks):
    """Two models of one seeded program reach the same values; neither copied the other. A
    version that did not remember a fit's values at each step unless a callback could copy
    them had every lookup inside such a fit (the accountant reads the ledger after each
    step; an epoch's end) take the second model's values for copies of the first's (4 + 4
    steps reported for 4). Each run starts with no noise draw salted, as in a process of
    its own (one process draws other noise for each trace: `lipdp.noise.salted_seeds`)."""
    x, y = _data(34)
    models = []
    for _ in range(2):
        tf.keras.utils.set_random_seed(35)
        lipdp.noise._forget_salted_draws()
        model = _model()
        model.fit(x, y, epochs=1, verbose=0, callbacks=[c() for c in callbacks])
        models.append(model)
    first, second = models
    for a, b in zip(first.trainable_variables, second.trainable_variables):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    assert first.dp_steps_taken == second.dp_steps_taken == 4


def test_a_learning_rate_schedule_copying_another_run_in_counts_it():
    """Audits (2026-12-06) of a version that skipped the per-step bookkeeping beside Keras'
    callbacks: `LearningRateScheduler` runs the user's schedule at each epoch's start, and
    one copying another run's layers in had them trained on unseen (4 steps reported for
    12, and a model copied from it 4)."""
    x, y = _data(36)
    a = _model()
    a.fit(x, y, epochs=2, verbose=0)
    b = _model()

    def schedule(epoch, rate):
        if epoch == 0:
            _copy_layers(a, b)
        return rate

    with pytest.warns(UserWarning, match="copied"):
        b.fit(x, y, epochs=1, verbose=0,
              callbacks=[tf.keras.callbacks.LearningRateScheduler(schedule)])
    assert b.dp_steps_taken == 12


def test_a_validation_pipeline_copying_another_run_in_counts_it():
    """The second audit of that version: user code runs inside a `fit` with no callback at
    all, in a training or validation pipeline (``tf.py_function``) or a compiled metric.
    Here the validation pipeline copies another run's layers in after the epoch's steps:
    4 steps reported for values that run's 8 trained."""
    x, y = _data(37)
    a = _model()
    a.fit(x, y, epochs=2, verbose=0)
    b = _model()

    def copy_once(features):
        if int(b.optimizer.iterations.numpy()) >= 4 and not copied:
            copied.append(True)
            _copy_layers(a, b)
        return features

    copied = []
    validation = tf.data.Dataset.from_tensor_slices(_data(38)).batch(16).map(
        lambda u, v: (tf.ensure_shape(tf.py_function(copy_once, [u], tf.float32), u.shape), v))
    with pytest.warns(UserWarning, match="copied"):
        b.fit(x, y, epochs=1, verbose=0, validation_data=validation)
    assert copied and b.dp_steps_taken == 12


@pytest.mark.parametrize("how", ["assign", "checkpoint", "load_weights", "tf.keras"])
def test_values_copied_from_a_model_loaded_from_a_file_bring_its_steps(how, tmp_path):
    """A model of 8 steps saved, then (as in another process: the registry cleared) loaded
    from its file, and its variables read directly into a fresh model (``assign``, a
    `tf.train.Checkpoint` of its layers): the fresh model reported its own 4 steps for
    weights of 12 (an audit, 2026-12-07): the loaded model remembered its values only when
    it handed them out. A loaded model's values are now remembered before another model
    looks its own up."""
    x, y = _data(31)
    a = _model()
    a.fit(x, y, epochs=2, verbose=0)
    path = str(tmp_path / {"load_weights": "a.h5"}.get(how, "a.keras"))
    if how == "load_weights":
        a.save_weights(path)
    else:
        a.save(path)
    del a
    weight_copies.clear()  # the registry of a new process
    if how == "load_weights":
        loaded = _model()
        loaded.load_weights(path)
    elif how == "tf.keras":
        loaded = tf.keras.models.load_model(path)
    else:
        loaded = lipdp.load_model(path)
    assert loaded.dp_steps_taken == 8
    fresh = _model()
    if how == "checkpoint":
        tf.train.Checkpoint(layers=loaded.layers).write(str(tmp_path / "layers"))
        tf.train.Checkpoint(layers=fresh.layers).read(str(tmp_path / "layers"))
    else:
        for to, source in zip(fresh.trainable_variables, loaded.trainable_variables):
            to.assign(source)
    with pytest.warns(UserWarning, match="copied"):
        fresh.fit(x, y, epochs=1, verbose=0)
    assert fresh.dp_steps_taken == 12
    _assert_agrees(accounting.epsilon_spent(fresh), _reference([(S, Q, 12)]))
