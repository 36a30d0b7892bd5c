"""The paper library's ``get_max_epochs`` (lip-dp, ICLR 2024), a thin adapter onto
`lipdp.accounting.get_max_epochs`.

The number of epochs is planned with the model's *true* noise multiplier and
sampling rate: the same epsilon as the paper library for the same script and the same
trainable variables (under ``noisify_strategy="local"`` every trainable variable is one
Gaussian mechanism, sigma/sqrt(V): the biases lipdp's layers train unless
``use_bias=False`` raise V, which a second warning says). What differs is the noise each
step adds, because lipdp calibrates it to sound
per-example gradient bounds where the paper library under-stated them. The first
call says, once, which of the model's layers that concerns
(`PaperCompatibilityWarning`):

- **Convolutions.** The paper library's ``DP_QuickSpectralConv2D`` stored its
  kernel already multiplied by deel-lip's RKO factor ``c`` (``c = 28/82 ~ 0.34``
  for a 3x3 kernel on 28x28 images) and bounded the per-example gradient of that
  variable by ``c sqrt(kh kw) X G``, while the gradient with respect to the
  stored kernel itself reaches ``sqrt(kh kw) X G`` (a constant image with an
  aligned cotangent comes within a few percent of it): under-stated by ``1 / c``.
  It also took the convolution as exactly 1-Lipschitz, which RKO only
  approximates. lipdp stores the orthonormal ``Psi`` and convolves with
  ``c Psi``: the bound ``c sqrt(m) X G`` is then the true one for ``Psi``, and
  bounds propagate through certified operator norms (`lipdp.operator_norms`).
- **Biases.** lipdp's dense and convolution layers have a bias unless
  ``use_bias=False`` (the paper library forbade biases there, so a script that
  omits the argument now trains one). The paper library's ``DP_AddBias`` bounded a bias gradient by G and
  the output norm by ``X + ||b||``, also after a convolution, where the bias is
  added to each of the P pixels: the true bounds are ``sqrt(P) G`` and
  ``X + sqrt(P) ||b||``, which lipdp uses.
- **GroupSort.** deel-lip's GroupSort2 backpropagates through ``tf.minimum`` /
  ``tf.maximum``, which at ties send both cotangents of a pair to one input (norm
  up to ``sqrt(2) G`` against the ``G`` assumed); lipdp's ``DP_GroupSort`` routes
  the cotangent through one permutation, also at ties.
"""

from __future__ import annotations

from typing import Optional

from lipdp import accounting
from lipdp.clipping.validation import leaf_layers
from lipdp.layers import DP_AddBias, DP_GroupSort, DP_QuickSpectralConv2D, DP_SpectralConv2D
from lipdp.metadata import NoiseStrategy
from lipdp.pipeline import PaperCompatibilityWarning, _warn_once

__all__ = ["PaperCompatibilityWarning", "get_max_epochs"]

_BOUND_CHANGES = {
    "convolution": (
        (DP_QuickSpectralConv2D, DP_SpectralConv2D),
        "convolutions: the paper library bounded the gradient of its stored kernel (already "
        "scaled by the RKO factor c) by c*sqrt(kh*kw)*X*G instead of sqrt(kh*kw)*X*G, an "
        "under-statement by 1/c (about 3 for 3x3 kernels), and took the convolution as "
        "exactly 1-Lipschitz; lipdp stores the orthonormal kernel, convolves with c times it, "
        "and propagates bounds through certified operator norms",
    ),
    "bias": (
        (DP_AddBias,),
        "biases: lipdp's dense and convolution layers have biases unless use_bias=False (the "
        "paper library forbade them); the paper library's DP_AddBias bounded a bias gradient "
        "by G and the output norm by X + ||b||, also when the bias is added to each of the P "
        "pixels of a feature map, where lipdp uses the true sqrt(P)*G and X + sqrt(P)*||b||",
    ),
    "groupsort": (
        (DP_GroupSort,),
        "GroupSort: deel-lip's GroupSort2 sends both cotangents of a tied pair to one input "
        "(norm up to sqrt(2)*G); lipdp's tie-safe DP_GroupSort keeps it a permutation",
    ),
}


def _layers(model):
    """The model's leaf layers and those of its residual branches."""
    layers = list(leaf_layers(model))
    return layers + [inner for layer in layers for inner in getattr(layer, "branch", ())]


def _trains_biases(layers) -> bool:
    """Whether a dense or convolution layer of `layers` has a bias."""
    return any(getattr(layer, "use_bias", False) for layer in layers)


def _changed_bounds(model):
    """The texts of `_BOUND_CHANGES` that concern the model's layers."""
    layers = _layers(model)
    found = []
    for topic, (classes, text) in _BOUND_CHANGES.items():
        hit = any(isinstance(layer, classes) for layer in layers)
        if topic == "bias":
            hit = hit or _trains_biases(layers)
        if hit:
            found.append(text)
    return found


def get_max_epochs(epsilon_max, model, epochs_max: Optional[int] = 1024) -> int:
    """The paper library's ``get_max_epochs(epsilon_max, model)``: the largest number of
    epochs E with ``epsilon(E epochs) <= epsilon_max`` for the model's `DPParameters` and
    `DatasetMetadata`, at most ``epochs_max`` (None: no cap).

    `lipdp.accounting.get_max_epochs` (an exact search on the step count). Warns once (`PaperCompatibilityWarning`) which of the
    model's bounds lipdp computes differently from the paper library.
    """
    changes = _changed_bounds(model)
    if changes:
        _warn_once(
            "bounds",
            "lipdp calibrates the noise to sound per-example gradient bounds; for this model "
            "they differ from the paper library's in " + "; ".join(changes) + ". The planned "
            "epochs and the printed epsilon are the same; the noise is larger where the paper "
            "library under-stated a bound (README: 'Migrating from the paper's library').",
        )
    if _per_layer_biases(model):
        _warn_once(
            "per-layer biases",
            "noisify_strategy='local' ('per-layer') makes every trainable variable one Gaussian "
            "mechanism (noise multiplier sigma/sqrt(V), V the trainable variables): this model's "
            "dense or convolution layers train biases the paper library forbade, so V, the "
            "epsilon of each epoch and this plan differ from the paper library's (fewer epochs; "
            "the printed epsilon is this model's). Give those layers use_bias=False for the "
            "paper's plan.",
        )
    return accounting.get_max_epochs(epsilon_max, model, epochs_max)


def _per_layer_biases(model) -> bool:
    """Whether `model` runs the per-layer strategy with a dense or convolution bias."""
    parameters = getattr(model, "dp_parameters", None)
    return (parameters is not None
            and parameters.noisify_strategy is NoiseStrategy.PER_LAYER
            and _trains_biases(_layers(model)))
