"""Ready-made Lipschitz architectures: MLP, VGG, ResNet and MLP-Mixer.

Each builder returns an uncompiled `lipdp.DP_Sequential` made only of DP layers,
so every variable has a per-example gradient bound and the whole network a
certified Lipschitz constant. Defaults follow the main paper's CIFAR-10 study
(appendix C.2.4, Figure 16): GroupSort2 activations, no batch normalisation,
L2-norm pooling, orthogonal (spectral / RKO) weights, 1-Lipschitz residual merges.

Every builder takes the same keyword arguments besides its architecture knobs:

- ``input_bound``: the L2 bound X0 enforced by the first layer
  (`DP_BoundedInput` clips to it). Default: ``dataset_metadata.max_norm`` when
  given, else ``sqrt(prod(input_shape))``, the largest norm of an input with
  values in [0, 1] (no clipping for such data).
- ``dp_parameters``: `lipdp.DPParameters`, default ``DPParameters()``.
- ``dataset_metadata``: `lipdp.DatasetMetadata`; may be set later with
  ``model.dataset_metadata = ...`` (it is required by ``compile``).
- ``activation``: "groupsort" (GroupSort2, gradient-norm preserving), "fullsort",
  "relu", "tanh", "softplus".
- ``name``: the model's name.
"""

from __future__ import annotations

import math
from typing import Sequence

from lipdp.layers import (DP_BoundedInput, DP_Flatten, DP_GlobalL2NormPooling2D, DP_GroupSort,
                          DP_LayerCentering, DP_Patches, DP_Permute, DP_QuickSpectralConv2D,
                          DP_QuickSpectralDense, DP_ReLU, DP_Reshape, DP_ScaledL2NormPooling2D, DP_Softplus,
                          DP_Tanh, DP_WrappedResidual, make_residuals)
from lipdp.layers.residual import DP_MergeResidual, DP_SplitResidual
from lipdp.metadata import DPParameters
from lipdp.model import DP_Sequential

_ACTIVATIONS = {
    "groupsort": lambda: DP_GroupSort(2),
    "fullsort": lambda: DP_GroupSort(None),
    "relu": DP_ReLU,
    "tanh": DP_Tanh,
    "softplus": DP_Softplus,
}


def _activation(name):
    if name not in _ACTIVATIONS:
        raise ValueError(f"Received an invalid value for `activation`, expected one of "
                         f"{sorted(_ACTIVATIONS)}. Received: activation={name!r}")
    return _ACTIVATIONS[name]()


def _head_layer(head):
    """The layer class in front of the classifier for ``head``."""
    heads = {"flatten": DP_Flatten, "global-l2": DP_GlobalL2NormPooling2D}
    if head not in heads:
        raise ValueError(f"Received an invalid value for `head`, expected one of "
                         f"{sorted(heads)}. Received: head={head!r}")
    return heads[head]


def _positive_int(value, name):
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"Received an invalid value for `{name}`, expected a positive integer. "
                         f"Received: {name}={value!r}")
    return value


def _input_layer(input_shape, input_bound, dataset_metadata):
    input_shape = tuple(int(d) for d in input_shape)
    if dataset_metadata is not None and tuple(dataset_metadata.input_shape) != input_shape:
        raise ValueError(f"input_shape={input_shape} disagrees with dataset_metadata.input_shape="
                         f"{tuple(dataset_metadata.input_shape)}.")
    if input_bound is None:
        if dataset_metadata is not None and dataset_metadata.max_norm is not None:
            input_bound = dataset_metadata.max_norm
        else:
            input_bound = math.sqrt(math.prod(input_shape))
    return DP_BoundedInput(float(input_bound), input_shape=input_shape)


def _model(layers, nb_classes, dp_parameters, dataset_metadata, name):
    _positive_int(nb_classes, "nb_classes")
    if dataset_metadata is not None and dataset_metadata.nb_classes != nb_classes:
        raise ValueError(f"nb_classes={nb_classes} disagrees with dataset_metadata.nb_classes="
                         f"{dataset_metadata.nb_classes}.")
    return DP_Sequential(layers, dp_parameters=dp_parameters or DPParameters(),
                         dataset_metadata=dataset_metadata, name=name)


def mlp(input_shape, nb_classes, *, width: int = 512, depth: int = 2, use_bias: bool = False,
        activation="groupsort", input_bound=None, dp_parameters=None, dataset_metadata=None,
        name="lipdp_mlp"):
    """Spectrally normalised MLP: ``depth`` hidden layers of ``width`` units.

    Knobs:
        width: hidden units per layer.
        depth: number of hidden layers (0 gives a linear classifier).
        use_bias: whether dense layers have (unconstrained) biases.
    """
    _positive_int(width, "width")
    if not isinstance(depth, int) or depth < 0:
        raise ValueError(f"Received an invalid value for `depth`, expected a non-negative "
                         f"integer. Received: depth={depth!r}")
    layers = [_input_layer(input_shape, input_bound, dataset_metadata), DP_Flatten()]
    for _ in range(depth):
        layers += [DP_QuickSpectralDense(width, use_bias=use_bias), _activation(activation)]
    layers.append(DP_QuickSpectralDense(nb_classes, use_bias=use_bias))
    return _model(layers, nb_classes, dp_parameters, dataset_metadata, name)


def vgg(input_shape, nb_classes, *, widths: Sequence[int] = (32, 64), convs_per_block: int = 2,
        dense_width: int = 256, use_bias: bool = False, activation="groupsort",
        input_bound=None, dp_parameters=None, dataset_metadata=None, name="lipdp_vgg"):
    """Lipschitz VGG: blocks of 3x3 RKO convolutions, each block ending in 2x2 L2-norm pooling.

    Knobs:
        widths: filters of each block (one block per entry).
        convs_per_block: 3x3 convolutions per block.
        dense_width: units of the hidden dense layer of the head (0: none).
        use_bias: whether convolutions and dense layers have biases.
    """
    _positive_int(convs_per_block, "convs_per_block")
    layers = [_input_layer(input_shape, input_bound, dataset_metadata)]
    for width in widths:
        _positive_int(width, "widths[i]")
        for _ in range(convs_per_block):
            layers += [DP_QuickSpectralConv2D(width, 3, use_bias=use_bias),
                       _activation(activation)]
        layers.append(DP_ScaledL2NormPooling2D(2))
    layers.append(DP_Flatten())
    if dense_width:
        layers += [DP_QuickSpectralDense(_positive_int(dense_width, "dense_width"),
                                         use_bias=use_bias), _activation(activation)]
    layers.append(DP_QuickSpectralDense(nb_classes, use_bias=use_bias))
    return _model(layers, nb_classes, dp_parameters, dataset_metadata, name)


def resnet(input_shape, nb_classes, *, width: int = 16, stages: int = 2, blocks_per_stage: int = 1,
           merge_policy: str = "1-lip-add", use_bias: bool = False, activation="groupsort",
           head: str = "flatten", input_bound=None, dp_parameters=None, dataset_metadata=None,
           name="lipdp_resnet"):
    """Lipschitz ResNet: a stem convolution, then stages of residual blocks.

    A block is ``x -> c (x + conv(act(conv(x))))`` (`make_residuals`, c = 1/2 for
    the default 1-Lipschitz merge). Between stages, 2x2 L2-norm pooling halves
    the resolution and a 1x1 convolution doubles the width. The head is a dense
    layer on the flattened feature maps, or on their global L2-norm pooling.

    Knobs:
        width: filters of the first stage (doubled at each stage).
        stages: number of stages.
        blocks_per_stage: residual blocks per stage.
        merge_policy: "1-lip-add" (1-Lipschitz average) or "add" (plain sum).
        use_bias: whether convolutions and dense layers have biases.
        head: "flatten" (default, as the paper's VGG) or "global-l2"
            (`DP_GlobalL2NormPooling2D`: one non-negative norm per channel; far
            fewer head weights, but signs and positions are lost: with width 8
            on 10k Fashion-MNIST images it stayed at chance for 3 epochs even
            without noise, where "flatten" reached 74%).
    """
    _positive_int(width, "width")
    _positive_int(stages, "stages")
    _positive_int(blocks_per_stage, "blocks_per_stage")
    head_layer = _head_layer(head)
    layers = [_input_layer(input_shape, input_bound, dataset_metadata),
              DP_QuickSpectralConv2D(width, 3, use_bias=use_bias), _activation(activation)]
    for stage in range(stages):
        filters = width * 2 ** stage
        if stage:
            layers += [DP_ScaledL2NormPooling2D(2),
                       DP_QuickSpectralConv2D(filters, 1, use_bias=use_bias)]
        for _ in range(blocks_per_stage):
            layers += make_residuals(
                [DP_QuickSpectralConv2D(filters, 3, use_bias=use_bias), _activation(activation),
                 DP_QuickSpectralConv2D(filters, 3, use_bias=use_bias)], merge_policy)
            layers.append(_activation(activation))
    layers += [head_layer(), DP_QuickSpectralDense(nb_classes, use_bias=use_bias)]
    return _model(layers, nb_classes, dp_parameters, dataset_metadata, name)


def mlp_mixer(input_shape, nb_classes, *, patch_size: int = 4, hidden_dim: int = 64,
              depth: int = 1, token_mlp_dim=None, channel_mlp_dim=None, residual: bool = True, merge_policy: str = "1-lip-add",
              centering: bool = False, use_bias: bool = False, activation="groupsort",
              head: str = "flatten", input_bound=None, dp_parameters=None,
              dataset_metadata=None, name="lipdp_mlp_mixer"):
    """Lipschitz MLP-Mixer (appendix C.2.4).

    Images are cut into ``patch_size`` patches (`DP_Patches`, a permutation) and
    each patch is embedded by one dense map to ``hidden_dim`` channels. Each of
    the ``depth`` blocks then applies

    - token mixing: ``Permute -> Dense(token_mlp_dim) -> act -> Dense(T) -> Permute``,
      dense maps over the T patches, shared by all channels;
    - channel mixing: ``Dense(channel_mlp_dim) -> act -> Dense(hidden_dim)``,
      dense maps over the channels, shared by all patches.

    Both are dense maps applied to disjoint slices, so their Lipschitz constant
    is their kernel's spectral norm and their kernel's per-example gradient is
    at most ``X G`` (`DP_QuickSpectralDense` on sequences). Square matrices, as
    the paper recommends, keep them norm preserving. With ``residual=True`` each
    mixing is wrapped in a residual section with a 1-Lipschitz merge. The head
    is a dense layer on the flattened tokens, or on their global L2-norm pooling.

    Knobs:
        patch_size: side of the square patches (must divide H and W).
        hidden_dim: channels per patch after the embedding.
        depth: number of mixer blocks.
        token_mlp_dim: hidden width of token mixing (default: T, rounded up to
            an even number for GroupSort2).
        channel_mlp_dim: hidden width of channel mixing (default: hidden_dim,
            rounded up to an even number).
        residual: skip connections around each mixing.
        merge_policy: "1-lip-add" or "add" (when residual).
        centering: start each mixing with `DP_LayerCentering` over channels.
        use_bias: whether dense layers have biases.
        head: "flatten" (default) or "global-l2" (one non-negative norm per
            channel over the tokens, as for `resnet`).
    """
    head_layer = _head_layer(head)
    _positive_int(patch_size, "patch_size")
    _positive_int(hidden_dim, "hidden_dim")
    _positive_int(depth, "depth")
    input_layer = _input_layer(input_shape, input_bound, dataset_metadata)
    h, w = int(input_shape[0]), int(input_shape[1])
    if h % patch_size or w % patch_size:
        raise ValueError(f"patch_size={patch_size} must divide the image size {h}x{w}.")
    tokens = (h // patch_size) * (w // patch_size)
    layers = [input_layer, DP_Patches(patch_size),
              DP_QuickSpectralDense(hidden_dim, use_bias=use_bias)]

    token_mlp_dim = _positive_int(token_mlp_dim or tokens + tokens % 2, "token_mlp_dim")
    channel_mlp_dim = _positive_int(channel_mlp_dim or hidden_dim + hidden_dim % 2,
                                    "channel_mlp_dim")

    def mixing(units, hidden_units, transpose):
        branch = [DP_LayerCentering()] if centering else []
        if transpose:
            branch.append(DP_Permute((2, 1)))
        branch += [DP_QuickSpectralDense(hidden_units, use_bias=use_bias), _activation(activation),
                   DP_QuickSpectralDense(units, use_bias=use_bias)]
        if transpose:
            branch.append(DP_Permute((2, 1)))
        if residual:
            return [DP_SplitResidual(), DP_WrappedResidual(branch), DP_MergeResidual(merge_policy)]
        return branch

    for _ in range(depth):
        layers += (mixing(tokens, token_mlp_dim, transpose=True)
                   + mixing(hidden_dim, channel_mlp_dim, transpose=False))
    if head == "global-l2":  # (T, C) tokens as a (T, 1, C) image: pooling over the tokens
        layers.append(DP_Reshape((tokens, 1, hidden_dim)))
    layers += [head_layer(), DP_QuickSpectralDense(nb_classes, use_bias=use_bias)]
    return _model(layers, nb_classes, dp_parameters, dataset_metadata, name)

