"""Classic DP-SGD in lipdp's train step: clip, average over D, add isotropic noise.

One step releases ``(sum_i clip(g_i)) / D + N(0, (sigma Delta)^2 I)`` where D is
the public batch denominator (`DatasetMetadata.batch_size`, never the realised
size of a Poisson batch) and ``Delta = sensitivity / D`` with ``sensitivity``
the bound of the clipping rule on every clipped per-example gradient
(C for flat and global clipping, ``sqrt(sum_v C_v^2)`` per layer). Adding or
removing one example changes the averaged gradient by at most Delta, so each
step is a Poisson-subsampled Gaussian mechanism with noise multiplier sigma
(`lipdp.accounting.model_step_noise_multiplier`). `ClippedDPSGD` gives the model's
``private_gradients`` the clipped sums and the noise std ``sigma Delta``.
"""

from __future__ import annotations

import warnings
from typing import List

import tensorflow as tf

from lipdp.clipping.engine import ClippedBatch
from lipdp.clipping.ghost import GhostEngine
from lipdp.clipping.rules import ClippingRule, make_rule
from lipdp.clipping.validation import (check_no_batch_coupling, check_per_example_gradients_run,
                                       per_example_loss)
from lipdp.clipping.vectorized import VectorizedEngine
from lipdp.metadata import DatasetMetadata, DPMode, DPParameters, NormEngine


class PreclipFallbackWarning(UserWarning):
    """Pre-clipping perturbation needs per-example gradients: the ghost engine is not used."""


class ClippedDPSGD:
    """The clipped private step of one compiled model.

    Built at compile time: checks the model (no batch-coupled layer, at least one
    trainable variable), resolves the per-example loss, the clipping rule and
    the engine. The model is passed to each call, not stored.

    Args:
        model: the Keras model being compiled.
        loss: any loss `lipdp.clipping.validation.per_example_loss` accepts.
        dp_parameters: `DPParameters` with ``mode="clipped"``.
        dataset_metadata: gives the public denominator D.

    Raises:
        BatchCouplingError, TypeError, ValueError: see `check_no_batch_coupling`,
            `check_per_example_gradients_run`, `per_example_loss`, `make_rule`.
        GhostRandomnessError: a ghost engine with a random fallback layer
            (`lipdp.clipping.ghost.check_no_replayed_randomness`).
    """

    def __init__(self, model: tf.keras.Model, loss, dp_parameters: DPParameters,
                 dataset_metadata: DatasetMetadata):
        if dp_parameters.mode is not DPMode.CLIPPED:
            raise ValueError("ClippedDPSGD needs DPParameters(mode='clipped', ...).")
        #: What the probe saw no pass write (`check_no_batch_coupling`), and every variable
        #: the model held then (for `lipdp.state_guard`).
        self.unwritten = check_no_batch_coupling(model)
        self.probed = list(model.variables)
        check_per_example_gradients_run(model)
        if not model.trainable_variables:
            raise ValueError("The model has no trainable variables to train privately (is it "
                             "built? give its first layer an input shape or an Input).")
        _refuse_half_precision_variables(model)
        self.loss_fn = per_example_loss(loss)
        self.rule: ClippingRule = make_rule(dp_parameters, model.trainable_variables)
        self.noise_multiplier = float(dp_parameters.noise_multiplier)
        self.denominator = float(dataset_metadata.batch_size)
        engine = dp_parameters.engine
        if engine is not NormEngine.VECTORIZED and dp_parameters.preclip_noise > 0:
            warnings.warn("preclip_noise > 0 needs every per-example gradient (the noise is "
                          "added to it before clipping): using engine='vectorized' instead of "
                          f"{engine.value!r}.", PreclipFallbackWarning, stacklevel=3)
            engine = NormEngine.VECTORIZED
        if engine is NormEngine.VECTORIZED:
            self.engine = VectorizedEngine(dp_parameters.preclip_noise)
        else:
            self.engine = GhostEngine(
                model, norm_method="auto" if engine is NormEngine.MIXED_GHOST else "gram")

    @property
    def sensitivity(self) -> float:
        """L2 sensitivity Delta of the averaged clipped gradient (add/remove one example)."""
        return self.rule.sensitivity() / self.denominator

    @property
    def noise_stddev(self) -> float:
        """``sigma * Delta``: std of the Gaussian added to every coordinate."""
        return self.noise_multiplier * self.sensitivity

    def clipped_batch(self, model, x, y) -> ClippedBatch:
        """The engine's output on one batch (sums of clipped gradients, norms, losses)."""
        return self.engine.clipped_sum(model, self.loss_fn, x, y, self.rule)

    def variable_sensitivities(self) -> List[tf.Tensor]:
        """``C_v / D`` per layer, ``C / D`` for every variable with flat and global
        clipping (one example may put its whole clipped norm on a single variable)."""
        return [tf.constant(s / self.denominator, tf.float32)
                for s in self.rule.variable_sensitivities()]


def _refuse_half_precision_variables(model: tf.keras.Model) -> None:
    """Refuse trainable variables of fewer than 32 bits (float16, bfloat16): their per-example
    gradients, squared norms and clipping factors round in that precision, and clipped
    contributions exceeded C by 1.2e-3 of it (the vectorized engine, flat clipping; a review,
    2026-12-07), far beyond what the noise's slack covers. The ``mixed_float16`` policy keeps
    float32 variables and passes.

    Raises:
        ValueError: naming the first such variable.
    """
    for variable in model.trainable_variables:
        if variable.dtype.is_floating and variable.dtype.size < 4:
            raise ValueError(
                f"The trainable variable '{variable.name}' is {variable.dtype.name}: its "
                "per-example gradients are clipped in that precision, and the clipped "
                "contributions exceed the threshold by about 1e-3 of it, beyond the "
                "sensitivity the noise is calibrated to. Keep trainable variables in float32 "
                "(the 'mixed_float16' policy does) or float64.")
