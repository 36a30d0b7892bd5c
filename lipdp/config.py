"""YAML configuration of a private training run, and everything built from it.

A config file is a YAML mapping of sections; every field has a default, so a
file only states what differs. `load_config` reads the file, applies
``--set section.field=value`` overrides (the value is parsed by
``yaml.safe_load``: ``--set training.epochs=5``, ``--set model.widths=[256,256]``,
``--set privacy.epsilon_budget=null``), rejects unknown sections and fields
(listing the valid ones) and validates every field, echoing the bad value.
`build_from_config` then builds the data pipelines, the model, its loss and
optimizer, and the arguments of ``model.fit``.

Schema (defaults shown)::

    dataset:
      name: fashion_mnist      # fashion_mnist | mnist | cifar10 | digits | breast_cancer
      batch_size: 5000         # D: expected batch size (Poisson), public gradient denominator
      input_bound: 10.0        # X0: L2 bound on every input ([0, 1]-scaled pixels)
      bound: clip              # clip: x * min(1, X0/||x||) | normalize: x * X0/||x||
      sampling: poisson        # poisson (what the accountant assumes) | shuffle (warns)
      seed: null               # int: reproducible batch sampling (experiments only: the
                               #   amplification by subsampling assumes secret randomness)
      nb_samples_train: null   # int: train on the first n examples only
      data_dir: null           # directory holding the files (see lipdp.data)
      augmentation: null       # null | shift | shift_flip (images; shifts up to 2 pixels)
      augmentation_multiplicity: 1  # k views per sampled example, gradients averaged
                               #   (clipless; same sensitivity and epsilon, k x the compute)
    model:
      architecture: mlp        # mlp | cnn | scatternet | tanh_cnn (clipped mode only)
      widths: [1024]           # mlp: hidden widths (each dense layer followed by GroupSort2)
      conv_filters: [32, 64]   # cnn: filters of the 3x3 conv blocks (conv, GroupSort2, L2 pool 2x2)
      dense_width: 512         # cnn: width of the hidden dense layer
      use_bias: false          # biases in every dense / conv layer
      scattering_J: 2          # scatternet: scales of the wavelet scattering (subsampling 2^J);
                               #   a list ([2, 1]) concatenates one scattering per J
      scattering_order_weights: [1.0, 1.0, 1.0]  # scatternet: weights of orders 0, 1, 2
      scattering_padding: reflect  # scatternet: reflect (kymatio's) | zero (half the
                               #   Lipschitz constant on 28x28: each pixel in the padded grid once)
      scattering_angles: 8     # scatternet: orientations L of the Morlet wavelets (kymatio's 8)
      scattering_scale_weights: null  # scatternet, several J, no normalisation: a factor per
                               #   scale on its order weights (null: all 1)
      feature_bound: 3.0       # scatternet: L2 bound of the scattering features
      feature_normalization: none  # scatternet: none | group (per-example group
                               #   normalisation: accuracy, but NO certified radius)
      feature_groups: 27       # scatternet, group: number of channel groups (a list: one per J)
      head: lipschitz          # mlp / scatternet: lipschitz (DP layers) | plain (Keras Dense
                               #   + tanh, zero-initialised output; clipped mode only)
      maxiter_bjorck: null     # Björck iterations per projection of the dense and conv
                               #   layers (null: deel-lip's 15, stopping at its tolerance; 1:
                               #   one iteration a step from the last projection's kernel,
                               #   which certifies the square-ish and large dense kernels:
                               #   faster; README, Speed); the build projects with deel-lip's
                               #   loop either way
      maxiter_spectral: null   # power iterations per projection, from the last step's vector,
                               #   before Björck (null: lipdp's 10; the certificate, never this
                               #   estimate, enters the bounds; README, Speed)
      bounded_activation: false  # mlp, bias-free: DP_BoundedActivation(X0) after the first
                               #   dense layer; its kernel's norm then enters no gradient
                               #   bound, and the steps between Björck refreshes
                               #   (training.bjorck_every) certify nothing for it (README, Speed)
    loss:
      name: tau_cce            # tau_cce | tau_bce | hinge | kr | hkr
      tau: 10.0                # temperature of tau_cce / tau_bce
      margin: 0.0              # tau_cce: raise the other classes' logits by this before the
                               #   softmax (Lipschitz-margin training; sqrt(2) Lip r aims at
                               #   certified radius r)
      min_margin: 1.0          # margin of hinge / hkr
      alpha: 10.0              # hinge weight of hkr
    optimizer:
      name: adam               # adam | sgd
      learning_rate: 0.001
      momentum: 0.9            # sgd only
      ema_momentum: null       # float in (0, 1): the final model is the exponential moving
                               #   average of the iterates (Keras use_ema; post-processing)
      learning_rate_decay: null  # null | cosine: the learning rate falls to 0 along a half
                               #   cosine over the planned steps (training.epochs or budget)
    privacy:
      noise_multiplier: 3.0    # sigma (0: no noise, not private: epsilon is infinite)
      delta: 1.0e-5
      noisify_strategy: global # global | per-layer (clipless only)
      epsilon_budget: 3.0      # null: no budget (then training.epochs is required)
      mode: clipless           # clipless (Clipless DP-SGD) | clipped (classic DP-SGD:
                               #   per-example gradients clipped to l2_norm_clip)
      l2_norm_clip: null       # clipped: the clipping threshold C (required there, or:)
      bound_fraction: null     # clipped, instead of l2_norm_clip: per-layer thresholds at
                               #   this fraction of the analytic gradient bounds at the
                               #   initial weights (lipdp.bounds.bound_fraction_thresholds)
      engine: ghost            # clipped: ghost | mixed-ghost (cheaper on early convolutions)
                               #   | vectorized: how per-example norms are computed
      adaptive_clip_quantile: null  # clipless: clip the loss-logits gradient at this privately
                               #   estimated quantile (appendix B.5; lipdp.AdaptiveClipping)
      adaptive_clip_noise: null     # its count's noise std (null: batch_size / 20), accounted
      adaptive_clip_initial: null   # its initial threshold (null: the loss constant)
      adaptive_clip_learning_rate: 0.2  # its geometric update rate
    training:
      epochs: null             # null: the most epochs the budget allows (get_max_epochs)
      private_logs_only: false # true: no training loss/accuracy in the logs (they are
                               #   computed on training data and not covered by epsilon)
      bjorck_every: 1          # Björck orthogonalisation every this many steps (spectral
                               #   normalisation only in between: faster; README, Speed)
    certification:
      radii: [0.0, 0.1411764705882353, 0.2823529411764706, 0.4235294117647059, 0.1, 0.25, 0.5]
                               # L2 radii in input space: 0 (clean accuracy), 36/255, 72/255,
                               #   108/255, 0.1, 0.25, 0.5
    output:
      save_model: null         # path for model.save(...) after training

Architectures (all layers from `lipdp.layers`, every one 1-Lipschitz):

- ``mlp``: ``DP_BoundedInput(X0), DP_Flatten, [DP_QuickSpectralDense(w), DP_GroupSort(2)]
  for w in widths, DP_QuickSpectralDense(nb_classes)``; with ``bounded_activation``,
  ``DP_BoundedActivation(X0)`` between the first dense layer and its GroupSort.
- ``cnn`` (the paper's network with the defaults): ``DP_BoundedInput(X0),
  [DP_QuickSpectralConv2D(f, 3x3), DP_GroupSort(2), DP_ScaledL2NormPooling2D(2)]
  for f in conv_filters, DP_Flatten, DP_QuickSpectralDense(dense_width),
  DP_GroupSort(2), DP_QuickSpectralDense(nb_classes)``. Needs image inputs.
- ``scatternet`` (Tramèr & Boneh's ScatterNet features, a Lipschitz head): the fixed front end
  ``DP_BoundedInput(X0), DP_Scattering(scattering_J, scattering_angles, order_weights=...)``
  (no variables, no data: its Lipschitz constant is computed, `lipdp.layers.scattering`;
  fewer angles make fewer paths and a smaller graph to build) is applied once to
  every image by `lipdp.data.load_dataset(feature_map=...)`; the DP model trained is the head
  ``DP_BoundedInput(feature_bound), DP_Flatten, [DP_QuickSpectralDense(w), DP_GroupSort(2)]
  for w in widths, DP_QuickSpectralDense(nb_classes)`` on the features. Certified radii are
  those of front end + head, in pixel space (`certification_target`). Needs image inputs and
  kymatio (``pip install lipdp[scatternet]``). ``feature_normalization: group`` appends
  Tramèr & Boneh's per-example group normalisation to the front end (Keras
  ``GroupNormalization(feature_groups, center=False, scale=False)``: each group of channels of
  one image centred and scaled to unit variance, from that image alone, so it costs no privacy).
  Its epsilon is 1e-5 (theirs). It lifts the small order-2 coefficients, but it is not
  Lipschitz in any useful sense (its constant is ``1/sqrt(epsilon)``, 316): such a model gets no certified radius, and the summary says so.
  With normalisation, ``scattering_J`` may list several scales (``[2, 1]``) and
  ``feature_groups`` as many group counts (``[27, 3]``): one scattering per J (orders up to
  ``min(2, J)``, the first order weights), each normalised by its own groups, flattened and
  concatenated (a Keras model without variables; J = 1 adds 9 paths of 14x14, the finer
  scale). Without normalisation, a list of scales makes the certified
  ``DP_MultiscaleScattering(scattering_J, order_weights, scale_weights=scattering_scale_weights)``
  (flattened scatterings concatenated, Lipschitz constant ``sqrt(sum_j L_j^2)``).
- ``head: plain`` (``mlp`` and ``scatternet``, clipped mode only): the same widths as plain
  Keras layers, ``Flatten, [Dense(w), tanh] for w in widths, Dense(nb_classes)`` with a
  zero-initialised output layer, unconstrained: classic DP-SGD's usual model (Tramèr &
  Boneh's linear ScatterNet classifier with ``widths: []``). No certified radius.
- ``tanh_cnn`` (Papernot et al. 2021, "Tempered sigmoid activations for deep learning with
  differential privacy", their MNIST / Fashion-MNIST network; for classic clipped DP-SGD,
  ``privacy.mode: clipped``): plain Keras layers ``Conv2D(16, 8x8, stride 2, same), tanh,
  MaxPool(2, stride 1), Conv2D(32, 4x4, stride 2, valid), tanh, MaxPool(2, stride 1), Flatten,
  Dense(32), tanh, Dense(nb_classes)`` (with biases). tanh is their tempered sigmoid
  ``s * sigmoid(T x) - o`` at (s, T, o) = (2, 2, 1). Not a Lipschitz network: no gradient
  bound and no certified radius; privacy comes from clipping.

The training budget: with ``epochs: null`` the run lasts ``get_max_epochs(epsilon_budget,
model)`` epochs (at least one: if the budget allows less than an epoch, the
accountant stops mid-epoch). In any case the `DP_Accountant` callback stops
training before a step would exceed ``epsilon_budget``.
"""

from __future__ import annotations

import copy
import math
import numbers
import warnings
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import yaml

__all__ = [
    "ConfigError",
    "DEFAULT_CONFIG",
    "apply_overrides",
    "build_from_config",
    "build_front_end",
    "build_loss",
    "build_model",
    "build_optimizer",
    "certification_target",
    "load_config",
    "planned_epochs",
    "validate_config",
]


class ConfigError(ValueError):
    """A configuration file, override or value is invalid (message says why)."""


DEFAULT_CONFIG: Dict[str, Dict[str, Any]] = {
    "dataset": {
        "name": "fashion_mnist",
        "batch_size": 5000,
        "input_bound": 10.0,
        "bound": "clip",
        "sampling": "poisson",
        "seed": None,
        "nb_samples_train": None,
        "data_dir": None,
        "augmentation": None,
        "augmentation_multiplicity": 1,
    },
    "model": {
        "architecture": "mlp",
        "widths": [1024],
        "conv_filters": [32, 64],
        "dense_width": 512,
        "use_bias": False,
        "scattering_J": 2,
        "scattering_order_weights": [1.0, 1.0, 1.0],
        "scattering_padding": "reflect",
        "scattering_angles": 8,
        "scattering_scale_weights": None,
        "feature_bound": 3.0,
        "feature_normalization": "none",
        "feature_groups": 27,
        "head": "lipschitz",
        "maxiter_bjorck": None,
        "maxiter_spectral": None,
        "bounded_activation": False,
    },
    "loss": {"name": "tau_cce", "tau": 10.0, "margin": 0.0, "min_margin": 1.0, "alpha": 10.0},
    "optimizer": {"name": "adam", "learning_rate": 0.001, "momentum": 0.9, "ema_momentum": None,
                  "learning_rate_decay": None},
    "privacy": {
        "noise_multiplier": 3.0,
        "delta": 1.0e-5,
        "noisify_strategy": "global",
        "epsilon_budget": 3.0,
        "mode": "clipless",
        "l2_norm_clip": None,
        "bound_fraction": None,
        "engine": "ghost",
        "adaptive_clip_quantile": None,
        "adaptive_clip_noise": None,
        "adaptive_clip_initial": None,
        "adaptive_clip_learning_rate": 0.2,
    },
    "training": {"epochs": None, "private_logs_only": False, "bjorck_every": 1},
    "certification": {"radii": [0.0, 36 / 255, 72 / 255, 108 / 255, 0.1, 0.25, 0.5]},
    "output": {"save_model": None},
}


# --------------------------------------------------------------------------- #
# Field validators: each returns the normalised value or raises ConfigError.
# --------------------------------------------------------------------------- #
def _invalid(key, expected, value):
    return ConfigError(f"Received an invalid value for `{key}`, expected {expected}. "
                       f"Received: {key}={value!r}")


def _is_int(value):
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _as_float(value):
    """A real number, or a string PyYAML left unparsed (it reads ``1e-5`` as a string)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, numbers.Integral):
        try:
            return float(value)
        except OverflowError:  # beyond float's range: out of range, as a number (a traceback
            return math.inf if value > 0 else -math.inf  # before: an audit, 2026-12-07)
    if isinstance(value, numbers.Real):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return None
    return None


def _positive_int(key, value):
    if not _is_int(value) or value <= 0:
        raise _invalid(key, "a positive integer", value)
    return int(value)


def _number(low=None, high=None, low_open=False, high_open=False, expected=None):
    def validate(key, value):
        x = _as_float(value)
        ok = x is not None and math.isfinite(x)
        if ok and low is not None:
            ok = x > low if low_open else x >= low
        if ok and high is not None:
            ok = x < high if high_open else x <= high
        if not ok:
            raise _invalid(key, expected, value)
        return x

    return validate


def _choice(*choices):
    def validate(key, value):
        if value not in choices:
            raise _invalid(key, "one of " + ", ".join(repr(c) for c in choices), value)
        return value

    return validate


def _bool(key, value):
    if not isinstance(value, bool):
        raise _invalid(key, "true or false", value)
    return value


def _int_list(key, value, allow_empty=True):
    if not isinstance(value, list) or not all(_is_int(v) and v > 0 for v in value) \
            or (not allow_empty and not value):
        expected = "a list of positive integers" + ("" if allow_empty else " (non-empty)")
        raise _invalid(key, expected, value)
    return [int(v) for v in value]


def _radii(key, value):
    if not isinstance(value, list):
        raise _invalid(key, "a list of finite non-negative numbers", value)
    out = []
    for r in value:
        x = _as_float(r)
        if x is None or not math.isfinite(x) or x < 0:
            raise _invalid(key, "a list of finite non-negative numbers", value)
        out.append(x)
    return out


def _optional_int(key, value):
    if value is None:
        return None
    if not _is_int(value):
        raise _invalid(key, "null or an integer", value)
    return int(value)


def _seed(key, value):
    """A sampling seed: null (a secret one) or an integer in [0, 2**63), a TensorFlow int64
    (10**23 was refused by TensorFlow with a message naming no field: an audit)."""
    if value is not None and (not _is_int(value) or not 0 <= value < 2**63):
        raise _invalid(key, "null or an integer in [0, 2**63)", value)
    return None if value is None else int(value)


def _optional_positive_int(key, value):
    return None if value is None else _positive_int(key, value)


def _optional_str(key, value):
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise _invalid(key, "null or a non-empty string (a path)", value)
    return value


def _dataset_names():
    from lipdp.data import DATASET_NAMES

    return DATASET_NAMES


def _dataset_name(key, value):
    return _choice(*_dataset_names())(key, value)


_POSITIVE = _number(low=0, low_open=True, expected="a finite positive number")
_NON_NEGATIVE = _number(low=0, expected="a finite non-negative number")
_OPEN_UNIT = _number(low=0, high=1, low_open=True, high_open=True, expected="a number in (0, 1)")


def _scales(key, value):
    """A positive integer, or a non-empty list of them (one per scattering scale)."""
    if isinstance(value, list):
        return _int_list(key, value, allow_empty=False)
    return _positive_int(key, value)


def _positive_list(key, value):
    if not isinstance(value, list) or not value:
        raise _invalid(key, "a non-empty list of positive numbers", value)
    return [_POSITIVE(key, v) for v in value]


def _order_weights(key, value):
    if not isinstance(value, list) or len(value) not in (2, 3):
        raise _invalid(key, "a list of 2 or 3 positive numbers (weights of the scattering orders "
                 "0, 1 and 2; 2 numbers: orders 0 and 1 only)", value)
    return [_POSITIVE(key, v) for v in value]

_VALIDATORS: Dict[str, Dict[str, Callable[[str, Any], Any]]] = {
    "dataset": {
        "name": _dataset_name,
        "batch_size": _positive_int,
        "input_bound": _POSITIVE,
        "bound": _choice("clip", "normalize"),
        "sampling": _choice("poisson", "shuffle"),
        "seed": _seed,
        "nb_samples_train": _optional_positive_int,
        "data_dir": _optional_str,
        "augmentation": lambda k, v: None if v is None else _choice("shift", "shift_flip")(k, v),
        "augmentation_multiplicity": _positive_int,
    },
    "model": {
        "architecture": _choice("mlp", "cnn", "scatternet", "tanh_cnn"),
        "widths": _int_list,
        "conv_filters": lambda k, v: _int_list(k, v, allow_empty=False),
        "dense_width": _positive_int,
        "use_bias": _bool,
        "scattering_J": _scales,
        "scattering_order_weights": _order_weights,
        "scattering_padding": _choice("reflect", "zero"),
        "scattering_angles": _positive_int,
        "scattering_scale_weights": lambda k, v: None if v is None else _positive_list(k, v),
        "feature_bound": _POSITIVE,
        "feature_normalization": _choice("none", "group"),
        "feature_groups": _scales,
        "head": _choice("lipschitz", "plain"),
        "maxiter_bjorck": _optional_positive_int,
        "maxiter_spectral": _optional_positive_int,
        "bounded_activation": _bool,
    },
    "loss": {
        "name": _choice("tau_cce", "tau_bce", "hinge", "kr", "hkr"),
        "tau": _POSITIVE,
        "margin": _NON_NEGATIVE,
        "min_margin": _POSITIVE,
        "alpha": _POSITIVE,
    },
    "optimizer": {
        "name": _choice("adam", "sgd"),
        "learning_rate": _POSITIVE,
        "momentum": _number(low=0, high=1, high_open=True, expected="a number in [0, 1)"),
        "ema_momentum": lambda k, v: None if v is None else _OPEN_UNIT(k, v),
        "learning_rate_decay": lambda k, v: None if v is None else _choice("cosine")(k, v),
    },
    "privacy": {
        "noise_multiplier": _NON_NEGATIVE,
        "delta": _number(low=0, high=1, low_open=True, high_open=True,
                         expected="a number in (0, 1)"),
        "noisify_strategy": _choice("global", "per-layer"),
        "epsilon_budget": lambda k, v: None if v is None else _POSITIVE(k, v),
        "mode": _choice("clipless", "clipped"),
        "l2_norm_clip": lambda k, v: None if v is None else _POSITIVE(k, v),
        "bound_fraction": lambda k, v: None if v is None else _POSITIVE(k, v),
        "engine": _choice("ghost", "mixed-ghost", "vectorized"),
        "adaptive_clip_quantile": lambda k, v: None if v is None else _number(
            low=0, high=1, low_open=True, high_open=True, expected="a number in (0, 1)")(k, v),
        "adaptive_clip_noise": lambda k, v: None if v is None else _POSITIVE(k, v),
        "adaptive_clip_initial": lambda k, v: None if v is None else _POSITIVE(k, v),
        "adaptive_clip_learning_rate": _POSITIVE,
    },
    "training": {"epochs": _optional_positive_int,
                 "private_logs_only": _bool, "bjorck_every": _positive_int},
    "certification": {"radii": _radii},
    "output": {"save_model": _optional_str},
}
assert _VALIDATORS.keys() == DEFAULT_CONFIG.keys()
assert all(_VALIDATORS[s].keys() == DEFAULT_CONFIG[s].keys() for s in DEFAULT_CONFIG)


# --------------------------------------------------------------------------- #
# Reading, merging, overriding, validating.
# --------------------------------------------------------------------------- #
def _valid_keys(section=None) -> str:
    if section is None:
        return ", ".join(DEFAULT_CONFIG)
    return ", ".join(f"{section}.{k}" for k in DEFAULT_CONFIG[section])


def _check_key(section, field, where):
    where = f" {where}" if where else ""
    if section not in DEFAULT_CONFIG:
        raise ConfigError(f"Unknown config section `{section}`{where}. Valid sections: "
                          f"{_valid_keys()}.")
    if field is not None and field not in DEFAULT_CONFIG[section]:
        raise ConfigError(f"Unknown config key `{section}.{field}`{where}. Valid keys: "
                          f"{_valid_keys(section)}.")


def _merge(user: Any, where: str) -> Dict[str, Dict[str, Any]]:
    """Defaults updated with the user's mapping (unknown sections / keys rejected)."""
    cfg = copy.deepcopy(DEFAULT_CONFIG)
    if user is None:
        return cfg
    where_ = f" {where}" if where else ""
    if not isinstance(user, dict):
        raise ConfigError(f"The config{where_} must be a mapping of sections "
                          f"({_valid_keys()}). Received: {user!r}")
    for section, fields in user.items():
        _check_key(section, None, where)
        if fields is None:
            continue
        if not isinstance(fields, dict):
            raise ConfigError(f"Config section `{section}`{where_} must be a mapping of "
                              f"fields ({_valid_keys(section)}). Received: {section}={fields!r}")
        for field, value in fields.items():
            _check_key(section, field, where)
            cfg[section][field] = value
    return cfg


def parse_override(text: str) -> Tuple[str, str, Any]:
    """``"section.field=value"`` -> ``(section, field, yaml.safe_load(value))``."""
    if not isinstance(text, str) or "=" not in text:
        raise ConfigError(f"Invalid override {text!r}: expected section.field=value, e.g. "
                          "training.epochs=5.")
    key, raw = text.split("=", 1)
    key = key.strip()
    parts = key.split(".")
    if len(parts) != 2 or not all(parts):
        raise ConfigError(f"Invalid override key {key!r} in {text!r}: expected section.field "
                          f"(sections: {_valid_keys()}).")
    section, field = parts
    _check_key(section, field, f"in override {text!r}")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as e:
        raise ConfigError(f"Invalid YAML value in override {text!r}: {e}") from None
    return section, field, value


def apply_overrides(cfg: Dict[str, Dict[str, Any]], overrides: Sequence[str]):
    """Returns a copy of `cfg` with ``section.field=value`` overrides applied (not validated)."""
    cfg = copy.deepcopy(cfg)
    for text in overrides or ():
        section, field, value = parse_override(text)
        cfg[section][field] = value
    return cfg


def _check_mode(model, privacy):
    """The cross-field rules of ``privacy.mode``."""
    mode, clip, fraction = privacy["mode"], privacy["l2_norm_clip"], privacy["bound_fraction"]
    if mode == "clipped" and (clip is None) == (fraction is None):
        raise ConfigError("privacy.mode='clipped' (classic DP-SGD) clips every per-example "
                          "gradient to a threshold: set either privacy.l2_norm_clip or "
                          "privacy.bound_fraction. Received: "
                          f"privacy.l2_norm_clip={clip!r}, privacy.bound_fraction={fraction!r}")
    if mode == "clipless" and privacy["engine"] != "ghost":
        raise ConfigError("privacy.engine computes the per-example norms classic DP-SGD clips: "
                          "it needs privacy.mode='clipped'. Received: privacy.mode='clipless', "
                          f"privacy.engine={privacy['engine']!r}")
    if mode == "clipless" and fraction is not None:
        raise ConfigError("privacy.bound_fraction sets the thresholds of classic DP-SGD's "
                          "per-layer clipping: it needs privacy.mode='clipped'. Received: "
                          f"privacy.mode='clipless', privacy.bound_fraction={fraction!r}")
    if fraction is not None and (model["head"] == "plain"
                                 or model["architecture"] == "tanh_cnn"):
        raise ConfigError("privacy.bound_fraction places thresholds at fractions of the "
                          "analytic gradient bounds, which a model of plain Keras layers does "
                          "not have (model.head='plain', model.architecture='tanh_cnn'): set "
                          "privacy.l2_norm_clip instead.")
    if mode == "clipless" and clip is not None:
        raise ConfigError("privacy.l2_norm_clip only applies to privacy.mode='clipped': Clipless "
                          "DP-SGD bounds gradients without clipping. Received: "
                          f"privacy.mode='clipless', privacy.l2_norm_clip={clip!r}")
    if mode == "clipped" and privacy["adaptive_clip_quantile"] is not None:
        raise ConfigError("privacy.adaptive_clip_quantile clips the loss-logits gradient inside "
                          "Clipless DP-SGD: it needs privacy.mode='clipless'.")
    if mode == "clipped" and privacy["noisify_strategy"] != "global":
        raise ConfigError("The noise of classic DP-SGD is isotropic: privacy.mode='clipped' needs "
                          "privacy.noisify_strategy='global'. Received: "
                          f"privacy.noisify_strategy={privacy['noisify_strategy']!r}")
    if model["head"] == "plain" and mode != "clipped":
        raise ConfigError("model.head='plain' is made of plain Keras layers, whose gradients "
                          "lipdp cannot bound: train it with privacy.mode='clipped' and "
                          "privacy.l2_norm_clip. Received: privacy.mode='clipless'")
    if model["head"] == "plain" and model["architecture"] not in ("mlp", "scatternet"):
        raise ConfigError("model.head='plain' applies to the mlp and scatternet architectures. "
                          f"Received: model.architecture={model['architecture']!r}")
    scales, groups = model["scattering_J"], model["feature_groups"]
    grouped = model["feature_normalization"] == "group"
    if isinstance(scales, list) and len(set(scales)) != len(scales):
        raise ConfigError("model.scattering_J lists distinct scales. Received: "
                          f"model.scattering_J={scales!r}")
    if isinstance(scales, list) and grouped and (not isinstance(groups, list)
                                                 or len(groups) != len(scales)):
        raise ConfigError("With several scattering scales and group normalisation, "
                          "model.feature_groups lists one group count per scale. Received: "
                          f"model.scattering_J={scales!r}, model.feature_groups={groups!r}")
    scale_weights = model["scattering_scale_weights"]
    if scale_weights is not None and (grouped or not isinstance(scales, list)
                                      or len(scale_weights) != len(scales)):
        raise ConfigError("model.scattering_scale_weights weighs the scales of a certified "
                          "multiscale front end: one number per entry of a list "
                          "model.scattering_J, without group normalisation (which would undo "
                          f"it). Received: model.scattering_J={scales!r}, "
                          f"model.scattering_scale_weights={scale_weights!r}, "
                          f"model.feature_normalization={model['feature_normalization']!r}")
    if isinstance(groups, list) and not (isinstance(scales, list) and grouped):
        raise ConfigError("model.feature_groups is a list only when model.scattering_J is one "
                          "(with group normalisation). "
                          f"Received: model.scattering_J={scales!r}, "
                          f"model.feature_groups={groups!r}")
    if model["architecture"] == "tanh_cnn" and mode != "clipped":
        raise ConfigError("model.architecture='tanh_cnn' is made of plain Keras layers, whose "
                          "gradients lipdp cannot bound: train it with privacy.mode='clipped' "
                          "and privacy.l2_norm_clip. Received: privacy.mode='clipless'")
    if model["bounded_activation"] and (model["architecture"] != "mlp"
                                        or model["head"] != "lipschitz" or model["use_bias"]
                                        or not model["widths"]):
        raise ConfigError("model.bounded_activation clips the first hidden layer's activations "
                          "to the input bound, the bound they have with a kernel of norm 1 and "
                          "no bias: it needs model.architecture='mlp', model.head='lipschitz', "
                          "model.use_bias=false and at least one hidden width. Received: "
                          f"model.architecture={model['architecture']!r}, "
                          f"model.head={model['head']!r}, model.use_bias={model['use_bias']!r}, "
                          f"model.widths={model['widths']!r}")


def validate_config(cfg: Dict[str, Dict[str, Any]]) -> Dict[str, Dict[str, Any]]:
    """Checks every field (and the few cross-field rules); returns a normalised copy.

    Raises:
        ConfigError: naming the field and echoing the bad value.
    """
    cfg = _merge(cfg, "")
    out = {}
    for section, validators in _VALIDATORS.items():
        out[section] = {field: check(f"{section}.{field}", cfg[section][field])
                        for field, check in validators.items()}
    privacy, training = out["privacy"], out["training"]
    if privacy["epsilon_budget"] is None and training["epochs"] is None:
        raise ConfigError("Set `training.epochs` or `privacy.epsilon_budget`: with neither, "
                          "the length of the run is undefined. Received: "
                          "privacy.epsilon_budget=None, training.epochs=None")
    if privacy["noise_multiplier"] == 0 and privacy["epsilon_budget"] is not None:
        raise ConfigError("privacy.noise_multiplier=0 adds no noise (epsilon is infinite), so "
                          "no step fits in a budget: set privacy.epsilon_budget=null and "
                          "training.epochs. Received: privacy.noise_multiplier=0, "
                          f"privacy.epsilon_budget={privacy['epsilon_budget']!r}")
    _check_mode(out["model"], privacy)
    loss = out["loss"]
    if loss["margin"] and loss["name"] != "tau_cce":
        raise ConfigError("loss.margin shifts the logits of the softmax cross-entropy: it needs "
                          f"loss.name='tau_cce'. Received: loss.name={loss['name']!r}, "
                          f"loss.margin={loss['margin']!r}")
    dataset = out["dataset"]
    n = dataset["nb_samples_train"]
    if n is not None and dataset["batch_size"] > n:
        raise ConfigError(f"`dataset.batch_size` ({dataset['batch_size']}) exceeds "
                          f"`dataset.nb_samples_train` ({n}).")
    return out


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key repeated in one mapping (PyYAML keeps the last one
    silently: a second `privacy:` section dropped the first one's noise_multiplier and delta
    for the defaults, found by an audit)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} appears twice in one mapping",
                    key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def load_config(path=None, overrides: Sequence[str] = ()) -> Dict[str, Dict[str, Any]]:
    """Reads a YAML config (or only the defaults if `path` is None), applies overrides, validates.

    Raises:
        ConfigError: unreadable file, invalid YAML (a key repeated in a mapping included),
            unknown key, invalid value.
    """
    user = None
    if path is not None:
        try:
            with open(path, "r", encoding="utf-8") as f:
                user = yaml.load(f, Loader=_UniqueKeyLoader)
        except OSError as e:
            raise ConfigError(f"Cannot read config file {path}: {e.strerror or e}") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"Invalid YAML in config file {path}: {e}") from None
        except UnicodeDecodeError as e:  # a traceback before (an audit)
            raise ConfigError(f"Config file {path} is not UTF-8 text: {e}") from None
    cfg = _merge(user, f"in {path}" if path is not None else "")
    return validate_config(apply_overrides(cfg, overrides))


# --------------------------------------------------------------------------- #
# Builders.
# --------------------------------------------------------------------------- #
def build_model(model_cfg: Dict[str, Any], metadata, dp_parameters):
    """The `DP_Sequential` described by the ``model`` section (see module docstring)."""
    from lipdp import layers
    from lipdp.model import DP_Sequential

    if model_cfg["architecture"] == "tanh_cnn":
        return DP_Sequential(layers=_tanh_cnn(metadata), dp_parameters=dp_parameters,
                             dataset_metadata=metadata)
    if model_cfg["head"] == "plain":
        return DP_Sequential(layers=_plain_head(model_cfg, metadata),
                             dp_parameters=dp_parameters, dataset_metadata=metadata)
    use_bias = model_cfg["use_bias"]
    # None keeps each layer's default (deel-lip's Björck loop, lipdp's 10 power iterations).
    projection = {"maxiter_bjorck": model_cfg["maxiter_bjorck"],
                  "maxiter_spectral": model_cfg["maxiter_spectral"]}
    stack: List[Any] = [layers.DP_BoundedInput(input_shape=metadata.input_shape,
                                               upper_bound=metadata.max_norm)]
    if model_cfg["architecture"] in ("mlp", "scatternet"):  # scatternet: the head
        stack.append(layers.DP_Flatten())
        for i, width in enumerate(model_cfg["widths"]):
            stack.append(layers.DP_QuickSpectralDense(width, use_bias=use_bias, **projection))
            if i == 0 and model_cfg["bounded_activation"]:
                stack.append(layers.DP_BoundedActivation(metadata.max_norm))
            stack.append(layers.DP_GroupSort(2))
    else:
        if len(metadata.input_shape) != 3:
            raise ConfigError("model.architecture='cnn' needs image inputs (H, W, C); dataset "
                              f"inputs have shape {metadata.input_shape}. Use 'mlp'.")
        for filters in model_cfg["conv_filters"]:
            stack += [layers.DP_QuickSpectralConv2D(filters, 3, use_bias=use_bias,
                                                    **projection),
                      layers.DP_GroupSort(2),
                      layers.DP_ScaledL2NormPooling2D(pool_size=2, strides=2)]
        stack += [layers.DP_Flatten(),
                  layers.DP_QuickSpectralDense(model_cfg["dense_width"], use_bias=use_bias,
                                               **projection),
                  layers.DP_GroupSort(2)]
    stack.append(layers.DP_QuickSpectralDense(metadata.nb_classes, use_bias=use_bias,
                                              **projection))
    return DP_Sequential(layers=stack, dp_parameters=dp_parameters, dataset_metadata=metadata)


def _plain_head(model_cfg: Dict[str, Any], metadata) -> List[Any]:
    """``head: plain``: Keras Dense layers with tanh, zero-initialised output (module docstring)."""
    import tensorflow as tf

    k, use_bias = tf.keras.layers, model_cfg["use_bias"]
    stack = [k.Input(metadata.input_shape), k.Flatten()]
    stack += [k.Dense(width, activation="tanh", use_bias=use_bias)
              for width in model_cfg["widths"]]
    return stack + [k.Dense(metadata.nb_classes, use_bias=use_bias, kernel_initializer="zeros")]


def _tanh_cnn(metadata) -> List[Any]:
    """Papernot et al.'s tempered-sigmoid (tanh) CNN, plain Keras layers (module docstring)."""
    import tensorflow as tf

    if len(metadata.input_shape) != 3:
        raise ConfigError("model.architecture='tanh_cnn' needs image inputs (H, W, C); dataset "
                          f"inputs have shape {metadata.input_shape}.")
    k = tf.keras.layers
    return [k.Input(metadata.input_shape),
            k.Conv2D(16, 8, strides=2, padding="same", activation="tanh"),
            k.MaxPooling2D(2, strides=1),
            k.Conv2D(32, 4, strides=2, padding="valid", activation="tanh"),
            k.MaxPooling2D(2, strides=1),
            k.Flatten(),
            k.Dense(32, activation="tanh"),
            k.Dense(metadata.nb_classes)]


# Tramèr & Boneh's (PyTorch's) GroupNorm epsilon; Keras's default 1e-3 would swamp the
# variance of the order-2 scattering groups (about 1e-5 on Fashion-MNIST).
_GROUP_NORM_EPSILON = 1e-5


def build_front_end(model_cfg: Dict[str, Any], input_bound: float):
    """The fixed front end of ``scatternet``, ``DP_BoundedInput(input_bound)`` then
    `DP_Scattering` (then, with ``feature_normalization: group``, a per-example
    ``GroupNormalization`` without variables), a Keras Sequential without variables, built on
    its first call; None for the other architectures.

    Raises:
        ConfigError: invalid scattering arguments.
    """
    if model_cfg["architecture"] != "scatternet":
        return None
    import tensorflow as tf

    from lipdp import layers

    grouped = model_cfg["feature_normalization"] == "group"
    if isinstance(model_cfg["scattering_J"], list) and grouped:
        return _multiscale_front_end(model_cfg, input_bound)
    weights = model_cfg["scattering_order_weights"]
    try:
        if isinstance(model_cfg["scattering_J"], list):  # certified: one DP layer
            scattering = layers.DP_MultiscaleScattering(
                scales=model_cfg["scattering_J"], angles=model_cfg["scattering_angles"],
                order_weights=weights, scale_weights=model_cfg["scattering_scale_weights"],
                padding=model_cfg["scattering_padding"])
        else:
            scattering = layers.DP_Scattering(J=model_cfg["scattering_J"],
                                              angles=model_cfg["scattering_angles"],
                                              max_order=len(weights) - 1, order_weights=weights,
                                              padding=model_cfg["scattering_padding"])
        stack = [layers.DP_BoundedInput(input_bound), scattering]
    except ValueError as e:
        raise ConfigError(f"Cannot build the scattering front end: {e}") from None
    if grouped:
        stack.append(_group_normalization(model_cfg["feature_groups"]))
    return tf.keras.Sequential(stack)


def _check_front_end(front, dataset: str) -> None:
    """Raise a ConfigError naming the model's fields when the front end refuses the dataset's
    images (more channel groups than the scattering makes channels), built on them alone: it
    was reported as the dataset section's, with Keras' dump of the call (an audit,
    2026-12-07). `build_from_config` asks only once loading failed: the build costs seconds."""
    import tensorflow as tf

    from lipdp.data import image_shape

    shape = image_shape(dataset)
    if shape is None:
        return
    try:
        front(tf.keras.Input(shape))
    except ValueError as e:  # Keras wraps the layer's message between two paragraphs
        paragraphs = [p.strip() for p in str(e).split("\n\n") if p.strip() and not
                      p.startswith(("Exception encountered", "Call arguments received"))]
        raise ConfigError(
            f"The scattering front end (model.scattering_J, model.scattering_angles, "
            f"model.feature_groups) does not fit {dataset}'s images of shape {shape}: "
            + " ".join(paragraphs or [str(e)])) from None


def _group_normalization(groups):
    import tensorflow as tf

    return tf.keras.layers.GroupNormalization(groups=groups, axis=-1,
                                              epsilon=_GROUP_NORM_EPSILON, center=False,
                                              scale=False)


def _multiscale_front_end(model_cfg: Dict[str, Any], input_bound: float):
    """Several scatterings of the bounded input (one per J of ``scattering_J``, orders up to
    ``min(2, J)``), each group-normalised by its own ``feature_groups`` entry, flattened and
    concatenated: a Keras model without variables, built on its first call (not a chain of DP
    layers: nothing about it is certified)."""
    import tensorflow as tf

    from lipdp import layers

    weights = model_cfg["scattering_order_weights"]
    bounded = layers.DP_BoundedInput(input_bound)
    branches = []
    try:
        for J, groups in zip(model_cfg["scattering_J"], model_cfg["feature_groups"]):
            max_order = min(len(weights) - 1, J)
            branches.append([layers.DP_Scattering(J=J, angles=model_cfg["scattering_angles"],
                                                  max_order=max_order,
                                                  order_weights=weights[:max_order + 1],
                                                  padding=model_cfg["scattering_padding"]),
                             _group_normalization(groups), tf.keras.layers.Flatten()])
    except ValueError as e:
        raise ConfigError(f"Cannot build the scattering front end: {e}") from None

    class MultiscaleScattering(tf.keras.Model):
        def __init__(self):
            super().__init__(name="multiscale_scattering")
            self.bounded, self.branches = bounded, branches

        def call(self, inputs):
            x = self.bounded(inputs)
            features = []
            for branch in self.branches:
                y = x
                for layer in branch:
                    y = layer(y)
                features.append(y)
            return tf.concat(features, axis=-1)

    return MultiscaleScattering()


def _hashable(value):
    return tuple(value) if isinstance(value, list) else value


def _front_end_key(model_cfg: Dict[str, Any], input_bound: float):
    """The feature cache's name for the front end `build_front_end` builds: the input bound
    and every option it reads (each ``scattering_*`` one, the normalisation and its groups),
    derived rather than listed, so that a new ``scattering_*`` option cannot be left out and
    have one setting's cached features served to another."""
    names = sorted(k for k in model_cfg if k.startswith("scattering_"))
    names += ["feature_normalization", "feature_groups"]
    return ("scatternet", input_bound) + tuple((k, _hashable(model_cfg[k])) for k in names)


def _bound_argument(dataset_cfg: Dict[str, Any], max_norm: float) -> Dict[str, float]:
    """`lipdp.data.load_dataset`'s keyword for the ``dataset.bound`` mode, set to max_norm."""
    from lipdp.data import InputBound

    return InputBound(dataset_cfg["bound"], max_norm).load_dataset_keyword()


def certification_target(cfg: Dict[str, Dict[str, Any]], model, ds_test):
    """``(network, test data)`` that certified radii are computed on, in the dataset's input
    space: ``(model, ds_test)``, or for ``scatternet`` the front end followed by ``model``'s
    layers (shared, trained weights: a Keras Sequential of DP layers mapping images to
    logits, whose certified Lipschitz constant includes the front end's) with the test images
    bounded by ``dataset.input_bound`` (the front end has no variables: the one built here
    computes what the training features were computed with)."""
    d = cfg["dataset"]
    front = build_front_end(cfg["model"], d["input_bound"])
    if front is None:
        return model, ds_test
    import tensorflow as tf

    from lipdp.data import load_dataset

    _, images, metadata = load_dataset(d["name"], d["batch_size"], data_dir=d["data_dir"],
                                       nb_samples_train=d["nb_samples_train"],
                                       **_bound_argument(d, d["input_bound"]))
    front_layers = front.layers if isinstance(front, tf.keras.Sequential) else [front]
    network = tf.keras.Sequential([tf.keras.layers.Input(metadata.input_shape)]
                                  + front_layers + list(model.layers))
    return network, images


def build_loss(loss_cfg: Dict[str, Any]):
    """The DP loss of the ``loss`` section."""
    from lipdp import losses

    name = loss_cfg["name"]
    if name == "tau_cce":
        return losses.DP_TauCategoricalCrossentropy(tau=loss_cfg["tau"],
                                                    margin=loss_cfg["margin"])
    if name == "tau_bce":
        return losses.DP_TauBCE(tau=loss_cfg["tau"])
    if name == "hinge":
        return losses.DP_MulticlassHinge(min_margin=loss_cfg["min_margin"])
    if name == "kr":
        return losses.DP_MulticlassKR()
    return losses.DP_MulticlassHKR(alpha=loss_cfg["alpha"], min_margin=loss_cfg["min_margin"])


def build_optimizer(optimizer_cfg: Dict[str, Any], total_steps: Optional[int] = None):
    """The Keras optimizer of the ``optimizer`` section.

    With ``ema_momentum`` m the optimizer keeps ``a <- m a + (1 - m) w`` after every step and
    `fit` ends by writing ``a`` into the weights (Keras's ``use_ema``): the released model is
    an average of released iterates, post-processing that costs no privacy. For the DP
    layers the average is taken before each step's projection, so the final weights may sit
    slightly outside the Lipschitz set; certified radii use the certified constant of the
    weights as they are, so they stay proven.

    With ``learning_rate_decay: cosine`` the learning rate of step t is
    ``lr (1 + cos(pi min(t, T) / T)) / 2`` over ``T = total_steps`` (Keras's `CosineDecay`,
    counted by the optimizer's own step counter, which checkpoints keep). A schedule fixed
    before training is public: it costs no privacy.

    Raises:
        ValueError: a decay without ``total_steps``.
    """
    import tensorflow as tf

    ema = {} if optimizer_cfg["ema_momentum"] is None else {
        "use_ema": True, "ema_momentum": optimizer_cfg["ema_momentum"]}
    learning_rate = optimizer_cfg["learning_rate"]
    if optimizer_cfg.get("learning_rate_decay") == "cosine":
        if not total_steps or total_steps < 1:
            raise ValueError("A cosine learning-rate decay needs the planned number of steps "
                             f"(got total_steps={total_steps!r}).")
        learning_rate = tf.keras.optimizers.schedules.CosineDecay(learning_rate, int(total_steps))
    if optimizer_cfg["name"] == "adam":
        return tf.keras.optimizers.Adam(learning_rate=learning_rate, **ema)
    return tf.keras.optimizers.SGD(learning_rate=learning_rate,
                                   momentum=optimizer_cfg["momentum"], **ema)


def planned_epochs(cfg: Dict[str, Dict[str, Any]], model) -> int:
    """``training.epochs``, or the most epochs ``privacy.epsilon_budget`` allows (>= 1).

    Raises:
        ConfigError: the budget does not even allow one step.
    """
    from lipdp import accounting

    epochs, budget = cfg["training"]["epochs"], cfg["privacy"]["epsilon_budget"]
    if budget is not None:
        sigma = accounting.model_step_noise_multiplier(model)
        q, delta = model.dataset_metadata.sampling_rate, cfg["privacy"]["delta"]
        if accounting.max_steps_for_budget(budget, sigma, q, delta) == 0:
            one = accounting.compute_epsilon(sigma, q, 1, delta)
            raise ConfigError(
                f"privacy.epsilon_budget={budget!r} does not allow a single step: one step "
                f"spends epsilon={accounting.format_epsilon(one)} (noise multiplier {sigma:g}, "
                f"sampling rate {q:g}). "
                "Raise the budget or privacy.noise_multiplier, or lower dataset.batch_size.")
    if epochs is not None:
        return epochs
    # At least one epoch: if less than an epoch fits, the accountant stops mid-epoch (so
    # get_max_epochs' warning that a plan of 0 epochs trains nothing does not apply).
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", accounting.NoEpochFitsWarning)
        return max(1, accounting.get_max_epochs(budget, model))


def build_from_config(cfg: Dict[str, Dict[str, Any]]):
    """Builds a run from a config (validated again here).

    Returns:
        ``(model, ds_train, ds_test, metadata, fit_kwargs)``: a compiled
        `DP_Sequential`, the pipelines and metadata of `lipdp.data.load_dataset`,
        and ``fit_kwargs = {"epochs", "validation_data", "callbacks"}`` for
        ``model.fit(ds_train, **fit_kwargs)``; the callbacks hold a
        `DP_Accountant` with the config's budget that prints epsilon each epoch.

    Raises:
        ConfigError: invalid config, or values the data / model reject (e.g.
            a batch size larger than the training set).
        FileNotFoundError, lipdp.data.DatasetFormatError: the data is missing
            or corrupt.
    """
    from lipdp.bounds import bound_fraction_thresholds
    from lipdp.callbacks import DP_Accountant
    from lipdp.data import DatasetFormatError, load_dataset
    from lipdp.metadata import AdaptiveClipping, DPParameters

    cfg = validate_config(cfg)
    d = cfg["dataset"]
    bound = _bound_argument(d, d["input_bound"])
    front = build_front_end(cfg["model"], d["input_bound"])
    if front is not None:
        m = cfg["model"]
        bound = {**_bound_argument(d, m["feature_bound"]), "feature_map": front,
                 "feature_cache_key": _front_end_key(m, d["input_bound"])}
    try:
        ds_train, ds_test, metadata = load_dataset(
            d["name"], d["batch_size"], sampling=d["sampling"], seed=d["seed"],
            nb_samples_train=d["nb_samples_train"], data_dir=d["data_dir"],
            augmentation=d["augmentation"],
            augmentation_multiplicity=d["augmentation_multiplicity"], **bound)
    except DatasetFormatError:
        raise
    except ValueError as e:
        if front is not None:  # the front end's own refusal names the model's fields
            _check_front_end(front, d["name"])
        raise ConfigError(f"Invalid dataset section: {e}") from None
    p = cfg["privacy"]
    try:
        clipped = {} if p["mode"] == "clipless" else {"mode": "clipped",
                                                      "l2_norm_clip": p["l2_norm_clip"],
                                                      "engine": p["engine"]}
        if p["adaptive_clip_quantile"] is not None:
            clipped["loss_gradient_clipping"] = AdaptiveClipping(
                target_quantile=p["adaptive_clip_quantile"],
                noise_multiplier=p["adaptive_clip_noise"],
                initial_clip=p["adaptive_clip_initial"],
                learning_rate=p["adaptive_clip_learning_rate"])
        common = {"noise_multiplier": p["noise_multiplier"], "delta": p["delta"],
                  "noisify_strategy": p["noisify_strategy"]}
        fraction = p["bound_fraction"]
        # With bound_fraction, the thresholds are placed on the built model's bounds: it is
        # built under the default (clipless) parameters, then given the clipped ones.
        model = build_model(cfg["model"], metadata,
                            DPParameters(**common, **({} if fraction is not None else clipped)))
        loss = build_loss(cfg["loss"])
        if fraction is not None:
            model.dp_parameters = DPParameters(**common, **{
                **clipped, "clipping": "per-layer",
                "l2_norm_clip": bound_fraction_thresholds(model, fraction, loss)})
        epochs = planned_epochs(cfg, model)
        optimizer = build_optimizer(cfg["optimizer"], epochs * metadata.steps_per_epoch)
        model.compile(loss=loss, optimizer=optimizer, metrics=["accuracy"],
                      private_logs_only=cfg["training"]["private_logs_only"],
                      bjorck_every=cfg["training"]["bjorck_every"])
    except ConfigError:
        raise
    except ValueError as e:
        raise ConfigError(f"Cannot build the model from the config: {e}") from None
    fit_kwargs = {
        "epochs": epochs,
        "validation_data": ds_test,
        "callbacks": [DP_Accountant(epsilon_budget=p["epsilon_budget"], log_fn="print")],
    }
    return model, ds_train, ds_test, metadata, fit_kwargs
