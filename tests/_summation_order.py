"""The arithmetic model's A2 (`lipdp.rounding`) on TensorFlow's CPU kernels: a matrix product
or a convolution sums each example's outputs along one order.

The test session switches oneDNN off (`tests/conftest.py`), but users run with it on (the
default), and the variable is read when TensorFlow starts, so
`tests/test_certify_rounding.py` also runs this module in a process of its own with oneDNN:

    TF_ENABLE_ONEDNN_OPTS=1 python -m tests._summation_order

which prints one JSON line: whether oneDNN is on, and the cases whose outputs differ.
"""

import json

import numpy as np
import tensorflow as tf

MATMULS = [(1, 784, 1024), (7, 784, 1024), (9, 1024, 10), (33, 16, 3)]
CONVOLUTIONS = [(1, 28, 1, 32, 1), (3, 14, 32, 64, 1), (2, 9, 17, 10, 2)]


def differing_cases():
    """The products whose outputs are not bit-identical for a kernel with identical output
    columns (eagerly and traced), on heavy-tailed values, which round differently under
    different summation orders: MLP widths, VGG/ResNet convolutions, strides, 'same' padding
    away from the border, batches that are not multiples of the vector width."""
    rng = np.random.default_rng(0)

    def heavy(*shape):
        return (rng.normal(size=shape) * np.exp(3.0 * rng.normal(size=shape))).astype(np.float32)

    traced_matmul = tf.function(tf.matmul)
    differing = []
    for batch, fan_in, units in MATMULS:
        kernel = np.repeat(heavy(fan_in, 1), units, axis=1)
        x = heavy(batch, fan_in)
        for how, product in [("eager", tf.matmul), ("traced", traced_matmul)]:
            y = product(x, kernel).numpy()
            if not np.all(y == y[:, :1]):
                differing.append(f"matmul {how} {batch}x{fan_in}x{units}")
        sequence = tf.tensordot(heavy(batch, 5, fan_in), kernel, [[2], [0]]).numpy()
        if not np.all(sequence == sequence[..., :1]):
            differing.append(f"tensordot {batch}x5x{fan_in}x{units}")
    for batch, size, channels, filters, strides in CONVOLUTIONS:
        kernel = np.repeat(heavy(3, 3, channels, 1), filters, axis=3)
        image = np.broadcast_to(heavy(channels), (batch, size, size, channels)).copy()
        traced = tf.function(lambda x, k, s=strides: tf.nn.conv2d(x, k, s, "SAME"))
        for how, convolve in [("eager", lambda x, k, s=strides: tf.nn.conv2d(x, k, s, "SAME")),
                              ("traced", traced)]:
            # Interior positions see identical patches: every output (position, filter) is equal.
            y = convolve(image, kernel).numpy()[:, 1:-1, 1:-1, :]
            if not np.all(y == y.flat[0]):
                differing.append(f"conv2d {how} {batch}x{size}x{size}x{channels}->{filters}"
                                 f"/{strides}")
    return differing


def onednn_enabled() -> bool:
    from tensorflow.python.util import _pywrap_util_port

    return bool(_pywrap_util_port.IsMklEnabled())


if __name__ == "__main__":
    print(json.dumps({"onednn": onednn_enabled(), "differing": differing_cases()}))
