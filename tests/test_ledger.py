"""The privacy ledger: epsilon is the composition of the mechanisms that actually ran.

Reference: dp_accounting's `RdpAccountant` composing, segment by segment,
``PoissonSampledDpEvent(q_k, GaussianDpEvent(s_k))`` ``T_k`` times, with the
step noise multiplier ``s_k`` derived here from the segment's parameters
(sigma, or sigma / sqrt(V) per layer, V counted from the model). It is given
lipdp's own integer orders, at which both accountants compute the same RDP
formula: they agree to 1e-7 relative, and no under-report beyond that is
allowed.
"""

import math
import warnings

import dp_accounting
import numpy as np
import pytest
import tensorflow as tf
from dp_accounting.rdp import rdp_privacy_accountant as dpa_rdp

import lipdp
from lipdp import accounting
from lipdp.layers import DP_BoundedInput, DP_GroupSort, DP_QuickSpectralDense
from lipdp.losses import DP_TauCategoricalCrossentropy
from tests._soundness import adversarial_inputs

N, DIM, K, DELTA = 64, 6, 3, 1e-5
AGREEMENT = 1e-7  # lipdp vs dp_accounting at the same orders (see module docstring)


def _metadata(batch=16):
    return lipdp.DatasetMetadata((DIM,), K, N, 8, batch, 2.0, "shuffle")


def _model(sigma=1.0, strategy="per-layer"):
    layers = [DP_BoundedInput(2.0, input_shape=(DIM,)), DP_QuickSpectralDense(8), DP_GroupSort(2),
              DP_QuickSpectralDense(8), DP_GroupSort(2), DP_QuickSpectralDense(K)]
    model = lipdp.DP_Sequential(layers, dp_parameters=lipdp.DPParameters(sigma, DELTA, strategy),
                                dataset_metadata=_metadata())
    _compile(model)
    return model


def _compile(model):
    model.compile(loss=DP_TauCategoricalCrossentropy(3.0), optimizer=tf.keras.optimizers.SGD(0.01))


def _recompile_with_sigma(model, sigma):
    model.dp_parameters = lipdp.DPParameters(sigma, DELTA, "per-layer")
    _compile(model)


def _data(seed=0):
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(N, DIM)).astype("float32"),
            np.eye(K, dtype="float32")[rng.integers(0, K, N)])


def _reference(segments, high=False):
    """dp_accounting's epsilon for [(s, q, T)], at lipdp's orders (with ``high``, its high
    orders up to 2000: dp_accounting takes seconds per order near 1e6, and the cases below
    have their optimum under 2000)."""
    orders = accounting._BASE_ORDERS.tolist()
    if high:
        orders += [o for o in accounting._HIGH_ORDERS.tolist() if o <= 2000]
    reference = dpa_rdp.RdpAccountant(orders)
    for s, q, steps in segments:
        reference.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(s)),
                          steps)
    return reference.get_epsilon(DELTA)


def _assert_agrees(epsilon, reference):
    assert epsilon >= reference * (1 - AGREEMENT), f"under-reported: {epsilon} < {reference}"
    assert epsilon <= reference * (1 + 1e-6), f"{epsilon} > {reference}"


def test_epsilon_composes_the_segments_that_ran():
    """Three fits: sigma=1 with all variables, then one layer frozen (V 6 -> 4), then
    sigma raised to 5. Today's code re-accounted every past step with the last
    parameters (sigma=5, V=4) and under-reported epsilon by more than 10x."""
    tf.keras.utils.set_random_seed(0)
    model = _model(sigma=1.0)
    x, y = _data()
    accountant = lipdp.DP_Accountant()
    history = [model.fit(x, y, epochs=2, verbose=0, callbacks=[accountant])]
    model.layers[3].trainable = False
    _compile(model)
    history.append(model.fit(x, y, epochs=2, verbose=0, callbacks=[accountant]))
    _recompile_with_sigma(model, 5.0)
    history.append(model.fit(x, y, epochs=1, verbose=0, callbacks=[accountant]))

    q = 16 / N
    segments = [(1.0 / math.sqrt(6), q, 8), (1.0 / math.sqrt(4), q, 8), (5.0 / math.sqrt(4), q, 4)]
    expected = _reference(segments)
    assert model.dp_steps_taken == 20
    _assert_agrees(accounting.epsilon_spent(model), expected)
    _assert_agrees(history[-1].history["epsilon"][-1], expected)
    # Every epoch's log is the composition up to that epoch.
    _assert_agrees(history[0].history["epsilon"][0], _reference([(segments[0][0], q, 4)]))
    _assert_agrees(history[1].history["epsilon"][-1], _reference(segments[:2]))
    assert [s.steps for s in model.privacy_ledger.segments] == [8, 8, 4]


def test_batch_size_and_sampling_change_open_a_segment():
    tf.keras.utils.set_random_seed(1)
    model = _model(sigma=2.0, strategy="global")
    x, y = _data(1)
    model.fit(x, y, epochs=1, verbose=0)
    model.dataset_metadata = _metadata(batch=32)
    _compile(model)
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    expected = _reference([(2.0, 16 / N, 4), (2.0, 32 / N, 2)])
    _assert_agrees(accounting.epsilon_spent(model), expected)
    mechanisms = [s.mechanism for s in model.privacy_ledger.segments]
    assert [m.batch_size for m in mechanisms] == [16, 32]


@pytest.mark.parametrize("change", ["noise multiplier", "freeze a layer", "batch size"])
def test_changes_after_compile_need_a_new_compile(change):
    """Without a new compile the traced step would keep running the old mechanism while
    the accountant read the new parameters: fit refuses instead."""
    model = _model()
    x, y = _data()
    model.fit(x, y, epochs=1, verbose=0)
    if change == "noise multiplier":
        model.dp_parameters = lipdp.DPParameters(5.0, DELTA, "per-layer")
    elif change == "freeze a layer":
        model.layers[1].trainable = False
    else:
        model.dataset_metadata = _metadata(batch=32)
    with pytest.raises(RuntimeError, match="compile"):
        model.fit(x, y, epochs=1, verbose=0)
    # Keras' train_on_batch puts back the trainable state of the last compile while it runs:
    # the frozen layer trained on, without a word, until 2026-12-07 (an audit).
    with pytest.raises(RuntimeError, match="compile"):
        model.train_on_batch(x[:16], y[:16])
    assert model.dp_steps_taken == 4
    _assert_agrees(accounting.epsilon_spent(model), _reference([(1.0 / math.sqrt(6), 0.25, 4)]))


@pytest.mark.parametrize("traced", [False, True])
@pytest.mark.parametrize("change", ["input bound", "loss parameter", "loss replaced"])
def test_a_changed_input_bound_or_loss_needs_a_new_compile(change, traced):
    """The loss's constant L is read at compile, the layers' and loss's attributes when the
    step is traced (first, or again for a batch of another size): an input bound lowered
    10x, a DP_MulticlassHKR's alpha raised from 1 to 50, or `model.dp_loss` replaced after
    compile trained against the old bound (exact per-example norms 8.7x to 25x the bound,
    an audit): fit and train_on_batch refuse until the model is compiled again, before or
    after the step was first traced."""
    model = _model()
    model.compile(loss=lipdp.losses.DP_MulticlassHKR(alpha=1.0),
                  optimizer=tf.keras.optimizers.SGD(0.01))
    x, y = _data()
    if traced:
        model.fit(x, y, epochs=1, verbose=0)
    if change == "input bound":
        model.layers[0].upper_bound = 0.2
    elif change == "loss parameter":
        model.dp_loss.alpha = 50.0
    else:
        model.dp_loss = lipdp.losses.DP_MulticlassHKR(alpha=50.0)
    what = {"input bound": r"the configuration of layer 'dp__bounded_input\S*' \(upper_bound\)",
            "loss parameter": r"the DP loss's constant L \(41.6\d*, 1.63\d* at compile\)",
            "loss replaced": r"the DP loss's constant L \(41.6"}[change]
    with pytest.raises(RuntimeError, match=f"Changed since the model was compiled: {what}"):
        model.fit(x, y, epochs=1, verbose=0)
    with pytest.raises(RuntimeError, match=what):
        model.train_on_batch(x[:8], y[:8])  # another batch size: a new trace
    assert model.dp_steps_taken == (4 if traced else 0)


def _scaled(function, factor=100.0):
    return lambda *args, **kwargs: factor * function(*args, **kwargs)


_BYPASSES = {  # an audit of the checks above: each trained at 1.5x to 7068x the bound
    "a dense layer's activation": (
        lambda m: setattr(m.layers[-1], "activation", _scaled(tf.identity)), r"\(activation\)"),
    "deel-lip's pooling coefficient": (
        lambda m: setattr(m.layers[3], "coef_lip", 10 * m.layers[3].coef_lip), r"\(coef_lip\)"),
    "the model's call on the instance": (
        lambda m: setattr(m, "call", _scaled(m.call)), "a `call` of its own"),
    "a layer's call on the instance": (
        lambda m: setattr(m.layers[-1], "call", _scaled(m.layers[-1].call)),
        "`call` replaced on the instance"),
    "the loss's call on the instance": (
        lambda m: setattr(m.dp_loss, "call", _scaled(m.dp_loss.call)),
        "the DP loss \\(its `call` replaced"),
    "a negative loss parameter": (
        lambda m: setattr(m.dp_loss, "alpha", -30.0), r"the DP loss's constant L \(-"),
}


@pytest.mark.parametrize("change", sorted(_BYPASSES))
def test_changes_the_configuration_does_not_show_are_refused_too(change):
    """What `call` reads but `get_config` leaves out (lipdp's dense layers drop `activation`,
    deel-lip sets `coef_lip` at build), a call patched on an instance, and a loss constant
    made negative (which a plain 'not larger' comparison let through) each trained at 1.5x
    to 7068x the bound after the checks of compile and build were added (an audit)."""
    from tests._models import cnn

    model = cnn()
    model.compile(loss=lipdp.losses.DP_MulticlassHKR(alpha=0.5),
                  optimizer=tf.keras.optimizers.SGD(0.01))
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 8, 8, 2)).astype("float32")
    y = np.eye(4, dtype="float32")[rng.integers(0, 4, 16)]
    mutate, message = _BYPASSES[change]
    mutate(model)
    with pytest.raises((RuntimeError, ValueError), match=message):
        model.train_on_batch(x, y)
    assert model.dp_steps_taken == 0


def test_a_pooling_size_changed_before_compile_is_refused_at_compile():
    """deel-lip's L2 pooling records nothing at its build; its pool size set from 2 to 1 after
    the model was made (its coefficient kept for 2: outputs 2|x|) trained at 1.5x the bound
    (an audit). A DP model records its layers' configurations when it is made."""
    from tests._models import cnn

    model = cnn()
    model.layers[3].pool_size = (1, 1)
    with pytest.raises(ValueError, match=r"had its pool_size changed"):
        model.compile(loss=DP_TauCategoricalCrossentropy(1.0), optimizer="sgd")


def test_a_loss_parameter_that_leaves_its_constant_trains_on():
    """The tau cross-entropy's L is sqrt(2) for every temperature: deel-lip's
    LossParamScheduler moving tau between fits, or a loop assigning it before each
    train_on_batch, was refused once the loss's whole configuration was compared, and so
    was `trainable` set on a layer without variables (an audit); only a larger L is refused.
    The noise follows the compiled L."""
    model = _model()
    x, y = _data()
    model.fit(x, y, epochs=1, verbose=0)
    model.dp_loss.tau.assign(30.0)
    model.layers[2].trainable = False  # a GroupSort: no variable, nothing changes
    model.fit(x, y, epochs=1, verbose=0)
    model.dp_loss.tau.assign(0.5)
    model.train_on_batch(x[:16], y[:16])
    assert model.dp_steps_taken == 9
    assert model._loss_lipschitz == math.sqrt(2.0)


def test_an_input_bound_changed_after_build_is_refused_and_clipped_at_consistently():
    """A radius fixed at build kept clipping at 2.0 inputs whose bound was lowered to 0.2
    (exact per-example norms above the bound, compiled again or not). The bounds now refuse
    a layer changed after build, and DP_BoundedInput clips at the radius of its current
    bound, as its bound pass reads it."""
    model = _model()
    model.layers[0].upper_bound = 0.2
    with pytest.raises(ValueError, match="had its upper_bound changed after it was built"):
        _compile(model)
    layer = model.layers[0]
    x = adversarial_inputs(np.random.default_rng(3), (DIM,), 2.0)
    assert np.max(np.linalg.norm(layer(x), axis=1)) <= float(layer.propagate_inputs(10.0)) == 0.2


def test_a_compile_that_never_trains_leaves_no_segment_and_same_parameters_continue():
    model = _model(sigma=1.0)
    x, y = _data()
    model.fit(x, y, epochs=1, verbose=0)
    _recompile_with_sigma(model, 3.0)
    model.fit(x, y, epochs=1, verbose=0)
    _recompile_with_sigma(model, 7.0)  # traced by nothing: no step ran with sigma = 7
    _recompile_with_sigma(model, 3.0)
    model.fit(x, y, epochs=1, verbose=0)
    segments = model.privacy_ledger.segments
    assert [(s.mechanism.noise_multiplier, s.steps) for s in segments] == [(1.0, 4), (3.0, 8)]


def test_budget_is_enforced_on_the_composition():
    """A budget given after a first segment counts that segment: the run stops at the
    last step whose composed epsilon fits."""
    model = _model(sigma=1.0)
    x, y = _data()
    model.fit(x, y, epochs=1, verbose=0)
    _recompile_with_sigma(model, 2.0)
    first = (1.0 / math.sqrt(6), 0.25, 4)
    s2 = 2.0 / math.sqrt(6)
    budget = 0.5 * (_reference([first, (s2, 0.25, 9)]) + _reference([first, (s2, 0.25, 10)]))
    model.fit(x, y, epochs=10, verbose=0, callbacks=[lipdp.DP_Accountant(epsilon_budget=budget)])
    assert model.dp_steps_taken == 4 + 9
    assert accounting.epsilon_spent(model) <= budget


def test_ledger_survives_saving_and_checkpoints(tmp_path):
    model = _model(sigma=1.0)
    x, y = _data()
    model.fit(x, y, epochs=1, verbose=0)
    _recompile_with_sigma(model, 4.0)
    model.fit(x, y, epochs=1, verbose=0)
    path = str(tmp_path / "model.keras")
    model.save(path)
    loaded = tf.keras.models.load_model(path)
    assert loaded.privacy_ledger == model.privacy_ledger
    assert accounting.epsilon_spent(loaded) == accounting.epsilon_spent(model)
    restored = _model(sigma=4.0)
    tf.train.Checkpoint(model=model).write(str(tmp_path / "ckpt"))
    tf.train.Checkpoint(model=restored).read(str(tmp_path / "ckpt")).expect_partial()
    assert restored.privacy_ledger == model.privacy_ledger


def test_end_to_end_epsilon_equals_dp_accounting_for_the_steps_taken():
    """One plain run: the epsilon DP_Accountant logs after fit is dp_accounting's for the
    steps taken (not a value pinned from lipdp itself)."""
    tf.keras.utils.set_random_seed(2)
    model = _model(sigma=1.5, strategy="global")
    x, y = _data(2)
    history = model.fit(x, y, epochs=3, verbose=0, callbacks=[lipdp.DP_Accountant()])
    assert model.dp_steps_taken == 12
    _assert_agrees(history.history["epsilon"][-1], _reference([(1.5, 0.25, 12)]))


@pytest.mark.parametrize("segments,high", [
    ([(3.0, 0.1, 100)], False),
    ([(1.0, 0.25, 30), (0.5, 0.25, 30), (2.5, 0.5, 7)], False),
    ([(5.0, 0.001, 1), (6.0, 0.001, 2)], True),  # tiny epsilon: optimum at order 331 (high grid)
])
def test_compose_epsilon_against_dp_accounting(segments, high):
    _assert_agrees(accounting.compose_epsilon(segments, DELTA), _reference(segments, high))
    if len(segments) == 1:
        assert accounting.compose_epsilon(segments, DELTA) == accounting.compute_epsilon(
            *segments[0], DELTA)


def test_compose_epsilon_edge_cases():
    assert accounting.compose_epsilon([], DELTA) == 0.0
    assert accounting.compose_epsilon([(0.0, 0.1, 0), (2.0, 0.1, 0)], DELTA) == 0.0
    assert accounting.compose_epsilon([(0.0, 0.1, 1), (2.0, 0.1, 5)], DELTA) == math.inf
    with pytest.raises(ValueError, match="segments"):
        accounting.compose_epsilon([(1.0, 0.1)], DELTA)
    with pytest.raises(ValueError, match="sampling_rate"):
        accounting.compose_epsilon([(1.0, 1.5, 3)], DELTA)


@pytest.mark.parametrize("budget", [0.5, 2.0, 8.0])
def test_max_steps_after_is_the_inverse_of_the_composition(budget):
    past = [(1.0, 0.25, 6), (3.0, 0.1, 20)]
    steps = accounting.max_steps_after(past, budget, 2.0, 0.2, DELTA)
    if steps == 0:
        assert accounting.compose_epsilon(past + [(2.0, 0.2, 1)], DELTA) > budget
    else:
        assert accounting.compose_epsilon(past + [(2.0, 0.2, steps)], DELTA) <= budget
        assert accounting.compose_epsilon(past + [(2.0, 0.2, steps + 1)], DELTA) > budget
    assert accounting.max_steps_after([], budget, 2.0, 0.2, DELTA) == \
        accounting.max_steps_for_budget(budget, 2.0, 0.2, DELTA)


def test_ledger_rows_round_trip_and_corrupt_rows_are_refused():
    from lipdp.ledger import PrivacyLedger, StepMechanism

    mechanism = StepMechanism.of(lipdp.DPParameters(2.0, DELTA, "per-layer"), _metadata(), 5)
    assert StepMechanism.from_row(mechanism.to_row()) == mechanism
    assert mechanism.step_noise_multiplier == pytest.approx(2.0 / math.sqrt(5))
    louder = StepMechanism.of(lipdp.DPParameters(3.0, DELTA, "per-layer"), _metadata(), 5)
    rows = np.array([[0.0, *mechanism.to_row()], [7.0, *louder.to_row()]])
    ledger = PrivacyLedger.from_rows(rows, 10)
    assert [s.steps for s in ledger.segments] == [7, 3] and ledger.steps == 10
    assert "steps 0-6" in ledger.describe(DELTA)
    same = np.array([[0.0, *mechanism.to_row()], [7.0, *mechanism.to_row()]])
    assert [s.steps for s in PrivacyLedger.from_rows(same, 10).segments] == [10]
    with pytest.raises(ValueError, match="Corrupt"):
        PrivacyLedger.from_rows(rows, 5)  # steps beyond the last segment's start missing
    with pytest.raises(ValueError, match="Corrupt"):
        PrivacyLedger.from_rows(np.zeros((0, rows.shape[1])), 3)
    bad = rows.copy()
    bad[0, 1] = 7.0  # no such mode
    with pytest.raises(ValueError, match="Corrupt"):
        PrivacyLedger.from_rows(bad, 10)


# --------------------------------------------------------------------------- #
# Ledgers replaced behind the traced step (found by an audit, 2026-11-27).
# --------------------------------------------------------------------------- #
def _global(sigma):
    return lipdp.DPParameters(sigma, DELTA, "global")


def _global_model(sigma):
    model = _model()
    model.dp_parameters = _global(sigma)
    _compile(model)
    return model


def test_steps_after_a_restored_ledger_are_recorded_under_the_mechanism_that_ran(tmp_path):
    """A tf.train.Checkpoint of 4 steps at sigma = 8 restored into a model whose step was
    traced at sigma = 1 (after 4 steps), then 4 more steps: before, the segment was opened
    only when the step was traced, and the 4 new steps were counted at sigma = 8 (epsilon
    0.28 against dp_accounting's >= 4 for what ran). Now each fit records its mechanism
    before the first step: at least 4 steps at sigma = 8 and 4 at sigma = 1 are composed."""
    tf.keras.utils.set_random_seed(3)
    x, y = _data(3)
    model = _global_model(8.0)
    model.fit(x, y, epochs=1, verbose=0)
    checkpoint = tf.train.Checkpoint(model=model)
    path = checkpoint.write(str(tmp_path / "sigma8"))
    model.dp_parameters = _global(1.0)
    _compile(model)
    model.fit(x, y, epochs=1, verbose=0)  # traced at sigma = 1
    checkpoint.read(path)                 # the ledger: 4 steps at sigma = 8
    with pytest.warns(UserWarning, match="older checkpoint"):
        model.fit(x, y, epochs=1, verbose=0)
    ran = [(8.0, 0.25, 4), (1.0, 0.25, 4)]
    assert model.privacy_ledger.segments[-1].mechanism.noise_multiplier == 1.0
    _assert_agrees(accounting.epsilon_spent(model), _reference(ran + [(1.0, 0.25, 4)]))
    assert accounting.epsilon_spent(model) >= _reference(ran)


def test_train_on_batch_and_keras_backup_and_restore_record_the_running_mechanism(tmp_path):
    """Keras' own BackupAndRestore resumes a sigma = 8 run's weights and ledger into a model
    whose step was traced at sigma = 1 by train_on_batch: the resumed steps count at sigma =
    1 (before: at sigma = 8, epsilon 0.35 against 5.34)."""
    tf.keras.utils.set_random_seed(4)
    x, y = _data(4)
    backup = str(tmp_path / "backup")

    class Interrupt(tf.keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            raise KeyboardInterrupt

    strong = _global_model(8.0)
    with pytest.raises(KeyboardInterrupt):
        strong.fit(x, y, epochs=3, verbose=0,
                   callbacks=[tf.keras.callbacks.BackupAndRestore(backup), Interrupt()])
    model = _global_model(1.0)
    model.train_on_batch(x[:16], y[:16])
    model.fit(x, y, epochs=3, verbose=0, callbacks=[tf.keras.callbacks.BackupAndRestore(backup)])
    segments = [(s.mechanism.noise_multiplier, s.steps) for s in model.privacy_ledger.segments]
    assert segments[-1] == (1.0, 8), segments
    assert accounting.epsilon_spent(model) >= _reference([(8.0, 0.25, 4), (1.0, 0.25, 8)])


def test_a_run_resumed_mid_epoch_from_shuffled_arrays_trains_on(tmp_path):
    """BackupAndRestore with an integer ``save_freq`` resumes inside an epoch, whose
    remaining steps see fewer examples than the metadata's N: the epoch-size check stopped
    the resumed run after them (an audit, 2026-12-06), so such resumes never finished."""
    x, y = _data(8)

    class Kill(tf.keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if self.model.dp_steps_taken == 6:  # the second epoch's second step
                raise KeyboardInterrupt

    backup = str(tmp_path / "backup")
    with pytest.raises(KeyboardInterrupt):
        _model().fit(x, y, epochs=3, verbose=0, callbacks=[
            tf.keras.callbacks.BackupAndRestore(backup, save_freq=1), Kill()])
    resumed = _model()
    resumed.fit(x, y, epochs=3, verbose=0,
                callbacks=[tf.keras.callbacks.BackupAndRestore(backup, save_freq=1)])
    assert resumed.dp_steps_taken == 12
    # an epoch short of N, not resumed, still stops the fit (the records unchecked before)
    short = tf.data.Dataset.from_tensor_slices((x[:48], y[:48])).filter(
        lambda *_: True).batch(16)
    with pytest.raises(RuntimeError, match="Epoch 1 trained on 48 examples"):
        _model().fit(short, epochs=1, verbose=0, validate_data=False)


def test_a_ledger_replaced_inside_a_traced_loop_stops_the_step():
    """A custom loop calling the traced step after the ledger was swapped for another
    mechanism's (no fit to record the segment): the step's guard fails before any update."""
    tf.keras.utils.set_random_seed(5)
    x, y = _data(5)
    other = _global_model(8.0)
    other.fit(x, y, epochs=1, verbose=0)
    model = _global_model(1.0)
    model._build_optimizer()
    step = tf.function(lambda a, b: model.train_step((a, b)))
    step(x[:16], y[:16])
    model._dp_ledger.assign(other._dp_ledger)
    before = [v.numpy() for v in model.trainable_variables]
    with pytest.raises(tf.errors.InvalidArgumentError, match="last segment is not the mechanism this step runs"):
        step(x[:16], y[:16])
    for v, b in zip(model.trainable_variables, before):
        np.testing.assert_array_equal(v.numpy(), b)


def test_restoring_an_older_checkpoint_then_training_counts_every_step(tmp_path):
    """12 steps, a tf.train.Checkpoint of the first 4 restored, 4 more steps: 16 ran. Before,
    fit continued from the restored counter and the ledger read 8 (max, not the sum); now
    fit puts it back to its high-water mark first."""
    tf.keras.utils.set_random_seed(6)
    x, y = _data(6)
    model = _model(sigma=1.0, strategy="global")
    model.fit(x, y, epochs=1, verbose=0)
    checkpoint = tf.train.Checkpoint(model=model)
    path = checkpoint.write(str(tmp_path / "early"))
    model.fit(x, y, epochs=2, verbose=0)
    checkpoint.read(path)
    with pytest.warns(UserWarning, match="older checkpoint"):
        model.fit(x, y, epochs=1, verbose=0)
    assert model.dp_steps_taken == 16
    _assert_agrees(accounting.epsilon_spent(model), _reference([(1.0, 0.25, 16)]))


def test_the_budget_holds_with_several_steps_per_execution():
    """compile(steps_per_execution=3) with 4 steps an epoch: Keras runs the epoch's last
    call with 1 step and lowers the value it stores while it does, and the accountant,
    reading it then, looked 1 step ahead and let the next 3-step call overrun the budget.
    Budgets from 5 to 17 steps' epsilon: never exceeded, and the run stops less than one
    call before it."""
    x, y = _data(7)
    for allowed in range(5, 18, 3):
        model = _model(sigma=1.0, strategy="global")
        model.compile(loss=DP_TauCategoricalCrossentropy(3.0),
                      optimizer=tf.keras.optimizers.SGD(0.01), steps_per_execution=3)
        budget = 0.5 * (_reference([(1.0, 0.25, allowed)])
                        + _reference([(1.0, 0.25, allowed + 1)]))
        model.fit(x, y, epochs=10, verbose=0,
                  callbacks=[lipdp.DP_Accountant(epsilon_budget=budget)])
        assert allowed - 3 < model.dp_steps_taken <= allowed, (allowed, model.dp_steps_taken)
        assert accounting.epsilon_spent(model) <= budget


class _Meddle(tf.keras.callbacks.Callback):
    """Listed after the accountant, after each call of the train function: clears its stop
    flag, raises the steps per call from 2 to 4 (after the second call), takes three steps
    of its own with `train_on_batch`, or runs a `fit` of two epochs."""

    def __init__(self, how, batch):
        super().__init__()
        self.how, self.batch, self.calls = how, batch, 0

    def on_train_batch_end(self, batch, logs=None):
        self.calls += 1
        if self.how == "stop flag cleared":
            self.model.stop_training = False
        elif self.how == "steps per call raised" and self.calls == 2:
            self.model.steps_per_execution = 4
        elif self.how == "train_on_batch":
            for _ in range(3):
                self.model.train_on_batch(*self.batch)
        elif self.how == "fit of its own":
            self.model.fit(*self.batch, epochs=2, verbose=0)


@pytest.mark.parametrize("how", ["stop flag cleared", "steps per call raised",
                                 "train_on_batch", "fit of its own"])
def test_no_callback_runs_training_past_the_budget(how):
    """An audit (2026-12-06), 6 steps allowed: a callback after the accountant clearing
    ``model.stop_training`` ran 12, one raising ``model.steps_per_execution`` from 2 to 4
    after the accountant's check 8, one calling ``train_on_batch`` 8, one running a `fit`
    of its own without an accountant 12. The call that would
    pass the budget now raises before it runs (`DP_Accountant.check_next_call`); Keras'
    tuner of the steps per call, which changes them from its own thread, is refused."""
    x, y = _data(7)
    model = _model(sigma=1.0, strategy="global")
    model.compile(loss=DP_TauCategoricalCrossentropy(3.0), optimizer=tf.keras.optimizers.SGD(0.01),
                  steps_per_execution=1 if how in ("train_on_batch", "fit of its own") else 2)
    budget = 0.5 * (_reference([(1.0, 0.25, 6)]) + _reference([(1.0, 0.25, 7)]))
    with pytest.raises(RuntimeError, match="past the 6 that fit"):
        model.fit(x, y, epochs=10, verbose=0, callbacks=[
            lipdp.DP_Accountant(epsilon_budget=budget),
            _Meddle(how, (x, y) if how == "fit of its own" else (x[:16], y[:16]))])
    assert model.dp_steps_taken <= 6
    assert accounting.epsilon_spent(model) <= budget
    with pytest.raises(ValueError, match="steps_per_execution='auto'"):
        model.compile(loss=DP_TauCategoricalCrossentropy(3.0), steps_per_execution="auto")


def test_a_delta_that_allows_publishing_a_record_is_warned_at_compile():
    model = _model()
    model.dp_parameters = lipdp.DPParameters(1.0, 1.0 / N)
    with pytest.warns(UserWarning, match=r"delta=0.015625 is at least 1 / nb_samples_train"):
        _compile(model)
    model.dp_parameters = lipdp.DPParameters(1.0, 0.5 / N)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _compile(model)


def test_train_on_batch_refuses_several_steps_per_execution():
    """Keras' train function under steps_per_execution=3 draws 3 batches from the one
    train_on_batch gives it: one private step, then an OutOfRangeError with the optimizer's
    iterations at 2. Refused before anything runs."""
    x, y = _data(8)
    model = _model()
    model.compile(loss=DP_TauCategoricalCrossentropy(3.0),
                  optimizer=tf.keras.optimizers.SGD(0.01), steps_per_execution=3)
    before = [w.numpy() for w in model.trainable_weights]
    with pytest.raises(ValueError, match="steps_per_execution=3"):
        model.train_on_batch(x[:16], y[:16])
    assert model.dp_steps_taken == 0 and int(model.optimizer.iterations.numpy()) == 0
    assert all(np.array_equal(a, w.numpy()) for a, w in zip(before, model.trainable_weights))
    # Evaluation and prediction of one batch failed with Keras' OutOfRangeError (a review,
    # 2026-12-07): refused by name too.
    with pytest.raises(ValueError, match="test_on_batch .*steps_per_execution=3"):
        model.test_on_batch(x[:16], y[:16])
    with pytest.raises(ValueError, match="predict_on_batch .*steps_per_execution=3"):
        model.predict_on_batch(x[:16])


class _PlainSteps(lipdp.DP_Sequential):
    """Overrides train_step with an ordinary, non-private step (no super())."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(self.dp_loss.call(y, self(x, training=True)))
        self.optimizer.apply_gradients(zip(tape.gradient(loss, self.trainable_variables),
                                           self.trainable_variables))
        return {}


class _ExtraSteps(lipdp.DP_Sequential):
    """Takes the private step, then applies a plain gradient of its own."""

    def train_step(self, data):
        logs = super().train_step(data)
        x, y = data
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(self.dp_loss.call(y, self(x, training=True)))
        self.optimizer.apply_gradients(zip(tape.gradient(loss, self.trainable_variables),
                                           self.trainable_variables))
        return logs


class _TwiceEachBatch(lipdp.DP_Sequential):
    """Takes the private step twice on each batch (an audit, 2026-12-07: under Poisson
    metadata, 92 steps recorded for 46 samples, epsilon 3.52 reported for 6.40)."""

    def train_step(self, data):
        super().train_step(data)
        return super().train_step(data)


class _ScaledLoss(lipdp.DP_Sequential):
    """Scales the losses the step differentiates (the same audit: per-example gradients
    9.5x their bound)."""

    def per_example_step_loss(self, y_true, y_pred):
        return 10.0 * super().per_example_step_loss(y_true, y_pred)


class _HiddenLayers(lipdp.DP_Sequential):
    """Shows the step layers of its own (a review, 2026-12-07: a bounded input the forward
    pass never ran, per-example gradients 100x the bound)."""

    @property
    def layers(self):
        return super().layers


class _LossProperty(lipdp.DP_Sequential):
    """Reads its DP loss through a property (the review's returned another loss while the
    step was traced: 25.5x the bound)."""

    @property
    def dp_loss(self):
        return self._loss_of_the_property

    @dp_loss.setter
    def dp_loss(self, loss):
        self._loss_of_the_property = loss


class _LipdpsOnTheClass:
    """A descriptor showing lipdp's `train_step` on the class and another on the model (the
    review's gave every row the first record's label: 9.52x the sensitivity)."""

    def __get__(self, model, cls):
        from lipdp.model import _DPModelMixin

        return _DPModelMixin.train_step if model is None else (lambda data: {})


class _Disguised(lipdp.DP_Sequential):
    train_step = _LipdpsOnTheClass()


@pytest.mark.parametrize("cls", [_PlainSteps, _ExtraSteps, _TwiceEachBatch, _ScaledLoss,
                                 _HiddenLayers, _LossProperty, _Disguised])
def test_a_subclass_replacing_a_method_of_the_private_step_is_refused(cls):
    """A train_step override taking plain steps trained with an epsilon of 0 reported, one
    applying its own gradients after super().train_step had half its updates un-noised (an
    audit; the optimizer's update count caught both at the end of the first epoch), one
    taking the step twice per batch or modifying the batch, and a scaled
    per_example_step_loss, trained outside the epsilon reported (an audit, 2026-12-07), and
    so did subclasses showing the step other layers or another loss, or a descriptor hiding
    a replaced train_step from a check made with getattr (a review): `compile` refuses a
    subclass defining a method of the private step or what it reads."""
    metadata = lipdp.DatasetMetadata((DIM,), K, N, 8, 16, 2.0, "poisson")
    model = cls(_model().layers, dp_parameters=lipdp.DPParameters(1.0, DELTA),
                dataset_metadata=metadata)
    with pytest.raises(ValueError, match="replaces `(train_step|per_example_step_loss|layers|"
                                         "dp_loss)` of lipdp's private step"):
        _compile(model)


def test_a_method_of_the_private_step_set_on_the_model_is_refused_before_training():
    x, y = _data(9)
    model = _model()
    model.train_step = lambda data: {}
    with pytest.raises(ValueError, match="replaces `train_step` of lipdp's private step"):
        model.fit(x, y, epochs=1, verbose=0)
    with pytest.raises(ValueError, match="replaces `train_step` of lipdp's private step"):
        model.train_on_batch(x[:16], y[:16])


class _PlainUpdates(tf.keras.callbacks.Callback):
    """After each step, applies a plain gradient through the model's optimizer."""

    def __init__(self, x, y):
        super().__init__()
        self.x, self.y = x, y

    def on_train_batch_end(self, batch, logs=None):
        model = self.model
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(model.dp_loss.call(self.y, model(self.x, training=True)))
        model.optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                                            model.trainable_variables))


def test_updates_applied_outside_the_private_step_stop_fit():
    """A callback applying its own gradients through the model's optimizer after each step
    (as train_step overrides did before `compile` refused them) had half its updates
    un-noised: the optimizer's update count must follow the ledger's steps. fit stops at
    the end of the first epoch, naming the difference (under Poisson metadata, where no
    count of the epoch's examples sees the plain steps)."""
    x, y = _data(9)
    metadata = lipdp.DatasetMetadata((DIM,), K, N, 8, 16, 2.0, "poisson")
    model = lipdp.DP_Sequential(_model().layers, dp_parameters=lipdp.DPParameters(1.0, DELTA),
                                dataset_metadata=metadata)
    _compile(model)
    with pytest.warns(UserWarning, match="arrays"), \
            pytest.raises(RuntimeError, match="By the end of epoch 1, the optimizer applied 4 "
                                              "more updates than the privacy ledger recorded"):
        model.fit(x, y, epochs=3, verbose=0, callbacks=[_PlainUpdates(x[:16], y[:16])])


def test_an_optimizer_arriving_with_updates_of_its_own_trains(tmp_path):
    """The check counts from where fit and train_on_batch begin: weights pretrained on public
    data with the optimizer's state (TensorFlow-format weights carry it) loaded before
    private fine-tuning were refused when the optimizer's count was compared with the ledger
    from zero (an audit)."""
    x, y = _data(10)
    public = _model()
    for _ in range(5):  # a plain (non-private) loop: public data
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(public.dp_loss.call(y, public(x, training=True)))
        public.optimizer.apply_gradients(zip(tape.gradient(loss, public.trainable_variables),
                                             public.trainable_variables))
    public.save_weights(str(tmp_path / "public"))
    model = _model()
    model.load_weights(str(tmp_path / "public"))
    model.fit(x, y, epochs=1, verbose=0)
    model.train_on_batch(x[:16], y[:16])
    assert model.dp_steps_taken == 5 and int(model.optimizer.iterations.numpy()) == 10


def test_a_dataset_of_unknown_length_counts_no_update_for_its_exhausted_call():
    """Keras' step that finds the iterator of a dataset of unknown length exhausted used to
    advance optimizer.iterations without an update (9 for 8 steps, an audit), which would
    look like an update outside the ledger; the optimizer's update now waits for the noisy
    gradients: the counts agree, and fit trains on."""
    x, y = _data(11)

    def batches():
        for start in range(0, N, 16):
            yield x[start:start + 16], y[start:start + 16]

    dataset = tf.data.Dataset.from_generator(batches, output_signature=(
        tf.TensorSpec((None, DIM), tf.float32), tf.TensorSpec((None, K), tf.float32)))
    model = _model()
    for _ in range(2):
        model.fit(dataset, epochs=2, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == model.dp_steps_taken == 16


def _on_layers(layers):
    """A compiled DP_Sequential of `layers` (shared with the models they come from), with the
    parameters of `_model()`."""
    model = lipdp.DP_Sequential(layers, dataset_metadata=_metadata(),
                                dp_parameters=lipdp.DPParameters(1.0, DELTA, "per-layer"))
    _compile(model)
    return model


def _adam_model(epochs, seed):
    """`_model()` with Adam (moments: an optimizer state built by the private steps), trained
    `epochs` epochs (4 steps each) on `_data(seed)`."""
    model = _model()
    model.compile(loss=DP_TauCategoricalCrossentropy(3.0), optimizer=tf.keras.optimizers.Adam(1e-2))
    x, y = _data(seed)
    model.fit(x, y, epochs=epochs, verbose=0)
    return model


@pytest.mark.parametrize("epochs_a,epochs_b", [(2, 1), (2, 2), (1, 2)],
                         ids=["ahead", "same length", "behind"])
def test_weights_of_another_run_set_over_an_optimizer_state_compose_both_runs(
        epochs_a, epochs_b, tmp_path):
    """Model B's Adam moments come from its own steps; given the weights of another run A of
    the same mechanism (set_weights, or an HDF5 file of them), its next updates read both
    runs. Both ledgers record the same segment, so each seemed to continue the other: B
    reported A's 8 steps (ahead, then 12 after 4 more, for 16: an audit), or its own 8
    (same length, behind). The ledger now composes both."""
    a, b = _adam_model(epochs_a, seed=1), _adam_model(epochs_b, seed=2)
    steps = 4 * (epochs_a + epochs_b)
    with pytest.warns(UserWarning, match="did not hand out"):
        b.set_weights(a.get_weights())
    s, q = 1.0 / math.sqrt(6), 16 / N
    assert b.dp_steps_taken == steps
    _assert_agrees(accounting.epsilon_spent(b), _reference([(s, q, steps)]))
    x, y = _data(3)
    b.fit(x, y, epochs=1, verbose=0)
    assert b.dp_steps_taken == steps + 4
    _assert_agrees(accounting.epsilon_spent(b), _reference([(s, q, steps + 4)]))

    a.save_weights(str(tmp_path / "a.h5"))
    c = _adam_model(epochs_b, seed=2)
    with pytest.warns(UserWarning, match="did not hand out"):
        c.load_weights(str(tmp_path / "a.h5"))
    assert c.dp_steps_taken == steps


def test_its_own_states_set_back_or_a_fresh_optimizer_keep_the_ledger(tmp_path):
    """What the model handed out (get_weights: Keras' EarlyStopping restores it; save_weights:
    ModelCheckpoint) is its own run: set back, the ledger keeps its steps, nothing added. A
    TensorFlow-format file carries the optimizer's state, which replaces the model's: the
    loaded run is then the only one its updates read. So does a model whose optimizer holds
    no state of its own (plain SGD, never stepped)."""
    x, y = _data(4)
    model = _adam_model(1, seed=1)
    best = model.get_weights()
    model.save_weights(str(tmp_path / "best.h5"))
    model.fit(x, y, epochs=1, verbose=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.load_weights(str(tmp_path / "best.h5"))
        model.set_weights(best)
    assert not [w for w in caught if "did not hand out" in str(w.message)]
    assert model.dp_steps_taken == 8 and model.privacy_ledger.steps == 8

    other = _adam_model(2, seed=2)
    other.save_weights(str(tmp_path / "other"))  # TensorFlow format: the optimizer's state too
    model.load_weights(str(tmp_path / "other"))
    assert model.dp_steps_taken == 8  # the model's run is gone: weights and moments replaced

    fresh = _model()  # plain SGD
    fresh.fit(x, y, epochs=1, verbose=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fresh.set_weights(other.get_weights())
    assert not [w for w in caught if "did not hand out" in str(w.message)]
    assert fresh.dp_steps_taken == 8


def test_runs_of_one_mechanism_are_told_apart_by_the_rows_naming_them():
    """`continues` and `concatenated` on stored ledgers: two runs of one mechanism differ
    only in the row naming each; a later checkpoint of a run continues its earlier ones, the
    composition of two runs continues the first and counts both, and ledgers saved before
    runs were named are decided by their segments."""
    ledger = lipdp.ledger
    mechanism = _model()._step_mechanism.to_row()
    segment = [0.0, *mechanism]

    def run(name, steps):
        return steps, np.array([ledger.run_row(name), segment])

    a, b = run(5, 8), run(7, 8)
    assert not ledger.continues(a, b) and not ledger.continues(b, a)
    assert ledger.continues(a, run(5, 12)) and not ledger.continues(run(5, 12), a)
    assert ledger.continues((0, ledger.EMPTY_STORAGE), a) and ledger.continues(run(9, 0), a)
    both = ledger.concatenated(a, b)
    assert both[0] == 16 and both[1][:, 0].tolist() == [ledger.RUN_MARK, 0, ledger.RUN_MARK, 8]
    assert ledger.continues(a, both) and not ledger.continues(both, a)
    assert not ledger.continues(b, both)
    # one mechanism's consecutive segments are one: composed as an uninterrupted run is
    assert [s.steps for s in ledger.PrivacyLedger.from_rows(both[1], 16).segments] == [16]
    # the name and segment opened for steps to come hold none: named again (after a load)
    opened = [ledger.run_row(9), [8.0, *mechanism]]
    assert ledger.continues((8, np.concatenate([a[1], opened])), a)
    renamed = np.concatenate([a[1], [ledger.run_row(11), [8.0, *mechanism]]])
    assert ledger.continues((8, np.concatenate([a[1], opened])), (8, renamed))
    assert not ledger.continues((8, np.concatenate([b[1], opened])), a)
    unnamed = np.array([segment])
    assert ledger.continues((8, unnamed), (12, unnamed))
    assert not ledger.continues((8, unnamed), a)  # an unnamed run and a named one: two runs
    for name in (0, 2 ** 53):
        with pytest.raises(ValueError, match="run id"):
            ledger.run_row(name)


def _adam_compiled():
    model = _model()
    model.compile(loss=DP_TauCategoricalCrossentropy(3.0), optimizer=tf.keras.optimizers.Adam(1e-2))
    return model


@pytest.mark.parametrize("epochs_b", [2, 1], ids=["same length", "shorter"])
def test_weights_of_another_run_set_over_a_loaded_optimizer_state_compose_both_runs(
        epochs_b, tmp_path):
    """A new model loads run A's TensorFlow-format checkpoint (weights, ledger and Adam
    moments), then is given the weights of another run B of the same mechanism: its next
    updates read A's moments and B's weights. Both ledgers recorded the same segment and the
    model had taken no step of its own, so B's ledger replaced A's (8 steps reported for 16)
    or A's was kept (8 for 12): an audit, 2026-12-06. Each run's ledger now names the run."""
    a, b = _adam_model(2, seed=1), _adam_model(epochs_b, seed=2)
    a.save_weights(str(tmp_path / "a"))
    model = _adam_compiled()
    model.load_weights(str(tmp_path / "a"))
    assert model.dp_steps_taken == 8
    with pytest.warns(UserWarning, match="another run"):
        model.set_weights(b.get_weights())
    steps = 8 + 4 * epochs_b
    assert model.dp_steps_taken == steps
    _assert_agrees(accounting.epsilon_spent(model), _reference([(1.0 / math.sqrt(6), 16 / N,
                                                                 steps)]))


@pytest.mark.parametrize("common_steps", [8, 0], ids=["trained checkpoint", "untrained file"])
def test_branches_resumed_from_one_file_are_told_apart(common_steps, tmp_path):
    """Two models resume one file (8 Adam steps, or none: saved by ``fit(epochs=0)``) and
    train apart; a third loads one branch's TensorFlow checkpoint (its Adam moments) and is
    given the other's weights. The first version of run names let both branches keep the
    file's name: 12 steps reported for 16, and 8 for 16 from the untrained file (an audit,
    2026-12-06). Each object now names its own steps; the common steps count twice (safe)."""
    base = _adam_compiled()
    base.fit(*_data(1), epochs=common_steps // 4, verbose=0)
    base.save_weights(str(tmp_path / "base"))
    branches = []
    for seed in (2, 3):
        branch = _adam_compiled()
        branch.load_weights(str(tmp_path / "base"))
        branch.fit(*_data(seed), epochs=1, verbose=0)
        branches.append(branch)
    branches[1].save_weights(str(tmp_path / "second"))
    model = _adam_compiled()
    model.load_weights(str(tmp_path / "second"))
    with pytest.warns(UserWarning, match="another run"):
        model.set_weights(branches[0].get_weights())
    truth = common_steps + 8
    assert model.dp_steps_taken >= truth
    assert accounting.epsilon_spent(model) >= _reference([(1.0 / math.sqrt(6), 16 / N, truth)])


def test_steps_after_a_load_inside_training_are_the_model_s_own(tmp_path):
    """A callback loads run A's checkpoint of 8 Adam steps at the second epoch: the 4 steps
    that follow are the model's. They were filed under A's name, and a model given these
    weights over A's later Adam state (16 steps) reported 16 for 20 (an audit, 2026-12-06)."""
    x, y = _data(15)
    a = _adam_compiled()
    a.fit(x, y, epochs=2, verbose=0)
    a.save_weights(str(tmp_path / "a8"))
    a.fit(x, y, epochs=2, verbose=0)
    a.save_weights(str(tmp_path / "a16"))

    class Restore(tf.keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            if epoch == 1:
                self.model.load_weights(str(tmp_path / "a8"))

    model = _adam_compiled()
    model.fit(*_data(16), epochs=2, verbose=0, callbacks=[Restore()])
    assert model.dp_steps_taken == 12
    model.save_weights(str(tmp_path / "model.h5"))
    other = _adam_compiled()
    other.load_weights(str(tmp_path / "a16"))
    with pytest.warns(UserWarning, match="another run"):
        other.load_weights(str(tmp_path / "model.h5"))
    assert other.dp_steps_taken >= 20


def _mixed_weights(model, other, own):
    """`other`'s weights, as `model.set_weights` takes them, with the model's own kept for
    the variables in `own`: both runs in the model."""
    own = {id(v) for v in own}
    return [mine if id(v) in own else theirs for v, mine, theirs in
            zip(model.weights, model.get_weights(), other.get_weights())]


class _SetsWeightsAfterFirstStep(tf.keras.callbacks.Callback):
    """At the end of a fit's first step, sets `other`'s weights on the model, keeping its own
    for the variables ``own(model)`` lists (`_mixed_weights`)."""

    def __init__(self, other, own):
        super().__init__()
        self.other, self.own = other, own

    def on_train_batch_end(self, batch, logs=None):
        if batch == 0:
            self.model.set_weights(_mixed_weights(self.model, self.other, self.own(self.model)))


def _fit_under_a_budget_of_12_with(loader_type):
    """A model of 4 steps fitted under a budget of 12 steps, with a `loader_type` listed after
    the accountant setting another run's weights (8 steps) on its first kernel; the fit
    must raise before a step past the budget. Returns the model and the budget."""
    budget = _reference([(1.0 / math.sqrt(6), 16 / N, 12)]) * 1.001
    other = _model()
    other.fit(*_data(2), epochs=2, verbose=0)
    model = _model()
    model.fit(*_data(1), epochs=1, verbose=0)
    loader = loader_type(other, lambda m: m.weights[:1])
    with pytest.warns(UserWarning, match="did not replace"), \
            pytest.raises(ValueError, match="Cannot train within epsilon_budget"):
        model.fit(*_data(1), epochs=3, verbose=0,
                  callbacks=[lipdp.DP_Accountant(epsilon_budget=budget), loader])
    return model, budget


def test_the_budget_holds_when_a_callback_loads_another_run_during_fit():
    """DP_Accountant planned its step limit once per epoch: weights of another run set by a
    callback during `fit` composed both ledgers, and training ran on past the budget (an
    audit, 2026-12-06: 13-14 steps for a budget of 12; epsilon 304.9 for 62.4). It now plans
    again before the next step and stops `fit` there."""
    s, q = 1.0 / math.sqrt(6), 16 / N
    model, budget = _fit_under_a_budget_of_12_with(_SetsWeightsAfterFirstStep)
    assert model.dp_steps_taken == 13  # 4, one step of this fit, then the other run's 8
    assert accounting.epsilon_spent(model) > budget  # the load, not a step, went past it

    # The loader listed first, at the end of a step, with a costlier run (sigma 0.3): the
    # accountant sees the change at that step's end and stops there (it trained on to 16
    # steps, epsilon 304.9 for a budget of 62.4).
    costly = _model(sigma=0.3)
    costly.fit(*_data(2), epochs=1, verbose=0)
    model = _model()
    model.fit(*_data(1), epochs=1, verbose=0)

    loader = _SetsWeightsAfterFirstStep(costly, lambda m: [m.weights[0], m._examples_seen])
    budget = _reference([(s, q, 16)]) * 1.001
    with pytest.warns(UserWarning, match="did not replace"):
        model.fit(*_data(1), epochs=6, verbose=0,
                  callbacks=[loader, lipdp.DP_Accountant(epsilon_budget=budget)])
    assert model.dp_steps_taken == 9  # 4, one step, the costly run's 4: no step after it


class _SetsWeightsBeforeSecondStep(_SetsWeightsAfterFirstStep):
    """`_SetsWeightsAfterFirstStep`, at the start of the fit's second step instead."""

    def on_train_batch_end(self, batch, logs=None):
        pass

    def on_train_batch_begin(self, batch, logs=None):
        if batch == 1:
            self.model.set_weights(_mixed_weights(self.model, self.other, self.own(self.model)))


def test_the_budget_holds_when_a_callback_after_the_accountant_loads_before_a_step():
    """A callback listed after `DP_Accountant` setting another run's weights at the start of
    a step: the accountant had checked the budget already, and the step ran past it (14
    steps for a budget of 12). `fit` checks the accountants' budgets again after every
    callback's start of a step (`_NoteLedger`), and stops before the step."""
    model, _ = _fit_under_a_budget_of_12_with(_SetsWeightsBeforeSecondStep)
    assert model.dp_steps_taken == 13  # 4, one step of this fit, then the other run's 8


def test_the_budget_holds_when_a_load_before_a_step_keeps_the_step_count():
    """A callback listed after `DP_Accountant` replacing every weight with those of a costlier
    run of as many steps (sigma 0.3 against 1, 4 steps each) before a step: only the ledger's
    rows change, not its step count. The accountant reads the ledger once per check and
    decodes it again when its stored rows changed (`DP_Accountant._ledger_state`); decoded
    again only when the count changed, the re-check before the step saw no change, and the
    step ran past the budget."""
    costly = _model(sigma=0.3)
    costly.fit(*_data(2), epochs=1, verbose=0)
    model = _model()
    model.fit(*_data(1), epochs=1, verbose=0)

    class Replace(tf.keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            if batch == 0:
                self.model.set_weights(costly.get_weights())

    budget = _reference([(1.0 / math.sqrt(6), 16 / N, 12)]) * 1.001
    with pytest.raises(ValueError, match="Cannot train within epsilon_budget"):
        model.fit(*_data(1), epochs=3, verbose=0,
                  callbacks=[lipdp.DP_Accountant(epsilon_budget=budget), Replace()])
    assert model.dp_steps_taken == 4  # the costly run's 4: no step after the load
    assert model.privacy_ledger == costly.privacy_ledger


def test_a_list_of_weights_that_keeps_some_of_the_model_s_own_is_not_a_replacement():
    """`set_weights` with another run's list in which the model's own trained kernel was put
    back, or the layer it trained then froze, or the power-iteration vectors its kernels
    left: the model keeps its run (audits of the first versions: 4 steps for 12)."""
    other = _model()
    other.fit(*_data(2), epochs=1, verbose=0)
    for kept in ("kernel", "frozen layer", "power_iteration_u"):
        model = _model()
        model.fit(*_data(1), epochs=2, verbose=0)
        if kept == "frozen layer":
            model.layers[-1].trainable = False
            _compile(model)
        own = (model.layers[-1].weights if kept == "frozen layer" else
               [w for w in model.weights if kept in w.name][:1])
        with pytest.warns(UserWarning, match="did not replace"):
            model.set_weights(_mixed_weights(model, other, own))
        assert model.dp_steps_taken == 12, kept


def test_a_run_wholly_replaced_by_another_leaves_only_the_other_and_a_run_keeps_its_name(
        tmp_path):
    """Every weight of another run set on a model whose optimizer holds no state its updates
    read (plain SGD): nothing of the model's run is left, and its ledger is the loaded one,
    whatever the mechanisms (before, runs of other mechanisms were composed). A run resumed
    from its checkpoint keeps the name of its run: its earlier checkpoints are its own."""
    x, y = _data(6)
    other = _model(sigma=2.0)
    other.fit(x, y, epochs=2, verbose=0)
    model = _model()
    model.fit(x, y, epochs=1, verbose=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model.set_weights(other.get_weights())
    assert model.dp_steps_taken == 8
    assert model.privacy_ledger == other.privacy_ledger

    other.save_weights(str(tmp_path / "early.h5"))
    other.save_weights(str(tmp_path / "early"))
    other.fit(x, y, epochs=1, verbose=0)
    other.save_weights(str(tmp_path / "late"))
    resumed = _model(sigma=2.0)
    resumed.load_weights(str(tmp_path / "late"))
    resumed.fit(x, y, epochs=1, verbose=0)
    with pytest.warns(UserWarning, match="keeps the 16 steps"):
        resumed.load_weights(str(tmp_path / "early.h5"))
    assert resumed.dp_steps_taken == 16
    assert lipdp.ledger.stored_rows(resumed._dp_ledger.numpy())[0, 0] == lipdp.ledger.RUN_MARK


def test_models_sharing_layers_count_each_others_steps():
    """A model built on a trained model's layers trains the same variables: each ledger must
    count the other's steps. Model B on A's layers reported its own 8 steps, and A, trained
    on by B, its own 4, for weights that took 12 (an audit, 2026-12-06); a new head on A's
    layers reported only its own steps too."""
    x, y = _data(5)
    s, q = 1.0 / math.sqrt(6), 16 / N
    a = _model()
    a.fit(x, y, epochs=1, verbose=0)
    b = _on_layers(a.layers)
    b.fit(x, y, epochs=2, verbose=0)
    assert b.dp_steps_taken == 12 and a.dp_steps_taken == 12  # read before a's ledger
    assert a.privacy_ledger.steps == 12
    _assert_agrees(accounting.epsilon_spent(a), _reference([(s, q, 12)]))
    a.fit(x, y, epochs=1, verbose=0)
    assert a.dp_steps_taken == 16 and b.privacy_ledger.steps == 16
    head = _on_layers(a.layers[:-1] + [DP_QuickSpectralDense(K)])
    head.fit(x, y, epochs=1, verbose=0)
    assert head.dp_steps_taken == 20
    _assert_agrees(accounting.epsilon_spent(head), _reference([(s, q, 20)]))


def test_steps_of_a_fit_stopped_by_an_exception_are_not_rolled_back(tmp_path):
    """The high-water mark was noted at epoch ends only: 3 steps of an epoch stopped by an
    exception, then a checkpoint of the step before them restored (what BackupAndRestore does
    when the run is started again), left the ledger at the checkpoint's count (an audit)."""
    x, y = _data(6)
    model = _model()
    model.fit(x, y, epochs=1, verbose=0)
    checkpoint = tf.train.Checkpoint(model=model)
    path = checkpoint.save(str(tmp_path / "ckpt"))

    class Stop(tf.keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 2:
                raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        model.fit(x, y, epochs=1, verbose=0, callbacks=[Stop()])
    assert model.dp_steps_taken == 7
    checkpoint.restore(path)
    with pytest.warns(UserWarning, match="keeps the 7 steps"):
        assert model.privacy_ledger.steps == 7


@pytest.mark.parametrize("when, taken", [("epoch", 8), ("step", 6)])
def test_a_checkpoint_restored_by_a_callback_during_fit_rolls_no_step_back(when, taken, tmp_path):
    """A callback restores, during `fit`, a tf.train.Checkpoint of the weights (the ledger
    among them) and of the optimizer's update count written 4 steps earlier, the momentum
    left as it is: the later updates read those 4 steps' noise, so all 12 steps count. The
    high-water mark was noted at epochs' ends, after the user's callbacks: restored in
    ``on_epoch_end``, the ledger read 8 of 12 steps without a word (an audit); restored
    after a step, the fit stopped on a count of updates outside the ledger."""
    x, y = _data(6)
    model = _model()
    model.compile(loss=DP_TauCategoricalCrossentropy(3.0),
                  optimizer=tf.keras.optimizers.SGD(0.01, momentum=0.9))

    class Restore(tf.keras.callbacks.Callback):
        path, steps = None, 0

        def on_train_batch_end(self, batch, logs=None):
            self.steps += 1
            if when == "step" and self.steps in (2, 6):
                self._write_then_read()

        def on_epoch_end(self, epoch, logs=None):
            if when == "epoch" and epoch < 2:
                self._write_then_read()

        def _write_then_read(self):
            variables = list(self.model.weights) + [self.model.optimizer.iterations]
            checkpoint = tf.train.Checkpoint(variables=variables)
            if self.path is None:
                self.path = checkpoint.write(str(tmp_path / "ckpt"))
            else:
                checkpoint.read(self.path)

    with pytest.warns(UserWarning, match=f"keeps the {taken} steps"):
        model.fit(x, y, epochs=3, verbose=0, callbacks=[Restore()])
    assert int(model.optimizer.iterations.numpy()) == 8  # the restored count, then 4 more
    assert model.dp_steps_taken == 12
    _assert_agrees(accounting.epsilon_spent(model), _reference([(1.0 / np.sqrt(6), 0.25, 12)]))


def _pretrained_layers(epochs, seed):
    """The layers of a `_model()` trained `epochs` epochs (4 steps each), the model dropped."""
    model = _model()
    x, y = _data(seed)
    model.fit(x, y, epochs=epochs, verbose=0)
    return model.layers


def test_layers_of_collected_frozen_or_several_runs_bring_their_steps(tmp_path):
    """The ledger owner is kept by its variables, and every owner of a model's variables
    counts, trainable or frozen, each run once. The audit of the first version (2026-12-06):
    a model on the layers of two runs of one mechanism (8 and 12 steps) counted 12, since one
    ledger seemed to continue the other; on the layers of a model since collected, 0; on a
    frozen base, 0; and a model trained on by another, exported before reading its ledger,
    wrote its own steps only."""
    import gc

    s, q = 1.0 / math.sqrt(6), 16 / N
    first, second = _pretrained_layers(2, 8), _pretrained_layers(3, 9)
    gc.collect()
    mixed = _on_layers(first[:3] + second[3:])
    assert mixed.privacy_ledger.steps == 20
    _assert_agrees(accounting.epsilon_spent(mixed), _reference([(s, q, 20)]))

    base = _pretrained_layers(2, 10)
    for layer in base:
        layer.trainable = False
    head = _on_layers(base[:-1] + [DP_QuickSpectralDense(K)])
    x, y = _data(11)
    head.fit(x, y, epochs=1, verbose=0)
    assert head.dp_steps_taken == 12
    _assert_agrees(accounting.epsilon_spent(head),
                   _reference([(s, q, 8), (1 / math.sqrt(2), q, 4)]))

    a = _model()
    a.fit(x, y, epochs=1, verbose=0)
    b = _on_layers(a.layers)
    b.fit(x, y, epochs=2, verbose=0)
    a.save_weights(str(tmp_path / "a.h5"))
    fresh = _model()
    fresh.load_weights(str(tmp_path / "a.h5"))
    assert fresh.dp_steps_taken == 12


def test_a_checkpoint_that_restores_part_of_the_model_composes_both_runs(tmp_path):
    """The model's last layer, trained by its own 4 steps, then frozen; a TensorFlow
    checkpoint of another run that lacks that layer sets every trainable variable, not the
    frozen one: the model holds both runs' weights (the load is not a wholesale one)."""
    x, y = _data(14)
    model = _model()
    model.fit(x, y, epochs=1, verbose=0)
    model.layers[-1].trainable = False
    _compile(model)
    shorter = lipdp.DP_Sequential(
        [DP_BoundedInput(2.0, input_shape=(DIM,)), DP_QuickSpectralDense(8),
                            DP_GroupSort(2), DP_QuickSpectralDense(8)],
        dp_parameters=lipdp.DPParameters(1.0, DELTA, "per-layer"),
        dataset_metadata=lipdp.DatasetMetadata((DIM,), 8, N, 8, 16, 2.0, "shuffle"))
    _compile(shorter)
    shorter.fit(x, np.eye(8, dtype="float32")[np.argmax(y, axis=1)], epochs=2, verbose=0)
    shorter.save_weights(str(tmp_path / "shorter"))
    with pytest.warns(UserWarning, match="did not replace"):
        model.load_weights(str(tmp_path / "shorter"))
    assert model.dp_steps_taken == 12


def test_weights_set_on_a_model_sharing_layers_reach_the_other_models_ledger():
    """Model M shares all but the head of A's layers, and A trained last (A owns them). The
    weights of another run B, set on M, land in A's variables too: A then holds B's layers
    under its own head, and reported its own 8 steps for 16 (M's ledger took B's alone, and
    A saw no other owner). `set_weights` now takes the variables over first, and a run wholly
    replaced forgets the ledgers it had absorbed."""
    s, q = 1.0 / math.sqrt(6), 16 / N
    x, y = _data(13)
    a = _model()
    a.fit(x, y, epochs=1, verbose=0)
    m = _on_layers(a.layers[:-1] + [DP_QuickSpectralDense(K)])
    a.fit(x, y, epochs=1, verbose=0)
    b = _model()
    b.fit(x, y, epochs=2, verbose=0)
    m.set_weights(b.get_weights())
    assert a.privacy_ledger.steps == 16
    _assert_agrees(accounting.epsilon_spent(a), _reference([(s, q, 16)]))

    # The replacing run shorter than the steps a model sharing the layers remembers of the
    # replaced one (an audit of the first version: 12 reported for 16, the token kept).
    n = _on_layers(b.layers[:-1] + [DP_QuickSpectralDense(K)])
    n.fit(x, y, epochs=1, verbose=0)
    assert n.dp_steps_taken == 12
    r = _model()
    r.fit(x, y, epochs=1, verbose=0)
    b.set_weights(r.get_weights())
    assert n.privacy_ledger.steps == 16


def test_a_reloaded_model_given_weights_of_its_own_run_counts_the_run_once(tmp_path):
    """A model restored with its optimizer's state (`lipdp.load_model`) holds no state of
    steps it took itself: the best weights of the same run loaded into it then are not
    another run's (the first version of the rule counted the run twice: 16 steps for 8)."""
    x, y = _data(12)
    model = _adam_model(1, seed=1)
    model.save_weights(str(tmp_path / "best.h5"))
    model.fit(x, y, epochs=1, verbose=0)
    model.save(str(tmp_path / "last.keras"))
    reloaded = lipdp.load_model(str(tmp_path / "last.keras"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        reloaded.load_weights(str(tmp_path / "best.h5"))
    assert not [w for w in caught if "did not hand out" in str(w.message)]
    assert reloaded.dp_steps_taken == 8


@pytest.mark.parametrize("first", ["accountant", "trainer"])
def test_steps_taken_at_the_end_of_training_are_logged_with_their_epsilon(first):
    """A callback's ``on_train_end`` calling ``train_on_batch`` took 3 steps after the last
    epoch's epsilon was written: the logs and History ended at 6.528 after 8 steps, while 11
    steps had spent 7.176 (an audit, 2026-12-07). The accountant now warns and logs again,
    whatever the callbacks' order."""
    x, y = _data(9)
    model, lines = _model(), []

    class Trainer(tf.keras.callbacks.Callback):
        def on_train_end(self, logs=None):
            for _ in range(3):
                self.model.train_on_batch(x[:16], y[:16])

    accountant = lipdp.DP_Accountant(log_fn=lines.append)
    callbacks = [accountant, Trainer()] if first == "accountant" else [Trainer(), accountant]
    with pytest.warns(UserWarning, match=r"3 private step\(s\) ran after the last epoch's "
                                         r"epsilon was written"):
        history = model.fit(x, y, epochs=2, verbose=0, callbacks=callbacks)
    spent = accounting.epsilon_spent(model)
    assert model.dp_steps_taken == 11
    assert history.history["epsilon"][-1] < spent
    assert lines[-1].endswith(f"after 11 steps epsilon={accounting.format_epsilon(spent)}, "
                              "delta=1e-05."), lines
    with warnings.catch_warnings(record=True) as caught:  # a fit without such steps: silent
        warnings.simplefilter("always")
        model.fit(x, y, epochs=1, verbose=0, callbacks=[accountant])
    assert not [w for w in caught if "ran after the last epoch" in str(w.message)]
    assert "after 15 steps." in lines[-1], lines
