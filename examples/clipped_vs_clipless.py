"""Clipless DP-SGD vs classic clipped DP-SGD on Fashion-MNIST, at the same epsilon.

Both runs train the same Lipschitz MLP (DP_BoundedInput, DP_Flatten,
DP_QuickSpectralDense, DP_GroupSort2, DP_QuickSpectralDense) with the same loss,
optimizer, Poisson sampling rate q = D / N, noise multiplier sigma and number of
epochs, so the accountant gives them the same (epsilon, delta). They differ only
in how the sensitivity of the averaged gradient is bounded:

* clipless: analytic per-example gradient bounds of the Lipschitz layers
  (noise std ``sigma * sqrt(sum_v Delta_v^2)``, recomputed every step);
* clipped: every per-example gradient is clipped to norm C (``flat``), its norm
  computed by the ghost engine (noise std ``sigma * C / D``).

Usage::

    .venv/bin/python examples/clipped_vs_clipless.py              # ~3 minutes on 2 CPU cores
    .venv/bin/python examples/clipped_vs_clipless.py --epochs 10 --clip 0.5 --engine vectorized
"""

from __future__ import annotations

import argparse
import math
import time

import tensorflow as tf

import lipdp
from lipdp.accounting import epsilon_spent
from lipdp.layers import DP_BoundedInput, DP_Flatten, DP_GroupSort, DP_QuickSpectralDense
from lipdp.losses import DP_TauCategoricalCrossentropy


def build(metadata, dp_parameters, width):
    return lipdp.DP_Sequential([
        DP_BoundedInput(metadata.max_norm, input_shape=metadata.input_shape),
        DP_Flatten(),
        DP_QuickSpectralDense(width, use_bias=False), DP_GroupSort(2),
        DP_QuickSpectralDense(metadata.nb_classes, use_bias=False),
    ], dp_parameters=dp_parameters, dataset_metadata=metadata)


def train(mode, args, ds_train, ds_test, metadata):
    common = dict(noise_multiplier=args.sigma, delta=args.delta)
    if mode == "clipless":
        params = lipdp.DPParameters(**common)
    else:
        params = lipdp.DPParameters(**common, mode="clipped", clipping=args.clipping,
                                    l2_norm_clip=args.clip, engine=args.engine)
    tf.keras.utils.set_random_seed(args.seed)  # the same initial weights in both modes
    model = build(metadata, params, args.width)
    tf.random.set_seed(None)  # but noise that no seed in this file predicts (SeededNoiseWarning)
    model.compile(loss=DP_TauCategoricalCrossentropy(args.tau),
                  optimizer=tf.keras.optimizers.Adam(args.lr), metrics=["accuracy"])
    if mode == "clipless":
        deltas = [float(s) for s in model.sensitivities()]
        noise = args.sigma * math.sqrt(sum(d * d for d in deltas))
        how = "analytic bounds"
    else:
        noise = args.sigma * args.clip / metadata.batch_size
        how = f"{args.clipping} clipping at C={args.clip:g}, {args.engine} engine"
    print(f"\n[{mode}] {how}; noise std on the averaged gradient at step 1: {noise:.3g}")
    start = time.perf_counter()
    model.fit(ds_train, epochs=args.epochs, verbose=2 if args.verbose else 0)
    seconds = time.perf_counter() - start
    _, accuracy = model.evaluate(ds_test, verbose=0)
    epsilon = epsilon_spent(model)
    print(f"[{mode}] {model.dp_steps_taken} steps in {seconds:.0f} s; "
          f"epsilon = {lipdp.accounting.format_epsilon(epsilon)} (delta = {args.delta:g}); "
          f"test accuracy = {accuracy:.4f}")
    return epsilon, accuracy


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=5000,
                        help="expected Poisson batch size D (the public denominator)")
    parser.add_argument("--sigma", type=float, default=3.0, help="noise multiplier")
    parser.add_argument("--delta", type=float, default=1e-5)
    parser.add_argument("--input-bound", type=float, default=10.0,
                        help="L2 bound X0 on the [0, 1]-scaled images")
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--tau", type=float, default=10.0, help="loss temperature")
    parser.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate (both runs)")
    parser.add_argument("--clip", type=float, default=1.0, help="clipping threshold C")
    parser.add_argument("--clipping", default="flat", choices=["flat", "per-layer", "global"])
    parser.add_argument("--engine", default="ghost", choices=["ghost", "mixed-ghost", "vectorized"])
    parser.add_argument("--seed", type=int, default=0,
                        help="weights and batch sampling, the same for both runs (a known "
                             "sampling seed: epsilon holds only while it is secret)")
    parser.add_argument("--verbose", action="store_true", help="Keras progress per epoch")
    args = parser.parse_args(argv)

    ds_train, ds_test, metadata = lipdp.data.load_dataset(
        "fashion_mnist", args.batch_size, bound_clip_value=args.input_bound, sampling="poisson",
        seed=args.seed)
    print(f"Fashion-MNIST: N={metadata.nb_samples_train}, D={metadata.batch_size}, "
          f"q={metadata.sampling_rate:.4f}, {metadata.steps_per_epoch} steps/epoch, "
          f"sigma={args.sigma:g}, {args.epochs} epochs")
    results = {mode: train(mode, args, ds_train, ds_test, metadata)
               for mode in ("clipless", "clipped")}
    print("\nmode      epsilon   test accuracy")
    for mode, (epsilon, accuracy) in results.items():
        print(f"{mode:9s} {lipdp.accounting.format_epsilon(epsilon):>7s}   {accuracy:.4f}")
    assert results["clipless"][0] == results["clipped"][0], "same mechanism, same epsilon"


if __name__ == "__main__":
    main()
