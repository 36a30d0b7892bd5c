"""tf.distribute checks that need a process of their own.

A strategy's devices must be configured before TensorFlow starts, and a
multi-worker strategy needs one process per worker, so `tests/test_distribute.py`
runs this module in subprocesses:

    python -m tests._distributed mirrored          # 2 logical CPUs, one process
    python -m tests._distributed worker            # one worker of a TF_CONFIG cluster

Each run prints one JSON line (its last line of output) with what it measured.
"""

import json
import os
import sys

import numpy as np
import tensorflow as tf

N_SAMPLER, Q_SAMPLER, STEPS_SAMPLER, SEED_SAMPLER = 200, 0.05, 400, 11


def _two_logical_cpus():
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration(), tf.config.LogicalDeviceConfiguration()])


class RecordingSGD(tf.keras.optimizers.SGD):
    """SGD that keeps the last (aggregated) gradient it applied to each variable, and the
    running sum of its squares over all the steps it applied."""

    def build(self, var_list):
        super().build(var_list)
        if not hasattr(self, "recorded"):
            self.recorded = [tf.Variable(tf.zeros_like(v), trainable=False) for v in var_list]
            self.squares = [tf.Variable(tf.zeros_like(v), trainable=False) for v in var_list]

    def update_step(self, gradient, variable):
        index = self._index_dict[self._var_key(variable)]
        self.recorded[index].assign(gradient)
        self.squares[index].assign_add(tf.square(gradient))
        super().update_step(gradient, variable)


CONFIGS = {
    "clipless-global": dict(noisify_strategy="global"),
    "clipless-per-layer": dict(noisify_strategy="per-layer"),
    "clipped-flat": dict(mode="clipped", clipping="flat", l2_norm_clip=1.0),
    "clipped-per-layer": dict(mode="clipped", clipping="per-layer", l2_norm_clip=1.0),
}


def _model(config, sigma, learning_rate, steps_per_epoch=4):
    return _compiled_mlp(sigma, learning_rate, steps_per_epoch, **CONFIGS[config])


def _compiled_mlp(sigma, learning_rate, steps_per_epoch=4, **parameters):
    """`tests._models.mlp` with DPParameters(sigma, 1e-5, **parameters), RecordingSGD, and
    metadata for `steps_per_epoch` batches of 16 an epoch."""
    from lipdp.losses import DP_TauCategoricalCrossentropy
    from lipdp.metadata import DPParameters
    from tests._models import metadata, mlp

    model = mlp(nb_classes=3, batch=16)
    model.dataset_metadata = metadata((10,), 3, n=16 * steps_per_epoch)
    model.dp_parameters = DPParameters(sigma, 1e-5, **parameters)
    model.compile(optimizer=RecordingSGD(learning_rate), loss=DP_TauCategoricalCrossentropy(1.0))
    return model


def _fit(model, x, y, epochs):
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
    model.fit(ds, epochs=epochs, verbose=0, shuffle=False)


def _expected_stddevs(model, config):
    """Single-device noise std of every variable, from the closed forms of DESIGN.md."""
    sensitivities = [float(s) for s in model.sensitivities()]
    sigma = model.dp_parameters.noise_multiplier
    if config.startswith("clipped"):
        return [sigma * 1.0 / 16 for _ in sensitivities]  # sigma C / D, C = 1, D = 16
    if config == "clipless-global":
        return [sigma * np.sqrt(sum(s * s for s in sensitivities)) for _ in sensitivities]
    return [sigma * s for s in sensitivities]


def _zeros(steps):
    """`steps` batches of 16 all-zero examples: one epoch of the noise runs."""
    n = 16 * steps
    return np.zeros((n, 10), np.float32), tf.one_hot(np.arange(n) % 3, 3).numpy()


NOISE_STEPS = 20


def _noise_statistic(model, config):
    """sum z^2 / n over the kernel coordinates of the gradients applied in one epoch (the
    steps of the model's metadata) on all-zero inputs, z = gradient / (single-device noise
    std). The model's learning rate is 0, so its biases keep their zero initialisation: every
    layer's input is 0, every kernel's gradient is exactly 0, and the applied kernel gradient
    is the noise alone."""
    steps = model.dataset_metadata.steps_per_epoch
    x, y = _zeros(steps)
    stds = _expected_stddevs(model, config)
    _fit(model, x, y, 1)  # one epoch; the optimizer sums the squared gradients
    squares, count = 0.0, 0
    for variable, summed, std in zip(model.trainable_variables, model.optimizer.squares, stds):
        if "kernel" in variable.name:
            squares += float(np.sum(summed.numpy())) / std ** 2
            count += steps * int(np.prod(variable.shape))
    return squares / count, count


def _sampler_pieces(strategy):
    """Per step, the example indices each replica trains on, and the global draws of a
    fresh pipeline with the same seed."""
    from lipdp.data import BatchSampler, _poisson_pipeline
    from lipdp.metadata import Sampling

    def pipeline():
        x = tf.range(N_SAMPLER, dtype=tf.float32)[:, None]
        y = tf.range(N_SAMPLER)
        return _poisson_pipeline(x, y, STEPS_SAMPLER, Q_SAMPLER,
                                 BatchSampler(Sampling.POISSON, SEED_SAMPLER), lambda a, b: (a, b))

    reference = [sorted(b[1].numpy().tolist()) for b in pipeline()]
    pieces = []
    for batch in strategy.experimental_distribute_dataset(pipeline()):
        labels = batch[1]
        values = labels.values if hasattr(labels, "values") else (labels,)
        pieces.append([v.numpy().tolist() for v in values])
    return reference, pieces


def mirrored():
    _two_logical_cpus()
    tf.keras.utils.set_random_seed(0)
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    rng = np.random.RandomState(0)
    x = rng.randn(64, 10).astype(np.float32)
    y = tf.one_hot(rng.randint(0, 3, 64), 3).numpy()
    from tests._models import weights_of_the_run

    results = {}
    for config in CONFIGS:
        single = _model(config, 0.0, 0.5)
        with strategy.scope():
            replicated = _model(config, 0.0, 0.5)
        replicated.set_weights(single.get_weights())
        _fit(single, x, y, 2)
        _fit(replicated, x, y, 2)
        weights_diff = max(float(np.max(np.abs(a - b))) for a, b in
                           zip(weights_of_the_run(single), weights_of_the_run(replicated)))
        gradient_diff = max(float(np.max(np.abs(a.numpy() - b.numpy()))) for a, b in
                            zip(single.optimizer.recorded, replicated.optimizer.recorded))
        single_ratio, n = _noise_statistic(_model(config, 2.0, 0.0, NOISE_STEPS), config)
        with strategy.scope():
            replicated = _model(config, 2.0, 0.0, NOISE_STEPS)
        replicated_ratio, _ = _noise_statistic(replicated, config)
        results[config] = dict(weights_diff=weights_diff, gradient_diff=gradient_diff,
                               single_ratio=single_ratio, replicated_ratio=replicated_ratio, n=n,
                               steps=replicated.dp_steps_taken)
    results["adaptive"] = _adaptive_clipping(strategy, x, y)
    results["oversized"] = _oversized_batches(strategy, x, y)
    reference, pieces = _sampler_pieces(strategy)
    results["sampler"] = dict(reference=reference, pieces=pieces)
    results["warmed_state"] = _warmed_state(strategy)  # last: it seeds, then unseeds
    return results


def _oversized_batches(strategy, x, y):
    """What fit says of global batches of 32 for a model declaring shuffled batches of 16,
    each replica given 16 of them: the check must be of the global batch."""
    with strategy.scope():
        model = _model("clipless-global", 1.0, 0.0)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(32)
    try:
        model.fit(ds, epochs=1, verbose=0, shuffle=False, steps_per_epoch=2)
    except tf.errors.InvalidArgumentError as error:
        return dict(error=error.message, steps=model.dp_steps_taken)
    return dict(error=None, steps=model.dp_steps_taken)


def _warmed_state(strategy):
    """What fit does under the strategy with a layer that writes a record into its state
    from its third call on (`tests.test_state_guard`): the error, the state after, and the
    steps counted."""
    from tests.test_state_guard import CANARY, _model

    with strategy.scope():
        model = _model("ghost")
    x = np.random.RandomState(1).randn(64, 4).astype(np.float32)
    x[:, 1] = CANARY
    try:
        model.fit(x, np.zeros(64, np.int64), batch_size=8, epochs=1, verbose=0)
    except tf.errors.InvalidArgumentError as error:
        return dict(error=error.message, largest=float(model.get_layer("warmed").largest.numpy()),
                    steps=model.dp_steps_taken)
    return dict(error=None, largest=float(model.get_layer("warmed").largest.numpy()),
                steps=model.dp_steps_taken)


def _adaptive_model(clipping, learning_rate, steps_per_epoch=4):
    """No gradient noise (sigma 0): the two runs compared noise-free draw no noise of their
    own (a seeded program's two models draw different noise, `lipdp.noise.salted_seeds`)."""
    from lipdp.metadata import AdaptiveClipping

    return _compiled_mlp(0.0, learning_rate, steps_per_epoch,
                         loss_gradient_clipping=AdaptiveClipping(**clipping))


COUNT_STEPS, COUNT_SIGMA, COUNT_RATE = 100, 2.0, 1e-3


def _count_noise_statistic(model):
    """sum n_t^2 / (sigma_b^2 N) over N steps, n_t the count noise of step t recovered from
    C_t: on 16 all-zero inputs (learning rate 0) every logit gradient has the same norm,
    below C_0 = 10 L, so every bit is 1, the centred sum is 8, and
    ``log(C_{t+1} / C_t) = -eta (1 + n_t / 16 - gamma)``."""
    x, y = _zeros(model.dataset_metadata.steps_per_epoch)
    clips = [float(model._logit_clip.numpy())]
    record = tf.keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: clips.append(float(model._logit_clip.numpy())))
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
    model.fit(ds, epochs=1, verbose=0, shuffle=False, callbacks=[record])
    ratios = np.log(np.asarray(clips[1:], np.float64) / np.asarray(clips[:-1], np.float64))
    noise = 16 * (-ratios / COUNT_RATE - 1 + 0.5)
    return float(np.mean(noise ** 2) / COUNT_SIGMA ** 2)


def _adaptive_clipping(strategy, x, y):
    """Adaptive clipping across replicas: with a negligible count noise, C_t and the weights
    follow the single-device run; with sigma_b = 2, the noise on the summed count has the
    single-device std."""
    from tests._models import weights_of_the_run

    exact = dict(noise_multiplier=1e-9, initial_clip=0.5)
    single = _adaptive_model(exact, 0.5)
    with strategy.scope():
        replicated = _adaptive_model(exact, 0.5)
    replicated.set_weights(single.get_weights())
    _fit(single, x, y, 2)
    _fit(replicated, x, y, 2)
    weights_diff = max(float(np.max(np.abs(a - b))) for a, b in
                       zip(weights_of_the_run(single), weights_of_the_run(replicated)))
    noisy = dict(noise_multiplier=COUNT_SIGMA, initial_clip=10 * np.sqrt(2.0),
                 learning_rate=COUNT_RATE, target_quantile=0.5)
    single_ratio = _count_noise_statistic(_adaptive_model(noisy, 0.0, COUNT_STEPS))
    with strategy.scope():
        replicated_ratio = _count_noise_statistic(_adaptive_model(noisy, 0.0, COUNT_STEPS))
    return dict(clip_single=float(single._logit_clip.numpy()),
                clip_replicated=float(replicated._logit_clip.numpy()),
                weights_diff=weights_diff, count_single_ratio=single_ratio,
                count_replicated_ratio=replicated_ratio, n=COUNT_STEPS)


MODES = ("clipless", "clipped")


def worker():
    """One worker of the cluster: the sampler's pieces, then one model per mode of `MODES`
    trained in turn under the same strategy; ``{mode: results}``."""
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    task = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    reference, pieces = _sampler_pieces(strategy)
    return {mode: dict(task=task, sampler=dict(reference=reference, pieces=pieces),
                       **_worker_training(strategy, mode)) for mode in MODES}


def _worker_training(strategy, mode):
    import lipdp
    from lipdp.layers import DP_BoundedInput, DP_GroupSort, DP_QuickSpectralDense

    results = {}
    unseeded, _, _ = lipdp.data.load_dataset("digits", 128, bound_clip_value=8.0)
    ds_train, _, metadata = lipdp.data.load_dataset("digits", 128, bound_clip_value=8.0, seed=3)
    tf.keras.utils.set_random_seed(0)
    with strategy.scope():
        parameters = (lipdp.DPParameters(2.0, 1e-5) if mode == "clipless" else
                      lipdp.DPParameters(2.0, 1e-5, mode="clipped", l2_norm_clip=1.0))
        model = lipdp.DP_Sequential(
            [DP_BoundedInput(8.0, input_shape=(64,)), DP_QuickSpectralDense(16),
             DP_GroupSort(2), DP_QuickSpectralDense(10)],
            dp_parameters=parameters, dataset_metadata=metadata)
        model.compile(optimizer=tf.keras.optimizers.SGD(0.5),
                      loss=lipdp.losses.DP_TauCategoricalCrossentropy(8.0))
    try:
        model.fit(unseeded, epochs=1, verbose=0)
        results["unseeded_refused"] = None
    except ValueError as error:
        results["unseeded_refused"] = str(error)
    task = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    own_seed, _, _ = lipdp.data.load_dataset("digits", 128, bound_clip_value=8.0, seed=3 + task)
    try:
        model.fit(own_seed, epochs=1, verbose=0)
        results["own_seeds_refused"] = None
    except ValueError as error:
        results["own_seeds_refused"] = str(error)
    other_data, _, _ = lipdp.data.load_dataset(  # same seed, N and D; other examples
        "digits", 128, bound_clip_value=8.0, seed=3,
        feature_map=lambda x, scale=1.0 + task: tf.reshape(x, (-1, 64)) * scale)
    try:
        model.fit(other_data, epochs=1, verbose=0)
        results["other_data_refused"] = None
    except ValueError as error:
        results["other_data_refused"] = str(error)
    model.fit(ds_train, epochs=2, verbose=0, callbacks=[lipdp.DP_Accountant()])
    results.update(weights=[w.tolist() for w in model.get_weights()],
                   ledger=lipdp.ledger.segment_rows(model._dp_ledger.numpy()).tolist(), steps=model.dp_steps_taken,
                   epsilon=lipdp.accounting.epsilon_spent(model),
                   steps_per_epoch=metadata.steps_per_epoch,
                   sampler_next_step=int(ds_train.lipdp_sampler.next_step.numpy()))
    return results


if __name__ == "__main__":
    outcome = {"mirrored": mirrored, "worker": worker}[sys.argv[1]]()
    print(json.dumps(outcome))
