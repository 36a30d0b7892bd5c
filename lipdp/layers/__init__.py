"""DP layers: Keras layers that implement backpropagation for bounds."""

from lipdp.layers.activations import DP_ReLU, DP_Sigmoid, DP_Softplus, DP_Tanh
from lipdp.layers.base import DPLayer
from lipdp.layers.basic import (DP_BoundedActivation, DP_BoundedInput, DP_Flatten, DP_GroupSort,
                               DP_ScaledL2NormPooling2D)
from lipdp.layers.conv import DP_QuickSpectralConv2D, DP_SpectralConv2D
from lipdp.layers.dense import DP_QuickFrobeniusDense, DP_QuickSpectralDense, DP_SpectralDense
from lipdp.layers.gradient_clipping import DP_ClipGradient
from lipdp.layers.normalization import DP_AddBias, DP_LayerCentering
from lipdp.layers.pooling import DP_GlobalL2NormPooling2D, DP_MaxPool2D
from lipdp.layers.reshaping import DP_Patches, DP_Permute, DP_Reshape
from lipdp.layers.residual import (DP_MergeResidual, DP_SplitResidual, DP_WrappedResidual,
                                   make_residuals)
from lipdp.layers.scattering import DP_MultiscaleScattering, DP_Scattering

__all__ = [
    "DPLayer",
    "DP_AddBias",
    "DP_BoundedActivation",
    "DP_BoundedInput",
    "DP_ClipGradient",
    "DP_Flatten",
    "DP_GlobalL2NormPooling2D",
    "DP_GroupSort",
    "DP_LayerCentering",
    "DP_MaxPool2D",
    "DP_MergeResidual",
    "DP_MultiscaleScattering",
    "DP_Patches",
    "DP_Permute",
    "DP_QuickFrobeniusDense",
    "DP_QuickSpectralConv2D",
    "DP_QuickSpectralDense",
    "DP_ReLU",
    "DP_Reshape",
    "DP_ScaledL2NormPooling2D",
    "DP_Scattering",
    "DP_Sigmoid",
    "DP_Softplus",
    "DP_SpectralConv2D",
    "DP_SpectralDense",
    "DP_SplitResidual",
    "DP_Tanh",
    "DP_WrappedResidual",
    "make_residuals",
]
