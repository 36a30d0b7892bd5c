"""Keras callbacks of lipdp.

`DP_Accountant` reports the privacy spent after each epoch and, given a budget,
stops training before the step that would exceed it. It only reads python
attributes of the model (``dp_parameters``, ``dataset_metadata``,
``privacy_ledger``, ``step_mechanism``, ``dp_steps_taken``) and calls
`lipdp.accounting` / `lipdp.ledger`; it never touches tensors.

`BoundMonitor` and `SignalToNoise` look at exact per-example gradients of a
sample of examples at the end of every epoch (`lipdp.bounds.tightness`, through
`lipdp.per_example`): the first checks the one invariant of lipdp (every
per-example gradient norm within the bound the noise is calibrated to) and logs
how tight the bounds are, the second compares the gradients with the noise.
**Neither is private** when given training data: they compute on the records
outside the noisy gradient, and epsilon does not cover what they log.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import warnings
from typing import Callable, Dict, Optional, Tuple, Union

import numpy as np
import tensorflow as tf

from lipdp import accounting
from lipdp.accounting import format_epsilon
from lipdp.bounds import tightness, variable_names
from lipdp.certify import first_examples
from lipdp.ledger import PrivacyLedger
from lipdp.metadata import DPMode, Sampling
from lipdp.records import finite_array_rows

__all__ = ["BoundMonitor", "BoundViolationError", "DP_Accountant", "SignalToNoise",
           "sample_examples"]

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


def _only_steps_since(before, after, most) -> bool:
    """Whether the ledger state ``after`` (``(steps, PrivacyLedger)``) is ``before`` plus at
    most `most` steps of one mechanism at its end, as a train call leaves it."""
    (steps_before, ledger_before), (steps_after, ledger_after) = before, after
    grown = steps_after - steps_before
    if not 0 <= grown <= most:
        return False
    segments = list(ledger_after.segments)
    if grown:
        last = segments.pop()
        if last.steps > grown:
            segments.append(dataclasses.replace(last, steps=last.steps - grown))
    return tuple(segments) == tuple(ledger_before.segments)


def _steps_per_execution(model) -> int:
    """Steps run by one call of Keras' train function (``compile(steps_per_execution=...)``)
    as it stands now. Keras lowers it while the last, partial call of an epoch runs (and
    restores it after), so a lookahead takes the largest value seen (`DP_Accountant`)."""
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
    progress bar, and logs a one-line summary. Private steps taken after the last epoch
    (a callback's ``on_train_end`` calling ``train_on_batch``) make it warn and log
    epsilon again once training ended (`after_training`).

    With ``epsilon_budget``: at the start of training it computes the largest
    total number of steps ``max_steps`` such that the ledger followed by more
    steps of the compiled mechanism (``model.step_mechanism``) fits in the
    budget, and raises ``ValueError`` if the ledger already holds that many (or
    if not even one more call of the train function fits); it plans again at the first
    epoch if a callback (``BackupAndRestore``) restored another ledger in between, so a
    budget holds across restarts whatever the callbacks' order. After each batch, if the next call
    of the train function would take the ledger past ``max_steps`` it sets
    ``model.stop_training = True``; Keras checks that flag right after
    ``on_train_batch_end``, so the step that would exceed the budget never runs
    and the final epsilon is ``<= epsilon_budget``. (Keras 2.15 still runs
    ``on_epoch_end`` for the interrupted epoch, so the history ends with the
    final epsilon.) With ``compile(steps_per_execution=k)`` the check looks
    ``k`` steps ahead, which may stop up to ``k - 1`` steps early, never late.
    Only with a budget does the callback read the ledger after every batch. In a
    DP model's `fit`, the budget is also enforced right before every call of the train
    function (`check_next_call`): a call that would pass it raises ``RuntimeError``
    instead of running (another callback cleared ``model.stop_training`` or set
    ``model.steps_per_execution``).

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
        self._planned_with = None  # the ledger max_steps was computed from, until epoch 1
        self._seen = None  # the ledger when the plan was made or the last step ended
        self._decoded = None  # the last ledger read: (its stored form, its decoded form)
        self._unlogged_plan = None  # the plan's line, until the first epoch begins
        self._logged_steps = None  # the steps the last epoch's epsilon counts

    # ------------------------------------------------------------------ helpers
    def _ledger(self, state=None):
        """``(steps, epsilon, delta)`` of the model's ledger `state` (default: read now,
        `_ledger_state`), at the model's delta."""
        steps, ledger = self._ledger_state() if state is None else state
        steps = accounting._check_count(steps, "dp_steps_taken")
        delta = accounting._check_delta(self.model.dp_parameters.delta)
        return steps, ledger.epsilon(delta), delta

    def _write_logs(self, logs, epsilon, delta):
        if logs is not None:
            logs["epsilon"] = epsilon
            logs["delta"] = delta

    # ------------------------------------------------------------------ hooks
    def on_train_begin(self, logs=None):
        if not hasattr(self.model, "privacy_ledger"):
            raise TypeError(
                f"DP_Accountant accounts a lipdp DP model's private steps, and this "
                f"{type(self.model).__name__} takes none: its fit is plain, non-private "
                "training. (tf.keras.models.clone_model of a DP_Sequential returns Keras' "
                "Sequential: clone with DP_Sequential.from_config(model.get_config()).)")
        self._stopped_for_budget = False
        self.max_steps = None
        self._lookahead = _steps_per_execution(self.model)
        metadata = self.model.dataset_metadata
        if getattr(metadata, "sampling", None) is Sampling.SHUFFLE:
            self._log(
                "lipdp: the pipeline shuffles into fixed-size batches; the reported epsilon "
                "is the Poisson-subsampling epsilon, not a proven guarantee for this pipeline."
            )
        self._planned_with = None
        self._logged_steps = None
        if self.epsilon_budget is not None:
            # Logged at the first epoch: a resumed run printed "0 already taken" before its
            # BackupAndRestore, listed after this callback, restored the steps taken.
            self._plan(quiet=True)

    def on_epoch_begin(self, epoch, logs=None):
        # A callback listed after this one (tf.keras.callbacks.BackupAndRestore) may have
        # restored another ledger since on_train_begin: plan again from the restored one.
        if self._planned_with is not None and self._planned_with != self._ledger_state():
            self._plan()
        self._log_plan()
        self._planned_with = None

    def _ledger_state(self):
        """``(dp_steps_taken, privacy_ledger)`` of the model, from one reading of a lipdp
        model's ledger (`_ledger_reading`), decoded again only when its stored rows changed.
        Reading the two properties composed the ledger and read it twice: with three checks
        a step, a tiny model's fit took 1.8x the time it took without an accountant."""
        reading = getattr(self.model, "_ledger_reading", None)
        if reading is None:
            return self.model.dp_steps_taken, self.model.privacy_ledger
        steps, rows = reading()
        key = (steps, rows.shape, rows.tobytes())
        if self._decoded is None or self._decoded[0] != key:
            self._decoded = key, (steps, PrivacyLedger.from_rows(rows, steps))
        return self._decoded[1]

    def _plan(self, quiet: bool = False):
        """``max_steps`` from the model's ledger; raises if not one more call fits. Logs the
        plan, or keeps its line for `on_epoch_begin` when `quiet`."""
        self._planned_with = self._seen = state = self._ledger_state()
        mechanism = self.model.step_mechanism
        sigma, q = mechanism.step_noise_multiplier, mechanism.sampling_rate
        steps, epsilon, delta = self._ledger(state)
        ledger = state[1]
        self.max_steps = ledger.max_steps(self.epsilon_budget, mechanism, delta)
        lookahead = _steps_per_execution(self.model)
        if steps + lookahead > self.max_steps:
            if steps >= self.max_steps and steps > 0:
                reason = (f"the privacy budget is already spent: the model's ledger holds "
                          f"{steps} steps (epsilon={format_epsilon(epsilon)}) and at most "
                          f"{self.max_steps} steps fit in the budget")
            else:
                one_more = accounting.compose_epsilon(
                    ledger.accounting_terms() + [(sigma, q, lookahead)], delta)
                reason = (f"{lookahead} more step(s) after the {steps} already taken would "
                          f"spend epsilon={format_epsilon(one_more)} (at most {self.max_steps} "
                          "steps fit)")
            raise ValueError(
                f"Cannot train within epsilon_budget={self.epsilon_budget:g} at "
                f"delta={delta:g}: {reason}. Step noise multiplier={sigma:g}, "
                f"sampling rate={q:g}."
            )
        self._unlogged_plan = (
            f"lipdp: epsilon_budget={self.epsilon_budget:g} (delta={delta:g}) allows "
            f"{self.max_steps} steps; {steps} already taken (epsilon={format_epsilon(epsilon)})."
        )
        if not quiet:
            self._log_plan()

    def _log_plan(self):
        if self._unlogged_plan is not None:
            self._log(self._unlogged_plan)
            self._unlogged_plan = None

    def on_train_batch_begin(self, batch, logs=None):
        """Plan again, before the step, when the ledger changed since the last step ended (no
        private step runs in between: another run's weights set or loaded by a callback,
        their ledger composed with the model's). The plan of the old ledger let training
        run past the budget (an audit, 2026-12-06: epsilon 304.9 for a budget of 62.4).
        Raises, as at the start of `fit`, when not one more step fits."""
        if self.max_steps is not None and self._ledger_state() != self._seen:
            self._plan()

    def check_next_call(self):
        """Raise a RuntimeError when the train function's next call would take the ledger
        past ``max_steps``. `fit` of a DP model runs it right before each call, after every
        callback's ``on_train_batch_begin`` (and `on_train_batch_begin`'s plan), for its own
        accountants and those of the fits it runs inside, and its `train_on_batch` before the
        step. The stop flag this callback sets is Keras' to
        honour: an audit (2026-12-06) ran 12 steps of 6 allowed (epsilon 49.3 for a budget
        of 31.3) with a callback clearing ``model.stop_training`` after it, 8 of 6 with
        ``model.steps_per_execution`` raised from 2 to 4 after its check, and 8 of 6 with
        a callback calling ``train_on_batch``."""
        if self.max_steps is None:
            return
        steps, calls = self._ledger_state()[0], _steps_per_execution(self.model)
        if steps + calls > self.max_steps:
            raise RuntimeError(
                f"The next call of the train function would run {calls} private step(s) after "
                f"the {steps} taken, past the {self.max_steps} that fit in "
                f"epsilon_budget={self.epsilon_budget:g}; it was not run. During fit, a "
                "callback cleared model.stop_training after DP_Accountant set it, set "
                "model.steps_per_execution after its check, or called train_on_batch.")

    def on_train_batch_end(self, batch, logs=None):
        if self.max_steps is None or self.model.stop_training:
            return
        # The largest call seen: Keras lowers the value during an epoch's last, partial call,
        # and the next epoch's calls are whole again.
        self._lookahead = lookahead = max(self._lookahead, _steps_per_execution(self.model))
        seen, self._seen = self._seen, self._ledger_state()
        if not _only_steps_since(seen, self._seen, lookahead):
            # Changed by more than the steps of this call (a callback listed before this one
            # set another run's weights): the limit of the ledger as it now stands.
            mechanism = self.model.step_mechanism
            self.max_steps = self._seen[1].max_steps(
                self.epsilon_budget, mechanism, float(self.model.dp_parameters.delta))
        steps = accounting._check_count(self._seen[0], "dp_steps_taken")
        if steps + lookahead > self.max_steps:
            self.model.stop_training = True
            self._stopped_for_budget = True
            _, epsilon, delta = self._ledger(self._seen)
            self._write_logs(logs, epsilon, delta)
            self._log(
                f"lipdp: stopping training after {steps} steps (epsilon={format_epsilon(epsilon)}, "
                f"delta={delta:g}): {lookahead} more step(s) would exceed "
                f"epsilon_budget={self.epsilon_budget:g}."
            )

    def on_epoch_end(self, epoch, logs=None):
        steps, epsilon, delta = self._ledger()
        self._logged_steps = steps
        self._write_logs(logs, epsilon, delta)
        budget = "" if self.epsilon_budget is None else f" / budget {self.epsilon_budget:g}"
        self._log(
            f"lipdp: epoch {epoch + 1}: epsilon={format_epsilon(epsilon)}{budget}, delta={delta:g} "
            f"after {steps} steps."
        )

    def after_training(self):
        """Warn, and log epsilon again, when private steps ran after the last epoch's
        epsilon was written (a callback's ``on_train_end`` calling ``train_on_batch``): the
        logs and ``History`` end with an epsilon that does not count them (an audit,
        2026-12-07: 6.528 shown after 8 steps, 7.176 spent by the 11 taken). A DP model's
        `fit` calls it once every callback's ``on_train_end`` has run."""
        if self._logged_steps is None:
            return
        steps, epsilon, delta = self._ledger()
        if steps > self._logged_steps:
            message = (f"{steps - self._logged_steps} private step(s) ran after the last "
                       f"epoch's epsilon was written (from a callback's on_train_end), which "
                       f"does not count them: after {steps} steps "
                       f"epsilon={format_epsilon(epsilon)}, delta={delta:g}.")
            warnings.warn(message, stacklevel=2)
            self._log("lipdp: " + message)
            self._logged_steps = steps

    def get_config(self) -> dict:
        return {
            "epsilon_budget": self.epsilon_budget,
            # A custom callable cannot be serialised; it is recorded as None.
            "log_fn": self.log_fn if self.log_fn in (None, "print", "logging") else None,
        }

    @classmethod
    def from_config(cls, config: dict) -> "DP_Accountant":
        return cls(**config)


# --------------------------------------------------------------------------- #
# Per-example gradients of a sample: bound monitor and signal-to-noise.
# --------------------------------------------------------------------------- #
class BoundViolationError(RuntimeError):
    """An exact per-example gradient norm exceeded the bound the noise is calibrated to:
    the privacy guarantee lipdp reports does not hold for this model."""


def _check_positive_int(value, name):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
        raise ValueError(f"Received an invalid value for `{name}`, expected a positive integer. "
                         f"Received: {name}={value!r}")
    return int(value)


def _check_seed(seed) -> int:
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError("Received an invalid value for `seed`, expected a non-negative "
                         f"integer. Received: seed={seed!r}")
    return int(seed)


def _checked_data(data):
    """A batched dataset as it is, or an ``(x, y)`` pair as arrays of equal, non-zero length."""
    if isinstance(data, tf.data.Dataset):
        return data
    if isinstance(data, (tuple, list)) and len(data) == 2:
        x, y = (np.asarray(a) for a in data)
        if len(x) != len(y) or len(x) == 0:
            raise ValueError(f"`data` must hold as many labels as inputs, at least one: "
                             f"received {len(x)} inputs and {len(y)} labels.")
        return x, y
    raise TypeError("`data` must be an (x, y) pair of arrays or a batched "
                    f"tf.data.Dataset of (x, y). Received: {type(data).__name__}")


def sample_examples(data, sample_size: int, seed: int = 0, epoch: int = 0
                    ) -> Tuple[np.ndarray, np.ndarray]:
    """The sample `BoundMonitor` and `SignalToNoise` look at after epoch `epoch` (0-based).

    Arrays ``(x, y)``: ``min(sample_size, n)`` distinct examples drawn uniformly by
    ``np.random.default_rng([seed, epoch])`` (the same on every run, a new draw each
    epoch). A batched dataset: its first `sample_size` examples, from a new iterator (its
    own shuffling, if any, decides which).
    """
    data, seed = _checked_data(data), _check_seed(seed)
    sample_size = _check_positive_int(sample_size, "sample_size")
    if isinstance(data, tuple):
        x, y = data
        rng = np.random.default_rng([seed, int(epoch)])
        index = np.sort(rng.choice(len(x), size=min(sample_size, len(x)), replace=False))
        return x[index], y[index]
    return first_examples(data, sample_size)


class _SampledGradients(tf.keras.callbacks.Callback):
    """Shared by `BoundMonitor` and `SignalToNoise`: the sample of an epoch and the
    tightness report (`lipdp.bounds.tightness`) of the model's current weights on it."""

    #: The prefixes of the logs computed from the examples of `data` (the others are functions
    #: of the weights): not private when `data` holds training records.
    data_log_prefixes: Tuple[str, ...] = ()

    def __init__(self, data, sample_size: int = 256, seed: int = 0, chunk_size: int = 64):
        super().__init__()
        self.sample_size = _check_positive_int(sample_size, "sample_size")
        self.seed = _check_seed(seed)
        self.chunk_size = _check_positive_int(chunk_size, "chunk_size")
        self._data = _checked_data(data)
        self._traced = {}  # the per-example gradient function, traced once for all epochs

    def sample(self, epoch: int) -> Tuple[np.ndarray, np.ndarray]:
        """The examples looked at after epoch `epoch` (0-based): `sample_examples`, but for
        those holding NaN or inf (in inputs or labels), which the private step passes with
        a zero contribution: their gradients are not finite, and one such input was
        reported as a broken bound (an audit, 2026-12-07). Training batches of k augmented
        views per example give their views, one input each (each view's gradient obeys the
        bound, hence their average).

        Raises:
            ValueError: no example of the sample is finite.
        """
        x, y = sample_examples(self._data, self.sample_size, self.seed, epoch)
        finite = finite_array_rows(x, np.float64) & finite_array_rows(y, np.float64)
        if not finite.all():
            if not finite.any():
                raise ValueError(f"{type(self).__name__}: every example of the sample holds NaN "
                                 "or inf values: there is no gradient to compare with a bound.")
            x, y = x[finite], y[finite]
        metadata = getattr(self.model, "dataset_metadata", None)
        views = getattr(metadata, "augmentation_multiplicity", 1)
        if views > 1 and x.shape[1:] == (views,) + tuple(metadata.input_shape):
            x, y = x.reshape((-1,) + tuple(metadata.input_shape)), np.repeat(y, views, axis=0)
        return x, y

    def _check_model(self):
        model = self.model
        parameters = getattr(model, "dp_parameters", None)
        if parameters is None or getattr(model, "dp_loss", None) is None:
            raise ValueError(f"{type(self).__name__} needs a DP model compiled with a DP loss.")
        if parameters.mode is DPMode.CLIPPED:
            raise ValueError(
                f"{type(self).__name__} looks at analytic gradient bounds (clipless mode); in "
                "clipped mode the clipping enforces the bound and there is nothing to monitor.")

    def on_train_begin(self, logs=None):
        self._check_model()

    def tightness_report(self, epoch: int) -> Dict[str, Dict[str, float]]:
        """`lipdp.bounds.tightness` of the current weights on ``sample(epoch)``, with
        the loss the model was compiled with: per variable name, the bound the train
        step computes at these weights and the max / mean of the exact per-example
        gradient norm divided by it."""
        x, y = self.sample(epoch)
        return tightness(self.model, (x, y), loss=self.model.dp_loss,
                         chunk_size=self.chunk_size, function_cache=self._traced)

    def _base_config(self) -> dict:
        # `data` is not serialisable; a config records the settings (for run reports).
        return {"sample_size": self.sample_size, "seed": self.seed,
                "chunk_size": self.chunk_size}

    @property
    def data(self):
        """The examples the callback samples from (a batched dataset or ``(x, y)`` arrays)."""
        return self._data


class BoundMonitor(_SampledGradients):
    """Checks the invariant ``||grad_v loss(f(x), y)|| <= bound(v)`` after every epoch.

    At the end of each epoch, on a sample of examples (`sample`), the exact
    per-example gradient norm of every trainable variable v (vectorised
    per-example gradients, `lipdp.per_example`) is divided by ``bound(v)``, the
    per-example bound that backpropagation for bounds gives with the compiled
    loss, both at the epoch's final weights (those the next step starts from):
    the bound the train step divides by its batch denominator and calibrates its
    noise to (`lipdp.bounds.tightness` calls the step's own
    `lipdp.bounds.backpropagate_bounds`). This is the empirical check the paper's
    appendix D.6 calls for: the whole privacy guarantee rests on these bounds.

    If some ratio exceeds ``1 + rtol`` it raises `BoundViolationError`, naming
    every violating variable (worst first) with its ratio, observed norm and
    bound, which stops `fit`. ``rtol`` (default 1e-4) only absorbs float32
    rounding of the gradients and of the bound (relative ~1e-6: where the tests
    attain a bound, the ratio is 1 to within 1e-6); a wrong constant in a
    layer's bound is off by far more (a missing sqrt(s) of a 3x3 window: 3x).

    Being a sample, a pass does not prove the invariant (only the layers' proofs
    and tests do); a violation disproves it.

    Logs, per variable name ``<var>`` (`lipdp.bounds.variable_names`, e.g.
    ``dense/kernel``), into the epoch's logs (``History``):

    - ``tightness_max/<var>``: max over the sample of ``||grad_v|| / bound(v)``;
    - ``tightness_mean/<var>``: the mean of the same ratio;
    - ``gradient_bound/<var>``: ``bound(v)``, per example (not divided by the batch).

    The last report is kept in `last_report` (``{var: {"bound", "max_ratio",
    "mean_ratio", "examples"}}``). **Not private** on training data (module
    docstring). Clipless mode only.

    Args:
        data: ``(x, y)`` arrays or a batched `tf.data.Dataset` of ``(x, y)``: the
            training data (or any data inside the declared input bound; inputs
            are clipped by the model anyway).
        sample_size: examples per epoch (default 256).
        seed: seed of the sample of array data.
        rtol: relative tolerance for float32 rounding, ``>= 0`` (default 1e-4).
        chunk_size: examples whose per-example gradients are held at once.
    """

    data_log_prefixes = ("tightness_max/", "tightness_mean/")

    def __init__(self, data, sample_size: int = 256, seed: int = 0, rtol: float = 1e-4,
                 chunk_size: int = 64):
        super().__init__(data, sample_size, seed, chunk_size)
        if isinstance(rtol, bool) or not isinstance(rtol, (int, float, np.integer, np.floating)) \
                or not math.isfinite(float(rtol)) or rtol < 0:
            raise ValueError("Received an invalid value for `rtol`, expected a finite "
                             f"non-negative number. Received: rtol={rtol!r}")
        self.rtol = float(rtol)
        self.last_report: Optional[Dict[str, Dict[str, float]]] = None

    def on_epoch_end(self, epoch, logs=None):
        report = self.tightness_report(epoch)
        self.last_report = report
        if logs is not None:
            for name, row in report.items():
                logs[f"tightness_max/{name}"] = row["max_ratio"]
                logs[f"tightness_mean/{name}"] = row["mean_ratio"]
                logs[f"gradient_bound/{name}"] = row["bound"]
        violations = sorted(((row["max_ratio"], name, row) for name, row in report.items()
                             if not row["max_ratio"] <= 1.0 + self.rtol), reverse=True)
        if violations:
            self.model.stop_training = True
            details = "; ".join(
                f"'{name}': ratio {ratio:.6g} (gradient norm {ratio * row['bound']:.6g} > bound "
                f"{row['bound']:.6g})" for ratio, name, row in violations)
            raise BoundViolationError(
                f"Gradient bound violated after epoch {epoch + 1}, on a sample of "
                f"{violations[0][2]['examples']} examples (tolerance rtol={self.rtol:g}): "
                f"{details}. The noise is calibrated to these bounds, so the reported privacy "
                "guarantee does not hold for this model.")

    def get_config(self) -> dict:
        return {**self._base_config(), "rtol": self.rtol}


class SignalToNoise(_SampledGradients):
    """Logs, per variable, the mean per-example gradient norm against the noise std.

    At the end of each epoch, on a sample of examples (`sample`), with the
    current weights:

    - ``grad_norm_mean/<var>``: mean over the sample of the exact per-example
      gradient norm ``||grad_v loss(f(x_i), y_i)||`` (`lipdp.bounds.tightness`:
      ``mean_ratio * bound``);
    - ``noise_std/<var>``: the standard deviation, per coordinate, of the Gaussian
      noise the train step adds to the averaged gradient of v, from the step's own
      code (``model._noise_stddevs(model.sensitivities())``): ``sigma * Delta_v``
      with the per-layer strategy, ``sigma * sqrt(sum_u Delta_u^2)`` with the
      global one, ``Delta_v = bound(v) / D``;
    - ``signal_to_noise/<var>``: ``grad_norm_mean / (D * noise_std)``, with D the
      step's public batch denominator. The averaged gradient is ``sum_i g_i / D``,
      so ``D * noise_std`` is the noise std on the *sum* of per-example gradients,
      the scale one example's gradient enters with. With the per-layer strategy
      this is ``tightness_mean / sigma``.

    Names ``<var>`` as in `BoundMonitor`. **Not private** on training data
    (module docstring). Clipless mode only.

    Args:
        data, sample_size, seed, chunk_size: as for `BoundMonitor`.
    """

    data_log_prefixes = ("grad_norm_mean/", "signal_to_noise/")

    def on_epoch_end(self, epoch, logs=None):
        if logs is None:  # nowhere to write: skip the per-example gradients
            return
        report = self.tightness_report(epoch)
        model = self.model
        names = variable_names(model)
        stddevs = model._noise_stddevs(model.sensitivities())  # the train step's noise
        denominator = float(model.step_mechanism.batch_size)
        for v, std in zip(model.trainable_variables, stddevs):
            name = names[v.ref()]
            row = report[name]
            mean_norm = row["mean_ratio"] * row["bound"]
            std = float(std)
            logs[f"grad_norm_mean/{name}"] = mean_norm
            logs[f"noise_std/{name}"] = std
            logs[f"signal_to_noise/{name}"] = (mean_norm / (denominator * std) if std > 0
                                               else math.inf)

    def get_config(self) -> dict:
        return self._base_config()
