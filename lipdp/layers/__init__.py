"""DP layers: Keras layers that implement backpropagation for bounds."""

from lipdp.layers.base import DPLayer
from lipdp.layers.basic import DP_BoundedInput, DP_Flatten, DP_GroupSort, DP_ScaledL2NormPooling2D
from lipdp.layers.conv import DP_QuickSpectralConv2D
from lipdp.layers.dense import DP_QuickSpectralDense

__all__ = [
    "DPLayer",
    "DP_BoundedInput",
    "DP_Flatten",
    "DP_GroupSort",
    "DP_QuickSpectralConv2D",
    "DP_QuickSpectralDense",
    "DP_ScaledL2NormPooling2D",
]
