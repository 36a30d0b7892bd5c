"""AutoGraph leaves lipdp's functions as written (`lipdp._autograph`) and still rewrites the
user's: a traced step runs the same graph, built without parsing lipdp's sources again."""

import numpy as np
import tensorflow as tf
from tensorflow.python.autograph.core import config
from tensorflow.python.autograph.impl import api, conversion

import lipdp
from lipdp._autograph import PACKAGE, skip_conversion
from lipdp.layers import DP_GroupSort
from tests._models import mlp


def _lipdp_rules():
    return [rule for rule in config.CONVERSION_RULES
            if isinstance(rule, config.DoNotConvert) and rule.matches(PACKAGE)]


class _SignFlip(tf.keras.layers.Layer):
    """A user's layer whose ``call`` branches on a tensor: traced as written, it fails."""

    def call(self, inputs):
        if tf.reduce_sum(inputs) > 0:
            return inputs
        return -inputs


def _recording_conversions(monkeypatch):
    """The module of every function AutoGraph rewrites from now on."""
    converted = []
    original = api._convert_actual

    def recording(entity, program_ctx):
        converted.append(getattr(entity, "__module__", None) or "")
        return original(entity, program_ctx)

    monkeypatch.setattr(api, "_convert_actual", recording)
    return converted


def test_lipdp_is_on_autographs_list_once_and_user_code_is_not():
    assert skip_conversion() and skip_conversion()  # importing lipdp already ran it
    assert len(_lipdp_rules()) == 1
    assert conversion.is_allowlisted(lipdp.bounds.backpropagate_bounds)
    assert conversion.is_allowlisted(DP_GroupSort(2).call)
    assert not conversion.is_allowlisted(_SignFlip().call)


def test_traced_functions_rewrite_the_users_layers_and_not_lipdps(monkeypatch):
    converted = _recording_conversions(monkeypatch)
    sort, flip = DP_GroupSort(2), _SignFlip()

    @tf.function
    def forward(x):
        return flip(sort(x))

    for x in ([[-3.0, 1.0, -2.0, -4.0]], [[3.0, 1.0, -2.0, 4.0]]):  # both branches
        sorted_x = sort(tf.constant(x)).numpy()
        expected = sorted_x if sorted_x.sum() > 0 else -sorted_x
        np.testing.assert_array_equal(forward(tf.constant(x)).numpy(), expected)
    assert __name__ in converted  # the user's layer (and the tf.function) were rewritten
    assert not [m for m in converted if m.split(".")[0] == PACKAGE], converted


def test_a_private_step_traces_without_rewriting_lipdp(monkeypatch):
    converted = _recording_conversions(monkeypatch)
    model = mlp()
    model.compile(optimizer=tf.keras.optimizers.SGD(0.1),
                  loss=lipdp.losses.DP_TauCategoricalCrossentropy(1.0))
    x = np.random.default_rng(0).normal(size=(64, 10)).astype(np.float32)
    y = np.eye(3, dtype=np.float32)[np.arange(64) % 3]
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert model.dp_steps_taken == 4
    assert not [m for m in converted if m.split(".")[0] == PACKAGE], converted
