"""The privacy ledger: which mechanism every private step ran.

A model's epsilon is the composition of what its train step actually released,
not a recomputation from today's parameters. Each step releases one
Poisson-subsampled Gaussian mechanism whose parameters are fixed when the model
is compiled (`StepMechanism`): changing the noise multiplier, the noise
strategy, the number of noised variables (freezing a layer), the batch size or
the sampling needs a new `compile`, and the first step after it opens a new
`Segment` in the ledger. `PrivacyLedger.epsilon` composes the segments
(`lipdp.accounting.compose_epsilon`, heterogeneous RDP composition).

The ledger lives in the model's saved state (a variable saved with the weights,
`.keras` files and checkpoints alike) as one row of numbers per segment:
``[first step, *StepMechanism.to_row()]`` (`EMPTY_STORAGE` before the first); a
segment's length is the distance to the next segment's first step, or to the model's
step counter for the last one. The steps each model object takes follow a row naming
them (`run_row`: a random number the object draws), so that two runs of one mechanism,
whose segments are the same numbers, are told apart (`continues`).
This module is pure Python and numpy: it never touches tensors.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence, Tuple

import numpy as np

from lipdp import accounting
from lipdp.metadata import (Clipping, DatasetMetadata, DPMode, DPParameters, NoiseStrategy,
                            Sampling)

__all__ = ["StepMechanism", "Segment", "PrivacyLedger", "LedgerMismatchError", "ROW_SIZE",
           "EMPTY_STORAGE", "RUN_MARK", "run_row", "stored_rows", "segment_rows", "continues",
           "includes", "steps_run", "concatenated"]


class LedgerMismatchError(ValueError):
    """A run resumed from a checkpoint would not continue the mechanism its ledger records."""


def _code(enum_value) -> float:
    return float(list(type(enum_value)).index(enum_value))


def _decode(enum_cls, code: float):
    members = list(enum_cls)
    index = int(code)
    if index != code or not 0 <= index < len(members):
        raise ValueError(f"Corrupt privacy ledger: {code!r} is not a {enum_cls.__name__} code.")
    return members[index]


@dataclasses.dataclass(frozen=True)
class StepMechanism:
    """What one private step releases, as the compiled train step runs it (all public).

    Attributes:
        mode: clipless or clipped DP-SGD.
        noise_multiplier: sigma of `DPParameters`.
        noisify_strategy: global or per-layer noise (clipless mode).
        clipping: the clipping rule (clipped mode; ``FLAT`` in clipless mode).
        nb_noised_variables: V, the number of trainable variables the step noises.
        batch_size: D, the public denominator (expected batch with Poisson sampling).
        nb_samples_train: N.
        sampling: Poisson or shuffled batches.
        delta: the delta of `DPParameters` when the step was compiled (informative:
            the ledger's epsilon is converted at the delta asked for).
        quantile_noise_multiplier: sigma_b of the count an `AdaptiveClipping` step
            releases (0: no such release).
    """

    mode: DPMode
    noise_multiplier: float
    noisify_strategy: NoiseStrategy
    clipping: Clipping
    nb_noised_variables: int
    batch_size: int
    nb_samples_train: int
    sampling: Sampling
    delta: float
    quantile_noise_multiplier: float = 0.0

    @classmethod
    def of(cls, dp_parameters: DPParameters, dataset_metadata: DatasetMetadata,
           nb_noised_variables: int) -> "StepMechanism":
        """The mechanism a model compiled with these parameters runs."""
        clipping = dp_parameters.loss_gradient_clipping
        return cls(mode=dp_parameters.mode,
                   noise_multiplier=float(dp_parameters.noise_multiplier),
                   noisify_strategy=dp_parameters.noisify_strategy,
                   clipping=dp_parameters.clipping,
                   nb_noised_variables=int(nb_noised_variables),
                   batch_size=int(dataset_metadata.batch_size),
                   nb_samples_train=int(dataset_metadata.nb_samples_train),
                   sampling=dataset_metadata.sampling,
                   delta=float(dp_parameters.delta),
                   quantile_noise_multiplier=0.0 if clipping is None else float(
                       clipping.count_noise_multiplier(dataset_metadata.batch_size)))

    @property
    def sampling_rate(self) -> float:
        """q = D / N."""
        return self.batch_size / self.nb_samples_train

    @property
    def step_noise_multiplier(self) -> float:
        """Noise multiplier of the one Gaussian mechanism a step amounts to:
        sigma in clipped mode (isotropic noise, `lipdp.clipping`) and for the global
        strategy, sigma / sqrt(V) per layer, joint with an adaptive clipping count released
        by the same step (`lipdp.accounting.step_noise_multiplier`)."""
        if self.mode is DPMode.CLIPPED:
            return self.noise_multiplier
        return accounting.step_noise_multiplier(self.noisify_strategy, self.noise_multiplier,
                                                self.nb_noised_variables,
                                                self.quantile_noise_multiplier)

    def to_row(self) -> Tuple[float, ...]:
        """The mechanism as numbers (the ledger's storage format)."""
        return (_code(self.mode), self.noise_multiplier, _code(self.noisify_strategy),
                _code(self.clipping), float(self.nb_noised_variables), float(self.batch_size),
                float(self.nb_samples_train), _code(self.sampling), self.delta,
                self.quantile_noise_multiplier)

    @classmethod
    def from_row(cls, row: Sequence[float]) -> "StepMechanism":
        mode, sigma, strategy, clipping, nb_variables, batch, n, sampling, delta, quantile = (
            float(value) for value in row)
        return cls(mode=_decode(DPMode, mode), noise_multiplier=sigma,
                   noisify_strategy=_decode(NoiseStrategy, strategy),
                   clipping=_decode(Clipping, clipping), nb_noised_variables=int(nb_variables),
                   batch_size=int(batch), nb_samples_train=int(n),
                   sampling=_decode(Sampling, sampling), delta=delta,
                   quantile_noise_multiplier=quantile)

    def describe(self) -> str:
        """One line: the mode, noise and sampling of the step."""
        if self.mode is DPMode.CLIPPED:
            noise = f"clipped ({self.clipping.value}), sigma={self.noise_multiplier:g}"
        else:
            noise = (f"clipless ({self.noisify_strategy.value}), sigma={self.noise_multiplier:g}, "
                     f"V={self.nb_noised_variables}")
            if self.quantile_noise_multiplier:
                noise += f", adaptive logit clipping (count sigma={self.quantile_noise_multiplier:g})"
        return (f"{noise}, step noise multiplier {self.step_noise_multiplier:.4g}, "
                f"q={self.sampling_rate:.4g} ({self.sampling.value}, D={self.batch_size}, "
                f"N={self.nb_samples_train})")


# ``[first step, *StepMechanism.to_row()]``
ROW_SIZE = 1 + len(dataclasses.fields(StepMechanism))

#: What a ledger without segments stores: one placeholder row of -1. (A variable holding a
#: (0, ROW_SIZE) array cannot be broadcast to the workers of a MultiWorkerMirroredStrategy:
#: TensorFlow 2.15's collective broadcast of an empty tensor crashes the process.)
EMPTY_STORAGE = np.full((1, ROW_SIZE), -1.0)


#: The first number of a row that names a run (`run_row`) instead of starting a segment.
RUN_MARK = -2.0


def run_row(run_id: int) -> np.ndarray:
    """The row naming a run: ``[RUN_MARK, run_id, 0, ...]``, `run_id` an integer below 2**53
    (exact in float64). The segments of the run follow it."""
    if not 0 < run_id < 2 ** 53:
        raise ValueError(f"A run id is an integer in (0, 2**53); received {run_id!r}.")
    row = np.zeros(ROW_SIZE)
    row[0], row[1] = RUN_MARK, float(run_id)
    return row


def stored_rows(stored) -> np.ndarray:
    """The rows of a stored ledger, run rows (`run_row`) and segment rows, without the
    placeholder of an empty ledger (`EMPTY_STORAGE`); ledgers saved before the placeholder
    existed store no row."""
    rows = (np.asarray(stored, dtype=np.float64).reshape(-1, ROW_SIZE) if np.size(stored)
            else np.zeros((0, ROW_SIZE)))
    return rows[:0] if np.array_equal(rows, EMPTY_STORAGE) else rows


def segment_rows(stored) -> np.ndarray:
    """The segment rows of a stored ledger (`stored_rows` without the rows naming runs)."""
    rows = stored_rows(stored)
    return rows[rows[:, 0] != RUN_MARK]


def continues(earlier, later) -> bool:
    """Whether the stored ledger ``later = (steps, rows)`` continues ``earlier``: the same
    rows (the runs named, the segments' first steps and mechanisms) up to ``earlier``'s step
    count, then perhaps more steps. A ledger without steps is continued by every ledger.

    Two runs of one mechanism record the same segments; the rows naming them differ
    (`run_row`), so neither continues the other. Ledgers saved before runs were named
    (2026-12-06) name none: between two of them the segments alone decide.

    ``earlier``'s rows after its last step (`steps_run`: the name and segment opened for
    steps to come) are not compared: a model names those again after a load
    (`DP_Model._open_segment`), and its high-water mark, noted before, then seemed another
    run, whose steps the next read added to the loaded ones (16 for a file of 8)."""
    (steps_a, stored_a), (steps_b, stored_b) = steps_run(earlier), later
    if steps_a == 0:
        return True
    a, b = stored_rows(stored_a), stored_rows(stored_b)
    if steps_a > steps_b or len(a) > len(b) or not np.array_equal(a, b[:len(a)]):
        return False
    following = segment_rows(b[len(a):])
    return not len(following) or following[0, 0] >= steps_a


def includes(later, earlier) -> bool:
    """Whether the stored ledger ``later = (steps, rows)`` holds every step of ``earlier``:
    `continues`, or ``earlier``'s rows found in ``later``'s as one block (the runs named
    and the mechanisms equal, the segments' first steps all shifted by one number) whose
    segments run on in ``later`` for at least ``earlier``'s steps: a ledger that composed
    ``earlier``'s run after steps of its own (`concatenated`). A block that names no run
    (ledgers saved before runs were named) is looked for at the start only (`continues`):
    runs of one mechanism record the same segments."""
    if continues(earlier, later):
        return True
    (steps_a, stored_a), (steps_b, stored_b) = earlier, later
    a, b = stored_rows(stored_a), stored_rows(stored_b)
    named = a[:, 0] == RUN_MARK
    if not named.any():
        return False
    for start in range(1, len(b) - len(a) + 1):
        block = b[start:start + len(a)]
        if not (np.array_equal(block[:, 0] == RUN_MARK, named)
                and np.array_equal(block[:, 1:], a[:, 1:])):
            continue
        shifts = block[~named, 0] - a[~named, 0]
        if not len(shifts) or np.any(shifts != shifts[0]):
            continue
        following = segment_rows(b[start + len(a):])
        end = following[0, 0] if len(following) else steps_b
        if end - shifts[0] >= steps_a:
            return True
    return False


def steps_run(state):
    """``state = (steps, rows)`` without its rows after the last step run: the row naming
    a model's next steps and the segment opened for them (`DP_Model._open_segment`), which
    record no step yet."""
    steps, stored = state
    rows = stored_rows(stored)
    while len(rows) and (rows[-1, 0] == RUN_MARK or rows[-1, 0] >= steps > 0):
        rows = rows[:-1]
    return steps, (rows if len(rows) else EMPTY_STORAGE)


def concatenated(first, then):
    """The stored ledger ``(steps, rows)`` of ``first``'s steps followed by ``then``'s: what
    a model holding weights from two runs has cost (the composition of both)."""
    (steps_a, stored_a), (steps_b, stored_b) = first, then
    a, b = stored_rows(stored_a), stored_rows(stored_b).copy()
    b[b[:, 0] != RUN_MARK, 0] += steps_a
    rows = np.concatenate([a, b]) if len(a) + len(b) else EMPTY_STORAGE
    return steps_a + steps_b, rows


@dataclasses.dataclass(frozen=True)
class Segment:
    """``steps`` consecutive private steps of one mechanism, from step ``start``."""

    mechanism: StepMechanism
    start: int
    steps: int


@dataclasses.dataclass(frozen=True)
class PrivacyLedger:
    """The segments of a model's training, in order."""

    segments: Tuple[Segment, ...]

    @classmethod
    def from_rows(cls, rows: np.ndarray, steps_taken: int) -> "PrivacyLedger":
        """The ledger stored as `rows` (one per segment; rows naming runs are skipped) for a
        model that took `steps_taken` steps in all. A segment that ran no step (opened for
        steps to come) is left out, and consecutive segments of one mechanism are one (a run
        resumed by another model object, which names its own steps, composes them as the
        uninterrupted run does, to the last bit).

        Raises:
            ValueError: rows of the wrong width, first steps not increasing from 0, or
                steps recorded that no segment covers.
        """
        rows = segment_rows(rows)
        starts = [int(r[0]) for r in rows] + [int(steps_taken)]
        if (len(rows) and starts[0] != 0) or any(b < a for a, b in zip(starts, starts[1:])) \
                or (not len(rows) and steps_taken):
            raise ValueError(f"Corrupt privacy ledger: segments start at {starts[:-1]} for "
                             f"{steps_taken} steps taken.")
        segments = []
        for row, start, end in zip(rows, starts, starts[1:]):
            if end == start:
                continue
            mechanism = StepMechanism.from_row(row[1:])
            if segments and segments[-1].mechanism == mechanism:
                start = segments.pop().start
            segments.append(Segment(mechanism, start, end - start))
        return cls(tuple(segments))

    @property
    def steps(self) -> int:
        """Total number of private steps."""
        return sum(segment.steps for segment in self.segments)

    def accounting_terms(self):
        """``[(step noise multiplier, sampling rate, steps)]``, one per segment."""
        return [(s.mechanism.step_noise_multiplier, s.mechanism.sampling_rate, s.steps)
                for s in self.segments]

    def epsilon(self, delta: float) -> float:
        """Epsilon at `delta` of everything the ledger records (composition of the segments)."""
        return accounting.compose_epsilon(self.accounting_terms(), delta)

    def max_steps(self, epsilon_budget: float, mechanism: StepMechanism, delta: float) -> int:
        """Total steps (recorded ones included) the run may reach with `mechanism` from now
        on without exceeding `epsilon_budget` at `delta`; ``self.steps`` if none more fits."""
        more = accounting.max_steps_after(self.accounting_terms(), epsilon_budget,
                                          mechanism.step_noise_multiplier,
                                          mechanism.sampling_rate, delta)
        return self.steps + more

    def check_resumes(self, mechanism: StepMechanism) -> None:
        """Resuming an interrupted run: its next steps must run the mechanism of its last
        segment.

        Raises:
            LedgerMismatchError: the ledger holds steps and its last segment ran another
                mechanism (naming the fields that differ). Training on with other
                parameters on purpose is allowed by `fit` (a new segment, accounted), but
                not as a resume.
        """
        if not self.steps:
            return
        last = self.segments[-1].mechanism
        if last == mechanism:
            return
        differ = [f"{field.name}: {getattr(last, field.name)!r} in the ledger, "
                  f"{getattr(mechanism, field.name)!r} now"
                  for field in dataclasses.fields(StepMechanism)
                  if getattr(last, field.name) != getattr(mechanism, field.name)]
        raise LedgerMismatchError(
            f"Cannot resume: the checkpoint's privacy ledger ({self.steps} steps) ran another "
            f"mechanism than this model is compiled with ({'; '.join(differ)}). Resume with "
            "the parameters of the interrupted run.")

    def describe(self, delta: float) -> str:
        """One line per segment and the composed epsilon."""
        lines = [f"steps {s.start}-{s.start + s.steps - 1}: {s.mechanism.describe()}"
                 for s in self.segments]
        epsilon = self.epsilon(delta)
        lines.append(f"composed: epsilon={accounting.format_epsilon(epsilon)} at delta={delta:g} "
                     f"after {self.steps} steps" if math.isfinite(epsilon) else
                     f"composed: epsilon=inf (a segment without noise) after {self.steps} steps")
        return "\n".join(lines)
