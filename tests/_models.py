"""Small DP models shared by the model-level tests."""

import tensorflow as tf

from lipdp.layers import (DP_BoundedInput, DP_Flatten, DP_GroupSort, DP_QuickSpectralConv2D,
                          DP_QuickSpectralDense, DP_ScaledL2NormPooling2D)
from lipdp.ledger import RUN_MARK
from lipdp.metadata import DatasetMetadata, DPParameters
from lipdp.model import DP_Model, DP_Sequential

X0 = 3.0


def weights_of_the_run(model):
    """``model.get_weights()`` with the name of every run in its ledger set to 0 (a random
    number drawn when a run starts, `lipdp.ledger.run_row`): two runs that computed the same
    updates compare equal, their ledgers' segments and step counts included."""
    weights = model.get_weights()
    for index, variable in enumerate(model.weights):
        if variable is model._dp_ledger:
            ledger = weights[index] = weights[index].copy()
            ledger[ledger[:, 0] == RUN_MARK, 1] = 0.0
    return weights


def metadata(input_shape, nb_classes, n=64, batch=16, sampling="shuffle"):
    return DatasetMetadata(input_shape, nb_classes, n, 16, batch, X0, sampling)


def cnn(nb_classes=4, bias=True, strategy="global", sigma=1.0, batch=16, sampling="shuffle"):
    layers = [DP_BoundedInput(X0, input_shape=(8, 8, 2)),
              DP_QuickSpectralConv2D(4, 3, use_bias=bias), DP_GroupSort(2),
              DP_ScaledL2NormPooling2D(2),
              DP_QuickSpectralConv2D(4, 3, strides=2, use_bias=bias), DP_GroupSort(None),
              DP_Flatten(), DP_QuickSpectralDense(6, use_bias=bias), DP_GroupSort(2),
              DP_QuickSpectralDense(nb_classes, use_bias=bias)]
    return DP_Sequential(layers, dp_parameters=DPParameters(sigma, 1e-5, strategy),
                         dataset_metadata=metadata((8, 8, 2), nb_classes, batch=batch,
                                                   sampling=sampling))


def mlp(nb_classes=3, strategy="global", sigma=1.0, batch=16):
    inputs = tf.keras.Input((10,))
    x = DP_BoundedInput(X0)(inputs)
    x = DP_QuickSpectralDense(8)(x)
    x = DP_GroupSort(2)(x)
    outputs = DP_QuickSpectralDense(nb_classes)(x)
    return DP_Model(inputs, outputs, dp_parameters=DPParameters(sigma, 1e-5, strategy),
                    dataset_metadata=metadata((10,), nb_classes, batch=batch))
