"""Public, data-independent description of a private training run.

`DatasetMetadata` describes the training set as the accountant sees it, and
`DPParameters` the privacy mechanism. Both are plain, frozen, validated records:
they never touch tensors, and everything they contain is public.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from typing import Optional, Tuple


class Sampling(str, enum.Enum):
    """How batches are drawn from the training set.

    - ``POISSON``: every example joins each batch independently with probability
      ``q = batch_size / nb_samples_train``. This is what the RDP amplification
      theorem assumes; the reported epsilon is exact for this pipeline.
    - ``SHUFFLE``: the data is shuffled once per epoch and cut into fixed-size
      batches. The accountant still reports the Poisson-subsampled epsilon (the
      common practice of the literature), which is *not* a proven guarantee for
      this pipeline; lipdp warns when it is used.
    """

    POISSON = "poisson"
    SHUFFLE = "shuffle"


class NoiseStrategy(str, enum.Enum):
    """How the Gaussian noise is calibrated to the per-variable sensitivities.

    - ``GLOBAL``: one isotropic Gaussian of std ``sigma * sqrt(sum_v Delta_v^2)``.
    - ``PER_LAYER``: std ``sigma * Delta_v`` on variable ``v``; accounted as the
      composition of one Gaussian mechanism per variable.
    """

    GLOBAL = "global"
    PER_LAYER = "per-layer"


def _parse_enum(enum_cls, value, argname):
    if isinstance(value, enum_cls):
        return value
    try:
        return enum_cls(value)
    except ValueError:
        allowed = ", ".join(repr(m.value) for m in enum_cls)
        raise ValueError(
            f"Received an invalid value for `{argname}`, expected one of {allowed}. "
            f"Received: {argname}={value!r}"
        ) from None


def _check_positive(value, argname, allow_zero=False):
    ok = value >= 0 if allow_zero else value > 0
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not ok \
            or not math.isfinite(value):
        kind = "non-negative" if allow_zero else "positive"
        raise ValueError(
            f"Received an invalid value for `{argname}`, expected a finite {kind} "
            f"number. Received: {argname}={value!r}"
        )


@dataclasses.dataclass(frozen=True)
class DatasetMetadata:
    """Public facts about the private training set.

    Args:
        input_shape: shape of one example, without the batch dimension.
        nb_classes: number of outputs of the classifier.
        nb_samples_train: number of training examples N (public).
        nb_samples_test: number of test examples.
        batch_size: the fixed, public batch denominator D. With Poisson sampling
            it is the *expected* batch size q*N; with shuffling it is the size of
            every full batch. Gradients are always ``sum / D``.
        max_norm: the L2 bound X0 declared on every input (the `DP_BoundedInput`
            layer clips to it in the forward pass).
        sampling: `Sampling` used by the training pipeline.
    """

    input_shape: Tuple[int, ...]
    nb_classes: int
    nb_samples_train: int
    nb_samples_test: int
    batch_size: int
    max_norm: Optional[float] = None
    sampling: Sampling = Sampling.POISSON

    def __post_init__(self):
        object.__setattr__(self, "input_shape", tuple(int(d) for d in self.input_shape))
        object.__setattr__(self, "sampling", _parse_enum(Sampling, self.sampling, "sampling"))
        for name in ("nb_classes", "nb_samples_train", "batch_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(
                    f"Received an invalid value for `{name}`, expected a positive "
                    f"integer. Received: {name}={value!r}"
                )
        if self.batch_size > self.nb_samples_train:
            raise ValueError(
                f"`batch_size` ({self.batch_size}) exceeds `nb_samples_train` "
                f"({self.nb_samples_train})."
            )
        if self.max_norm is not None:
            _check_positive(self.max_norm, "max_norm")

    @property
    def sampling_rate(self) -> float:
        """q = D / N, the probability that an example takes part in a step."""
        return self.batch_size / self.nb_samples_train

    @property
    def steps_per_epoch(self) -> int:
        """Number of steps in one epoch: ceil(N / D) (a partial last batch counts)."""
        return math.ceil(self.nb_samples_train / self.batch_size)

    def get_config(self) -> dict:
        config = dataclasses.asdict(self)
        config["sampling"] = self.sampling.value
        config["input_shape"] = list(self.input_shape)
        return config

    @classmethod
    def from_config(cls, config: dict) -> "DatasetMetadata":
        return cls(**config)


@dataclasses.dataclass(frozen=True)
class DPParameters:
    """The privacy mechanism of a run.

    Args:
        noise_multiplier: sigma, the ratio between the noise std and the
            sensitivity of the averaged gradient. 0 disables noise (then the run
            is not private and epsilon is infinite).
        delta: the delta of the reported (epsilon, delta)-DP guarantee.
        noisify_strategy: a `NoiseStrategy` or its string value.
    """

    noise_multiplier: float = 1.0
    delta: float = 1e-5
    noisify_strategy: NoiseStrategy = NoiseStrategy.GLOBAL

    def __post_init__(self):
        object.__setattr__(
            self, "noisify_strategy",
            _parse_enum(NoiseStrategy, self.noisify_strategy, "noisify_strategy"),
        )
        _check_positive(self.noise_multiplier, "noise_multiplier", allow_zero=True)
        if not (isinstance(self.delta, (int, float)) and 0 < self.delta < 1):
            raise ValueError(
                "Received an invalid value for `delta`, expected a number in (0, 1). "
                f"Received: delta={self.delta!r}"
            )

    def get_config(self) -> dict:
        return {
            "noise_multiplier": float(self.noise_multiplier),
            "delta": float(self.delta),
            "noisify_strategy": self.noisify_strategy.value,
        }

    @classmethod
    def from_config(cls, config: dict) -> "DPParameters":
        return cls(**config)
