"""Each step's check that nothing wrote the batch into a variable the probe saw still.

Classic DP-SGD's models, and clipless models holding a DP layer defined outside lipdp, are
probed at compile (`lipdp.clipping.validation.check_no_batch_coupling`): a variable that a
training-mode pass writes differently for different inputs is refused. Every pass of that
probe starts from the compiled state, so a layer that writes only after some calls (a warm-up)
was not seen: a custom layer keeping the running maximum of ``|x|`` from its fourth call on
saved a training record's exact value (1234.5) in its weights, released with the model
without noise (an audit, 2026-12-07).

`StateGuard` closes that gap for every variable no pass of the probe moved, but for the
model's bookkeeping (`DP_Model._guard`): trainable ones (a forward pass may assign a weight),
a subclass' own, lipdp's layers' (a user layer holding one, or a closure in a ``Lambda``, may
write them: exempting the variables of lipdp's and Keras' layers let both keep a record, a
review, 2026-12-07). Each training step reads them before anything uses the batch, and after
the private gradients, before the update, fails if any differs bit for bit from what it
held: the step stops with ``InvalidArgumentError`` naming the variables, no update applied,
and the values put back first (each replica its own, under a distribution strategy), so
what the batch wrote does not stay in the model. Evaluation and prediction steps are checked
the same way (the probe runs training-mode passes: a layer writing in inference kept the
records `evaluate` ran on). The failure itself tells that a step changed the state, once:
the model is refused from then on.

lipdp's own passes over records outside a step (`lipdp.certify`, `lipdp.audit`, `tightness`)
run under the guard too (`run_guarded`, `guarded_call`). A variable the model holds that the
probe did not see (created by a pass after it, traced, in inference or after the probe's
calls; set on a layer later: each kept a record in a review, 2026-12-07) fails the step that
traces with it, and every call of `fit`, `evaluate`, `predict` (`refuse_created`); the probe
refuses one its own passes create (`check_no_batch_coupling`).

Not seen: variables the probe saw move the same way for every input (a call counter,
power-iteration vectors), which may later record the data; a write undone within the step;
state held outside the model (a variable no layer tracks), which a weight's ``constraint``,
applied by the optimizer after the check, could copy into the weight; a user's own direct
``model(x)``; a layer's ``project``, run after the check, reaching the batch through the
traced graph's captures (deliberate code: a review, 2026-12-07); the steps of a model never
compiled. Without a probe (lipdp's layers only: the clipless step) nothing is guarded and no
operation is added to the step; a clipped Keras model's weights cost one copy and one
comparison per step (`benchmarks/state_guard_cost.py`).
"""

from __future__ import annotations

from typing import Any, Callable, List, Sequence

import tensorflow as tf

_INTEGER_OF_SIZE = {1: tf.int8, 2: tf.int16, 4: tf.int32, 8: tf.int64}


def _bits(t: tf.Tensor) -> tf.Tensor:
    """`t` as integers of its floating bytes (NaN equal to itself, -0 unequal to 0), or as is."""
    if t.dtype.is_floating:
        return tf.bitcast(t, _INTEGER_OF_SIZE[t.dtype.size])
    return t


class StateGuard:
    """The variables a step must leave as it found them until its update.

    Args:
        variables: the variables to guard (`check_no_batch_coupling`'s return).
        model: the model they belong to; None: no check of created variables (nothing was
            probed).
        known: the variables `model` may hold: those the probe saw. Any other fails a step
            (a variable created by a later pass, traced or in inference, escaped both
            checks: an audit, 2026-12-07; so did one created by a trace of `compile` after
            the probe, when the known variables were read from the model after it).
    """

    def __init__(self, variables: Sequence[tf.Variable] = (), model=None,
                 known: Sequence[tf.Variable] = ()):
        self.variables = list(variables)
        self.model = model
        self._known = {v.ref() for v in known}

    def read(self) -> List[tf.Tensor]:
        """The guarded variables' values now (at the start of a step)."""
        return [v.read_value() for v in self.variables]

    def checked(self, before: List[tf.Tensor], outputs, step: str = "training"):
        """`outputs` (a structure of tensors) once the guarded variables are found to hold
        `before` again, after `outputs` are computed (by a ``step``: "training",
        "evaluation", "prediction").

        Raises:
            InvalidArgumentError: (at run time) naming the variables that changed, after
                putting them back.
            ValueError: (when the step is traced, or run eagerly) the model holds
                a variable it did not hold when the guard was made, created by the step;
                run eagerly, what the step wrote into it is zeroed first.
        """
        self.refuse_created(step)
        if not self.variables:
            return outputs
        with tf.control_dependencies(tf.nest.flatten(outputs)):
            changed = tf.stack([tf.reduce_any(tf.not_equal(_bits(v.read_value()), _bits(b)))
                                for v, b in zip(self.variables, before)])
        written = tf.reduce_any(changed)
        put_back = tf.cond(written, lambda: self._assign(before), lambda: tf.constant(True))
        names = tf.constant([v.name for v in self.variables])
        with tf.control_dependencies([put_back]):
            check = tf.debugging.Assert(tf.logical_not(written), [
                f"A step ({step}) changed variables that lipdp's compile-time probe saw no "
                "training pass change (a layer writing its state only after some calls, or in "
                "inference): what it wrote may be the records it ran on, released with the "
                "model without noise, outside the privacy guarantee. They were put back"
                f"{', and no update was applied' if step == 'training' else ''}. Remove that "
                "state from the layer. Changed:",
                tf.boolean_mask(names, changed)], summarize=len(self.variables))
        if tf.executing_eagerly():  # checked already; `outputs` kept as they are (numpy)
            return outputs
        with tf.control_dependencies([check]):
            return tf.nest.map_structure(tf.identity, outputs)

    def refuse_created(self, step: str):
        """Raise `ValueError` when the model holds a variable the probe did not see (see
        `checked`); run eagerly, its value is zeroed first."""
        if self.model is None:
            return
        created = [v for v in self.model.variables if v.ref() not in self._known]
        if not created:
            return
        if tf.executing_eagerly():  # the step ran: its writes are in them
            for v in created:
                v.assign(tf.zeros_like(v))
        # A ValueError: AutoGraph, converting the user's layer that called for the trace,
        # re-raises exceptions of its known types only (a subclass became a StagingError).
        raise ValueError(
            f"A step ({step}) found variables in the model that compile's probe did not see "
            f"(created or set on a layer after it): {[v.name for v in created]}. What a pass "
            "writes into them is checked neither at compile nor by the steps, and it may be "
            "the records it ran on, released with the model without noise. Create every "
            "variable in its layer's build(), and compile again after changing the model.")

    def _assign(self, values):
        with tf.control_dependencies([v.assign(value) for v, value in
                                      zip(self.variables, values)]):
            return tf.constant(True)


def run_guarded(model, step: str, compute: Callable[[], Any]):
    """``compute()`` under a DP model's state guard (`StateGuard`), named `step` in the
    error: a step's body when traced, or lipdp's passes over records run eagerly; without a
    guard (another model, or one never compiled) as it is."""
    guard = getattr(model, "_state_guard", None)
    if guard is None:
        return compute()
    before = guard.read()
    return guard.checked(before, compute(), step)


def guarded_call(model, inputs):
    """``model(inputs, training=False)`` under a DP model's state guard, as its `predict`
    steps run: lipdp's certificates, attacks and scores call the model so, and a layer
    writing in inference kept a record they ran on (an audit, 2026-12-07)."""
    return run_guarded(model, "prediction", lambda: model(inputs, training=False))
