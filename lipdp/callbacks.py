"""Keras callbacks of lipdp.

`DP_Accountant` reports the privacy spent after each epoch and, given a budget,
stops training before the step that would exceed it. It only reads python
attributes of the model (``dp_parameters``, ``dataset_metadata``,
``privacy_ledger``, ``step_mechanism``, ``dp_steps_taken``) and calls
`lipdp.accounting` / `lipdp.ledger`; it never touches tensors.
"""

from __future__ import annotations

import logging
from typing import Callable, Optional, Union

import tensorflow as tf

from lipdp import accounting
from lipdp.metadata import Sampling

__all__ = ["DP_Accountant"]

_LOGGER = logging.getLogger("lipdp")


def _make_log_fn(log_fn):
    if log_fn is None:
        return lambda message: None
    if log_fn == "print":
        return print
    if log_fn == "logging":
        return _LOGGER.info
    if callable(log_fn):
        return log_fn
    raise ValueError(
        "Received an invalid value for `log_fn`, expected None, 'print', 'logging' "
        f"or a callable taking one string. Received: log_fn={log_fn!r}"
    )


def _steps_per_execution(model) -> int:
    """Steps run by one call of Keras' train function (``compile(steps_per_execution=...)``)."""
    value = getattr(model, "_steps_per_execution", None)
    if value is None:
        return 1
    try:
        return max(1, int(value.numpy()))
    except AttributeError:
        return max(1, int(value))


class DP_Accountant(tf.keras.callbacks.Callback):
    """Privacy accountant and budget stop.

    After every epoch, writes ``logs["epsilon"]`` (the composition of every
    segment of the model's privacy ledger, see `lipdp.accounting.epsilon_spent`:
    steps of earlier `fit` calls count with the mechanism they ran) and
    ``logs["delta"]``, so both appear in ``History.history`` and in Keras'
    progress bar, and logs a one-line summary.

    With ``epsilon_budget``: at the start of training it computes the largest
    total number of steps ``max_steps`` such that the ledger followed by more
    steps of the compiled mechanism (``model.step_mechanism``) fits in the
    budget, and raises ``ValueError`` if the ledger already holds that many (or
    if not even one more call of the train function fits). After each batch, if the next call
    of the train function would take the ledger past ``max_steps`` it sets
    ``model.stop_training = True``; Keras checks that flag right after
    ``on_train_batch_end``, so the step that would exceed the budget never runs
    and the final epsilon is ``<= epsilon_budget``. (Keras 2.15 still runs
    ``on_epoch_end`` for the interrupted epoch, so the history ends with the
    final epsilon.) With ``compile(steps_per_execution=k)`` the check looks
    ``k`` steps ahead, which may stop up to ``k - 1`` steps early, never late.
    Only with a budget does the callback read the ledger after every batch.

    Args:
        epsilon_budget: optional finite positive epsilon not to exceed (at the
            model's ``dp_parameters.delta``).
        log_fn: ``None`` (silent), ``"print"``, ``"logging"`` (logger
            ``"lipdp"``, level INFO) or a callable taking one string.
    """

    def __init__(self, epsilon_budget: Optional[float] = None,
                 log_fn: Union[None, str, Callable[[str], None]] = None):
        super().__init__()
        # Batch hooks never read the logs' tensors: do not make Keras convert
        # them to numpy after every step (a device sync per step).
        self._supports_tf_logs = True
        if epsilon_budget is not None:
            epsilon_budget = accounting._check_budget(epsilon_budget, allow_zero=False)
        self.epsilon_budget = epsilon_budget
        self.log_fn = log_fn
        self._log = _make_log_fn(log_fn)
        self.max_steps: Optional[int] = None
        self._stopped_for_budget = False

    # ------------------------------------------------------------------ helpers
    def _ledger(self):
        steps = accounting._check_count(self.model.dp_steps_taken, "dp_steps_taken")
        epsilon = accounting.epsilon_spent(self.model)
        return steps, epsilon, float(self.model.dp_parameters.delta)

    def _write_logs(self, logs, epsilon, delta):
        if logs is not None:
            logs["epsilon"] = epsilon
            logs["delta"] = delta

    # ------------------------------------------------------------------ hooks
    def on_train_begin(self, logs=None):
        self._stopped_for_budget = False
        self.max_steps = None
        metadata = self.model.dataset_metadata
        if getattr(metadata, "sampling", None) is Sampling.SHUFFLE:
            self._log(
                "lipdp: the pipeline shuffles into fixed-size batches; the reported epsilon "
                "is the Poisson-subsampling epsilon, not a proven guarantee for this pipeline."
            )
        if self.epsilon_budget is None:
            return
        mechanism = self.model.step_mechanism
        sigma, q = mechanism.step_noise_multiplier, mechanism.sampling_rate
        delta = float(self.model.dp_parameters.delta)
        ledger = self.model.privacy_ledger
        self.max_steps = ledger.max_steps(self.epsilon_budget, mechanism, delta)
        steps, epsilon, _ = self._ledger()
        lookahead = _steps_per_execution(self.model)
        if steps + lookahead > self.max_steps:
            if steps >= self.max_steps and steps > 0:
                reason = (f"the privacy budget is already spent: the model's ledger holds "
                          f"{steps} steps (epsilon={epsilon:.4g}) and at most {self.max_steps} "
                          "steps fit in the budget")
            else:
                one_more = accounting.compose_epsilon(
                    ledger.accounting_terms() + [(sigma, q, lookahead)], delta)
                reason = (f"{lookahead} more step(s) after the {steps} already taken would "
                          f"spend epsilon={one_more:.4g} (at most {self.max_steps} steps fit)")
            raise ValueError(
                f"Cannot train within epsilon_budget={self.epsilon_budget:g} at "
                f"delta={delta:g}: {reason}. Step noise multiplier={sigma:g}, "
                f"sampling rate={q:g}."
            )
        self._log(
            f"lipdp: epsilon_budget={self.epsilon_budget:g} (delta={delta:g}) allows "
            f"{self.max_steps} steps; {steps} already taken (epsilon={epsilon:.4g})."
        )

    def on_train_batch_end(self, batch, logs=None):
        if self.max_steps is None or self.model.stop_training:
            return
        steps = accounting._check_count(self.model.dp_steps_taken, "dp_steps_taken")
        lookahead = _steps_per_execution(self.model)
        if steps + lookahead > self.max_steps:
            self.model.stop_training = True
            self._stopped_for_budget = True
            _, epsilon, delta = self._ledger()
            self._write_logs(logs, epsilon, delta)
            self._log(
                f"lipdp: stopping training after {steps} steps (epsilon={epsilon:.4g}, "
                f"delta={delta:g}): {lookahead} more step(s) would exceed "
                f"epsilon_budget={self.epsilon_budget:g}."
            )

    def on_epoch_end(self, epoch, logs=None):
        steps, epsilon, delta = self._ledger()
        self._write_logs(logs, epsilon, delta)
        budget = "" if self.epsilon_budget is None else f" / budget {self.epsilon_budget:g}"
        self._log(
            f"lipdp: epoch {epoch + 1}: epsilon={epsilon:.4g}{budget}, delta={delta:g} "
            f"after {steps} steps."
        )

    def get_config(self) -> dict:
        return {
            "epsilon_budget": self.epsilon_budget,
            # A custom callable cannot be serialised; it is recorded as None.
            "log_fn": self.log_fn if self.log_fn in (None, "print", "logging") else None,
        }

    @classmethod
    def from_config(cls, config: dict) -> "DP_Accountant":
        return cls(**config)
