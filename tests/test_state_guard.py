"""A layer that writes its state only after some calls (a warm-up) is stopped at the first
step that writes, before its update, with the written value put back (`lipdp.state_guard`):
in classic DP-SGD, and for a DP layer defined outside lipdp in clipless mode. The
compile-time probe (`check_no_batch_coupling`), every pass of which starts from the compiled
state, let it through: a running maximum of ``|x|`` after three calls saved a training
record's value (1234.5) in the model (an audit, 2026-12-07)."""

import warnings

import numpy as np
import pytest
import tensorflow as tf

import lipdp
from lipdp.clipping import BatchCouplingError
from lipdp.layers import DP_BoundedInput, DP_QuickSpectralDense
from lipdp.layers.base import DPLayer
from lipdp.losses import DP_TauCategoricalCrossentropy

L = tf.keras.layers
N, BATCH, DIM, CANARY = 64, 8, 4, 1234.5


class _WarmedMaximum(L.Layer):
    """The identity, which from its third training call on keeps the largest ``|x|`` it
    sees in a non-trainable variable: the probe's passes, each from the compiled state (no
    call yet), never write it."""

    def build(self, input_shape):
        self.calls = self.add_weight(name="calls", shape=(), initializer="zeros",
                                     trainable=False)
        self.largest = self.add_weight(name="largest", shape=(), initializer="zeros",
                                       trainable=False)

    def call(self, inputs, training=None):
        if training:
            self.calls.assign_add(1.0)
            self.largest.assign(tf.where(
                self.calls > 2.0, tf.maximum(self.largest, tf.reduce_max(tf.abs(inputs))),
                self.largest))
        return inputs


class _WarmedModel(lipdp.DP_Sequential):
    """`_WarmedMaximum`'s state in the model's own variables (a subclass): only layers'
    variables were guarded, and it kept the canary (an audit, 2026-12-07)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls = tf.Variable(0.0, trainable=False, name="model_calls")
        self.largest = tf.Variable(0.0, trainable=False, name="model_largest")

    def call(self, inputs, training=None, **kwargs):
        if training:
            self.calls.assign_add(1.0)
            self.largest.assign(tf.where(
                self.calls > 2.0, tf.maximum(self.largest, tf.reduce_max(tf.abs(inputs))),
                self.largest))
        return super().call(inputs, training=training, **kwargs)


class _InferenceMaximum(L.Layer):
    """Keeps the largest ``|x|`` of its inference calls (`evaluate`, `predict`): the probe
    judges training passes."""

    def build(self, input_shape):
        self.largest = self.add_weight(name="largest", shape=(), initializer="zeros",
                                       trainable=False)

    def call(self, inputs, training=None):
        if not training:
            self.largest.assign(tf.maximum(self.largest, tf.reduce_max(tf.abs(inputs))))
        return inputs


class _LazyMaximum(L.Layer):
    """Creates its variable in its first training call (after build) and writes the batch's
    largest ``|x|`` into it: the probe listed the variables before its passes, so neither
    it nor the guard compared this one (an audit, 2026-12-07: the canary stayed)."""

    largest = None

    def call(self, inputs, training=None):
        if training:
            if self.largest is None:
                with tf.init_scope():
                    self.largest = self.add_weight(name="largest", shape=(),
                                                   initializer="zeros", trainable=False)
            self.largest.assign(tf.reduce_max(tf.abs(inputs)))
        return inputs


class _LaterMaximum(L.Layer):
    """Creates its variable after the compile-time probe, at its first call that `when`
    accepts (``(training, eager)``), and keeps the largest ``|x|`` in it (an audit,
    2026-12-07: a traced training call, an inference call, the 41st call in Python)."""

    largest = None

    def __init__(self, when, **kwargs):
        super().__init__(**kwargs)
        self.when, self.calls = when, 0

    def call(self, inputs, training=None):
        self.calls += 1
        if self.largest is None and self.when(training, tf.executing_eagerly(), self.calls):
            with tf.init_scope():
                self.largest = self.add_weight(name="largest", shape=(), initializer="zeros",
                                               trainable=False)
        if self.largest is not None:
            self.largest.assign(tf.maximum(self.largest, tf.reduce_max(tf.abs(inputs))))
        return inputs


class _IdentityBounds(DPLayer):
    """The bounds of the identity, which these layers are (their writes aside): they hold."""

    def propagate_inputs(self, input_bound):
        return input_bound

    def backpropagate_inputs(self, input_bound, gradient_bound):
        return gradient_bound


class _LaterDPMaximum(_LaterMaximum, _IdentityBounds):
    """`_LaterMaximum` as a DP layer: in clipless mode, compile's check of variables read
    across layers traces the model after the probe, which created the variable before the
    guard listed the model's variables (a review, 2026-12-07)."""


class _InferenceDPMaximum(_InferenceMaximum, _IdentityBounds):
    """`_InferenceMaximum` as a DP layer."""


class _WarmedDPMaximum(_WarmedMaximum, _IdentityBounds):
    """`_WarmedMaximum` as a DP layer."""


def _model(mode, run_eagerly=False, layer=None, model_cls=lipdp.DP_Sequential):
    tf.keras.utils.set_random_seed(0)
    metadata = lipdp.DatasetMetadata((DIM,), 3, N, 8, BATCH, CANARY, "shuffle")
    if mode == "clipless":
        model = lipdp.DP_Sequential(
            [DP_BoundedInput(CANARY, input_shape=(DIM,)), (layer or _WarmedDPMaximum)(
                name="warmed"), DP_QuickSpectralDense(3)],
            dp_parameters=lipdp.DPParameters(noise_multiplier=1.0, delta=1e-5),
            dataset_metadata=metadata)
        loss = DP_TauCategoricalCrossentropy(1.0)
    else:
        model = model_cls(
            [L.Input((DIM,)), (layer or _WarmedMaximum)(name="warmed"), L.Dense(3)],
            dp_parameters=lipdp.DPParameters(1.0, 1e-5, mode="clipped", l2_norm_clip=1.0,
                                             engine=mode),
            dataset_metadata=metadata)
        loss = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model.compile(loss=loss, optimizer=tf.keras.optimizers.SGD(0.1), run_eagerly=run_eagerly)
    tf.random.set_seed(None)
    return model


@pytest.mark.parametrize("mode,run_eagerly", [
    ("ghost", False), ("ghost", True), ("vectorized", False), ("clipless", False)])
def test_state_written_after_a_warm_up_stops_the_step_and_is_put_back(mode, run_eagerly):
    """Every batch holds the canary: the step that first writes it fails naming the
    variable, its update not applied, the variable back at 0, the ledger at the steps
    before; the call counter (moved alike by every probe pass) is not guarded."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = _model(mode, run_eagerly)
    names = [v.name for v in model._state_guard.variables]
    assert "warmed/largest:0" in names and "warmed/calls:0" not in names
    rng = np.random.default_rng(1)
    x = rng.normal(size=(BATCH, DIM)).astype(np.float32)
    x[3, 1] = CANARY
    y = rng.integers(0, 3, BATCH)
    warmed = model.get_layer("warmed")
    for step in range(6):
        before = [v.numpy() for v in model.trainable_variables]
        try:
            model.train_on_batch(x, y)
        except tf.errors.InvalidArgumentError as error:
            assert "warmed/largest:0" in error.message
            assert "put back, and no update was applied" in error.message
            break
        assert warmed.largest.numpy() == 0.0
    else:
        pytest.fail(f"six steps trained; the layer holds {warmed.largest.numpy()}")
    assert warmed.calls.numpy() > 2.0  # the layer did write in the failed step
    assert warmed.largest.numpy() == 0.0
    for b, v in zip(before, model.trainable_variables):
        np.testing.assert_array_equal(b, v.numpy(), err_msg=v.name)
    assert model.dp_steps_taken == step
    assert model._examples_seen.numpy() == step * BATCH  # not the failed step's


def test_state_of_a_model_subclass_is_guarded():
    """The subclass' own variable, written from the third call on, stops that step; the
    model's bookkeeping (ledger, step count, draw mark) is not guarded: the step writes it."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = _model("ghost", layer=lambda name: L.Activation("linear", name=name),
                       model_cls=_WarmedModel)
    names = [v.name for v in model._state_guard.variables]
    assert "model_largest:0" in names and "model_calls:0" not in names
    assert not {"dp_steps_taken:0", "dp_ledger:0", "examples_seen:0", "loss_gradient_clip:0",
                "poisson_draws_until:0"} & set(names)
    x = np.full((BATCH, DIM), CANARY, np.float32)
    with pytest.raises(tf.errors.InvalidArgumentError, match="model_largest:0"):
        for _ in range(6):
            model.train_on_batch(x, np.zeros(BATCH, np.int64))
    assert model.largest.numpy() == 0.0 and model.dp_steps_taken == 2


class _HeldLayerModel(lipdp.DP_Sequential):
    """Calls a `_WarmedMaximum` it holds in an attribute: Keras does not track the layers set
    on a Sequential model, so its variables were in neither `model.variables` nor the
    probe's and the guard's lists, and it kept the canary through `fit` (a review,
    2026-12-07)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.held = {"maxima": [_WarmedMaximum(name="held")]}

    def call(self, inputs, training=None, **kwargs):
        inputs = self.held["maxima"][0](inputs, training=training)
        return super().call(inputs, training=training, **kwargs)


class _HeldLayerFunctional(lipdp.DP_Model):
    """`_HeldLayerModel` as a functional model, which Keras does track the layers of."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.held = _WarmedMaximum(name="held")

    def call(self, inputs, training=None, **kwargs):
        return super().call(self.held(inputs, training=training), training=training, **kwargs)


@pytest.mark.parametrize("functional", [False, True])
def test_a_layer_held_outside_the_model_s_layers_is_refused_at_compile(functional):
    """A Sequential subclass' held layer is refused; a functional subclass' is tracked by
    Keras, so probed and guarded."""
    parameters = lipdp.DPParameters(1.0, 1e-5, mode="clipped", l2_norm_clip=1.0)
    metadata = lipdp.DatasetMetadata((DIM,), 3, N, 8, BATCH, CANARY, "shuffle")
    loss = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    if functional:
        inputs = tf.keras.Input((DIM,))
        model = _HeldLayerFunctional(inputs, L.Dense(3)(inputs), dp_parameters=parameters,
                                     dataset_metadata=metadata)
        model.compile(loss=loss, optimizer=tf.keras.optimizers.SGD(0.1))
        assert any(v.name.endswith("held/largest:0") for v in model._state_guard.variables)
        return
    model = _HeldLayerModel([L.Input((DIM,)), L.Dense(3)], dp_parameters=parameters,
                            dataset_metadata=metadata)
    with pytest.raises(BatchCouplingError, match="'held' .* held in attribute 'held' "
                                                 "of .* is not one of the model's layers"):
        model.compile(loss=loss, optimizer=tf.keras.optimizers.SGD(0.1))


class _StatefulModule(tf.Module):
    """Not a Keras layer: a `tf.Module` keeping the largest ``|x|`` it is given."""

    def __init__(self):
        super().__init__(name="held")
        self.largest = tf.Variable(0.0, trainable=False)

    def __call__(self, inputs):
        self.largest.assign(tf.maximum(self.largest, tf.reduce_max(tf.abs(inputs))))
        return inputs


class _HeldElsewhere(lipdp.DP_Sequential):
    """Holds `held` (set by the test) and calls it first in its `call`."""

    held = None

    def call(self, inputs, training=None, **kwargs):
        if self.held is not None:
            inputs = _first(self.held)(inputs)
        return super().call(inputs, training=training, **kwargs)


def _first(held):
    if isinstance(held, (set, list)):
        return next(iter(held))
    return getattr(held, "layer", held)


@pytest.mark.parametrize("holder", ["a set", "a SimpleNamespace", "a tf.Module",
                                    "set after compile"])
def test_layers_and_modules_held_in_other_ways_are_refused(holder):
    """A review (2026-12-07) got past the first version with a layer in a set or a
    SimpleNamespace, a stateful `tf.Module` that is not a layer, and a layer set on the model
    after compile (it kept the canary through `fit`): refused at compile, or at the next
    call of `fit`."""
    import types

    model = _HeldElsewhere(
        [L.Input((DIM,)), L.Dense(3)],
        dp_parameters=lipdp.DPParameters(1.0, 1e-5, mode="clipped", l2_norm_clip=1.0),
        dataset_metadata=lipdp.DatasetMetadata((DIM,), 3, N, 8, BATCH, CANARY, "shuffle"))
    held = {"a set": lambda: {_WarmedMaximum(name="held")},
            "a SimpleNamespace": lambda: types.SimpleNamespace(layer=_WarmedMaximum(name="held")),
            "a tf.Module": _StatefulModule,
            "set after compile": lambda: _WarmedMaximum(name="held")}[holder]()

    def compile_model():
        model.compile(loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      optimizer=tf.keras.optimizers.SGD(0.1))

    message = "'held' .* held in attribute 'held' of .* is not one of the model's layers"
    if holder == "set after compile":
        compile_model()
        model.held = held
        with pytest.raises(BatchCouplingError, match=message):
            model.fit(np.full((N, DIM), CANARY, np.float32), np.zeros(N, np.int64), verbose=0)
        assert model.dp_steps_taken == 0
        return
    model.held = held
    with pytest.raises(BatchCouplingError, match=message):
        compile_model()


def test_a_variable_created_by_a_forward_pass_is_refused_at_compile():
    with pytest.raises(BatchCouplingError, match="warmed/largest:0' of layer 'warmed' .* "
                                                 "created by a forward pass"):
        _model("ghost", layer=_LazyMaximum)


@pytest.mark.parametrize("call,step", [
    (lambda model, x: model.evaluate(x, np.zeros(BATCH, np.int64), verbose=0), "evaluation"),
    (lambda model, x: model.predict(x, verbose=0), "prediction")])
def test_state_written_in_inference_is_put_back(call, step):
    """`evaluate` and `predict` on the training records ran the layer's write unchecked."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = _model("ghost", layer=_InferenceMaximum)
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=f"A step \\({step}\\) changed .*warmed/largest:0"):
        call(model, np.full((BATCH, DIM), CANARY, np.float32))
    assert model.get_layer("warmed").largest.numpy() == 0.0


def test_a_model_of_lipdp_layers_guards_nothing():
    """A clipless model of lipdp's own layers alone is not probed and guards nothing: its
    step runs no extra operation."""
    model = lipdp.DP_Sequential(
        [DP_BoundedInput(1.0, input_shape=(DIM,)), DP_QuickSpectralDense(3)],
        dp_parameters=lipdp.DPParameters(noise_multiplier=1.0, delta=1e-5),
        dataset_metadata=lipdp.DatasetMetadata((DIM,), 3, N, 8, BATCH, 1.0, "shuffle"))
    model.compile(loss=DP_TauCategoricalCrossentropy(1.0), optimizer="sgd")
    assert model._state_guard.variables == []


LATER = {
    "a traced training call": (lambda training, eager, calls: training and not eager, False,
                               lambda model, x, y: model.fit(x, y, batch_size=BATCH, verbose=0)),
    "a traced training call, clipless": (
        lambda training, eager, calls: training and not eager, False,
        lambda model, x, y: model.fit(x, np.eye(3, dtype=np.float32)[y], batch_size=BATCH,
                                      verbose=0)),
    "an inference call": (lambda training, eager, calls: training is False, False,
                          lambda model, x, y: model.evaluate(x, y, batch_size=BATCH, verbose=0)),
    "the 41st call, eagerly": (lambda training, eager, calls: training and calls > 40, True,
                               lambda model, x, y: model.fit(x, y, batch_size=BATCH, epochs=10,
                                                             verbose=0)),
}


@pytest.mark.parametrize("case", sorted(LATER))
def test_a_variable_created_after_compile_stops_the_step(case):
    """The guard's list is made at compile: a variable created later, by a traced pass, an
    inference pass or after the probe's calls, was compared by nothing and kept the canary.
    The step that creates one fails (traced: before it runs; eagerly: the value zeroed)."""
    when, eager, run = LATER[case]
    clipless = case.endswith("clipless")
    later = _LaterDPMaximum if clipless else _LaterMaximum
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = _model("clipless" if clipless else "ghost", run_eagerly=eager,
                       layer=lambda name: later(when, name=name))
    x = np.full((N, DIM), CANARY, np.float32)
    with pytest.raises(ValueError, match="did not see .*warmed/largest:0"):
        run(model, x, np.zeros(N, np.int64))
    assert model.get_layer("warmed").largest.numpy() == 0.0


def test_lipdp_certificates_run_under_the_guard():
    """`lipdp.certify` called the model directly, outside `predict`: a layer writing in
    inference kept the canary (an audit, 2026-12-07)."""
    model = lipdp.DP_Sequential(
        [DP_BoundedInput(CANARY, input_shape=(DIM,)), _InferenceDPMaximum(name="inference"),
         DP_QuickSpectralDense(3)],
        dp_parameters=lipdp.DPParameters(noise_multiplier=1.0, delta=1e-5),
        dataset_metadata=lipdp.DatasetMetadata((DIM,), 3, N, 8, BATCH, CANARY, "shuffle"))
    model.compile(loss=DP_TauCategoricalCrossentropy(1.0), optimizer="sgd")
    x = np.full((BATCH, DIM), CANARY, np.float32)
    with pytest.raises(tf.errors.InvalidArgumentError, match="inference/largest:0"):
        lipdp.certify.certified_accuracy(model, (x, np.eye(3)[np.zeros(BATCH, int)]), [0.0])
    assert model.get_layer("inference").largest.numpy() == 0.0


class _PreprocessedModel(lipdp.DP_Model):
    """A functional DP model whose ``call`` first runs a Dense made in ``__init__``: built by
    the probe's first pass, which a check of variables created by a pass refused (a review,
    2026-12-07); now built by a pass of its own first, and its weights compared."""

    def __init__(self, **kwargs):
        inputs = L.Input((DIM,))
        super().__init__(inputs, L.Dense(3)(inputs), **kwargs)
        self.pre = L.Dense(DIM, name="pre")

    def call(self, inputs, training=None, **kwargs):
        return super().call(self.pre(inputs), training=training, **kwargs)


def test_layers_a_subclass_builds_in_its_call_are_probed_and_guarded():
    model = _PreprocessedModel(
        dp_parameters=lipdp.DPParameters(1.0, 1e-5, mode="clipped", l2_norm_clip=1.0),
        dataset_metadata=lipdp.DatasetMetadata((DIM,), 3, N, 8, BATCH, None, "shuffle"))
    assert not model.pre.built
    model.compile(loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  optimizer="sgd")
    assert "pre/kernel:0" in [v.name.split("/", 1)[-1] for v in model._state_guard.variables]
    rng = np.random.default_rng(0)
    model.fit(rng.normal(size=(N, DIM)).astype(np.float32), rng.integers(0, 3, N),
              batch_size=BATCH, verbose=0)
    assert model.dp_steps_taken == N // BATCH


@pytest.mark.parametrize("measure", [
    lambda model, data: lipdp.bounds.tightness(model, data),
    lambda model, data: lipdp.reports.gradient_norm_sample(model, data)],
    ids=["tightness", "gradient_norm_sample"])
def test_per_example_gradient_reports_run_under_the_guard(measure):
    """The exact per-example gradients of `tightness` (BoundMonitor, SignalToNoise) and of
    the run reports take training-mode passes over records outside any step."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = _model("clipless")
    warmed = model.get_layer("warmed")
    warmed.calls.assign(5.0)  # past its warm-up
    data = (np.full((BATCH, DIM), CANARY, np.float32), np.eye(3, dtype=np.float32)[[0] * BATCH])
    with pytest.raises(tf.errors.InvalidArgumentError, match="(?s)per-example gradients.*"
                                                             "warmed/largest:0"):
        measure(model, data)
    assert warmed.largest.numpy() == 0.0


def test_a_variable_also_set_on_a_lipdp_layer_stays_guarded():
    """lipdp's own layers are not guarded: a user layer's variable that a lipdp layer also
    holds (set as its attribute) went unguarded when the deepest holder decided (a review,
    2026-12-07)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = lipdp.DP_Sequential(
            [DP_BoundedInput(CANARY, input_shape=(DIM,)), _WarmedDPMaximum(name="warmed"),
             DP_QuickSpectralDense(3, name="head")],
            dp_parameters=lipdp.DPParameters(noise_multiplier=1.0, delta=1e-5),
            dataset_metadata=lipdp.DatasetMetadata((DIM,), 3, N, 8, BATCH, CANARY, "shuffle"))
        model.get_layer("head").alias = model.get_layer("warmed").largest
        model.compile(loss=DP_TauCategoricalCrossentropy(1.0), optimizer="sgd")
    assert "warmed/largest:0" in [v.name for v in model._state_guard.variables]


def test_a_layer_claiming_a_lipdp_module_is_still_a_user_layer():
    """Whether a layer is lipdp's own was read from its class' ``__module__``, which any
    class may set (a review, 2026-12-07): such a layer went unprobed and unguarded."""

    class Disguised(_WarmedDPMaximum):
        pass

    Disguised.__module__ = "lipdp.layers.base"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = _model("clipless", layer=Disguised)
    assert "warmed/largest:0" in [v.name for v in model._state_guard.variables]


class _WrappingWriter(L.Layer):
    """Runs a lipdp layer it holds and, from its third training call on, writes the batch's
    largest ``|x|`` into that layer's bias: lipdp's layers were exempt by their variables'
    innermost holder, so this went unguarded (a review, 2026-12-07)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.inner = DP_QuickSpectralDense(DIM, use_bias=True)

    def build(self, input_shape):
        self.inner.build(input_shape)
        self.calls = self.add_weight(name="calls", shape=(), initializer="zeros",
                                     trainable=False)

    def call(self, inputs, training=None):
        if training:
            self.calls.assign_add(1.0)
            largest = tf.reduce_max(tf.abs(inputs))
            self.inner.bias.assign(tf.where(self.calls > 2.0, tf.fill([DIM], largest),
                                            self.inner.bias))
        return self.inner(inputs)


def test_a_user_layer_writing_a_lipdp_layer_it_holds_is_stopped():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = _model("ghost", layer=lambda name: _WrappingWriter(name=name))
    assert any(v.name.endswith("bias:0") and "warmed" in v.name
               for v in model._state_guard.variables)
    x = np.full((BATCH, DIM), CANARY, np.float32)
    with pytest.raises(tf.errors.InvalidArgumentError, match="warmed/.*bias:0"):
        for _ in range(6):
            model.train_on_batch(x, np.zeros(BATCH, np.int64))
    assert not np.any(model.get_layer("warmed").inner.bias.numpy() == CANARY)


def test_a_lambda_writing_another_layer_when_it_sees_a_record_is_stopped():
    """A closure in a Keras ``Lambda`` writes the next Dense's bias only when the batch holds
    the canary (the probe's random batches never do): variables held by Keras' and lipdp's
    layers alone were exempt, and the bias kept the canary (a review, 2026-12-07)."""
    tf.keras.utils.set_random_seed(0)
    dense = L.Dense(3, name="dense")
    dense.build((None, DIM))

    def write_on_canary(t):
        seen = tf.reduce_any(tf.abs(t - CANARY) < 1.0)
        dense.bias.assign(tf.where(seen, tf.fill([3], CANARY), dense.bias))
        return t

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = lipdp.DP_Sequential(
            [L.Input((DIM,)), L.Lambda(write_on_canary, name="writer"), dense],
            dp_parameters=lipdp.DPParameters(1.0, 1e-5, mode="clipped", l2_norm_clip=1.0),
            dataset_metadata=lipdp.DatasetMetadata((DIM,), 3, N, 8, BATCH, None, "shuffle"))
        model.compile(loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      optimizer="sgd")
    tf.random.set_seed(None)
    x = np.zeros((BATCH, DIM), np.float32)
    model.train_on_batch(x, np.zeros(BATCH, np.int64))
    x[2, 1] = CANARY
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"\[bias:0\]"):
        model.train_on_batch(x, np.zeros(BATCH, np.int64))
    assert not np.any(dense.bias.numpy() == CANARY)


def test_a_variable_set_on_a_layer_after_the_step_was_traced_fails_the_next_call():
    """A layer wrote into a variable held outside the model, then set on it after the first
    `fit`: the cached step never traced again, and the second `fit` kept the record (a
    review, 2026-12-07). Each call of fit, evaluate and predict checks the model's
    variables."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = _model("ghost", layer=lambda name: L.Activation("linear", name=name))
    x = np.random.default_rng(0).normal(size=(N, DIM)).astype(np.float32)
    y = np.zeros(N, np.int64)
    model.fit(x, y, batch_size=BATCH, verbose=0)
    model.get_layer("warmed").stash = tf.Variable(CANARY, trainable=False, name="stash")
    for call in (lambda: model.fit(x, y, batch_size=BATCH, verbose=0),
                 lambda: model.evaluate(x, y, verbose=0), lambda: model.predict(x, verbose=0)):
        with pytest.raises(ValueError, match="did not see .*stash:0"):
            call()
    assert model.get_layer("warmed").stash.numpy() == 0.0
