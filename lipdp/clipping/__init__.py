"""Classic DP-SGD with per-example clipping, in lipdp's `model.fit`.

Selected with ``DPParameters(mode="clipped", clipping=..., l2_norm_clip=C,
engine=..., noise_multiplier=sigma)``. The model may then contain ordinary Keras
layers (anything without batch statistics), DP layers too.

* `rules`: clipping factors and sensitivities -- ``flat`` (Abadi et al.),
  ``per-layer`` (a threshold per trainable variable), ``global`` (Bu et al.,
  keep an example's gradient only when its norm is at most C).
* `vectorized`: exact per-example gradients (optionally perturbed before
  clipping, Chen, Wu & Hong 2020), clipped and summed.
* `ghost` / `ghost_norms`: Lee & Kifer's fast clipping -- per-example norms from layer
  inputs and output cotangents (Dense, Conv2D, Embedding), the clipped sum from each
  layer's output and its reweighted cotangents; other layers fall back to exact
  gradients, visibly (`ghost_plan`), and are refused when they draw random numbers in
  training (`GhostRandomnessError`), when a layer does not see one row per example (a
  batch axis folded with positions: `GhostRowsError`) and when layers compute in float16
  or bfloat16 (their norms underflow): use ``"vectorized"``. Engine ``"ghost"`` uses
  Gram identities only; ``"mixed-ghost"`` forms a layer's per-example gradient
  (transiently, for its norm) when that is smaller than its Gram matrices.
* `mechanism`: `ClippedDPSGD`, what the model's ``private_gradients`` uses in
  clipped mode: the sum of clipped gradients (divided by D there) and the
  isotropic noise std ``sigma * C / D``.
* `validation`: per-example losses (each example's loss from its own label and
  output) and the refusal of batch-coupled layers and of non-trainable state
  written from the data (moving statistics).
"""

from lipdp.clipping.engine import ClippedBatch
from lipdp.clipping.ghost import (GhostEngine, GhostFallbackWarning, GhostPlan,
                                  GhostRandomnessError, GhostRowsError, ghost_plan)
from lipdp.clipping.ghost_norms import register_ghost_rule
from lipdp.clipping.mechanism import ClippedDPSGD, PreclipFallbackWarning
from lipdp.clipping.rules import (ClippingRule, FlatClipping, GlobalClipping, PerLayerClipping,
                                  make_rule)
from lipdp.clipping.validation import BatchCouplingError, check_no_batch_coupling, per_example_loss
from lipdp.clipping.vectorized import VectorizedEngine

__all__ = [
    "BatchCouplingError",
    "ClippedBatch",
    "ClippedDPSGD",
    "ClippingRule",
    "FlatClipping",
    "GhostEngine",
    "GhostFallbackWarning",
    "GhostPlan",
    "GhostRandomnessError",
    "GhostRowsError",
    "GlobalClipping",
    "PerLayerClipping",
    "PreclipFallbackWarning",
    "VectorizedEngine",
    "check_no_batch_coupling",
    "ghost_plan",
    "make_rule",
    "per_example_loss",
    "register_ghost_rule",
]
