"""lipdp: differentially private training of Lipschitz networks without clipping.

Clipless DP-SGD (Béthune et al.): the networks are Lipschitz by construction, so
every per-example gradient has an analytic bound ("backpropagation for bounds"),
and Gaussian noise is calibrated to it at every step of `model.fit`. The same
`fit` also runs classic DP-SGD with per-example clipping (``DPParameters(
mode="clipped", ...)``, `lipdp.clipping`) for comparison.
"""

import os as _os
import sys as _sys

# The `lipdp` command (or ``python -m lipdp.cli``) shows lipdp's own lines: unless the user
# set TF_CPP_MIN_LOG_LEVEL, TensorFlow's C++ start-up log (CUDA, cuDNN, TensorRT and
# CPU-feature lines, among them spurious "Unable to register" errors) is hidden, and
# `lipdp.cli` lowers its Python logger; `lipdp ... --verbose` keeps them.
# This must run before TensorFlow is imported; importing lipdp as a library changes nothing.
_ARGV = getattr(_sys, "argv", None) or [""]
_ORIG_ARGV = list(getattr(_sys, "orig_argv", None) or [])
_RUN_AS_CLI = (_os.path.basename(_ARGV[0]) == "lipdp" or "-mlipdp.cli" in _ORIG_ARGV
               or any(a == "-m" and b == "lipdp.cli" for a, b in zip(_ORIG_ARGV, _ORIG_ARGV[1:])))
_QUIET_TENSORFLOW = (_RUN_AS_CLI and "--verbose" not in _ARGV
                     and "TF_CPP_MIN_LOG_LEVEL" not in _os.environ)
if _QUIET_TENSORFLOW:
    _os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"

from lipdp._autograph import skip_conversion as _skip_conversion

_skip_conversion()  # traces of lipdp's functions: as written, not rewritten (`lipdp._autograph`)

from lipdp import (audit, bounds, certify, checkpoints, clipping, data, layers, ledger, losses,
                   records)
from lipdp.accounting import get_eps_delta, get_max_epochs
from lipdp.callbacks import BoundMonitor, DP_Accountant, SignalToNoise
from lipdp.checkpoints import load_model
from lipdp.metadata import (AdaptiveClipping, Clipping, DatasetMetadata, DPMode, DPParameters,
                            NoiseStrategy, NormEngine, Sampling)
from lipdp.model import DP_Model, DP_Sequential

from lipdp import zoo  # noqa: I001 (after lipdp.model, which it builds on)

__version__ = "0.1.0"

__all__ = [
    "AdaptiveClipping",
    "BoundMonitor",
    "Clipping",
    "DP_Accountant",
    "DP_Model",
    "DP_Sequential",
    "DPMode",
    "DPParameters",
    "DatasetMetadata",
    "NoiseStrategy",
    "NormEngine",
    "Sampling",
    "SignalToNoise",
    "audit",
    "bounds",
    "certify",
    "checkpoints",
    "clipping",
    "data",
    "get_eps_delta",
    "get_max_epochs",
    "layers",
    "ledger",
    "load_model",
    "losses",
    "records",
    "zoo",
]
