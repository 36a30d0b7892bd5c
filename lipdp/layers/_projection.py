"""Shared projection settings for spectrally constrained DP layers (wraps deel-lip)."""

from __future__ import annotations

from deel.lip.normalizers import (
    DEFAULT_BETA_BJORCK,
    DEFAULT_EPS_BJORCK,
    DEFAULT_EPS_SPECTRAL,
    DEFAULT_MAXITER_BJORCK,
    _check_RKO_params,
)

# Power iteration runs from the vector cached at the previous step, so a few
# iterations per step keep it converged; more at build, from a random start.
DEFAULT_MAXITER_SPECTRAL = 10
BUILD_MAXITER_SPECTRAL = 100


class ProjectionConfig:
    """Validated hyper-parameters of the RKO / spectral + Björck projection.

    Args:
        eps_spectral: stopping tolerance of the cached power iteration.
        maxiter_spectral: power iterations per projection.
        eps_bjorck: stopping tolerance of Björck orthogonalisation; ``None``
            disables it (the kernel is then only spectrally normalised).
        beta_bjorck: Björck step size, in (0, 0.5].
        maxiter_bjorck: Björck iterations per projection.
    """

    KEYS = ("eps_spectral", "maxiter_spectral", "eps_bjorck", "beta_bjorck", "maxiter_bjorck")

    def __init__(self, eps_spectral=DEFAULT_EPS_SPECTRAL, maxiter_spectral=DEFAULT_MAXITER_SPECTRAL,
                 eps_bjorck=DEFAULT_EPS_BJORCK, beta_bjorck=DEFAULT_BETA_BJORCK,
                 maxiter_bjorck=DEFAULT_MAXITER_BJORCK):
        _check_RKO_params(eps_spectral, eps_bjorck, beta_bjorck)
        for name, value in (("maxiter_spectral", maxiter_spectral), ("maxiter_bjorck", maxiter_bjorck)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"Received an invalid value for `{name}`, expected a positive integer. "
                    f"Received: {name}={value!r}"
                )
        self.eps_spectral = float(eps_spectral)
        self.maxiter_spectral = maxiter_spectral
        self.eps_bjorck = None if eps_bjorck is None else float(eps_bjorck)
        self.beta_bjorck = float(beta_bjorck)
        self.maxiter_bjorck = maxiter_bjorck

    def get_config(self):
        return {key: getattr(self, key) for key in self.KEYS}
