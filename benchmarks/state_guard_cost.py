"""What `lipdp.state_guard` costs a classic DP-SGD step: paired, in one process.

Two copies of each model (same weights), one with the step's check of the guarded variables
(every Keras layer's weights, read before the step and compared bit for bit before the
update) and one with an empty guard, trained with ``train_on_batch`` in alternating rounds
(the order swapped every round); the table gives the median of the per-round ratios and the
medians of the step times beside them. Models: a 784-1024-10 tanh MLP at batch 1024 and a
small tanh CNN (conv 16, conv 32, dense 10 on 28x28x1) at batch 256, ghost engine.

Usage: ``.venv/bin/python benchmarks/state_guard_cost.py [--rounds 20]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _layers(kind):
    import tensorflow as tf

    layers = tf.keras.layers
    if kind == "MLP 784-1024-10":
        return [layers.Input((784,)), layers.Dense(1024, activation="tanh"),
                layers.Dense(10)], (784,), 1024
    return [layers.Input((28, 28, 1)), layers.Conv2D(16, 3, activation="tanh"),
            layers.MaxPooling2D(), layers.Conv2D(32, 3, activation="tanh"),
            layers.MaxPooling2D(), layers.Flatten(), layers.Dense(10)], (28, 28, 1), 256


def _model(kind, guarded):
    import tensorflow as tf

    import lipdp
    from lipdp.state_guard import StateGuard

    tf.keras.utils.set_random_seed(0)  # the same weights in both copies
    layers, shape, batch = _layers(kind)
    model = lipdp.DP_Sequential(
        layers, dp_parameters=lipdp.DPParameters(1.0, 1e-5, mode="clipped", l2_norm_clip=1.0),
        dataset_metadata=lipdp.DatasetMetadata(shape, 10, 60000, 10, batch, None, "shuffle"))
    model.compile(loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  optimizer="sgd")
    tf.random.set_seed(None)
    if not guarded:
        model._state_guard = StateGuard([])
    return model, shape, batch


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--steps", type=int, default=3, help="steps per round and copy")
    args = parser.parse_args()
    import numpy as np

    warnings.simplefilter("ignore")  # the seeded-noise warning: timing only
    print("| model, batch | guarded variables | guarded / unguarded (median) | per-round "
          "ratios (min-max) | guarded step | unguarded step |")
    print("|---|---|---|---|---|---|")
    for kind in ("MLP 784-1024-10", "CNN 16-32-10"):
        guarded, shape, batch = _model(kind, True)
        plain, _, _ = _model(kind, False)
        rng = np.random.default_rng(0)
        x = rng.normal(size=(batch,) + shape).astype(np.float32)
        y = rng.integers(0, 10, batch)

        def timed(model):
            start = time.perf_counter()
            for _ in range(args.steps):
                model.train_on_batch(x, y)
            return (time.perf_counter() - start) / args.steps

        for model in (guarded, plain):  # trace and warm up
            timed(model)
        times = {id(guarded): [], id(plain): []}
        for round_ in range(args.rounds):
            for model in ((guarded, plain) if round_ % 2 == 0 else (plain, guarded)):
                times[id(model)].append(timed(model))
        ratios = [a / b for a, b in zip(times[id(guarded)], times[id(plain)])]
        print(f"| {kind}, {batch} | {len(guarded._state_guard.variables)} | "
              f"{statistics.median(ratios):.3f}x | {min(ratios):.2f}-{max(ratios):.2f} | "
              f"{statistics.median(times[id(guarded)]) * 1e3:.1f} ms | "
              f"{statistics.median(times[id(plain)]) * 1e3:.1f} ms |")


if __name__ == "__main__":
    main()
