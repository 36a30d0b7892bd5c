"""lipdp: differentially private training of Lipschitz networks without clipping.

Clipless DP-SGD (Béthune et al.): the networks are Lipschitz by construction, so
every per-example gradient has an analytic bound ("backpropagation for bounds"),
and Gaussian noise is calibrated to it at every step of `model.fit`. The same
`fit` also runs classic DP-SGD with per-example clipping (``DPParameters(
mode="clipped", ...)``, `lipdp.clipping`) for comparison.
"""

from lipdp import audit, bounds, certify, clipping, data, layers, ledger, losses, records
from lipdp.accounting import get_eps_delta, get_max_epochs
from lipdp.callbacks import BoundMonitor, DP_Accountant, SignalToNoise
from lipdp.metadata import (Clipping, DatasetMetadata, DPMode, DPParameters, NoiseStrategy,
                            NormEngine, Sampling)
from lipdp.model import DP_Model, DP_Sequential

from lipdp import zoo  # noqa: I001 (after lipdp.model, which it builds on)

__version__ = "0.1.0"

__all__ = [
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
    "clipping",
    "data",
    "get_eps_delta",
    "get_max_epochs",
    "layers",
    "ledger",
    "losses",
    "records",
    "zoo",
]
