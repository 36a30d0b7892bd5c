"""Where the paper's CNN loses to a plain CNN: its activation and pooling layers.

`benchmarks/run.py` shows that the Lipschitz CNN's forward+backward pass is most of a clipless
step. This script says which layers make the difference, paired in one process (alternating
rounds, medians of per-round ratios to ``dp``):

* forward+backward of the CNN of ``run.py`` (``dp``, batch ``--batch``, mean cross-entropy of
  the logits; GroupSort2 and the L2-norm pooling after it run as lipdp's one fused kernel
  when the kernels are available, `lipdp.kernels`) and of copies of it with layers swapped
  **for timing only**
  (the copies are not DP models): both layers in their TensorFlow-ops reference versions
  (``dp, reference layers``: what lipdp ran before the fused kernels, and still runs without
  a C++ compiler), GroupSort2 -> ReLU (``relu``), scaled L2-norm pooling -> max pooling
  (``maxpool``), both (``relu+maxpool``), lipdp's convolution and dense layers -> Keras's
  (``keras-conv/dense``), everything (``all-keras``); and the plain CNN's whole training
  step (``floor``, as in ``run.py``);
* forward+backward of one layer on ``[batch, 28, 28, 32]`` random inputs (the first conv
  block's activations), cotangent fixed: identity, ReLU, GroupSort2 (fused kernel, reference,
  reference compiled with XLA), 2x2 pooling (L2-norm fused, L2-norm reference, max).

Usage: ``.venv/bin/python benchmarks/layer_costs.py [--batch 1024] [--rounds 8]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _swapped_cnn(dp_model, relu, maxpool, keras_linear, reference=False):
    """A copy of the DP CNN's layer list with the chosen layers replaced by Keras ones (or,
    with `reference`, GroupSort2 and L2-norm pooling by their reference versions)."""
    import tensorflow as tf
    from deel.lip.layers import ScaledL2NormPooling2D

    from lipdp.layers._pair_sort import reference_sort_pairs

    layers = []
    for layer in dp_model.layers:
        kind = type(layer).__name__
        if kind == "DP_GroupSort" and reference:
            layers.append(tf.keras.layers.Lambda(
                lambda x, pairing=layer.pairing: reference_sort_pairs(x, pairing)))
        elif kind == "DP_ScaledL2NormPooling2D" and reference:
            layers.append(ScaledL2NormPooling2D(layer.pool_size, k_coef_lip=layer.k_coef_lip))
        elif kind == "DP_GroupSort" and relu:
            layers.append(tf.keras.layers.ReLU())
        elif kind == "DP_ScaledL2NormPooling2D" and maxpool:
            layers.append(tf.keras.layers.MaxPooling2D(2))
        elif kind == "DP_QuickSpectralConv2D" and keras_linear:
            layers.append(tf.keras.layers.Conv2D(layer.filters, layer.kernel_size,
                                                 padding=layer.padding, use_bias=False))
        elif kind == "DP_QuickSpectralDense" and keras_linear:
            layers.append(tf.keras.layers.Dense(layer.units, use_bias=False))
        elif kind == "DP_BoundedInput" and keras_linear:
            continue
        else:
            layers.append(layer)
    return tf.keras.Sequential([tf.keras.layers.Input(dp_model.input_shape[1:])] + layers)


def _forward_backward(model, x, y):
    import tensorflow as tf

    @tf.function
    def call():
        with tf.GradientTape() as tape:
            logits = model(x, training=True)
            loss = tf.reduce_mean(tf.keras.losses.categorical_crossentropy(
                y, logits, from_logits=True))
        return tf.add_n([tf.reduce_sum(g) for g in
                         tape.gradient(loss, model.trainable_variables)])

    return call


def _activation(fn, x, cotangent):
    import tensorflow as tf

    @tf.function
    def call():
        with tf.GradientTape() as tape:
            tape.watch(x)
            value = tf.reduce_sum(fn(x) * cotangent)
        return tf.reduce_sum(tape.gradient(value, x))

    return call


def _xla_group_sort(channels):
    """GroupSort2 (halves pairing) with its forward and backward each compiled by XLA."""
    import tensorflow as tf

    half = channels // 2
    first = tf.range(channels) < half

    @tf.function(jit_compile=True)
    def forward(v):
        partner = tf.roll(v, shift=half, axis=3)
        swap = tf.where(first, v >= partner, partner >= v)
        return tf.where(swap, partner, v), swap

    @tf.function(jit_compile=True)
    def backward(g, swap):
        return tf.where(swap, tf.roll(g, shift=half, axis=3), g)

    def group_sort(x):
        @tf.custom_gradient
        def sort(v):
            out, swap = forward(v)
            return out, lambda g: backward(g, swap)

        return sort(x)

    return group_sort


def _paired(calls, rounds, reference):
    for call in calls.values():
        call().numpy()
        call().numpy()
    times = {name: [] for name in calls}
    for index in range(rounds):
        for name in (list(calls) if index % 2 == 0 else list(reversed(calls))):
            start = time.perf_counter()
            calls[name]().numpy()
            times[name].append(time.perf_counter() - start)
    return {name: (1000 * statistics.median(series),
                   statistics.median(t / r for t, r in zip(series, times[reference])))
            for name, series in times.items()}


def _print_table(title, figures, reference):
    print(f"\n{title}\n\n| variant | ms | x {reference} |\n|---|---|---|")
    for name, (ms, ratio) in figures.items():
        print(f"| {name} | {ms:.1f} | {ratio:.2f} |")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=8)
    args = parser.parse_args(argv)

    import tensorflow as tf

    from deel.lip.layers import ScaledL2NormPooling2D

    import run
    from lipdp import kernels
    from lipdp.layers import DP_ScaledL2NormPooling2D
    from lipdp.layers._pair_sort import reference_sort_pairs, sort_pairs

    print(f"lipdp fused kernels: {kernels.status()}")
    tf.keras.utils.set_random_seed(0)
    x, y = run._data(args.batch)  # pylint: disable=protected-access
    _, dp_model = run._build("cnn", "twin", args.batch)  # pylint: disable=protected-access
    floor_step, _ = run._floor("cnn")  # pylint: disable=protected-access
    variants = {"dp": (False, False, False), "dp, reference layers": (False, False, False, True),
                "relu": (True, False, False),
                "maxpool": (False, True, False), "relu+maxpool": (True, True, False),
                "keras-conv/dense": (False, False, True), "all-keras": (True, True, True)}
    calls = {name: _forward_backward(_swapped_cnn(dp_model, *swaps), x, y)
             for name, swaps in variants.items()}
    calls["floor (whole step)"] = lambda: floor_step(x, y)
    _print_table(f"CNN forward+backward at batch {args.batch}, layers swapped (timing only)",
                 _paired(calls, args.rounds, "dp"), "dp")

    activations = tf.random.stateless_normal([args.batch, 28, 28, 32], seed=[0, 1])
    cotangent = tf.random.stateless_normal([args.batch, 28, 28, 32], seed=[0, 2])
    pooled = tf.random.stateless_normal([args.batch, 14, 14, 32], seed=[0, 3])
    calls = {name: _activation(fn, activations, cotangent) for name, fn in (
        ("identity", tf.identity), ("relu", tf.nn.relu), ("groupsort2, fused", sort_pairs),
        ("groupsort2, reference", reference_sort_pairs),
        ("groupsort2, reference with XLA", _xla_group_sort(32)))}
    calls.update({name: _activation(fn, activations, pooled) for name, fn in (
        ("L2-norm pooling 2x2, fused", DP_ScaledL2NormPooling2D(2)),
        ("L2-norm pooling 2x2, reference", ScaledL2NormPooling2D(2)),
        ("max pooling 2x2", tf.keras.layers.MaxPooling2D(2)))})
    _print_table(f"one layer, forward+backward on [{args.batch}, 28, 28, 32]",
                 _paired(calls, args.rounds, "relu"), "relu")
    return 0


if __name__ == "__main__":
    sys.exit(main())
