"""Checkpoints carry the privacy ledger; a resumed run continues the epsilon count.

Every check compares with an independent computation of what the ledger must say: the
accountant's epsilon for the number of steps an uninterrupted run takes.
"""

import logging
import os
import warnings

import numpy as np
import pytest
import tensorflow as tf

import lipdp
from lipdp.checkpoints import (BackupAndRestore, LedgerMismatchError, load_model,
                               save_model_atomically)
from lipdp.layers import DP_BoundedInput, DP_GroupSort, DP_QuickSpectralDense

BATCH = 256  # digits: 1438 training examples -> 6 Poisson steps per epoch


@pytest.fixture(autouse=True)
def _draws_of_this_test_only(monkeypatch):
    """Each test starts as a new process would: `lipdp.data.reserved_draws` counts every
    Poisson pipeline the process built, and other tests' pipelines would raise a
    train_on_batch's draw mark past the draws these tests name."""
    monkeypatch.setattr(lipdp.data, "_EVERY_NEXT_STEP", [])


def _data(seed=1):
    return lipdp.data.load_dataset("digits", BATCH, bound_clip_value=8.0, seed=seed)


def _model(metadata, sigma=2.0):
    model = lipdp.DP_Sequential(
        [DP_BoundedInput(8.0, input_shape=(64,)), DP_QuickSpectralDense(16), DP_GroupSort(2),
         DP_QuickSpectralDense(10)],
        dp_parameters=lipdp.DPParameters(sigma, 1e-5), dataset_metadata=metadata)
    model.compile(optimizer=tf.keras.optimizers.Adam(1e-2),
                  loss=lipdp.losses.DP_TauCategoricalCrossentropy(8.0), metrics=["accuracy"])
    return model


def _expected_epsilon(model, steps):
    mechanism = model.step_mechanism
    return lipdp.accounting.compute_epsilon(mechanism.step_noise_multiplier,
                                            mechanism.sampling_rate, steps, 1e-5)


@pytest.fixture(scope="module")
def trained():
    ds, _, metadata = _data()
    model = _model(metadata)
    model.fit(ds, epochs=2, verbose=0)
    return model, metadata


def _same_ledger(restored, model):
    assert restored.dp_steps_taken == model.dp_steps_taken == 12
    stored = model._dp_ledger.numpy()  # the restored model names its own steps after it
    np.testing.assert_array_equal(restored._dp_ledger.numpy()[:len(stored)], stored)
    assert restored.privacy_ledger == model.privacy_ledger
    assert lipdp.accounting.epsilon_spent(restored) == lipdp.accounting.epsilon_spent(model)


@pytest.mark.parametrize("fmt", ["tf.train.Checkpoint", "weights-tf", "weights.h5", ".keras"])
def test_every_format_carries_the_ledger(trained, tmp_path, fmt):
    model, metadata = trained
    if fmt == ".keras":
        path = save_model_atomically(model, str(tmp_path / "model.keras"))
        restored = tf.keras.models.load_model(path)
        assert sorted(os.listdir(tmp_path)) == ["model.keras"]  # no temporary left
    else:
        restored = _model(metadata)
        if fmt == "tf.train.Checkpoint":
            path = tf.train.Checkpoint(model=model).save(str(tmp_path / "ckpt"))
            tf.train.Checkpoint(model=restored).restore(path).expect_partial()
        else:
            path = str(tmp_path / ("weights" if fmt == "weights-tf" else "weights.h5"))
            model.save_weights(path)
            restored.load_weights(path)
    _same_ledger(restored, model)


def test_model_checkpoint_callback_carries_the_ledger(tmp_path):
    ds, _, metadata = _data()
    model = _model(metadata)
    path = str(tmp_path / "epoch{epoch}.weights.h5")
    model.fit(ds, epochs=2, verbose=0, callbacks=[
        tf.keras.callbacks.ModelCheckpoint(path, save_weights_only=True)])
    restored = _model(metadata)
    restored.load_weights(str(tmp_path / "epoch2.weights.h5"))
    _same_ledger(restored, model)


def test_training_a_restored_model_continues_the_count(trained, tmp_path):
    model, metadata = trained
    path = tf.train.Checkpoint(model=model).save(str(tmp_path / "ckpt"))
    ds, _, _ = _data()
    restored = _model(metadata)
    tf.train.Checkpoint(model=restored).restore(path).expect_partial()
    restored.fit(ds, epochs=1, verbose=0)
    assert restored.dp_steps_taken == 18
    assert lipdp.accounting.epsilon_spent(restored) == pytest.approx(
        _expected_epsilon(restored, 18), rel=1e-9)


class _Interrupt(tf.keras.callbacks.Callback):
    """Kills the fit (an exception, as a preempted worker would die) at an epoch's start."""

    def __init__(self, epoch):
        super().__init__()
        self.epoch = epoch

    def on_epoch_begin(self, epoch, logs=None):
        if epoch == self.epoch:
            raise RuntimeError("interrupted")


def _budget_run(backup_dir, interrupt_at=None, budget=3.0, log_fn=None):
    """A fit of 40 epochs that the budget stops mid-epoch (38 steps: 6 per epoch at sigma 2,
    q = 256 / 1438, epsilon 3; 7 at epsilon 1.5); the DP_Accountant is listed
    *before* BackupAndRestore, so it first plans with the ledger of a fresh model."""
    ds, _, metadata = _data()
    model = _model(metadata)
    callbacks = [lipdp.DP_Accountant(epsilon_budget=budget, log_fn=log_fn)]
    if interrupt_at is not None:
        callbacks.append(_Interrupt(interrupt_at))
    if backup_dir is not None:
        callbacks.append(BackupAndRestore(backup_dir))
    model.fit(ds, epochs=40, verbose=0, callbacks=callbacks)
    return model


def test_backup_and_restore_resumes_with_the_same_steps_and_epsilon(tmp_path):
    uninterrupted = _budget_run(None)
    steps = uninterrupted.dp_steps_taken
    assert steps % 6 != 0, "the budget should stop the run mid-epoch"
    with pytest.raises(RuntimeError, match="interrupted"):
        _budget_run(str(tmp_path), interrupt_at=3)
    lines = []
    resumed = _budget_run(str(tmp_path), log_fn=lines.append)  # as a new process would
    assert resumed.dp_steps_taken == steps
    # The plan printed is the restored ledger's, not the fresh model's "0 already taken".
    plans = [line for line in lines if "already taken" in line]
    taken = _expected_epsilon(resumed, 18)
    assert plans == [f"lipdp: epsilon_budget=3 (delta=1e-05) allows {steps} steps; 18 already "
                     f"taken (epsilon={lipdp.accounting.format_epsilon(taken)})."]
    epsilon = lipdp.accounting.epsilon_spent(resumed)
    assert epsilon == lipdp.accounting.epsilon_spent(uninterrupted)
    assert epsilon == pytest.approx(_expected_epsilon(resumed, steps), rel=1e-9)
    assert epsilon <= 3.0 < _expected_epsilon(resumed, steps + 1)


def test_a_spent_budget_stays_spent_after_restore(tmp_path):
    model = _budget_run(str(tmp_path / "first"), budget=1.5)
    path = tf.train.Checkpoint(model=model).save(str(tmp_path / "ckpt"))
    ds, _, metadata = _data()
    restored = _model(metadata)
    tf.train.Checkpoint(model=restored).restore(path).expect_partial()
    with pytest.raises(ValueError, match="already spent"):
        restored.fit(ds, epochs=1, verbose=0,
                     callbacks=[lipdp.DP_Accountant(epsilon_budget=1.5)])
    assert restored.dp_steps_taken == model.dp_steps_taken


def _draw_sizes(ds, metadata, count):
    """The sizes of the batches of Poisson draws 0 to `count` - 1 of `ds`'s seed, computed
    apart from the pipeline (`lipdp.data.BatchSampler`: example i in draw t iff u_i < q)."""
    seed, n, q = ds.lipdp_sampler.seed, metadata.nb_samples_train, metadata.sampling_rate
    return [int(np.sum(tf.random.stateless_uniform(
        [n], seed=tf.constant([seed, t], tf.int64), dtype=tf.float64).numpy() < q))
        for t in range(count)]


class _BatchSizes(tf.keras.callbacks.Callback):
    """``{step: examples}`` of every private step this fit ran (the model's count of
    examples restarts at each epoch), and with a `sampler`, ``{step: draw}``: the draw its
    pipeline's pass gave that step (the pass's first draw, plus the batches of the epoch
    before it: a resumed epoch's iterator is a new pass)."""

    def __init__(self, sampler=None):
        super().__init__()
        self.sizes, self.draws, self._seen, self._sampler = {}, {}, 0, sampler

    def on_epoch_begin(self, epoch, logs=None):
        self._seen, self._batches = 0, 0

    def on_train_batch_end(self, batch, logs=None):
        seen, step = int(self.model._examples_seen.numpy()), self.model.dp_steps_taken - 1
        self.sizes[step], self._seen = seen - self._seen, seen
        if self._sampler is not None:
            self.draws[step] = self._sampler.last_pass_start() + self._batches
        self._batches += 1


class _KillAt(tf.keras.callbacks.Callback):
    """At the model's step `steps`, a KeyboardInterrupt (a killed run), or with `stop` the
    end of the fit (``model.stop_training``)."""

    def __init__(self, steps, stop=False):
        super().__init__()
        self.steps, self.stop = steps, stop

    def on_train_batch_end(self, batch, logs=None):
        if self.model.dp_steps_taken == self.steps:
            if not self.stop:
                raise KeyboardInterrupt
            self.model.stop_training = True


def _assert_each_draw_once(sizes, draws, metadata, seed=1):
    """Every step trained on its own draw (no draw twice), and on that draw's batch (its
    size computed apart from the pipeline)."""
    steps = sorted(draws)
    assert len({draws[t] for t in steps}) == len(steps), draws
    expected = _draw_sizes(_data(seed)[0], metadata, max(draws.values()) + 1)
    assert [sizes[t] for t in steps] == [expected[draws[t]] for t in steps]


@pytest.mark.parametrize("processes", ["one process", "new objects"])
def test_a_poisson_run_resumed_mid_epoch_twice_never_trains_on_a_draw_twice(tmp_path,
                                                                              processes):
    """A seeded Poisson pipeline, a backup every 2 steps, killed at step 5 (its backup at 4,
    inside the first epoch) and, resumed, killed at step 9 (backup at 8); resumed again to
    the end. The resumed first epoch used 2 of its pass's 6 draws: with a draw counter
    advanced as the prefetch read ahead, the steps after it trained on later draws, and
    the second resume drew the used ones again (an audit, 2026-12-06: replayed draws,
    epsilon under-reported). The steps of the final model's history must each have
    trained on a draw of its own, in one process (the pipeline's counter lives on) and as
    in a new process (every pipeline of the seed dropped first: only what the backup
    saved, ``poisson_draws_until``, says which draws were used)."""
    import gc

    ds, _, metadata = _data()
    assert len(set(_draw_sizes(ds, metadata, 24))) > 12
    backup, sizes, draws = str(tmp_path / "backup"), {}, {}
    for kill, keep in ((5, range(0, 4)), (9, range(4, 8)), (None, range(8, 24))):
        if processes == "new objects":
            del ds
            gc.collect()
        ds, _, metadata = _data()
        record = _BatchSizes(ds.lipdp_sampler)
        callbacks = [record, BackupAndRestore(backup, save_freq=2)]
        try:
            _model(metadata).fit(ds, epochs=4, verbose=0,
                                 callbacks=callbacks + ([_KillAt(kill)] if kill else []))
        except KeyboardInterrupt:
            pass
        sizes.update({t: record.sizes[t] for t in keep})
        draws.update({t: record.draws[t] for t in keep})
    assert sorted(draws) == list(range(24))
    assert [draws[t] for t in range(4)] == [0, 1, 2, 3]  # the run's own first draws
    _assert_each_draw_once(sizes, draws, metadata)


def test_a_custom_loop_after_a_fit_of_fewer_steps_than_the_pipeline_draws_fresh_batches():
    """``steps_per_epoch`` below the pipeline's 6: Keras keeps one pass over both epochs, past
    the step fit sets before each; fit must leave the pipeline after that pass's draws.
    It was left at draw 2 (an audit, 2026-12-06), and the loop trained on draws 2 and 3
    again."""
    ds, _, metadata = _data(seed=2)
    draws = _draw_sizes(ds, metadata, 12)
    model, sizes = _model(metadata), _BatchSizes()
    model.fit(ds, epochs=2, steps_per_epoch=2, verbose=0, callbacks=[sizes])
    assert [sizes.sizes[t] for t in range(4)] == draws[:4]
    with pytest.warns(lipdp.data.ShuffleSamplingWarning, match="train_on_batch"):
        looped = [int(y.shape[0]) for x, y in ds if model.train_on_batch(x, y) is not None]
    assert looped == draws[6:] and model.dp_steps_taken == 10  # after the fit's pass, 0..5


def test_a_fit_after_a_loop_over_the_pipeline_draws_no_batch_the_loop_used():
    """A peek at one batch (its pass reserves draws 0..5), a train_on_batch loop (draws 6..11
    for steps 0..5), then fit from the model's step 6: fit set the draws back to 6 and
    trained its 6 steps on the loop's draws again (an audit, 2026-12-06). It must draw on
    after every draw a train_on_batch may have used (`poisson_draws_until`)."""
    ds, _, metadata = _data(seed=3)
    draws = _draw_sizes(ds, metadata, 18)
    next(iter(ds))
    model, sizes = _model(metadata), _BatchSizes()
    with pytest.warns(lipdp.data.ShuffleSamplingWarning, match="train_on_batch"):
        looped = [int(y.shape[0]) for x, y in ds if model.train_on_batch(x, y) is not None]
    assert looped == draws[6:12]
    model.fit(ds, epochs=1, verbose=0, callbacks=[sizes])
    assert [sizes.sizes[t] for t in range(6, 12)] == draws[12:18]


@pytest.mark.parametrize("then", ["pipeline rebuilt", "weights in a new model"])
def test_the_floor_a_loop_leaves_outlives_its_pipeline_and_model_object(then):
    """As above (a peek, then a loop on draws 6..11 for steps 0..5), then the pipeline
    dropped and built again with its seed (a notebook cell run again), or the loop's weights
    given to a new model object: the floor lived with the pipeline's counter and the model
    object, and fit trained 6 of 6 steps on the loop's draws again (a review, 2026-12-06).
    The model's weights keep it (`poisson_draws_until`)."""
    import gc

    ds, _, metadata = _data(seed=5)
    draws = _draw_sizes(ds, metadata, 18)
    next(iter(ds))
    model = _model(metadata)
    with pytest.warns(lipdp.data.ShuffleSamplingWarning, match="train_on_batch"):
        looped = [int(y.shape[0]) for x, y in ds if model.train_on_batch(x, y) is not None]
    assert looped == draws[6:12]
    if then == "pipeline rebuilt":
        del ds
        gc.collect()
        ds = _data(seed=5)[0]
        assert int(ds.lipdp_sampler.next_step.numpy()) == 0  # a new counter
    else:
        weights, model = model.get_weights(), _model(metadata)
        model.set_weights(weights)
        assert model.dp_steps_taken == 6
    sizes = _BatchSizes()
    model.fit(ds, epochs=1, verbose=0, callbacks=[sizes])
    assert [sizes.sizes[t] for t in range(6, 12)] == draws[12:18]


def test_an_iterator_kept_across_a_fit_trains_on_no_draw_the_fit_used():
    """An iterator opened (one batch peeked: its pass reserves draws 0..5) before a fit and
    trained on after it: the fit set the draws back to the model's step 0 and trained on
    draws 0..5, and the loop over the old iterator trained on 5 of them again (an audit,
    2026-12-06). The fit must draw after the old pass's reservation."""
    ds, _, metadata = _data(seed=6)
    iterator = iter(ds)
    peeked = next(iterator)
    model, record = _model(metadata), _BatchSizes(ds.lipdp_sampler)
    model.fit(ds, epochs=1, verbose=0, callbacks=[record])
    assert sorted(record.draws.values()) == list(range(6, 12))
    draws = _draw_sizes(ds, metadata, 12)
    with pytest.warns(lipdp.data.ShuffleSamplingWarning, match="train_on_batch"):
        looped = [int(y.shape[0]) for x, y in [peeked, *iterator]
                  if model.train_on_batch(x, y) is not None]
    assert looped == draws[:6]  # the old pass's own draws
    assert [record.sizes[t] for t in range(6)] == draws[6:12]
    assert model.poisson_draws_until == 12


def test_a_loop_continued_in_another_process_draws_on(tmp_path):
    """A loop over the pipeline (draws 0..5 for steps 0..5, after a peek at the first),
    the model saved, every pipeline of the seed dropped (as in a new process), the model
    loaded and fitted on a new pipeline of the seed: the floor the loop left lived in this
    process only, and fit from step 6 would have drawn 6..11 again if the peek's pass had
    been the loop's second (here it trained on draws the loop's pass reserved). The saved
    ``poisson_draws_until`` carries it; so does a model given the saved weights."""
    import gc

    ds, _, metadata = _data(seed=7)
    draws = _draw_sizes(ds, metadata, 24)
    next(iter(ds))  # draws 0..5 reserved, unused
    model = _model(metadata)
    with pytest.warns(lipdp.data.ShuffleSamplingWarning, match="train_on_batch"):
        looped = [int(y.shape[0]) for x, y in ds.take(4) if model.train_on_batch(x, y) is not None]
    assert looped == draws[6:10] and model.poisson_draws_until == 12
    path = str(tmp_path / "looped.keras")
    model.save(path)
    weights = model.get_weights()
    del ds, model
    gc.collect()
    for loaded in ("load_model", "set_weights"):
        ds = _data(seed=7)[0]
        assert int(ds.lipdp_sampler.next_step.numpy()) == 0  # a new counter
        if loaded == "load_model":
            model = tf.keras.models.load_model(path)
        else:
            model = _model(metadata)
            model.set_weights(weights)
        assert model.dp_steps_taken == 4 and model.poisson_draws_until == 12
        record = _BatchSizes(ds.lipdp_sampler)
        model.fit(ds, epochs=1, verbose=0, callbacks=[record])
        assert sorted(record.draws.values()) == list(range(12, 18))
        assert [record.sizes[t] for t in range(4, 10)] == draws[12:18]
        del ds, model, record
        gc.collect()


def test_a_second_model_fitted_on_the_pipeline_draws_fresh_batches():
    """fit started the sampler at the model's own step: a second model fitted on the
    pipeline a first one trained on replayed its batches exactly (an audit: 15 of 15
    batches), and only a warning said so. The second model draws on."""
    ds, _, metadata = _data(seed=8)
    first, second = _BatchSizes(ds.lipdp_sampler), _BatchSizes(ds.lipdp_sampler)
    _model(metadata).fit(ds, epochs=1, verbose=0, callbacks=[first])
    with warnings.catch_warnings():
        warnings.simplefilter("error", lipdp.data.ShuffleSamplingWarning)
        _model(metadata).fit(ds, epochs=1, verbose=0, callbacks=[second])
    assert sorted(first.draws.values()) == list(range(6))
    assert sorted(second.draws.values()) == list(range(6, 12))
    draws = _draw_sizes(ds, metadata, 12)
    assert [second.sizes[t] for t in range(6)] == draws[6:]


class _Worsening(tf.keras.callbacks.Callback):
    """A monitored value that only grows: EarlyStopping restores the first epoch."""

    def on_epoch_end(self, epoch, logs=None):
        logs["worsening"] = float(epoch)


def test_a_shuffled_run_continued_on_a_new_pipeline_of_its_seed_shuffles_anew(tmp_path):
    """tf.data's ``shuffle(seed=...)`` restarted its permutations in each pipeline built with
    the seed: a model saved after 2 epochs and fitted again on a new pipeline of the seed (as
    in a new process) trained on the first run's 2 epochs again, batch for batch, without a
    word (an audit, 2026-12-07). Shuffled passes now draw on the model's mark as Poisson
    ones do, each pass the permutation of ``(seed, the step it starts at)``."""
    import gc

    def data():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # shuffle sampling's and the known seed's
            return lipdp.data.load_dataset("digits", BATCH, bound_clip_value=8.0, seed=12,
                                           sampling="shuffle")

    ds, _, metadata = data()
    steps = metadata.steps_per_epoch
    model = _model(metadata)
    model.fit(ds, epochs=2, verbose=0)
    assert ds.lipdp_sampler.last_pass_start() == steps and model.poisson_draws_until == 2 * steps
    path = str(tmp_path / "model.keras")
    model.save(path)
    del model, ds
    gc.collect()
    ds = data()[0]
    assert ds.lipdp_sampler.next_step.numpy() == 0  # a new process's counter
    model = tf.keras.models.load_model(path)
    model.fit(ds, epochs=1, verbose=0)
    assert ds.lipdp_sampler.last_pass_start() == 2 * steps
    assert model.poisson_draws_until == 3 * steps and model.dp_steps_taken == 3 * steps


@pytest.mark.parametrize("first", ["a loop over batches listed from a dropped pipeline",
                                   "a fit whose EarlyStopping restores an earlier epoch",
                                   "a fit on a mapped pipeline",
                                   "a model given a run's layers one by one"])
def test_a_run_saved_and_continued_in_another_process_draws_no_batch_twice(tmp_path, first):
    """A review (2026-12-06) replayed 6 draws after each of these, the model saved and fitted
    again once every pipeline of the seed was dropped (as in a new process): the loop's
    batches came from no live pipeline, EarlyStopping set the saved draw mark back with
    the weights, and a mapped pipeline lost the sampler that fit manages; a second review
    replayed 4 after a model given a run's layers one by one (the run's mark stayed behind
    while its ledger came along)."""
    import gc

    ds, _, metadata = _data(seed=10)
    mapped = first.endswith("mapped pipeline")
    if not mapped:
        next(iter(ds))  # a peek: draws 0..5 reserved, unused
    model, used = _model(metadata), {}
    if first.startswith("a loop"):
        batches = list(ds)  # draws 6..11
        del ds
        gc.collect()
        with pytest.warns(lipdp.data.ShuffleSamplingWarning, match="train_on_batch"):
            for x, y in batches:
                model.train_on_batch(x, y)
        used.update({t: 6 + t for t in range(6)})
    else:
        record = _BatchSizes(ds.lipdp_sampler)
        if first.startswith("a fit whose"):
            stop = tf.keras.callbacks.EarlyStopping(monitor="worsening", mode="min",
                                                    patience=1, restore_best_weights=True)
            model.fit(ds, epochs=4, verbose=0, callbacks=[record, _Worsening(), stop])
        elif first.startswith("a model given"):
            with pytest.raises(KeyboardInterrupt):  # after 2 steps: its pass's other 4 skipped
                model.fit(ds, epochs=1, verbose=0, callbacks=[record, _KillAt(2)])
            model.fit(ds, epochs=1, verbose=0, callbacks=[record])
            copy = _model(metadata)
            with pytest.warns(UserWarning, match="copied from another model"):
                for source, target in zip(model.layers, copy.layers):
                    target.set_weights(source.get_weights())
                assert copy.dp_steps_taken == 8
            model = copy
        else:
            model.fit(ds.map(lambda x, y: (x, y)), epochs=1, verbose=0, callbacks=[record])
        used.update(record.draws)
        del ds, record
    path = str(tmp_path / "model.keras")
    model.save(path)
    del model
    gc.collect()
    ds = _data(seed=10)[0]
    model, record = tf.keras.models.load_model(path), _BatchSizes(ds.lipdp_sampler)
    model.fit(ds.map(lambda x, y: (x, y)) if mapped else ds, epochs=1, verbose=0,
              callbacks=[record])
    sizes = {t: record.sizes[t] for t in record.draws}
    expected = _draw_sizes(ds, metadata, max(record.draws.values()) + 1)
    assert [sizes[t] for t in sorted(sizes)] == [expected[record.draws[t]] for t in sorted(sizes)]
    assert not set(used.values()) & set(record.draws.values()), (used, record.draws)


_REPEATED = ["take(3).repeat()", "repeat() after a stopped fit",
             "take(3).repeat(3) run out inside a 5-step call", "a step interrupted in a new pass"]


@pytest.mark.parametrize("repeated", _REPEATED)
def test_a_pipeline_repeated_within_an_epoch_raises_the_saved_mark_past_every_pass(tmp_path,
                                                                                   repeated):
    """A repeated pipeline begins passes inside an epoch: each reserves 6 draws. The saved
    mark was raised by the epoch's first pass only, and a run continued in another process
    (every pipeline of the seed dropped) trained on 3 of the later passes' draws again (an
    audit, 2026-12-07); raised after each batch, it still missed the steps of a multi-step
    call that ran out of data (saved by Keras' ModelCheckpoint at the epoch's end), and a
    step interrupted before its batch ended (a review: 3 and 1 draws replayed). The draws
    the first run trained follow from the passes (pass p of a fit starts 6p after the fit's
    first) and are checked by the examples they hold."""
    import gc

    seed = 11 + _REPEATED.index(repeated)  # a counter of its own
    ds, _, metadata = _data(seed)
    assert ds.lipdp_sampler.started_at == 0
    model = _model(metadata)
    if repeated.startswith("take(3).repeat(3)"):
        model.compile(optimizer="adam", loss=lipdp.losses.DP_TauCategoricalCrossentropy(8.0),
                      steps_per_execution=5)
        saved_by_keras = tf.keras.callbacks.ModelCheckpoint(str(tmp_path / "model.keras"))
        model.fit(ds.take(3).repeat(3), steps_per_epoch=10, epochs=1, verbose=0,  # runs out
                  callbacks=[saved_by_keras])  # at the epoch's end, before fit returns
        used = [0, 1, 2, 6, 7, 8, 12, 13, 14]
    elif repeated.startswith("take"):
        model.fit(ds.take(3).repeat(), steps_per_epoch=9, epochs=1, verbose=0)
        used = [0, 1, 2, 6, 7, 8, 12, 13, 14]
    else:
        model.fit(ds, epochs=1, verbose=0, callbacks=[_KillAt(2, stop=True)])  # 2..5 skipped
        used = [0, 1] + list(range(6, 16))
        if repeated.startswith("a step"):  # a KeyboardInterrupt surfacing as a step returns
            steps = model.make_train_function()

            def interrupted(iterator):
                logs = steps(iterator)
                if model.dp_steps_taken == 9:  # the first step of the fit's second pass
                    raise KeyboardInterrupt
                return logs

            model.train_function, used = interrupted, used[:9]
        try:
            model.fit(ds.repeat(), steps_per_epoch=10, epochs=1, verbose=0)
        except KeyboardInterrupt:
            model.train_function = steps
    assert model.dp_steps_taken == len(used)
    expected = _draw_sizes(ds, metadata, 30)
    last_epoch = [d for d in used if d >= 6] if 0 in used and 2 not in used else used
    assert int(model._examples_seen.numpy()) == sum(expected[d] for d in last_epoch)
    path = str(tmp_path / "model.keras")
    if not repeated.startswith("take(3).repeat(3)"):
        model.save(path)
    del model, ds
    gc.collect()
    ds = _data(seed)[0]
    model, record = tf.keras.models.load_model(path), _BatchSizes(ds.lipdp_sampler)
    model.compile(optimizer="adam", loss=lipdp.losses.DP_TauCategoricalCrossentropy(8.0))
    model.fit(ds, epochs=1, verbose=0, callbacks=[record])  # one step a call: one draw each
    sizes = [record.sizes[t] for t in sorted(record.sizes)]
    assert sizes == [expected[record.draws[t]] for t in sorted(record.sizes)]
    assert not set(used) & set(record.draws.values()), record.draws


def test_weights_saved_before_the_draw_mark_load_it_as_zero(tmp_path):
    """Lists and `.weights.h5` / `.keras` files saved before ``poisson_draws_until`` existed
    lack that last weight: they load, with it at 0, and the model then draws from its step
    count (such a model drew step t's batch from draw t). Simulated by dropping the weight
    from a list and a file; a list of another length is still refused."""
    import h5py

    ds, _, metadata = _data(seed=9)
    model = _model(metadata)
    model.fit(ds, epochs=1, verbose=0)
    assert model.poisson_draws_until == 6 and model.weights[-1] is model._draws_until
    path = str(tmp_path / "old.weights.h5")
    model.save_weights(path)
    with h5py.File(path, "r+") as f:
        assert sorted(f["vars"]) == ["0", "1", "2", "3", "4"]
        del f["vars"]["4"]
    for load in ("list", "file"):
        fresh = _model(metadata)
        if load == "list":
            fresh.set_weights(model.get_weights()[:-1])
        else:
            fresh.load_weights(path)
        # 0 loaded (or the source's 6, where this process knows the values as its copies)
        assert fresh.dp_steps_taken == 6 and fresh.poisson_draws_until == 6
    with pytest.raises(ValueError, match="weight list of length"):
        _model(metadata).set_weights(model.get_weights()[:-2])


def test_loops_over_two_pipelines_of_one_seed_draw_on():
    """Two pipelines of one explicit seed in one process share their draws' counter: a loop
    over the second, after one over the first, drew the first's batches again (an audit,
    2026-12-06)."""
    first, _, metadata = _data(seed=4)
    second, _, _ = _data(seed=4)
    draws, model = _draw_sizes(first, metadata, 12), _model(metadata)
    with pytest.warns(lipdp.data.ShuffleSamplingWarning, match="train_on_batch"):
        looped = [int(y.shape[0]) for ds in (first, second) for x, y in ds
                  if model.train_on_batch(x, y) is not None]
    assert looped == draws
    # A pipeline of the seed built in the middle of a loop draws on from where it stands: no
    # replay warning (one came from the shared counter's last pass, begun at 12: a review).
    third = _data(seed=4)[0]
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for step, (x, y) in enumerate(third):
            model.train_on_batch(x, y)
            if step == 2:
                fourth = _data(seed=4)[0]
        looped = [int(y.shape[0]) for x, y in fourth if model.train_on_batch(x, y) is not None]
    assert not [w for w in record if "draws from step" in str(w.message)]
    assert looped == _draw_sizes(first, metadata, 24)[18:]


def test_a_fit_inside_a_fit_on_a_pipeline_of_the_same_seed_is_refused():
    """The outer fit's pass reserved the draws of the steps the inner fit would take: both
    trained on them (an audit, 2026-12-06: 4 of 18 draws twice)."""
    ds, _, metadata = _data()
    model = _model(metadata)

    class Nested(tf.keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 1:
                self.model.fit(_data()[0], epochs=1, verbose=0)

    with pytest.raises(ValueError, match="from inside another fit of this model"):
        model.fit(ds, epochs=1, verbose=0, callbacks=[Nested()])
    assert model.dp_steps_taken == 2


def test_budget_plans_from_the_ledger_a_later_callback_restores(tmp_path):
    """Keras' own BackupAndRestore (no mechanism check) listed after the accountant restores
    18 steps at sigma 2 into a model compiled at sigma 3: the budget must count them."""
    with pytest.raises(RuntimeError, match="interrupted"):
        _budget_run(str(tmp_path), interrupt_at=3)  # 18 steps at sigma 2
    ds, _, metadata = _data()
    model = _model(metadata, sigma=3.0)
    model.fit(ds, epochs=40, verbose=0, callbacks=[
        lipdp.DP_Accountant(epsilon_budget=3.0),
        tf.keras.callbacks.BackupAndRestore(str(tmp_path))])
    first, second = model.privacy_ledger.segments
    assert (first.steps, first.mechanism.noise_multiplier) == (18, 2.0)
    assert second.mechanism.noise_multiplier == 3.0
    # Planned from an empty ledger, the accountant would allow 109 steps at sigma 3 in all.
    assert 0 < second.steps < 109 - 18
    assert lipdp.accounting.epsilon_spent(model) <= 3.0


def test_resume_refuses_a_ledger_of_another_mechanism(tmp_path):
    with pytest.raises(RuntimeError, match="interrupted"):
        _budget_run(str(tmp_path), interrupt_at=1)
    ds, _, metadata = _data()
    other = _model(metadata, sigma=1.5)
    with pytest.raises(LedgerMismatchError, match=r"noise_multiplier: 2\.0 in the ledger, 1\.5 now"):
        other.fit(ds, epochs=3, verbose=0, callbacks=[BackupAndRestore(str(tmp_path))])


def test_load_model_reports_the_epsilon(trained, tmp_path, caplog):
    model, _ = trained
    path = save_model_atomically(model, str(tmp_path / "model.keras"))
    with caplog.at_level(logging.INFO, logger="lipdp"):
        loaded = lipdp.load_model(path)
    epsilon = lipdp.accounting.epsilon_spent(loaded)
    assert epsilon == pytest.approx(_expected_epsilon(model, 12), rel=1e-9)
    assert "trained with 12 private steps" in caplog.text
    assert f"epsilon={lipdp.accounting.format_epsilon(epsilon)}" in caplog.text
    assert load_model is lipdp.load_model


def test_a_failed_save_leaves_the_previous_model(trained, tmp_path, monkeypatch):
    model, _ = trained
    path = save_model_atomically(model, str(tmp_path / "model.keras"))
    before = open(path, "rb").read()

    def broken_save(target, *args, **kwargs):
        with open(target, "wb") as f:
            f.write(b"half a model")
        raise OSError("disk full")

    monkeypatch.setattr(model, "save", broken_save)
    with pytest.raises(OSError, match="disk full"):
        save_model_atomically(model, path)
    assert open(path, "rb").read() == before
    assert sorted(os.listdir(tmp_path)) == ["model.keras"]


def test_early_stopping_restoring_best_weights_keeps_every_step_in_the_ledger():
    """Keras' EarlyStopping(restore_best_weights=True) sets an earlier epoch's weights, and
    with them (they are among the weights) that epoch's ledger: the later epochs ran and
    chose them, so the ledger must keep every step. Without the guard: 6 of 12 steps."""
    ds, ds_test, metadata = _data()
    model = _model(metadata)

    class Worsening(tf.keras.callbacks.Callback):
        """A monitored value that is best after the first epoch, then worse."""

        def on_epoch_end(self, epoch, logs=None):
            logs["worsening"] = float(epoch)

    stop = tf.keras.callbacks.EarlyStopping(monitor="worsening", mode="min", patience=1,
                                            restore_best_weights=True)
    first_epoch = []
    remember = tf.keras.callbacks.LambdaCallback(on_epoch_end=lambda epoch, logs: first_epoch.append(
        [w.numpy().copy() for w in model.trainable_variables]) if epoch == 0 else None)
    with pytest.warns(UserWarning, match="the ledger keeps the 12 steps"):
        model.fit(ds, epochs=10, verbose=0, callbacks=[Worsening(), remember, stop])
    assert model.dp_steps_taken == 12  # epochs 1 and 2 ran, epoch 1's weights restored
    for restored, expected in zip(model.trainable_variables, first_epoch[0]):
        np.testing.assert_array_equal(restored.numpy(), expected)
    assert lipdp.accounting.epsilon_spent(model) == pytest.approx(_expected_epsilon(model, 12),
                                                                  rel=1e-9)


def test_loading_older_weights_keeps_the_ledger(trained, tmp_path):
    """A model of 12 steps given initial weights keeps its steps. On a model of its own: the
    module's trained one, left holding the initial weights of every model built with the
    tests' seed, would then hand them out as 12 steps' values (`lipdp.weight_copies`), and
    the later tests' new models, built with that seed, would count them."""
    _, metadata = trained
    model = _model(metadata)
    model.fit(_data()[0], epochs=2, verbose=0)
    fresh = _model(metadata)
    path = str(tmp_path / "untrained")  # TensorFlow checkpoint format
    fresh.save_weights(path)
    steps = model.dp_steps_taken
    with pytest.warns(UserWarning, match=f"the ledger keeps the {steps} steps"):
        model.load_weights(path)
    assert model.dp_steps_taken == steps
    np.testing.assert_array_equal(model.layers[1].kernel.numpy(), fresh.layers[1].kernel.numpy())


def _saved_and_a_quiet_run(trained, path, epochs):
    """``(model, path, quiet)``: the trained model, its weights saved at `path`, and another
    run of the same architecture with four times the noise, trained `epochs` epochs."""
    model, metadata = trained
    model.save_weights(path)
    quiet = _model(metadata, sigma=8.0)
    quiet.fit(_data()[0], epochs=epochs, verbose=0)
    return model, path, quiet


def test_weights_of_another_run_add_their_ledger_to_the_models(trained, tmp_path):
    """A model that trained 18 steps with little noise loads the weights of another run (12
    steps, four times the noise's inverse): its ledger now holds both runs. Keeping the longer
    ledger, as before, reported the small epsilon of the quiet run for the other's weights."""
    model, path, quiet = _saved_and_a_quiet_run(trained, str(tmp_path / "other.weights.h5"), 3)
    assert quiet.dp_steps_taken == 18
    own = lipdp.accounting.epsilon_spent(quiet)
    with pytest.warns(UserWarning, match="holds both, the model's 18 steps then the loaded 12"):
        quiet.load_weights(path)
    segments = quiet.privacy_ledger.segments
    assert [(s.start, s.steps) for s in segments] == [(0, 18), (18, 12)]
    assert [s.mechanism for s in segments] == [quiet.step_mechanism,
                                               model.privacy_ledger.segments[0].mechanism]
    loaded = lipdp.accounting.epsilon_spent(model)
    assert own < loaded < lipdp.accounting.epsilon_spent(quiet)
    for a, b in zip(quiet.trainable_variables, model.trainable_variables):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


def test_a_load_that_skips_the_ledger_is_refused_and_undone(trained, tmp_path):
    """HDF5 by name with ``skip_mismatch=True`` skipped the ledger's rows (stored shape (1,
    11), declared (None, 11)) and loaded the step counter: the model's own mechanism was then
    stretched over the loaded steps (0.81 reported for weights that had cost 68.9)."""
    model, path, other = _saved_and_a_quiet_run(trained, str(tmp_path / "by_name.h5"), 1)
    weights, ledger = other.get_weights(), other._dp_ledger.numpy()
    with pytest.raises(ValueError, match="step counter without its segments"):
        other.load_weights(path, by_name=True, skip_mismatch=True)
    assert other.dp_steps_taken == 6
    np.testing.assert_array_equal(other._dp_ledger.numpy(), ledger)
    for a, b in zip(other.get_weights(), weights):
        np.testing.assert_array_equal(a, b)


def test_restoring_an_older_checkpoint_does_not_roll_the_ledger_back(tmp_path):
    """`tf.train.Checkpoint.restore` assigns the variables directly (no set_weights): the
    ledger read afterwards is put back to the most steps it held after a fit epoch or a
    train_on_batch call."""
    ds, _, metadata = _data()
    model = _model(metadata)
    model.fit(ds, epochs=1, verbose=0)
    path = tf.train.Checkpoint(model=model).save(str(tmp_path / "ckpt"))
    model.fit(ds, epochs=1, verbose=0)
    for x, y in ds.take(2):  # and 2 steps outside fit
        model.train_on_batch(x, y)
    tf.train.Checkpoint(model=model).restore(path).expect_partial()
    with pytest.warns(UserWarning, match="the ledger keeps the 14 steps"):
        ledger = model.privacy_ledger
    assert ledger.steps == model.dp_steps_taken == 14
    assert lipdp.accounting.epsilon_spent(model) == pytest.approx(_expected_epsilon(model, 14),
                                                                  rel=1e-9)
