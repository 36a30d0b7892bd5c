"""Public, data-independent description of a private training run.

`DatasetMetadata` describes the training set as the accountant sees it, and
`DPParameters` the privacy mechanism. Both are plain, frozen, validated records:
they never touch tensors, and everything they contain is public.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import numbers
from typing import Optional, Tuple, Union


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
      composition of one Gaussian mechanism per variable. ``"local"`` (the paper
      library's name for it) is accepted as an alias.
    """

    GLOBAL = "global"
    PER_LAYER = "per-layer"

    @classmethod
    def _missing_(cls, value):
        # "local": the paper library's (lip-dp) earlier name of the per-layer strategy,
        # still used in its README; accepted so that its scripts run unchanged.
        return cls.PER_LAYER if value == "local" else None


class DPMode(str, enum.Enum):
    """Which private training algorithm `model.fit` runs.

    - ``CLIPLESS``: Clipless DP-SGD. Per-example gradient norms are bounded
      analytically through the Lipschitz DP layers; nothing is clipped.
    - ``CLIPPED``: classic DP-SGD (Abadi et al.): every per-example gradient is
      computed (or its norm, see `NormEngine`) and clipped; any Keras layer
      without batch coupling is allowed (`lipdp.clipping`).
    """

    CLIPLESS = "clipless"
    CLIPPED = "clipped"


class Clipping(str, enum.Enum):
    """How classic DP-SGD bounds a per-example gradient g (``mode="clipped"``).

    - ``FLAT``: ``g * min(1, C / ||g||)`` over all trainable variables at once.
    - ``PER_LAYER``: ``g_v * min(1, C_v / ||g_v||)`` for each trainable variable v;
      the whole clipped gradient has norm at most ``sqrt(sum_v C_v^2)``.
    - ``GLOBAL``: ``g * 1{||g|| <= C}`` (Bu et al., Algorithm 1, option 2): an
      example's gradient is kept whole or dropped; norm at most C.

    The averaged clipped gradient ``sum_i clip(g_i) / D`` then has L2 sensitivity
    ``C / D`` (flat, global) or ``sqrt(sum_v C_v^2) / D`` (per-layer) under
    add/remove-one, and the noise std is sigma times that.
    """

    FLAT = "flat"
    PER_LAYER = "per-layer"
    GLOBAL = "global"


class NormEngine(str, enum.Enum):
    """How the per-example gradient norms of classic DP-SGD are computed.

    - ``VECTORIZED``: exact per-example gradients of every variable
      (`lipdp.per_example`), then clipped and summed.
    - ``GHOST``: Lee & Kifer's Algorithm 1: per-example norms of Dense, Conv2D
      and Embedding layers from their inputs and output cotangents
      (`lipdp.clipping.ghost_norms`, Gram identities: no per-example gradient of
      those layers is ever formed), exact per-example gradients for the other
      layers only, then the clipped sum from each layer's output and its
      reweighted cotangents.
    - ``MIXED_GHOST``: as ``GHOST``, but a Dense/Conv2D layer whose Gram
      matrices (``2 T^2`` numbers per example, T positions or patches) would be
      larger than its per-example gradient (``m n``) gets its norm from that
      gradient, formed transiently chunk by chunk ("mixed ghost clipping", Bu et
      al. 2022). Cheaper on early convolutions; same clipped update.
    """

    VECTORIZED = "vectorized"
    GHOST = "ghost"
    MIXED_GHOST = "mixed-ghost"


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


def _plain(value):
    """A NumPy scalar as the Python number it holds (``np.float32(2.0)`` was refused with
    "Received: noise_multiplier=2.0": an audit); anything else as it is."""
    item = getattr(value, "item", None)
    if isinstance(value, numbers.Number) and type(value) not in (bool, int, float) and item:
        return item()
    return value


def _check_positive(value, argname, allow_zero=False):
    if not isinstance(value, (int, float)) or isinstance(value, bool) \
            or not math.isfinite(value) or not (value >= 0 if allow_zero else value > 0):
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
        augmentation_multiplicity: k, the number of augmented views the training
            pipeline gives each example (`lipdp.augmentation`): its batches hold
            inputs of shape ``(batch, k) + input_shape`` when k > 1, and the private
            step uses the average of an example's k view gradients as its gradient.
    """

    input_shape: Tuple[int, ...]
    nb_classes: int
    nb_samples_train: int
    nb_samples_test: int
    batch_size: int
    max_norm: Optional[float] = None
    sampling: Sampling = Sampling.POISSON
    augmentation_multiplicity: int = 1

    def __post_init__(self):
        shape = self.input_shape
        dims = [_plain(d) for d in shape] if isinstance(shape, (tuple, list)) else []
        if not dims or not all(type(d) is int and d > 0 for d in dims):
            # (4.7,) was truncated to (4,), (-4,) and () accepted, 4 raised "not iterable"
            # (an audit)
            raise ValueError("Received an invalid value for `input_shape`, expected a tuple of "
                             f"positive integers. Received: input_shape={shape!r}")
        object.__setattr__(self, "input_shape", tuple(dims))
        object.__setattr__(self, "sampling", _parse_enum(Sampling, self.sampling, "sampling"))
        for name in ("nb_classes", "nb_samples_train", "nb_samples_test", "batch_size",
                     "augmentation_multiplicity", "max_norm"):
            object.__setattr__(self, name, _plain(getattr(self, name)))
        test = self.nb_samples_test
        if not isinstance(test, int) or isinstance(test, bool) or test < 0:
            raise ValueError("Received an invalid value for `nb_samples_test`, expected a "
                             f"non-negative integer. Received: nb_samples_test={test!r}")
        for name in ("nb_classes", "nb_samples_train", "batch_size", "augmentation_multiplicity"):
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
class AdaptiveClipping:
    """Loss-logits gradient clipping at a privately estimated quantile (paper appendix B.5,
    with the geometric quantile tracking of Andrew et al. 2021). Clipless mode only.

    Each example's gradient of the loss w.r.t. the logits is clipped to norm C_t in the
    backward pass, so the bound pass starts from ``min(L, C_t)`` instead of the loss
    constant L: the noise shrinks with C_t. After each step, the fraction of the batch
    whose logit gradient is at most C_t is released by a Gaussian mechanism (the sum of
    ``1[||g_i|| <= C_t] - 1/2``, sensitivity 1/2, plus ``N(0, noise_multiplier^2)``),
    divided by the public D and moved back by 1/2, and
    ``C_{t+1} = C_t exp(-learning_rate (fraction - target_quantile))``. The release is
    part of the step's mechanism: the ledger composes it with the gradient's (a joint
    Gaussian with ``z^-2 = z_gradient^-2 + (2 noise_multiplier)^-2``). Under
    `tf.distribute` the replicas' counts are summed and the count's noise is drawn once.

    Args:
        target_quantile: gamma in (0, 1): C_t tracks the gamma-quantile of the
            examples' logit-gradient norms (the paper: at least 0.9).
        noise_multiplier: sigma_b > 0 of the count; None means D / 20 (Andrew et al.'s
            choice: its privacy cost is then small beside the gradient's).
        initial_clip: C_0 > 0; None starts at the loss constant L (no clipping).
        learning_rate: eta > 0 of the geometric update.
    """

    target_quantile: float = 0.9
    noise_multiplier: Optional[float] = None
    initial_clip: Optional[float] = None
    learning_rate: float = 0.2

    def __post_init__(self):
        for name in ("target_quantile", "noise_multiplier", "initial_clip", "learning_rate"):
            object.__setattr__(self, name, _plain(getattr(self, name)))
        if not (_is_real(self.target_quantile) and 0 < self.target_quantile < 1):
            raise ValueError("Received an invalid value for `target_quantile`, expected a "
                             f"number in (0, 1). Received: {self.target_quantile!r}")
        for name in ("noise_multiplier", "initial_clip"):
            value = getattr(self, name)
            if value is not None:
                _check_positive(value, name)
                object.__setattr__(self, name, float(value))
        if self.noise_multiplier is not None and not 2.0 ** -64 <= self.noise_multiplier <= 4e37:
            # float32 draws of the count's noise flushed to zero below (a noiseless count,
            # an audit) or overflowed above, as for the gradient's noise.
            raise ValueError("Received an invalid value for `noise_multiplier`, expected a "
                             "number in [2^-64, 4e37], where float32 can draw its noise. "
                             f"Received: noise_multiplier={self.noise_multiplier!r}")
        if self.initial_clip is not None and \
                not 2.0 ** -126 <= self.initial_clip <= MAX_CLIP:  # MAX_CLIP: float32's max
            # C_t is a float32 variable: 1e39 was stored as inf and 1e-50 as 0, which the
            # step refuses as a C_t no update makes (a review, 2026-12-07).
            raise ValueError("Received an invalid value for `initial_clip`, expected a number "
                             "in float32's normal range [2^-126, 3.4e38] (C_t is stored in "
                             f"float32). Received: initial_clip={self.initial_clip!r}")
        _check_positive(self.learning_rate, "learning_rate")
        object.__setattr__(self, "target_quantile", float(self.target_quantile))
        object.__setattr__(self, "learning_rate", float(self.learning_rate))

    def count_noise_multiplier(self, batch_size: int) -> float:
        """sigma_b for the public denominator D."""
        return self.noise_multiplier if self.noise_multiplier is not None else batch_size / 20

    def get_config(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class DPParameters:
    """The privacy mechanism of a run.

    Args:
        noise_multiplier: sigma, the ratio between the noise std and the
            sensitivity of the averaged gradient. 0 disables noise (then the run
            is not private and epsilon is infinite).
        delta: the delta of the reported (epsilon, delta)-DP guarantee.
        noisify_strategy: a `NoiseStrategy` or its string value. Clipless mode
            only: classic DP-SGD always adds isotropic noise.
        mode: a `DPMode` or its value: ``"clipless"`` (default, Clipless DP-SGD)
            or ``"clipped"`` (classic DP-SGD with per-example clipping, see
            `lipdp.clipping`). The fields below only apply to ``"clipped"`` and
            must keep their defaults otherwise.
        clipping: a `Clipping` rule or its value: ``"flat"`` (default),
            ``"per-layer"`` or ``"global"``.
        l2_norm_clip: the clipping threshold C (required in clipped mode). With
            ``"per-layer"`` it is either a sequence of thresholds ``C_v``, one per
            trainable variable in the order of `model.trainable_variables`
            (checked at compile), or one number C, split as ``C_v = C / sqrt(V)``
            over the V trainable variables (so that ``sqrt(sum_v C_v^2) = C``).
        engine: a `NormEngine` or its value: ``"ghost"`` (default),
            ``"mixed-ghost"`` or ``"vectorized"``. All give the same clipped
            gradient; they differ in time and memory (``benchmarks/run.py``).
        preclip_noise: std k >= 0 of the Gaussian perturbation ``k * N(0, I)``
            added to each per-example gradient *before* clipping (Chen, Wu & Hong
            2020, Sec. 5) to reduce the clipping bias; 0 (default) disables it.
            It needs per-example gradients: with a ghost engine the step
            falls back to the vectorised engine (with a warning). It does not
            change the sensitivity (clipping comes after it).
        loss_gradient_clipping: an `AdaptiveClipping` (or its config dict) to clip
            the loss-logits gradient at a privately estimated quantile (clipless
            mode); None (default) uses the loss constant.

    Raises:
        ValueError: an invalid value; ``noisify_strategy="per-layer"`` in clipped
            mode (the noise of classic DP-SGD is isotropic); clipped-mode fields
            in clipless mode; several thresholds for a rule other than
            ``"per-layer"``.
    """

    noise_multiplier: float = 1.0
    delta: float = 1e-5
    noisify_strategy: NoiseStrategy = NoiseStrategy.GLOBAL
    mode: DPMode = DPMode.CLIPLESS
    clipping: Clipping = Clipping.FLAT
    l2_norm_clip: Optional[Union[float, Tuple[float, ...]]] = None
    engine: NormEngine = NormEngine.GHOST
    preclip_noise: float = 0.0
    loss_gradient_clipping: Optional[AdaptiveClipping] = None

    def __post_init__(self):
        for name in ("noise_multiplier", "delta", "preclip_noise"):
            object.__setattr__(self, name, _plain(getattr(self, name)))
        if isinstance(self.noise_multiplier, str):
            raise TypeError(
                "DPParameters takes (noise_multiplier, delta, noisify_strategy, ...) in this "
                "order; the paper library's positional order (noisify_strategy, "
                "noise_multiplier, delta) does not carry over: name the arguments. Received: "
                f"noise_multiplier={self.noise_multiplier!r}")
        if isinstance(self.loss_gradient_clipping, dict):
            object.__setattr__(self, "loss_gradient_clipping",
                               AdaptiveClipping(**self.loss_gradient_clipping))
        if self.loss_gradient_clipping is not None and \
                not isinstance(self.loss_gradient_clipping, AdaptiveClipping):
            raise TypeError("`loss_gradient_clipping` must be a lipdp.AdaptiveClipping. "
                            f"Received: {self.loss_gradient_clipping!r}")
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
        object.__setattr__(self, "mode", _parse_enum(DPMode, self.mode, "mode"))
        object.__setattr__(self, "clipping", _parse_enum(Clipping, self.clipping, "clipping"))
        object.__setattr__(self, "engine", _parse_enum(NormEngine, self.engine, "engine"))
        if not _is_real(self.preclip_noise) or not math.isfinite(self.preclip_noise) \
                or self.preclip_noise < 0:
            raise ValueError(
                "Received an invalid value for `preclip_noise`, expected a finite non-negative "
                f"number. Received: preclip_noise={self.preclip_noise!r}"
            )
        object.__setattr__(self, "preclip_noise", float(self.preclip_noise))
        if self.mode is DPMode.CLIPLESS:
            self._check_clipless()
        else:
            self._check_clipped()

    def _check_clipless(self):
        defaults = {"clipping": Clipping.FLAT, "l2_norm_clip": None,
                    "engine": NormEngine.GHOST, "preclip_noise": 0.0}
        for name, default in defaults.items():
            value = getattr(self, name)
            if value != default:
                shown = value.value if isinstance(value, enum.Enum) else value
                raise ValueError(
                    f"`{name}` only applies to mode='clipped' (classic DP-SGD); Clipless DP-SGD "
                    f"bounds gradients without clipping. Received: mode='clipless', "
                    f"{name}={shown!r}"
                )

    def _check_clipped(self):
        if self.loss_gradient_clipping is not None:
            raise ValueError("`loss_gradient_clipping` applies to mode='clipless' (it clips the "
                             "logit gradient inside Clipless DP-SGD's bound pass).")
        if self.noisify_strategy is not NoiseStrategy.GLOBAL:
            raise ValueError(
                "Received an invalid value for `noisify_strategy` in mode='clipped', expected "
                "'global': classic DP-SGD adds one isotropic Gaussian calibrated to the clipping "
                "threshold (per-layer thresholds are set with clipping='per-layer'). "
                f"Received: noisify_strategy={self.noisify_strategy.value!r}"
            )
        clip = self.l2_norm_clip
        if clip is None:
            raise ValueError("mode='clipped' needs a clipping threshold: pass `l2_norm_clip=C` "
                             "(a positive number; per-variable thresholds with "
                             "clipping='per-layer').")
        if isinstance(clip, (list, tuple)):
            if self.clipping is not Clipping.PER_LAYER:
                raise ValueError(
                    "Received an invalid value for `l2_norm_clip`, expected one positive number "
                    f"with clipping={self.clipping.value!r} (a sequence of thresholds needs "
                    f"clipping='per-layer'). Received: l2_norm_clip={clip!r}"
                )
            if not clip or not all(_is_clip_threshold(c) for c in clip):
                raise ValueError(
                    "Received an invalid value for `l2_norm_clip`, expected a non-empty sequence "
                    f"of numbers in [{MIN_CLIP:g}, {MAX_CLIP:.4g}] ({_CLIP_RANGE_REASON}). "
                    f"Received: l2_norm_clip={clip!r}"
                )
            object.__setattr__(self, "l2_norm_clip", tuple(float(c) for c in clip))
        elif _is_clip_threshold(clip):
            object.__setattr__(self, "l2_norm_clip", float(clip))
        else:
            raise ValueError(
                f"Received an invalid value for `l2_norm_clip`, expected a number in "
                f"[{MIN_CLIP:g}, {MAX_CLIP:.4g}] (or, with clipping='per-layer', a sequence of "
                f"them; {_CLIP_RANGE_REASON}). Received: l2_norm_clip={clip!r}"
            )

    def get_config(self) -> dict:
        clip = self.l2_norm_clip
        return {
            "noise_multiplier": float(self.noise_multiplier),
            "delta": float(self.delta),
            "noisify_strategy": self.noisify_strategy.value,
            "mode": self.mode.value,
            "clipping": self.clipping.value,
            "l2_norm_clip": list(clip) if isinstance(clip, tuple) else clip,
            "engine": self.engine.value,
            "preclip_noise": float(self.preclip_noise),
            "loss_gradient_clipping": (None if self.loss_gradient_clipping is None
                                       else self.loss_gradient_clipping.get_config()),
        }

    @classmethod
    def from_config(cls, config: dict) -> "DPParameters":
        return cls(**config)


def _is_real(value):
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


#: The clipping thresholds classic DP-SGD accepts. The engines compute squared norms in
#: float32, where squares below 2^-126 are flushed: a gradient of P coordinates loses up to
#: about sqrt((6P + 1) 2^-126) = 2.7e-19 sqrt(P) of its norm, and one below C passes unclipped.
#: From C = 1e-6 that excess is under 3e-7 C for a trillion coordinates; an audit
#: (2026-12-06) passed gradients 10 to 1e6 times C with C from 1e-20 to 1e-30, and C beyond
#: float32's range became 0 (NaN clip factors on the records whose gradient underflowed) or
#: inf (NaN on every step).
MIN_CLIP, MAX_CLIP = 1e-6, 3.4028234663852886e38  # float32's largest finite
_CLIP_RANGE_REASON = ("below it, float32's underflow of tiny gradients' squares lets them "
                      "pass unclipped; above it, float32 overflows")


def _is_clip_threshold(value):
    return _is_positive_real(value) and MIN_CLIP <= float(value) <= MAX_CLIP


def _is_positive_real(value):
    return _is_real(value) and math.isfinite(value) and value > 0
