"""Step time and peak memory of private training: clipless vs classic DP-SGD.

For each batch size (default 256, 1024, 4096) and each configuration, one
private step is timed on a small CNN on 28x28x1 inputs (``--model mlp``: the
Lipschitz MLP of ``examples/clipped_vs_clipless.py`` instead):

* ``clipless``: Clipless DP-SGD (lipdp DP layers, analytic bounds, no per-example work);
* ``ghost``: lipdp classic DP-SGD, flat clipping, ghost norms (Lee & Kifer) with Gram
  identities only (no per-example gradient of a Dense/Conv2D layer is formed), same DP layers;
* ``mixed-ghost``: the same, but a layer whose Gram matrices are larger than its per-example
  gradient gets its norm from that gradient, formed chunk by chunk (Bu et al.'s mixed ghost
  clipping; here the first convolution);
* ``vectorized``: lipdp classic DP-SGD, flat clipping, exact vectorised per-example gradients,
  same DP layers;
* ``ghost-keras``, ``vectorized-keras``: the same lipdp engines on the plain Keras model that
  tensorflow-privacy trains (no projection, no DP layer): the like-for-like comparison;
* ``tf-privacy-optimizer``: tensorflow-privacy's ``DPKerasSGDOptimizer`` (vectorised Jacobian
  of the loss vector, then a loop over ``num_microbatches = batch`` microbatches) on the same
  architecture built from plain Keras layers (Conv2D, ReLU);
* ``tf-privacy-model``: tensorflow-privacy's ``DPSequential`` (``num_microbatches=None``: one
  example per microbatch, ``use_xla=False`` as lipdp) with its default fast-clipping layer
  registry (Dense, Embedding): ghost norms on ``--model mlp``; on ``cnn`` Conv2D is not in the
  registry, so it clips exact per-example gradients from ``tf.vectorized_map``;
* ``non-private``: plain SGD step on the plain Keras model, for scale.

Architectures: ``cnn``: input 28x28x1 -> Conv 3x3 16 filters stride 2 'same' -> GroupSort2
(ReLU for Keras) -> Conv 3x3 32 filters stride 2 'same' -> GroupSort2 (ReLU) -> Flatten ->
Dense 10 (20.5k parameters). ``mlp``: Flatten -> Dense 1024 -> GroupSort2 (ReLU) -> Dense 10,
no biases (813k parameters). Every lipdp step includes the projection of the DP layers.

Method:

* step time: the step is compiled with ``tf.function`` (as ``fit`` does: lipdp's
  ``train_step``, tf-privacy's ``minimize``), run ``--warmup`` times (tracing + warm-up),
  then ``--steps`` times; the median wall-clock time is reported (each step ends by reading a
  value back to the host, so asynchronous execution cannot hide work). Slow configurations
  stop early: after the first (tracing) step, further warm-up and timed steps only run while
  less than ``--budget`` seconds have passed (at least one timed step; the table gives the
  count). A configuration is not run at all when its measurement at the previous batch
  size, extrapolated to the new one (quadratically for tf-privacy-optimizer, whose per-example
  Jacobian costs time and memory quadratic in the batch: measured 64 -> 128 -> 256;
  linearly for the others), predicts a step longer than ``--timeout`` or more memory than
  80% of the machine's available memory; the table says so.
* peak memory: every (configuration, batch size) runs in its own subprocess. The resident set
  high-water mark ``getrusage(RUSAGE_SELF).ru_maxrss`` is read after the model, optimizer and
  batch are built (baseline) and again after all steps; the difference is the extra peak
  memory the steps needed (compilation included). It is a process-level figure: allocator
  caching and TensorFlow's own buffers count, which is the memory a user actually pays.

Usage::

    .venv/bin/python benchmarks/run.py                 # 256, 1024, 4096
    .venv/bin/python benchmarks/run.py --quick         # fewer steps, 256 and 1024
    .venv/bin/python benchmarks/run.py --batch-sizes 128 512 --configs clipless ghost
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

CONFIGS = ("clipless", "ghost", "mixed-ghost", "vectorized", "ghost-keras", "vectorized-keras",
           "tf-privacy-optimizer", "tf-privacy-model", "non-private")
LIPDP_CONFIGS = ("clipless", "ghost", "mixed-ghost", "vectorized", "ghost-keras",
                 "vectorized-keras")
INPUT_SHAPE = (28, 28, 1)
NB_CLASSES = 10
NB_SAMPLES = 60000
CLIP = 1.0
SIGMA = 1.0


# How step time and memory grow with the batch size, used to skip hopeless runs.
_SCALING_EXPONENT = {"tf-privacy-optimizer": 2}


def _available_mib() -> float:
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return float("inf")


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux: KiB


def _dp_model(config, batch, architecture):
    import tensorflow as tf

    from lipdp.layers import (DP_BoundedInput, DP_Flatten, DP_GroupSort, DP_QuickSpectralConv2D,
                              DP_QuickSpectralDense)
    from lipdp.losses import DP_TauCategoricalCrossentropy
    from lipdp.metadata import DatasetMetadata, DPParameters
    from lipdp.model import DP_Sequential

    plain_keras = config.endswith("-keras")
    if config == "clipless":
        params = DPParameters(SIGMA, 1e-5)
    else:
        params = DPParameters(SIGMA, 1e-5, mode="clipped", clipping="flat", l2_norm_clip=CLIP,
                              engine=config[:-len("-keras")] if plain_keras else config)
    metadata = DatasetMetadata(INPUT_SHAPE, NB_CLASSES, NB_SAMPLES, 10000, batch, 10.0, "shuffle")
    if plain_keras:
        model = DP_Sequential(_keras_model(architecture).layers, dp_parameters=params,
                              dataset_metadata=metadata)
        model.build((None,) + INPUT_SHAPE)
        model.compile(loss=tf.keras.losses.CategoricalCrossentropy(from_logits=True),
                      optimizer=tf.keras.optimizers.SGD(0.1))
        step = tf.function(model.train_step)
        return lambda x, y: step((x, y))["loss"]
    if architecture == "cnn":
        layers = [DP_QuickSpectralConv2D(16, 3, strides=2), DP_GroupSort(2),
                  DP_QuickSpectralConv2D(32, 3, strides=2), DP_GroupSort(2),
                  DP_Flatten(), DP_QuickSpectralDense(NB_CLASSES)]
    else:
        layers = [DP_Flatten(), DP_QuickSpectralDense(1024, use_bias=False), DP_GroupSort(2),
                  DP_QuickSpectralDense(NB_CLASSES, use_bias=False)]
    model = DP_Sequential([DP_BoundedInput(10.0, input_shape=INPUT_SHAPE)] + layers,
                          dp_parameters=params, dataset_metadata=metadata)
    model.compile(loss=DP_TauCategoricalCrossentropy(10.0), optimizer=tf.keras.optimizers.SGD(0.1))
    step = tf.function(model.train_step)
    return lambda x, y: step((x, y))["loss"]


def _keras_layers(architecture):
    import tensorflow as tf

    layers = tf.keras.layers
    if architecture == "cnn":
        return [layers.Conv2D(16, 3, strides=2, padding="same"), layers.ReLU(),
                layers.Conv2D(32, 3, strides=2, padding="same"), layers.ReLU(),
                layers.Flatten(), layers.Dense(NB_CLASSES)]
    return [layers.Flatten(), layers.Dense(1024, use_bias=False), layers.ReLU(),
            layers.Dense(NB_CLASSES, use_bias=False)]


def _keras_model(architecture):
    import tensorflow as tf

    return tf.keras.Sequential([tf.keras.layers.Input(INPUT_SHAPE)] + _keras_layers(architecture))


def _tf_privacy_model_step(architecture):
    import tensorflow as tf
    import tensorflow_privacy
    from tensorflow_privacy.privacy.fast_gradient_clipping.layer_registry import (
        make_default_layer_registry)

    # Built from an InputLayer: tf-privacy decides on fast clipping in the constructor.
    model = tensorflow_privacy.DPSequential(
        l2_norm_clip=CLIP, noise_multiplier=SIGMA, num_microbatches=None, use_xla=False,
        layer_registry=make_default_layer_registry(),
        layers=[tf.keras.layers.InputLayer(INPUT_SHAPE)] + _keras_layers(architecture))
    fast = model._enable_fast_peg_computation  # pylint: disable=protected-access
    assert fast == (architecture == "mlp"), f"tf-privacy fast clipping: {fast}"
    model.compile(optimizer=tf.keras.optimizers.SGD(0.1),
                  loss=tf.keras.losses.CategoricalCrossentropy(from_logits=True))
    step = tf.function(model.train_step)
    return lambda x, y: step((x, y))["loss"]


def _tf_privacy_step(batch, architecture):
    import tensorflow as tf
    import tensorflow_privacy

    model = _keras_model(architecture)
    optimizer = tensorflow_privacy.DPKerasSGDOptimizer(
        l2_norm_clip=CLIP, noise_multiplier=SIGMA, num_microbatches=batch, learning_rate=0.1)
    loss = tf.keras.losses.CategoricalCrossentropy(from_logits=True,
                                                   reduction=tf.keras.losses.Reduction.NONE)

    @tf.function
    def step(x, y):
        optimizer.minimize(lambda: loss(y, model(x, training=True)), model.trainable_variables)
        return tf.reshape(model.trainable_variables[0], [-1])[0]

    return step


def _non_private_step(architecture):
    import tensorflow as tf

    model = _keras_model(architecture)
    optimizer = tf.keras.optimizers.SGD(0.1)
    loss = tf.keras.losses.CategoricalCrossentropy(from_logits=True)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            value = loss(y, model(x, training=True))
        optimizer.apply_gradients(zip(tape.gradient(value, model.trainable_variables),
                                      model.trainable_variables))
        return value

    return step


def worker(config: str, batch: int, architecture: str, warmup: int, steps: int,
           budget: float) -> dict:
    """Runs in a fresh process: build, baseline memory, warm-up, timed steps."""
    import warnings

    import numpy as np
    import tensorflow as tf

    warnings.simplefilter("ignore")
    tf.keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    x = tf.constant(rng.uniform(size=(batch,) + INPUT_SHAPE), tf.float32)
    y = tf.one_hot(rng.integers(0, NB_CLASSES, batch), NB_CLASSES)
    if config in LIPDP_CONFIGS:
        step = _dp_model(config, batch, architecture)
    elif config == "tf-privacy-optimizer":
        step = _tf_privacy_step(batch, architecture)
    elif config == "tf-privacy-model":
        step = _tf_privacy_model_step(architecture)
    else:
        step = _non_private_step(architecture)
    baseline = _rss_mib()
    step(x, y).numpy()  # tracing
    first_done = time.perf_counter()
    for _ in range(warmup - 1):
        if time.perf_counter() - first_done > budget:
            break
        step(x, y).numpy()
    times = []
    while len(times) < steps and (not times or time.perf_counter() - first_done < budget):
        start = time.perf_counter()
        step(x, y).numpy()
        times.append(time.perf_counter() - start)
    return {"config": config, "batch": batch, "step_s": statistics.median(times),
            "peak_mib": _rss_mib() - baseline, "times": times}


def _run_worker(config, batch, args) -> dict:
    command = [sys.executable, os.path.abspath(__file__), "--worker", config, str(batch),
               "--model", args.model, "--warmup", str(args.warmup), "--steps", str(args.steps),
               "--budget", str(args.budget)]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    try:
        done = subprocess.run(command, capture_output=True, text=True, env=env,
                              timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"config": config, "batch": batch, "error": f"timed out (> {args.timeout:.0f} s)"}
    if done.returncode != 0:
        if done.returncode < 0:
            return {"config": config, "batch": batch,
                    "error": f"killed by signal {-done.returncode}"
                             + (" (out of memory)" if done.returncode == -9 else "")}
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        return {"config": config, "batch": batch, "error": " | ".join(tail)}
    return json.loads(done.stdout.strip().splitlines()[-1])


def _table(results, batch_sizes, configs) -> str:
    by_key = {(r["config"], r["batch"]): r for r in results}
    lines = ["| batch | configuration | step time (s) | x clipless | peak extra RSS (MiB) "
             "| x clipless | timed steps |", "|---|---|---|---|---|---|---|"]
    for batch in batch_sizes:
        base = by_key.get(("clipless", batch), {})
        for config in configs:
            r = by_key.get((config, batch))
            if r is None:
                continue
            if "error" in r:
                lines.append(f"| {batch} | {config} | {r['error'][:90]} | | | | |")
                continue
            t_ratio = (f"{r['step_s'] / base['step_s']:.2f}" if base.get("step_s") else "-")
            m_ratio = (f"{r['peak_mib'] / base['peak_mib']:.2f}"
                       if base.get("peak_mib", 0) > 0 else "-")
            lines.append(f"| {batch} | {config} | {r['step_s']:.4f} | {t_ratio} | "
                         f"{r['peak_mib']:.0f} | {m_ratio} | {len(r['times'])} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=None)
    parser.add_argument("--configs", nargs="+", choices=CONFIGS, default=list(CONFIGS))
    parser.add_argument("--quick", action="store_true",
                        help="batch sizes 256 and 1024, 1 warm-up and 3 timed steps")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps (default 2)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 5)")
    parser.add_argument("--model", choices=["cnn", "mlp"], default="cnn")
    parser.add_argument("--budget", type=float, default=30.0,
                        help="seconds of steps after tracing before a configuration stops early")
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="seconds allowed to one configuration (subprocess)")
    parser.add_argument("--worker", nargs=2, metavar=("CONFIG", "BATCH"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
    args.steps = args.steps if args.steps is not None else (3 if args.quick else 5)
    if args.worker:
        print(json.dumps(worker(args.worker[0], int(args.worker[1]), args.model, args.warmup,
                                args.steps, args.budget)))
        return 0
    batch_sizes = args.batch_sizes or ([256, 1024] if args.quick else [256, 1024, 4096])
    configs = ["clipless"] + [c for c in args.configs if c != "clipless"]
    results, last = [], {}
    start = time.perf_counter()
    for batch in batch_sizes:
        for config in configs:
            previous = last.get(config)
            skip = None
            if previous is not None and "error" in previous:
                skip = f"not run: see batch {previous['batch']}"
            elif previous is not None:
                growth = (batch / previous["batch"]) ** _SCALING_EXPONENT.get(config, 1)
                seconds, mib = previous["step_s"] * growth, previous["peak_mib"] * growth
                if seconds > args.timeout:
                    skip = (f"not run: ~{seconds:.0f} s/step extrapolated from batch "
                            f"{previous['batch']}")
                elif mib > 0.8 * _available_mib():
                    skip = (f"not run: ~{mib / 1024:.0f} GiB extrapolated from batch "
                            f"{previous['batch']}, {_available_mib() / 1024:.0f} GiB available")
            if skip:
                result = {"config": config, "batch": batch, "error": skip}
            else:
                result = _run_worker(config, batch, args)
            results.append(result)
            if previous is None or "error" not in previous:
                last[config] = result
            shown = (f"{result['step_s']:.4f} s/step, +{result['peak_mib']:.0f} MiB"
                     if "error" not in result else f"FAILED: {result['error']}")
            print(f"batch {batch:5d}  {config:12s} {shown}", flush=True)
    print(f"\n{_table(results, batch_sizes, configs)}\n")
    print(f"model {args.model}; total wall time {time.perf_counter() - start:.0f} s; median of "
          f"up to {args.steps} steps after up to {args.warmup} warm-up steps; "
          f"{os.cpu_count()} CPU cores")
    return 0


if __name__ == "__main__":
    sys.exit(main())
