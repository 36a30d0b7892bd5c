"""Speed benchmark: what Clipless DP-SGD costs over non-private training, and over tf-privacy.

Models (inputs 28x28x1, 10 classes, no biases anywhere):

* ``cnn``: the paper's CNN, built as lipdp's CLI builds it from the model section of
  ``configs/fashion_mnist_cnn.yaml`` (``lipdp.config.build_model``): DP_BoundedInput(10) ->
  [DP_QuickSpectralConv2D(f, 3x3), DP_GroupSort(2), DP_ScaledL2NormPooling2D(2)] for f in
  32, 64 -> DP_Flatten -> DP_QuickSpectralDense(512) -> DP_GroupSort(2) ->
  DP_QuickSpectralDense(10) (1.63M parameters);
* ``mlp``: the main job's MLP, built from the model section of ``configs/fashion_mnist.yaml``
  by the same builder: DP_BoundedInput(10) -> DP_Flatten -> DP_QuickSpectralDense(1024) ->
  DP_BoundedActivation(10) -> DP_GroupSort(2) -> DP_QuickSpectralDense(10) (813k parameters;
  the activation clip, ``model.bounded_activation``, lets the private step leave the first
  kernel's norm uncertified: `lipdp.bounds.norms_no_gradient_bound_reads`).

The main job's config sets ``maxiter_bjorck: 1`` (one Björck iteration per projection, from the
kernel the last one left, which certifies it) and ``maxiter_spectral: 2`` (two power iterations
before it, from the last step's vector); the CNN's keeps deel-lip's loop to its
tolerance (up to 15 iterations). ``--maxiter-bjorck N`` sets both models' count: 15 measures
the mlp as it was before 2026-11-27.

DP models are described by ``DatasetMetadata(input_shape=(28, 28, 1), nb_classes=10,
nb_samples_train=60000, nb_samples_test=10000, batch_size=B, max_norm=10, sampling="shuffle")``
and trained with ``DP_TauCategoricalCrossentropy(10)``. Every configuration gets a fresh
``Adam(1e-3)`` (tf-privacy's vectorized optimizer: its legacy-Adam subclass, same settings).
The batch is a seeded constant: uniform [0, 1] images, random one-hot labels.

Configurations:

* ``floor``: the plain Keras model of the same widths (cnn: Conv2D(32, 3, 'same'), ReLU,
  MaxPooling2D(2), Conv2D(64, 3, 'same'), ReLU, MaxPooling2D(2), Flatten, Dense(512), ReLU,
  Dense(10); mlp: Flatten, Dense(1024), ReLU, Dense(10)), trained non-privately: GradientTape ->
  mean cross-entropy from logits -> ``apply_gradients``;
* ``twin``: the DP model (same lipdp layers) trained non-privately: GradientTape over
  ``model(x, training=True)`` -> mean of the DP loss' per-example values (``loss.call``) ->
  ``apply_gradients`` -> ``model.project()`` (a non-private user of these 1-Lipschitz layers
  pays the projections too);
* ``clipless``: Clipless DP-SGD, ``DPParameters(noise_multiplier=1, delta=1e-5)`` (global
  noise), compiled with ``private_logs_only=True``; the step is ``model.train_step((x, y))``,
  called with numpy's BLAS on one thread where ``fit`` calls it so (the cnn: its certificates'
  host products are small, `lipdp.host_blas`; also the breakdown's bound pass);
* ``clipless-per-layer``: the same with ``noisify_strategy="per-layer"``;
* ``ghost``: lipdp's classic DP-SGD on the same DP layers: ``mode="clipped", clipping="flat",
  l2_norm_clip=1, engine="ghost"`` (ghost norms, no per-example gradient of a Dense/Conv2D
  layer is formed), same step;
* ``tf-privacy-model``: tensorflow-privacy's ``DPSequential`` on the floor architecture
  (``l2_norm_clip=1, noise_multiplier=1, num_microbatches=None``: one example per microbatch,
  ``use_xla=False`` as lipdp) with its default fast-clipping layer registry (Dense, Embedding).
  It takes the fast path (ghost norms) only when every trainable layer is registered: on the
  mlp; on the cnn (Conv2D is not registered) it clips exact per-example gradients computed
  with ``tf.vectorized_map``. The path taken is read from the model and printed under the table;
* ``tf-privacy-vectorized``: tensorflow-privacy's ``VectorizedDPKerasAdamOptimizer``
  (``num_microbatches=B``: the Jacobian of the per-example loss vector, then clipping) on the
  floor model, step ``optimizer.minimize``. Its time and memory grow quadratically with the
  batch (the Jacobian back-propagates B one-hot cotangents through the whole batch; measured
  on this machine in own processes, from batch 64 to 128 a step takes 2.3x (cnn) / 2.0x (mlp)
  the time and 3.2x / 1.6x the peak extra memory, and the mlp from 128 to 256 2.4x and 2.0x),
  so skips extrapolate it quadratically (the others linearly);
* ``twin-bjorck4``, ``clipless-bjorck4``: the twin and clipless with Björck on a schedule,
  ``compile(bjorck_every=4)`` (the twin: ``model.project(orthogonalise=...)`` on every fourth
  step of its own count): spectral normalisation alone on the three steps between. Each
  timed call of these runs a whole period of 4 steps, and its time / 4 is their step time (a
  median over single steps would drop the step with Björck). The paired table gives
  clipless-bjorck4's ratio to the twin of the same schedule under it. On the mlp,
  clipless-bjorck4 is the main job's configuration (``training.bjorck_every: 4``): between
  refreshes its step certifies only the 1024 x 10 kernel;
* ``tf-privacy fastest`` (a table row): the faster of the tf-privacy configurations that ran;
* ``certified-floor`` (mlp only): not a training method but a lower estimate of any private
  step that keeps its kernels orthogonal and certifies them every step, as clipless does: the
  floor's step (its ReLU, its loss, no bound pass, no power iteration), then lipdp's fused
  noise on every gradient and, after ``apply_gradients``, one certifying Björck iteration
  (``lipdp.layers._bjorck.certifying_bjorck``: one Gram matrix, one product, the certificate's
  statistics and host call) on each kernel, from orthogonal kernels. It runs in
  tensorflow-privacy's process too, and the paired table gives tensorflow-privacy's step over
  it: where that is below 1, no step of this design can be faster than tensorflow-privacy's
  on this machine.

Every step is compiled with ``tf.function`` and ends by reading one element of every variable
of the model back to the host with ``.numpy()``: the reads come after the step's assignments
(optimizer, projections of every layer), so no work of a step is left running into the next
timed call, and asynchronous execution cannot hide work.

Measurements, for each model and batch size (default 256, 1024, 4096):

1. Paired in one process (the primary figures: this machine's speed drifts by up to 2x between
   runs, a ratio measured within one round does not). One subprocess builds every lipdp
   configuration that fits in memory (tensorflow-privacy's run in a second one, beside the
   floor, the twin and clipless again, whose ratios to them are what the tables and targets
   give: the CNN's vectorised tf-privacy step holds 14 GiB at batch 1024, and sharing its
   process slowed the other configurations, clipless x twin 1.21 against 1.15-1.19 without it,
   2026-11-26), warms each one up (tracing + 2 steps), then runs
   ``--rounds`` rounds: in each round every configuration runs one timed step, in a fixed
   order that is reversed every other round. Reported: the median step time, and the median
   over rounds of the per-round ratios to ``floor`` and to ``twin`` (and to ``clipless`` and
   ``clipless-bjorck4``, for the targets).
2. Own process (``--no-isolated`` skips it): every (model, configuration, batch) runs in its
   own subprocess: tracing, 2 warm-up steps, ``--rounds`` timed steps; the median step time,
   and the peak extra memory: the resident set high-water mark ``getrusage(RUSAGE_SELF)
   .ru_maxrss`` read after the model, optimizer and batch are built (baseline) and again after
   all steps; the difference is what the steps needed (compilation included; allocator caching
   and TensorFlow's own buffers count: the memory a user actually pays). Also its ratio to the
   floor's.

Breakdown of the clipless step, in the paired subprocess: separately ``tf.function``-compiled
pieces of the step, on a second clipless model built like the first, each warmed up and timed
in the same rounds as the whole steps, after them and always in step order (so that their bound
pass, like the step's, sees the weights the last projection left: the optimizer piece moves
them without projecting, and on unprojected kernels the certificates leave the near-orthogonal
shortcut: the mlp's bound pass takes 2x as long. An earlier version ran the pieces on the
clipless model itself, in the alternating order; the clipless step then met unprojected weights
every other round, and mlp@4096 read 1.52x the twin instead of 1.04-1.08x):
``forward+backward`` (``model._averaged_gradients(x, y)``: gradients
/ D, per-example losses, predictions), ``bound pass`` (``model.sensitivities()``: certified
operator norms and the backpropagation of bounds), ``noise`` (``model._noise_stddevs`` of
precomputed sensitivities, then ``lipdp.noise.add_gaussian_noise`` to every variable, with
the step's finiteness check), ``optimizer``
(``model.optimizer.apply_gradients`` of the noisy gradients of a fresh, untimed
``model.private_gradients`` call before each timed one, so that the weights move as in
training, not along one fixed gradient: Björck's iteration count depends on how far they
moved), ``projection`` (``model.project()``); the whole step is the clipless configuration's.
Reported: the median time of each piece, its share of the whole step, and what the pieces
leave unaccounted (whole - sum: graph overheads, checks; negative when pieces overlap in the
step: the bound pass does not depend on the batch, and TensorFlow runs it on the host beside
the forward+backward). Beside them, not part of the step: the forward+backward piece compiled
with XLA
(``jit_compile=True``), to show whether XLA would help (lipdp's step cannot use it: its
certified norms run on the host), and the noise as the step drew it before the fused kernel
(``check_numerics``, then ``lipdp.noise.gaussian_noise``'s TensorFlow ops), paired with the
``noise`` piece.

Slow and large configurations: after tracing, a configuration's further steps (warm-up, then
timed ones) only run while they have taken less than ``--budget`` seconds in all (at least one
timed step; the tables give the count). A configuration is not run at all when its measurement
at the previous batch size (own process; with ``--no-isolated``, the paired process, whose
memory figure is the growth of the peak while that configuration was built and warmed up),
extrapolated to the new one, predicts a step longer than ``--timeout`` / 3 (tracing and one
timed step must fit in ``--timeout``) or more memory than 80% of the available memory
(MemAvailable), nor after it failed or was skipped; the tables say so. Each configuration must
fit on its own: the paired process holds them together, but their peaks do not coincide. A
subprocess gets ``--timeout`` seconds per configuration it runs.

The output (``--output``, default ``benchmarks/results.md``; ``--output -`` prints only) is a
markdown report: date, machine, versions, command line, the tables per model, and a "Targets"
section: fixed bounds checked mechanically (PASS/FAIL; "not measured" when a figure is
missing) against the paired ratios: clipless x twin <= 1.10 on cnn@1024, cnn@4096, mlp@4096
and <= 1.5 on mlp@1024; clipless x floor <= 1.5 on cnn@1024 and cnn@4096; the fastest
tf-privacy configuration's ratio to clipless >= 6 on cnn@1024 and its ratio to
clipless-bjorck4 (the main job's schedule) > 1 on the mlp at every batch size run (its ratio
to clipless with Björck every step is printed under the mlp's paired table); and, from the own-process runs, clipless peak extra memory / floor's <= 1.6 on
cnn@4096.

Usage::

    .venv/bin/python benchmarks/run.py                       # make bench
    .venv/bin/python benchmarks/run.py --quick               # batch 256 and 1024, 4 rounds
    .venv/bin/python benchmarks/run.py --models mlp --batch-sizes 512 --configs clipless
    # (floor and twin always run: they are the references of the ratios)
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import operator
import os
import platform
import resource
import shlex
import statistics
import subprocess
import sys
import time

MODELS = ("cnn", "mlp")
# The configurations whose model sections the models are: the paper's CNN and the main job.
_CONFIG_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")
MODEL_CONFIGS = {"cnn": os.path.join(_CONFIG_DIR, "fashion_mnist_cnn.yaml"),
                 "mlp": os.path.join(_CONFIG_DIR, "fashion_mnist.yaml")}
# Changes to those model sections (--maxiter-bjorck), set by `main`.
MODEL_OVERRIDES = {}
BJORCK_EVERY = 4  # the Björck schedule of the "-bjorck4" configurations
SCHEDULED = f"-bjorck{BJORCK_EVERY}"
CERTIFIED_FLOOR = "certified-floor"
CONFIGS = ("floor", "twin", "clipless", "clipless-per-layer", "ghost", "tf-privacy-model",
           "tf-privacy-vectorized", "twin" + SCHEDULED, "clipless" + SCHEDULED, CERTIFIED_FLOOR)
#: Configurations that only some models run.
ONLY_FOR = {CERTIFIED_FLOOR: ("mlp",)}
TF_PRIVACY = ("tf-privacy-model", "tf-privacy-vectorized")
PIECES = ("forward+backward", "bound pass", "noise", "optimizer", "projection")
# Timed beside the pieces, not part of the step: would XLA (jit_compile) help?
XLA_PIECE = "forward+backward with XLA (not in the step)"
TF_NOISE_PIECE = "noise with TensorFlow ops (not in the step)"
#: Pieces timed beside the step's, for comparison (the step does not run them).
ASIDE_PIECES = (XLA_PIECE, TF_NOISE_PIECE)
# Paired ratios are taken to these.
REFERENCES = ("floor", "twin", "clipless", "twin" + SCHEDULED, "clipless" + SCHEDULED,
              CERTIFIED_FLOOR)
INPUT_SHAPE = (28, 28, 1)
NB_CLASSES = 10
NB_SAMPLES_TRAIN = 60000
NB_SAMPLES_TEST = 10000
MAX_NORM = 10.0
TAU = 10.0
SIGMA = 1.0
DELTA = 1e-5
CLIP = 1.0
LEARNING_RATE = 1e-3
WARMUP = 2

# How step time and memory grow with the batch size, used to skip hopeless runs.
_SCALING_EXPONENT = {"tf-privacy-vectorized": 2}


# --------------------------------------------------------------------- machine
def _meminfo_mib(key: str) -> float:
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return float("inf")


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux: KiB


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _git(*args) -> str:
    """Output of a git command in this repository ('' when git fails)."""
    try:
        done = subprocess.run(["git", *args], capture_output=True, text=True, timeout=10,
                              cwd=os.path.dirname(os.path.abspath(__file__)))
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return done.stdout.strip() if done.returncode == 0 else ""


def _git_commit() -> str:
    """The commit measured, and the tracked files changed since it (they were measured too)."""
    commit = _git("rev-parse", "--short", "HEAD") or "unknown"
    changed = [path for path in _git("diff", "--name-only", "HEAD").split()
               if path != "benchmarks/results.md"]  # this benchmark's own output
    return commit + (f" with uncommitted changes to {', '.join(changed)}" if changed else "")


# ------------------------------------------------------------------ the models
def _data(batch):
    import numpy as np
    import tensorflow as tf

    rng = np.random.default_rng(0)
    x = tf.constant(rng.uniform(size=(batch,) + INPUT_SHAPE), tf.float32)
    y = tf.one_hot(rng.integers(0, NB_CLASSES, batch), NB_CLASSES)
    return x, y


def _probe(tensors):
    """A scalar depending on every tensor (of known, non-empty shape; lipdp's ledger rows
    are written when the step is traced): reading it back ends a timed call."""
    import tensorflow as tf

    return tf.add_n([tf.cast(tf.reshape(t, [-1])[0], tf.float32) for t in tensors
                     if t.shape.is_fully_defined() and t.shape.num_elements()])


def _dp_model(model_name, batch, config):
    from lipdp.config import build_model, load_config
    from lipdp.metadata import DatasetMetadata, DPParameters

    model_cfg = load_config(MODEL_CONFIGS[model_name])["model"]
    model_cfg.update(MODEL_OVERRIDES)
    metadata = DatasetMetadata(input_shape=INPUT_SHAPE, nb_classes=NB_CLASSES,
                               nb_samples_train=NB_SAMPLES_TRAIN,
                               nb_samples_test=NB_SAMPLES_TEST, batch_size=batch,
                               max_norm=MAX_NORM, sampling="shuffle")
    if config == "ghost":
        params = DPParameters(SIGMA, DELTA, mode="clipped", clipping="flat", l2_norm_clip=CLIP,
                              engine="ghost")
    else:
        params = DPParameters(SIGMA, DELTA, noisify_strategy=(
            "per-layer" if config == "clipless-per-layer" else "global"))
    return build_model(model_cfg, metadata, params)


def _keras_layers(model_name):
    import tensorflow as tf

    layers = tf.keras.layers
    if model_name == "cnn":
        return [layers.Conv2D(32, 3, padding="same", use_bias=False), layers.ReLU(),
                layers.MaxPooling2D(2),
                layers.Conv2D(64, 3, padding="same", use_bias=False), layers.ReLU(),
                layers.MaxPooling2D(2), layers.Flatten(),
                layers.Dense(512, use_bias=False), layers.ReLU(),
                layers.Dense(NB_CLASSES, use_bias=False)]
    return [layers.Flatten(), layers.Dense(1024, use_bias=False), layers.ReLU(),
            layers.Dense(NB_CLASSES, use_bias=False)]


def _keras_model(model_name):
    import tensorflow as tf

    return tf.keras.Sequential([tf.keras.layers.Input(INPUT_SHAPE)] + _keras_layers(model_name))


def _floor(model_name):
    import tensorflow as tf

    model = _keras_model(model_name)
    optimizer = tf.keras.optimizers.Adam(LEARNING_RATE)

    @tf.function
    def step(x, y):
        optimizer.apply_gradients(zip(_floor_gradients(model, x, y), model.trainable_variables))
        return _probe(model.variables)

    return step, model


def _floor_gradients(model, x, y):
    """Gradients of the floor's loss (mean cross-entropy from logits) for its variables."""
    import tensorflow as tf

    with tf.GradientTape() as tape:
        logits = model(x, training=True)
        loss = tf.reduce_mean(tf.keras.losses.categorical_crossentropy(y, logits,
                                                                        from_logits=True))
    return tape.gradient(loss, model.trainable_variables)


def _certified_floor(model_name):
    """The floor's step, noised and its kernels certified as clipless's are (the docstring's
    ``certified-floor``)."""
    import tensorflow as tf

    from lipdp.layers._bjorck import certifying_bjorck
    from lipdp.noise import add_gaussian_noise

    model = _keras_model(model_name)
    for variable in model.trainable_variables:
        variable.assign(tf.keras.initializers.Orthogonal(seed=0)(variable.shape))
    optimizer = tf.keras.optimizers.Adam(LEARNING_RATE)

    @tf.function
    def step(x, y):
        variables = model.trainable_variables
        gradients = add_gaussian_noise(_floor_gradients(model, x, y), [SIGMA] * len(variables))
        optimizer.apply_gradients(zip(gradients, variables))
        certificates = []
        for variable in variables:
            kernel, certificate = certifying_bjorck(variable, eps=1e-3, beta=0.5, maxiter=1)
            variable.assign(kernel)
            certificates.append(certificate)
        return _probe(model.variables + certificates)

    return step, model


def _twin(model_name, batch, bjorck_every=1):
    import tensorflow as tf

    from lipdp.losses import DP_TauCategoricalCrossentropy

    model = _dp_model(model_name, batch, "clipless")
    loss = DP_TauCategoricalCrossentropy(TAU)
    optimizer = tf.keras.optimizers.Adam(LEARNING_RATE)
    steps = tf.Variable(0, dtype=tf.int64, trainable=False)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            value = tf.reduce_mean(loss.call(y, model(x, training=True)))
        optimizer.apply_gradients(zip(tape.gradient(value, model.trainable_variables),
                                      model.trainable_variables))
        model.project(True if bjorck_every == 1 else tf.equal(steps % bjorck_every, 0))
        steps.assign_add(1)
        return _probe(model.variables)

    return step, model


def _as_fit_runs_it(model, call):
    """`call` with numpy's BLAS limited as `DP_Model.make_train_function` limits it around each
    step of ``fit`` when the model's certificates call for it (`lipdp.host_blas`)."""
    from lipdp.host_blas import with_limited_blas_threads

    if not getattr(model, "limits_host_blas", lambda: False)():
        return call
    return with_limited_blas_threads(call)


def _train_step(model):
    """The model's own ``train_step`` under ``tf.function``, as ``fit`` runs it."""
    import tensorflow as tf

    @tf.function
    def step(x, y):
        model.train_step((x, y))
        return _probe(model.variables)

    return _as_fit_runs_it(model, step)


def _lipdp_private(model_name, batch, config):
    import tensorflow as tf

    from lipdp.losses import DP_TauCategoricalCrossentropy

    model = _dp_model(model_name, batch, config)
    model.compile(loss=DP_TauCategoricalCrossentropy(TAU),
                  optimizer=tf.keras.optimizers.Adam(LEARNING_RATE), private_logs_only=True,
                  bjorck_every=_bjorck_every(config))
    return _train_step(model), model


def _tf_privacy_model(model_name):
    import tensorflow as tf
    import tensorflow_privacy
    from tensorflow_privacy.privacy.fast_gradient_clipping.layer_registry import (
        make_default_layer_registry)

    # Built from an InputLayer: tf-privacy decides on fast clipping in the constructor.
    model = tensorflow_privacy.DPSequential(
        l2_norm_clip=CLIP, noise_multiplier=SIGMA, num_microbatches=None, use_xla=False,
        layer_registry=make_default_layer_registry(),
        layers=[tf.keras.layers.InputLayer(INPUT_SHAPE)] + _keras_layers(model_name))
    model.compile(optimizer=tf.keras.optimizers.Adam(LEARNING_RATE),
                  loss=tf.keras.losses.CategoricalCrossentropy(from_logits=True))
    return _train_step(model), model


def _tf_privacy_path(model) -> str:
    if model._enable_fast_peg_computation:  # pylint: disable=protected-access
        return "fast clipping (ghost norms of the registered Dense layers)"
    return ("per-example gradients with tf.vectorized_map (a trainable layer is not in the "
            "default registry)")


def _tf_privacy_vectorized(model_name, batch):
    import tensorflow as tf
    import tensorflow_privacy

    model = _keras_model(model_name)
    optimizer = tensorflow_privacy.VectorizedDPKerasAdamOptimizer(
        l2_norm_clip=CLIP, noise_multiplier=SIGMA, num_microbatches=batch,
        learning_rate=LEARNING_RATE)
    loss = tf.keras.losses.CategoricalCrossentropy(from_logits=True,
                                                   reduction=tf.keras.losses.Reduction.NONE)

    @tf.function
    def step(x, y):
        optimizer.minimize(lambda: loss(y, model(x, training=True)), model.trainable_variables)
        return _probe(model.variables)

    return step, model


def _bjorck_every(config) -> int:
    """The configuration's Björck schedule, and the steps one timed call runs: a whole
    period (one step with Björck, the others without: a median over single steps would
    leave the expensive one out)."""
    return BJORCK_EVERY if config.endswith(SCHEDULED) else 1


def _build(model_name, config, batch):
    """``(step(x, y), model)`` of one configuration; a scheduled one's ``step`` runs a whole
    period (`_bjorck_every`)."""
    step, model = _build_one(model_name, config, batch)
    period = _bjorck_every(config)
    if period == 1:
        return step, model
    return (lambda x, y: [step(x, y) for _ in range(period)][-1]), model


def _build_one(model_name, config, batch):
    if config == "floor":
        return _floor(model_name)
    if config == CERTIFIED_FLOOR:
        return _certified_floor(model_name)
    if config in ("twin", "twin" + SCHEDULED):
        return _twin(model_name, batch, _bjorck_every(config))
    if config == "tf-privacy-model":
        return _tf_privacy_model(model_name)
    if config == "tf-privacy-vectorized":
        return _tf_privacy_vectorized(model_name, batch)
    return _lipdp_private(model_name, batch, config)


def _breakdown_pieces(model, x, y) -> dict:
    """Zero-argument timed calls of the pieces of the clipless step, on its model, and the
    untimed preparations some of them need before each call."""
    import tensorflow as tf

    from lipdp import noise as lipdp_noise

    variables = model.trainable_variables
    sensitivities = model.sensitivities()
    noisy_gradients = []

    @tf.function
    def private_gradients(x, y):
        return model.private_gradients(x, y)[1]

    def fresh_noisy_gradients():
        # The optimizer piece applies a new noisy gradient each time, as training does: a fixed
        # one would drift the weights the same way every round, and the projection piece after
        # it would then take more Björck iterations than in the step.
        noisy_gradients[:] = private_gradients(x, y)

    @tf.function
    def forward_backward(x, y):
        return _probe(tf.nest.flatten(model._averaged_gradients(x, y)))  # pylint: disable=W0212

    @tf.function
    def bound_pass():
        return _probe(model.sensitivities())

    @tf.function
    def noise(sensitivities):
        stddevs = model._noise_stddevs(sensitivities)  # pylint: disable=protected-access
        return _probe(lipdp_noise.add_gaussian_noise(variables, stddevs, non_finite_messages=[
            v.name for v in variables]))

    @tf.function
    def tf_noise(sensitivities):
        # What the step did before the fused kernel: check_numerics, then the TF-ops draw.
        stddevs = model._noise_stddevs(sensitivities)  # pylint: disable=protected-access
        return _probe([lipdp_noise._noised_by_tf_ops(v, s, v.name)  # pylint: disable=W0212
                       for v, s in zip(variables, stddevs)])

    @tf.function
    def optimizer(gradients):
        model.optimizer.apply_gradients(zip(gradients, variables))
        return _probe(model.variables)

    @tf.function
    def projection():
        model.project()
        return _probe(model.variables)

    forward_backward_xla = tf.function(forward_backward.python_function, jit_compile=True)
    fresh_noisy_gradients()
    calls = {"forward+backward": lambda: forward_backward(x, y),
             "bound pass": _as_fit_runs_it(model, bound_pass),
             "noise": lambda: noise(sensitivities), "optimizer": lambda: optimizer(noisy_gradients),
             "projection": projection, XLA_PIECE: lambda: forward_backward_xla(x, y),
             TF_NOISE_PIECE: lambda: tf_noise(sensitivities)}
    return calls, {"optimizer": fresh_noisy_gradients}


# --------------------------------------------------------------------- workers
def _timed(call) -> float:
    start = time.perf_counter()
    call().numpy()
    return time.perf_counter() - start


def _warm_up(call, budget, prepare=None) -> float:
    """Tracing, then up to WARMUP steps within the budget; returns the seconds after tracing.
    ``prepare`` (untimed) runs before each call."""
    prepare = prepare or (lambda: None)
    prepare()
    call().numpy()
    spent = 0.0
    for _ in range(WARMUP):
        if spent > budget:
            break
        prepare()
        spent += _timed(call)
    return spent


def paired_worker(model_name, batch, configs, rounds, budget, breakdown=True) -> dict:
    """Runs in a fresh process: every configuration (and, with `breakdown`, the pieces of the
    clipless step), alternating rounds."""
    import tensorflow as tf

    tf.keras.utils.set_random_seed(0)
    x, y = _data(batch)
    calls, spent, results, notes, prepare = {}, {}, {}, {}, {}
    for config in configs:
        before = _rss_mib()
        step, model = _build(model_name, config, batch)
        calls[config] = lambda step=step: step(x, y)
        spent[config] = _warm_up(calls[config], budget)
        results[config] = {"warmup_mib": _rss_mib() - before}
        if config == "tf-privacy-model":
            notes[config] = _tf_privacy_path(model)
        if config == "clipless" and breakdown:
            # The pieces get a model of their own: their optimizer piece moves the weights
            # without projecting them, which must not reach the clipless step's bound pass.
            piece_model = _build(model_name, config, batch)[1]
            piece_calls, prepare = _breakdown_pieces(piece_model, x, y)
            for piece, call in piece_calls.items():
                calls[piece] = call
                spent[piece] = _warm_up(call, budget, prepare.get(piece))
    pieces = [name for name in calls if name in PIECES or name in ASIDE_PIECES]
    times = {name: [] for name in calls}  # per round, None once the budget is spent
    whole_steps = [name for name in calls if name not in pieces]
    for round_index in range(rounds):
        # The pieces always run in step order: their bound pass, like the step's, sees weights
        # that the last projection left (the near-orthogonal certificate's case).
        order = (whole_steps if round_index % 2 == 0 else list(reversed(whole_steps))) + pieces
        for name in order:
            if times[name] and spent[name] > budget:
                times[name].append(None)
                continue
            if name in prepare:
                prepare[name]()
            elapsed = _timed(calls[name])
            times[name].append(elapsed / _bjorck_every(name))
            spent[name] += elapsed
    piece_figures = {}
    for name, series in times.items():
        figures = _summary(series, times)
        if name in results:
            results[name].update(figures)
        else:
            piece_figures[name] = figures
    return {"configs": results, "pieces": piece_figures, "notes": notes}


def _summary(series, times) -> dict:
    """Median step time, rounds run, and medians of the per-round ratios to the references."""
    ran = [t for t in series if t is not None]
    ratios = {ref: statistics.median([t / r for t, r in zip(series, times[ref])
                                      if t is not None and r is not None])
              for ref in REFERENCES if ref in times}
    return {"step_s": statistics.median(ran), "rounds": len(ran), "ratio_to": ratios}


def isolated_worker(model_name, config, batch, steps, budget) -> dict:
    """Runs in a fresh process: build, baseline memory, warm-up, timed steps."""
    import tensorflow as tf

    tf.keras.utils.set_random_seed(0)
    x, y = _data(batch)
    step, _ = _build(model_name, config, batch)
    baseline = _rss_mib()
    spent = _warm_up(lambda: step(x, y), budget)
    times = []
    while len(times) < steps and (not times or spent < budget):
        elapsed = _timed(lambda: step(x, y))
        times.append(elapsed / _bjorck_every(config))
        spent += elapsed
    return {"step_s": statistics.median(times), "peak_mib": _rss_mib() - baseline,
            "steps": len(times)}


def _run_worker(worker_args, args, timeout) -> dict:
    command = [sys.executable, os.path.abspath(__file__), "--worker", *worker_args,
               "--rounds", str(args.rounds), "--budget", str(args.budget)]
    if args.maxiter_bjorck is not None:
        command += ["--maxiter-bjorck", str(args.maxiter_bjorck)]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    try:
        done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out (> {timeout:.0f} s)"}
    if done.returncode < 0:
        return {"error": f"killed by signal {-done.returncode}"
                         + (" (out of memory)" if done.returncode == -9 else "")}
    if done.returncode != 0:
        lines = (done.stderr or done.stdout).strip().splitlines() or ["no output"]
        # TensorFlow ends with the op's name; the reason (e.g. OOM) stands a few lines above.
        reason = next((line for line in reversed(lines) if "OOM" in line or "Error" in line),
                      lines[-1])
        return {"error": f"failed: {reason.strip()[:160]}".replace("|", "/")}
    return json.loads(done.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------ scheduling
def _skip_reason(config, batch, previous, args):
    """Why not to run ``config`` at ``batch``, from its last measurement; None to run it."""
    if previous is None:
        return None
    if "error" in previous:
        return f"not run: see batch {previous['batch']}"
    growth = (batch / previous["batch"]) ** _SCALING_EXPONENT.get(config, 1)
    seconds, mib = previous["step_s"] * growth, previous["peak_mib"] * growth
    if seconds > args.timeout / 3:
        return f"not run: ~{seconds:.0f} s/step extrapolated from batch {previous['batch']}"
    available = _meminfo_mib("MemAvailable")
    if mib > 0.8 * available:
        return (f"not run: ~{mib / 1024:.1f} GiB extrapolated from batch {previous['batch']}, "
                f"{available / 1024:.1f} GiB available")
    return None


def _remember(last, config, batch, result, peak_key):
    """Keeps the measurement later batch sizes extrapolate from (or the first failure)."""
    if "error" in last.get(config, {}):
        return
    last[config] = ({"batch": batch, "error": result["error"]} if "error" in result else
                    {"batch": batch, "step_s": result["step_s"], "peak_mib": result[peak_key]})


def _measure_batch(model_name, batch, configs, last, args):
    """Own-process runs (unless --no-isolated), then the paired run, of one batch size."""
    isolated, skipped = {}, {}
    for config in configs:
        reason = (f"not run: {', '.join(ONLY_FOR[config])} only"
                  if model_name not in ONLY_FOR.get(config, (model_name,))
                  else _skip_reason(config, batch, last.get(config), args))
        if reason is None and not args.no_isolated:
            isolated[config] = _run_worker(["isolated", model_name, str(batch), config], args,
                                           args.timeout)
            _print_progress(model_name, batch, config, "own process", isolated[config])
            _remember(last, config, batch, isolated[config], "peak_mib")
            if "error" in isolated[config]:
                skipped[config] = {"error": "not run: failed in its own process"}
        elif reason is not None:
            isolated[config] = skipped[config] = {"error": reason}
            _remember(last, config, batch, skipped[config], "peak_mib")
            print(f"{model_name} batch {batch:5d}  {config:22s} {reason}", flush=True)
    to_pair = [config for config in configs if config not in skipped]
    print(f"{model_name} batch {batch:5d}: paired rounds of {', '.join(to_pair) or 'nothing'}",
          flush=True)
    paired = _run_paired(model_name, batch, to_pair, args)
    paired["configs"].update(skipped)
    for config in to_pair:
        _print_progress(model_name, batch, config, "paired", paired["configs"][config])
        if args.no_isolated:
            _remember(last, config, batch, paired["configs"][config], "warmup_mib")
    return isolated, paired


def _run_paired(model_name, batch, configs, args) -> dict:
    """The paired rounds of `configs`: tensorflow-privacy's configurations in a process of
    their own, with the references (floor, twin, clipless, on the mlp clipless-bjorck4, the
    probe) again; lipdp's in another."""
    tf_privacy = [c for c in configs if c in TF_PRIVACY]
    lipdp_configs = [c for c in configs if c not in TF_PRIVACY]
    result = _run_paired_process(model_name, batch, lipdp_configs, args, "paired")
    if tf_privacy:
        # On the mlp the main job's schedule too (its target's ratio).
        scheduled = ("clipless" + SCHEDULED,) if model_name == "mlp" else ()
        references = [c for c in ("floor", "twin", "clipless") + scheduled + (CERTIFIED_FLOOR,)
                      if c in lipdp_configs]
        other = _run_paired_process(model_name, batch, references + tf_privacy, args,
                                    "paired-no-pieces")
        result["configs"].update({c: other["configs"][c] for c in tf_privacy})
        result["notes"].update(other["notes"])
    return result


def _run_paired_process(model_name, batch, configs, args, kind) -> dict:
    if not configs:
        return {"configs": {}, "pieces": {}, "notes": {}}
    result = _run_worker([kind, model_name, str(batch)] + configs, args,
                         args.timeout * len(configs))
    if "error" in result:
        return {"configs": {c: {"error": result["error"]} for c in configs}, "pieces": {},
                "notes": {}}
    return result


def _print_progress(model_name, batch, config, kind, result):
    if "error" in result:
        shown = result["error"]
    elif kind == "paired":
        ratios = ", ".join(f"x {ref} {value:.2f}" for ref, value in result["ratio_to"].items()
                           if ref != "clipless")
        shown = f"{result['step_s'] * 1e3:.1f} ms/step ({ratios})"
    else:
        shown = f"{result['step_s'] * 1e3:.1f} ms/step, +{result['peak_mib']:.0f} MiB"
    print(f"{model_name} batch {batch:5d}  {config:22s} {kind}: {shown}", flush=True)


# --------------------------------------------------------------------- report
def _ms(seconds) -> str:
    return f"{seconds * 1e3:.1f}"


def _ratio(result, ref) -> str:
    value = result.get("ratio_to", {}).get(ref)
    return "-" if value is None else f"{value:.2f}"


def _fastest_tf_privacy(paired_configs):
    """``(config, result)`` of the fastest tf-privacy configuration that ran, or None."""
    ran = [(c, paired_configs[c]) for c in TF_PRIVACY
           if "step_s" in paired_configs.get(c, {})]
    return min(ran, key=lambda item: item[1]["step_s"]) if ran else None


def _paired_table(model_name, batch_sizes, configs, paired) -> str:
    lines = ["| batch | configuration | step (ms) | x floor | x twin | rounds |",
             "|---|---|---|---|---|---|"]
    for batch in batch_sizes:
        results = paired[(model_name, batch)]["configs"]
        for config in configs:
            r = results[config]
            if "error" in r:
                lines.append(f"| {batch} | {config} | {r['error'][:120]} | | | |")
            else:
                lines.append(f"| {batch} | {config} | {_ms(r['step_s'])} | {_ratio(r, 'floor')} "
                             f"| {_ratio(r, 'twin')} | {r['rounds']} |")
        fastest = _fastest_tf_privacy(results)
        if fastest:
            config, r = fastest
            lines.append(f"| {batch} | tf-privacy fastest ({config}) | {_ms(r['step_s'])} | "
                         f"{_ratio(r, 'floor')} | {_ratio(r, 'twin')} | {r['rounds']} |")
    notes = {(c, note) for batch in batch_sizes
             for c, note in paired[(model_name, batch)]["notes"].items()}
    scheduled = [f"{batch}: {_ratio(r, 'twin' + SCHEDULED)}" for batch in batch_sizes
                 for r in [paired[(model_name, batch)]["configs"].get("clipless" + SCHEDULED, {})]
                 if "ratio_to" in r and "twin" + SCHEDULED in r["ratio_to"]]
    if scheduled:
        notes.add((f"clipless{SCHEDULED} x twin{SCHEDULED} (same schedule), by batch",
                   ", ".join(scheduled)))
    def tf_privacy_ratios(ref):
        """``"batch: ratio"`` of the fastest tf-privacy step to `ref`'s, where both ran."""
        return [f"{batch}: {_ratio(fastest[1], ref)}" for batch in batch_sizes
                for fastest in [_fastest_tf_privacy(paired[(model_name, batch)]["configs"])]
                if fastest and ref in fastest[1].get("ratio_to", {})]

    under_probe = tf_privacy_ratios(CERTIFIED_FLOOR)
    every_step = tf_privacy_ratios("clipless")
    if every_step:
        notes.add(("tf-privacy fastest / clipless (Björck every step, paired), by batch",
                   ", ".join(every_step)))
    if under_probe:
        notes.add((f"tf-privacy fastest / {CERTIFIED_FLOOR} (its step over the probe's, paired), "
                   "by batch", ", ".join(under_probe)))
    return "\n".join(lines + [""] + [f"{c} path: {note}." for c, note in sorted(notes)])


def _isolated_table(model_name, batch_sizes, configs, isolated) -> str:
    lines = ["| batch | configuration | step (ms) | peak extra RSS (MiB) | x floor memory "
             "| timed steps |", "|---|---|---|---|---|---|"]
    for batch in batch_sizes:
        floor = isolated.get((model_name, "floor", batch), {})
        for config in configs:
            r = isolated[(model_name, config, batch)]
            if "error" in r:
                lines.append(f"| {batch} | {config} | {r['error'][:120]} | | | |")
                continue
            memory = (f"{r['peak_mib'] / floor['peak_mib']:.2f}"
                      if floor.get("peak_mib", 0) > 0 else "-")
            lines.append(f"| {batch} | {config} | {_ms(r['step_s'])} | {r['peak_mib']:.0f} | "
                         f"{memory} | {r['steps']} |")
    return "\n".join(lines)


def _breakdown_table(model_name, batch_sizes, paired) -> str:
    lines = ["| batch | piece | ms | % of whole step |", "|---|---|---|---|"]
    for batch in batch_sizes:
        pieces = paired[(model_name, batch)]["pieces"]
        whole = paired[(model_name, batch)]["configs"].get("clipless", {}).get("step_s")
        if whole is None or not pieces:
            lines.append(f"| {batch} | clipless not measured | | |")
            continue
        rows = [(piece, pieces[piece]["step_s"]) for piece in PIECES]
        rows += [("unaccounted", whole - sum(t for _, t in rows)), ("whole step", whole)]
        rows += [(piece, pieces[piece]["step_s"]) for piece in ASIDE_PIECES if piece in pieces]
        lines += [f"| {batch} | {piece} | {_ms(t)} | {100 * t / whole:.0f}% |"
                  for piece, t in rows]
    return "\n".join(lines)


_OPS = {"<=": operator.le, ">=": operator.ge, ">": operator.gt}


def _targets(paired, isolated, batch_sizes):
    """``(what, value or None, op, bound)``: fixed bounds on the measured ratios."""

    def paired_ratio(model_name, batch, ref):
        result = paired.get((model_name, batch), {}).get("configs", {}).get("clipless", {})
        return result.get("ratio_to", {}).get(ref)

    def tf_privacy_over_clipless(model_name, batch, clipless="clipless"):
        results = paired.get((model_name, batch), {}).get("configs", {})
        fastest = _fastest_tf_privacy(results)
        return fastest[1]["ratio_to"].get(clipless) if fastest else None

    def memory_ratio(model_name, batch):
        clipless = isolated.get((model_name, "clipless", batch), {}).get("peak_mib")
        floor = isolated.get((model_name, "floor", batch), {}).get("peak_mib")
        return clipless / floor if clipless is not None and floor else None

    targets = [(f"clipless x twin, {m}@{b}", paired_ratio(m, b, "twin"), "<=", 1.10)
               for m, b in (("cnn", 1024), ("cnn", 4096), ("mlp", 4096))]
    targets.append(("clipless x twin, mlp@1024", paired_ratio("mlp", 1024, "twin"), "<=", 1.5))
    targets += [(f"clipless x floor, cnn@{b}", paired_ratio("cnn", b, "floor"), "<=", 1.5)
                for b in (1024, 4096)]
    targets.append(("tf-privacy fastest / clipless, cnn@1024",
                    tf_privacy_over_clipless("cnn", 1024), ">=", 6.0))
    # The MLP as the main job trains it: a bounded activation behind its first kernel and
    # Björck every BJORCK_EVERY steps (configs/fashion_mnist.yaml); with Björck every step, the
    # paired table's notes give the ratio.
    targets += [(f"tf-privacy fastest / clipless{SCHEDULED} (the main job's schedule), mlp@{b}",
                 tf_privacy_over_clipless("mlp", b, "clipless" + SCHEDULED), ">", 1.0)
                for b in batch_sizes]
    targets.append(("clipless peak memory / floor peak memory (own process), cnn@4096",
                    memory_ratio("cnn", 4096), "<=", 1.6))
    return targets


def _targets_table(targets) -> str:
    lines = ["| target | measured | bound | verdict |", "|---|---|---|---|"]
    for what, value, op, bound in targets:
        verdict = "not measured" if value is None else (
            "PASS" if _OPS[op](value, bound) else "FAIL")
        shown = "-" if value is None else f"{value:.2f}"
        lines.append(f"| {what} | {shown} | {op} {bound:g} | {verdict} |")
    return "\n".join(lines)


def _kernel_status() -> str:
    """Whether the DP layers ran lipdp's fused kernels (the subprocesses load the same cached
    library, or fall back the same way)."""
    from lipdp import kernels

    return kernels.status()


def _header(elapsed) -> str:
    versions = ", ".join(f"{name} {_version(package)}" for name, package in (
        ("TensorFlow", "tensorflow"), ("deel-lip", "deel-lip"),
        ("tensorflow-privacy", "tensorflow-privacy"), ("numpy", "numpy")))
    command = shlex.join([sys.executable] + sys.argv)
    return "\n".join([
        "# Speed benchmark: Clipless DP-SGD", "",
        f"- date: {datetime.datetime.now().isoformat(timespec='seconds')}",
        f"- machine: {_cpu_model()}, {os.cpu_count()} cores, "
        f"{_meminfo_mib('MemTotal') / 1024:.1f} GiB memory",
        f"- versions: Python {platform.python_version()}, {versions}; lipdp commit "
        f"{_git_commit()}",
        f"- command: `{command}`",
        f"- lipdp's fused GroupSort2 / L2-norm pooling / noise kernels (`lipdp.kernels`): "
        f"{_kernel_status()}",
        f"- total wall time: {elapsed:.0f} s", "",
        "What each configuration is and how time and memory are measured: the docstring of "
        "`benchmarks/run.py`. The paired figures are the primary ones (medians of per-round "
        "ratios within one process).",
    ])


def _report(args, batch_sizes, configs, isolated, paired, elapsed) -> str:
    sections = [_header(elapsed)]
    for model_name in args.models:
        sections += [f"## {model_name}: paired in one process ({args.rounds} rounds)",
                     _paired_table(model_name, batch_sizes, configs, paired)]
        if not args.no_isolated:
            sections += [f"## {model_name}: each configuration in its own process",
                         _isolated_table(model_name, batch_sizes, configs, isolated)]
        sections += [f"## {model_name}: breakdown of the clipless step (paired rounds)",
                     _breakdown_table(model_name, batch_sizes, paired)]
    sections += ["## Targets", _targets_table(_targets(paired, isolated, batch_sizes))]
    return "\n\n".join(sections) + "\n"


# ------------------------------------------------------------------------ main
def _parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=None,
                        help="default 256 1024 4096 (--quick: 256 1024)")
    parser.add_argument("--configs", nargs="+", choices=CONFIGS, default=list(CONFIGS),
                        help="floor and twin are always run (the ratios' references)")
    parser.add_argument("--rounds", type=int, default=None,
                        help="paired rounds, and timed steps in an own process (default 8; "
                             "--quick: 4)")
    parser.add_argument("--quick", action="store_true", help="batch 256 and 1024, 4 rounds")
    parser.add_argument("--output", default=os.path.join(os.path.dirname(
        os.path.abspath(__file__)), "results.md"), help="markdown report; '-': print only")
    parser.add_argument("--no-isolated", action="store_true",
                        help="skip the own-process runs (time and memory of each configuration)")
    parser.add_argument("--budget", type=float, default=30.0,
                        help="seconds of steps after tracing before a configuration stops early")
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="seconds allowed to a subprocess per configuration it runs")
    parser.add_argument("--maxiter-bjorck", type=int, default=None,
                        help="Björck iterations per projection of both models, instead of "
                             "their configs' (mlp: 1; cnn: deel-lip's loop, up to 15)")
    parser.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.rounds = args.rounds if args.rounds is not None else (4 if args.quick else 8)
    return args


def main(argv=None) -> int:
    args = _parse_args(argv)
    if args.maxiter_bjorck is not None:
        MODEL_OVERRIDES["maxiter_bjorck"] = args.maxiter_bjorck
    if args.worker:
        kind, model_name, batch, *configs = args.worker
        if kind in ("paired", "paired-no-pieces"):
            result = paired_worker(model_name, int(batch), configs, args.rounds, args.budget,
                                   breakdown=kind == "paired")
        else:
            result = isolated_worker(model_name, configs[0], int(batch), args.rounds,
                                     args.budget)
        print(json.dumps(result))
        return 0
    batch_sizes = args.batch_sizes or ([256, 1024] if args.quick else [256, 1024, 4096])
    configs = [c for c in CONFIGS if c in ("floor", "twin") or c in args.configs]
    start = time.perf_counter()
    isolated, paired = {}, {}
    for model_name in args.models:
        last = {}
        for batch in batch_sizes:
            batch_isolated, paired[(model_name, batch)] = _measure_batch(
                model_name, batch, configs, last, args)
            isolated.update({(model_name, c, batch): r for c, r in batch_isolated.items()})
    report = _report(args, batch_sizes, configs, isolated, paired, time.perf_counter() - start)
    print("\n" + report)
    if args.output != "-":
        with open(args.output, "w") as out:
            out.write(report)
        print(f"written to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
