"""`lipdp.noise`: the private step's Gaussian noise (Box–Muller of TF uniforms), in TF ops
(`standard_normal`, `gaussian_noise`) and added by the fused kernel (`add_gaussian_noise`).

The fused kernel against independent computations: TensorFlow's own ``tf.random.uniform``
with the same seeds (its uniforms, bit for bit: the same Philox stream, the same
reservation), float64 numpy on every one of the transform's 2^23 inputs, then the same
statistical tests as the TF-ops noise.

Against independent computations: scipy's normal CDF (Kolmogorov–Smirnov), exact chi-square
and normal quantiles for the std and mean (`tests._stats`), binomial tails for P(|z| > 3),
and the correlation of the two halves of a draw (the cos and sin outputs of the same
uniforms). Seeded, so each test's outcome is fixed; the thresholds are those of tests with
a false-failure rate of 1e-6 had the draws been fresh."""

import math
import warnings
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf
from scipy import stats

from lipdp import kernels
from lipdp.data import ShuffleSamplingWarning
from lipdp.noise import (SeededNoiseWarning, add_gaussian_noise, drawing_at_step, gaussian_noise,
                         salted_seeds, standard_normal)
from tests._models import weights_of_the_run
from tests._stats import assert_gaussian_noise

N = 2_000_001  # odd: the last Box–Muller pair is cut


def _draw(dtype=tf.float32, n=N, seed=7):
    tf.random.set_seed(seed)
    return tf.function(lambda: standard_normal(n, dtype))().numpy().astype(np.float64)


@pytest.mark.parametrize("dtype", [tf.float32, tf.float64])
def test_draw_is_standard_normal(dtype):
    z = _draw(dtype)
    assert z.shape == (N,) and np.all(np.isfinite(z))
    assert_gaussian_noise(z, 1.0, f"standard_normal {dtype.name}")
    # Kolmogorov-Smirnov against the exact normal CDF: sup |F_n - Phi| at level 1e-6 is
    # about 2.7 / sqrt(n) (0.0019 here); a std off by 1% gives about 0.0024.
    assert stats.kstest(z, "norm").statistic < stats.kstwo.isf(1e-6, N)
    # Tails: P(|z| > 3) = 0.0027; the count is binomial.
    p = 2 * stats.norm.sf(3.0)
    count = int(np.sum(np.abs(z) > 3.0))
    low, high = stats.binom.ppf(5e-7, N, p), stats.binom.isf(5e-7, N, p)
    assert low <= count <= high, (count, low, high)


def test_the_two_outputs_of_a_pair_are_uncorrelated():
    """Box–Muller's cos and sin outputs (first and second half of a draw) share their
    uniforms: they are independent only if the transform is right. Their correlation, and
    that of their squares (dependent radii), stay within the null's 1e-6 band."""
    z = _draw(n=N - 1)
    _assert_pair_outputs_uncorrelated(z[: (N - 1) // 2], z[(N - 1) // 2:])


def _assert_pair_outputs_uncorrelated(a, b):
    """The correlation of the cos outputs `a` and the sin outputs `b` of the same pairs, and
    that of their squares (dependent radii), within the null's 1e-6 band."""
    band = stats.norm.isf(5e-7) / math.sqrt(a.size)
    assert abs(np.corrcoef(a, b)[0, 1]) < band
    assert abs(np.corrcoef(a * a, b * b)[0, 1]) < band


def test_consecutive_draws_differ_and_seeds_repeat():
    tf.random.set_seed(3)
    draw = tf.function(lambda: standard_normal(1000))
    first, second = draw().numpy(), draw().numpy()
    assert not np.array_equal(first, second)
    tf.random.set_seed(3)
    draw = tf.function(lambda: standard_normal(1000))
    np.testing.assert_array_equal(draw().numpy(), first)


def _values_shared(a, b):
    """How many values of `a` also occur in `b`.

    Independent float32 normals coincide by chance: two draws of 2000 share 0.06 values on
    average (measured over 300 unseeded pairs; 5.7% of pairs share one or two), so a check of
    independence allows a few. Reused counters would share every value of the overlap.
    """
    return int(np.count_nonzero(np.isin(a, b)))


def test_noise_takes_each_tensors_shape_dtype_and_std():
    like = [tf.zeros([300, 200]), tf.zeros([7]), tf.zeros([0, 3]), tf.zeros([], tf.float32),
            tf.zeros([400, 250], tf.float64)]
    stds = [2.0, tf.constant(0.5), 1.0, 3.0, tf.constant(0.25, tf.float64)]
    tf.random.set_seed(11)
    noise = tf.function(lambda: gaussian_noise(like, stds))()
    for n, t in zip(noise, like):
        assert n.shape == t.shape and n.dtype == t.dtype
    assert_gaussian_noise(noise[0].numpy(), 2.0, "300x200, std 2", nb_tests=2)
    assert_gaussian_noise(noise[4].numpy(), 0.25, "400x250 float64, std 0.25", nb_tests=2)
    # Each tensor has a draw of its own (no value of one repeats in another).
    assert _values_shared(noise[1].numpy() / 0.5, noise[0].numpy() / 2.0) <= 4


def test_dynamic_shapes_in_a_graph():
    @tf.function(input_signature=[tf.TensorSpec([None, 5]), tf.TensorSpec([None])])
    def draw(a, b):
        return gaussian_noise([a, b], [1.0, 1.0])

    a, b = draw(tf.zeros([4, 5]), tf.zeros([3]))
    assert a.shape == (4, 5) and b.shape == (3,)
    a, b = draw(tf.zeros([0, 5]), tf.zeros([0]))
    assert a.shape == (0, 5) and b.shape == (0,)


needs_kernels = pytest.mark.skipif(kernels.fused_ops() is None,
                                   reason=f"fused kernels unavailable: {kernels.status()}")
UNIT = 2.0 ** -23  # the uniforms' spacing, and float32's relative spacing in [1, 2)


def _fused_draw(x, stddev, seed, seed2):
    """The fused kernel on `x` in a fresh graph (a fresh generator: its first draw)."""
    ops = kernels.fused_ops()
    return tf.function(lambda: ops.lipdp_add_gaussian_noise(
        tf.constant(x, tf.float32), stddev, seed=seed, seed2=seed2))().numpy()


def _transform(bits):
    """``(r, cos, sin)`` of the kernel's Box–Muller functions, on uint32 bits."""
    a, b = (tf.constant(v, tf.uint32) for v in bits)
    return [t.numpy() for t in kernels.fused_ops().lipdp_box_muller(a, b)]


@needs_kernels
@pytest.mark.parametrize("n", [4 * 100_003, 4 * 100_003 - 1, 2])
def test_fused_noise_is_the_box_muller_transform_of_tf_random_uniforms(n):
    """With the seeds ``tf.random.uniform`` gets, the kernel's noise is, bit for bit,
    ``fl(r(u_2k) cos(2 pi u_2k+1))`` and ``fl(r(u_2k) sin(2 pi u_2k+1))`` of that op's
    uniforms: TensorFlow's Philox stream and reservation, split between threads without a
    counter used twice or skipped; and ``x + stddev * z`` rounded as in float32."""
    tf.random.set_seed(20261127)
    seed, seed2 = tf.compat.v1.random.get_seed(5)
    uniforms = tf.function(lambda: tf.random.uniform([n], seed=5))().numpy()
    bits = np.round(uniforms.astype(np.float64) / UNIT).astype(np.uint32)
    np.testing.assert_array_equal(bits.astype(np.float64) * UNIT, uniforms)  # exact
    pairs = n // 2  # a cut last pair's second uniform is not in `uniforms`
    r, cosine, sine = _transform((bits[0:2 * pairs:2], bits[1:2 * pairs:2]))
    expected = np.stack([r * cosine, r * sine], 1).ravel()  # float32 products
    z = _fused_draw(np.zeros(n, np.float32), 1.0, seed, seed2)
    np.testing.assert_array_equal(z[:2 * pairs], expected)
    x = np.random.default_rng(0).normal(size=n).astype(np.float32)
    stddev = np.float32(0.37)
    y = _fused_draw(x, stddev, seed, seed2)
    np.testing.assert_array_equal(y, x + stddev * z)  # fl(x + fl(s z)), float32 throughout


@needs_kernels
def test_box_muller_functions_on_every_input():
    """The radius on all 2^23 uniforms (with the angle 0: cos 1, sin 0 exactly) and the
    cosine and sine on all 2^23 angles, against float64: within 1.2 * 2^-23 relative and
    1.7 * 2^-24 absolute (the kernel's stated accuracy); the largest radius is the TF-ops
    noise's, sqrt(2 * 23 ln 2)."""
    every = np.arange(2 ** 23, dtype=np.uint32)
    r, cosine, sine = _transform((every, np.zeros_like(every)))
    assert np.all(cosine == 1.0) and np.all(sine == 0.0)
    exact = np.sqrt(-2.0 * np.log1p(-(every * UNIT)))
    assert r[0] == 0.0
    assert np.max(np.abs(r[1:] - exact[1:]) / exact[1:]) <= 1.2 * UNIT
    assert abs(float(r.max()) - math.sqrt(2 * 23 * math.log(2))) <= 4 * UNIT
    _, cosine, sine = _transform((np.zeros_like(every), every))
    angle = 2.0 * np.pi * every * UNIT
    assert np.max(np.abs(cosine - np.cos(angle))) <= 1.7 * UNIT / 2
    assert np.max(np.abs(sine - np.sin(angle))) <= 1.7 * UNIT / 2
    assert np.max(np.abs(cosine)) <= 1.0 and np.max(np.abs(sine)) <= 1.0


@needs_kernels
def test_added_noise_is_standard_normal_with_independent_pair_outputs():
    tf.random.set_seed(8)
    like = [tf.zeros([N]), tf.zeros([1000, 700])]
    noisy = tf.function(lambda: add_gaussian_noise(like, [1.0, tf.constant(3.0)]))()
    z = noisy[0].numpy().astype(np.float64)
    assert_gaussian_noise(z, 1.0, "fused, std 1", nb_tests=2)
    assert_gaussian_noise(noisy[1].numpy(), 3.0, "fused, std 3", nb_tests=2)
    # The two outputs of a pair (interleaved here) share their uniforms.
    _assert_pair_outputs_uncorrelated(z[0:N - 1:2], z[1:N - 1:2])
    assert stats.kstest(z, "norm").statistic < stats.kstwo.isf(1e-6, N)


@needs_kernels
def test_added_noise_runs_the_kernel_where_usable_and_falls_back_elsewhere():
    """float32 on the CPU: the kernel; float64 and XLA: TF ops, same shapes and dtypes."""
    like = [tf.zeros([30, 20]), tf.zeros([7]), tf.zeros([0, 3]), tf.zeros([]),
            tf.zeros([400, 250], tf.float64)]
    stds = [2.0, tf.constant(0.5), 1.0, 3.0, tf.constant(0.25, tf.float64)]
    draw = tf.function(lambda: add_gaussian_noise(like, stds))
    kinds = [op.type for op in draw.get_concrete_function().graph.get_operations()]
    assert kinds.count("LipdpAddGaussianNoise") == 4 and "RandomUniform" in kinds
    tf.random.set_seed(12)
    noisy = draw()
    for n, t in zip(noisy, like):
        assert n.shape == t.shape and n.dtype == t.dtype
    assert_gaussian_noise(noisy[4].numpy(), 0.25, "float64 fallback", nb_tests=2)
    counter = tf.Variable(0, dtype=tf.int64)

    @tf.function(jit_compile=True)
    def xla():
        with drawing_at_step(counter):
            return add_gaussian_noise([tf.zeros([300, 200])], [2.0])

    assert "LipdpAddGaussianNoise" not in {
        op.type for op in xla.get_concrete_function().graph.get_operations()}
    assert_gaussian_noise(xla()[0].numpy(), 2.0, "XLA fallback", nb_tests=2)


def _xla_step_draws(seed=None):
    """Two steps' noise (counter 0 then 1) from one trace under XLA, then step 0's again from
    a second trace, with `seed` as the global seed (None: an unseeded program)."""
    tf.keras.utils.set_random_seed(seed) if seed is not None else tf.random.set_seed(None)
    counter = tf.Variable(0, dtype=tf.int64)

    def traced():
        @tf.function(jit_compile=True)
        def draw():
            with drawing_at_step(counter):
                return gaussian_noise([tf.zeros([1000])], [1.0])[0]
        return draw

    draw = traced()
    first = draw().numpy()
    counter.assign_add(1)
    second = draw().numpy()
    counter.assign(0)
    again = traced()().numpy()
    return first, second, again


def test_noise_under_xla_is_drawn_anew_at_each_step_and_in_each_trace():
    """XLA compiles TensorFlow's stateful random ops from their op seeds, (0, 0) in a program
    without a global seed: every process drew the same noise (an audit cancelled it between
    two runs on neighbouring datasets, `test_xla_noise_differs_between_processes`). Under
    XLA the draw is stateless, keyed by 126 bits from the OS at each trace and folded with
    the step counter; a seeded program repeats its draws, as outside XLA."""
    first, second, again = _xla_step_draws()
    assert _values_shared(first, second) <= 4 and _values_shared(first, again) <= 4
    first_seeded, second_seeded, again_seeded = _xla_step_draws(seed=5)
    assert _values_shared(first_seeded, second_seeded) <= 4
    np.testing.assert_array_equal(first_seeded, again_seeded)
    tf.random.set_seed(None)
    with pytest.raises(RuntimeError, match="needs the private step's counter"):
        tf.function(lambda: gaussian_noise([tf.zeros([3])], [1.0]), jit_compile=True)()


XLA_ENGINES = ("ghost", "vectorized")

# One model per engine, each engine's noisy kernel gradient printed on a line of its own.
_XLA_STEP = """
import numpy as np, tensorflow as tf
from lipdp.metadata import DatasetMetadata, DPParameters
from lipdp.model import DP_Sequential
for engine in %r:
    model = DP_Sequential(
        [tf.keras.layers.Input((4,)), tf.keras.layers.Dense(3, kernel_initializer="zeros")],
        dp_parameters=DPParameters(1.0, 1e-5, mode="clipped", clipping="flat",
                                   l2_norm_clip=1.0, engine=engine),
        dataset_metadata=DatasetMetadata((4,), 3, 16, 16, 8, None, "shuffle"))
    model.compile(loss=tf.keras.losses.CategoricalCrossentropy(from_logits=True),
                  optimizer=tf.keras.optimizers.SGD(1.0))
    noisy = tf.function(lambda x, y: model.private_gradients(x, y)[1][0], jit_compile=True)(
        tf.zeros((8, 4)), tf.one_hot([0] * 8, 3))
    print(engine, " ".join(repr(float(v)) for v in noisy.numpy().ravel()))
""" % (XLA_ENGINES,)


@pytest.fixture(scope="module")
def xla_noise_of_two_processes():
    """``{engine: [noise of process 1, noise of process 2]}``: two fresh interpreters, each
    running every engine's step in turn (one interpreter start per process, not per engine)."""
    runs = [subprocess.run([sys.executable, "-c", _XLA_STEP], capture_output=True, text=True,
                           timeout=300, check=True) for _ in range(2)]
    noise = {engine: [] for engine in XLA_ENGINES}
    for run in runs:
        for line in run.stdout.splitlines():
            engine, *values = line.split()
            noise[engine].append(np.array([float(v) for v in values]))
    return noise


@pytest.mark.parametrize("engine", XLA_ENGINES)
def test_xla_noise_differs_between_processes(xla_noise_of_two_processes, engine):
    """Classic DP-SGD's noisy gradients under XLA (a user's jit-compiled function: `fit`
    refuses jit_compile, whose step loses its assertions), no seed anywhere: two processes,
    zero inputs (a zero kernel gradient), so the noisy kernel gradient is the noise. With
    `compile(jit_compile=True)`, when it was allowed, they were equal, bit for bit, before the
    stateless draw."""
    noise = xla_noise_of_two_processes[engine]
    assert len(noise) == 2 and noise[0].shape == (12,)
    assert np.all(noise[0] != 0) and np.all(noise[1] != 0)
    assert _values_shared(noise[0], noise[1]) == 0


@needs_kernels
def test_added_noise_differs_between_draws_and_tensors_and_repeats_under_a_seed():
    def traced():
        return tf.function(lambda: add_gaussian_noise([tf.zeros([1000]), tf.zeros([1000])],
                                                      [1.0, 1.0]))

    tf.random.set_seed(3)
    draw = traced()
    first, second = [np.concatenate([t.numpy() for t in draw()]) for _ in range(2)]
    assert _values_shared(first, second) <= 4  # consecutive draws: fresh counters
    assert _values_shared(first[:1000], first[1000:]) <= 4  # each tensor a draw of its own
    tf.random.set_seed(3)
    np.testing.assert_array_equal(np.concatenate([t.numpy() for t in traced()()]), first)
    tf.random.set_seed(None)  # unseeded: two programs never share their noise
    unseeded = [np.concatenate([t.numpy() for t in traced()()]) for _ in range(2)]
    assert _values_shared(unseeded[0], unseeded[1]) <= 4


@needs_kernels
@pytest.mark.parametrize("shapes", [([4, 5], [3]), ([0, 5], [0])])
def test_added_noise_with_dynamic_shapes_in_a_graph(shapes):
    @tf.function(input_signature=[tf.TensorSpec([None, 5]), tf.TensorSpec([None])])
    def draw(a, b):
        return add_gaussian_noise([a, b], [1.0, 1.0])

    a, b = draw(tf.ones(shapes[0]), tf.ones(shapes[1]))
    assert a.shape == tuple(shapes[0]) and b.shape == tuple(shapes[1])
    assert np.all(a.numpy() != 1.0)


@needs_kernels
@pytest.mark.parametrize("dtype", [tf.float32, tf.float64])  # the kernel, the TF-ops fallback
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_tensors_fail_with_their_message_when_one_is_given(dtype, bad):
    values = np.zeros(1001)
    values[777] = bad
    tensor = tf.constant(values, dtype)
    checked = tf.function(lambda: add_gaussian_noise(
        [tf.zeros([5], dtype), tensor], [1.0, 1.0], non_finite_messages=["first", "second"]))
    with pytest.raises(tf.errors.InvalidArgumentError, match="second"):
        checked()
    unchecked = tf.function(lambda: add_gaussian_noise([tensor], [1.0]))()[0].numpy()
    assert not np.isfinite(unchecked[777]) and np.all(np.isfinite(np.delete(unchecked, 777)))


def _trained_weights(unseed_before_training):
    """A small model built and trained (4 noisy steps) right after
    ``tf.keras.utils.set_random_seed(5)``, optionally unseeded before `fit`: ``(initial
    weights, trained weights, SeededNoiseWarnings of fit, model)``."""
    tf.keras.utils.set_random_seed(5)
    model = _small_model()
    initial = model.get_weights()
    if unseed_before_training:
        tf.random.set_seed(None)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        model.fit(*_small_data(), batch_size=8, epochs=1, verbose=0)
    seeded = [w for w in record if issubclass(w.category, SeededNoiseWarning)]
    return initial, weights_of_the_run(model), seeded, model


def _small_model():
    """A compiled 4-3 clipless model (sigma 1, shuffled batches of 8 of 32 examples)."""
    import lipdp
    from lipdp.layers import DP_BoundedInput, DP_QuickSpectralDense
    from lipdp.losses import DP_TauCategoricalCrossentropy

    model = lipdp.DP_Sequential(
        [DP_BoundedInput(1.0, input_shape=(4,)), DP_QuickSpectralDense(3)],
        dp_parameters=lipdp.DPParameters(noise_multiplier=1.0, delta=1e-5),
        dataset_metadata=lipdp.DatasetMetadata((4,), 3, 32, 8, 8, 1.0, "shuffle"))
    model.compile(loss=DP_TauCategoricalCrossentropy(1.0), optimizer="sgd")
    return model


def _small_data():
    x = np.random.default_rng(0).normal(size=(32, 4)).astype(np.float32)
    return x, np.eye(3, dtype=np.float32)[np.arange(32) % 3]


def test_a_seeded_program_warns_that_its_noise_is_a_function_of_the_seed():
    """After `tf.keras.utils.set_random_seed` (the Keras idiom for reproducible runs) the
    noise of every step is a function of the seed and of the program: a run of the program
    in another process releases the same noisy updates, so whoever knows the seed
    regenerates the noise and subtracts it. `fit` warns (`SeededNoiseWarning`); within one
    process, a run seeded again draws other noise (until 2026-12-07, the same, bit for bit).
    Unseeded before training, as the warning advises, the weights start the same and the
    noise differs, without a warning."""
    first, second = _trained_weights(False), _trained_weights(False)
    for a, b in zip(first[0], second[0]):
        np.testing.assert_array_equal(a, b)  # the same initialisation
    assert any(not np.array_equal(a, b) for a, b in zip(first[1], second[1]))
    assert first[2] and "global random seed is set (5)" in str(first[2][0].message)
    assert "run again with it in another process" in str(first[2][0].message)
    first, second = _trained_weights(True), _trained_weights(True)
    for a, b in zip(first[0], second[0]):
        np.testing.assert_array_equal(a, b)  # the same initialisation
    assert any(not np.array_equal(a, b) for a, b in zip(first[1], second[1]))
    assert not first[2] and not second[2]
    model = _trained_weights(True)[3]
    tf.keras.utils.set_random_seed(6)  # train_on_batch in a seeded program
    x, y = np.zeros((8, 4), np.float32), np.eye(3, dtype=np.float32)[np.arange(8) % 3]
    with pytest.warns(SeededNoiseWarning, match="global random seed is set"):
        model.train_on_batch(x, y)


def _two_models_trained_after_one_seed():
    """The trained variables of two models of one architecture, given the same initial weights
    and trained in turn on the same batches after one ``tf.keras.utils.set_random_seed``."""
    tf.keras.utils.set_random_seed(7)
    models = [_small_model(), _small_model()]
    models[1].set_weights(models[0].get_weights())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SeededNoiseWarning)
        warnings.simplefilter("ignore", ShuffleSamplingWarning)  # fixed batches, on purpose
        for model in models:  # the same batches
            batches = tf.data.Dataset.from_tensor_slices(_small_data()).batch(8)
            model.fit(batches, epochs=1, verbose=0)
    return [[v.numpy() for v in model.trainable_variables] for model in models]


def test_two_models_of_one_seeded_program_draw_their_own_noise():
    """TensorFlow seeds a traced random op from the global seed and its place in the graph,
    so two models of one architecture traced at the same step after one seeding drew the same
    noise: an audit (2026-12-07) trained them on datasets differing in one record and the
    difference of their releases was the noiseless one (to 5e-5, noise std 0.53). Each trace
    of the process now draws its own (`lipdp.noise.salted_seeds`), also when the program seeds
    again before a run (a sweep or cross-validation seeded run by run)."""
    first, second = _two_models_trained_after_one_seed()
    assert all(not np.array_equal(a, b) for a, b in zip(first, second))
    again = _two_models_trained_after_one_seed()  # the same seed again, the same process
    for a, b in zip(first + second, again[0] + again[1]):
        assert not np.array_equal(a, b)


def _salted_seeds_of_traces(traces):
    """The seeds `salted_seeds` gives for a salt of each step of `traces` (lists of steps,
    each list in a traced function of its own: TensorFlow's own op seed counts the seeds a
    graph took, from 0), in a program seeded 3, counted from a fresh process' first draw."""
    import lipdp.noise

    tf.random.set_seed(3)
    lipdp.noise._forget_salted_draws()
    seeds = []
    for steps in traces:
        def trace(steps=steps):
            seeds.extend(salted_seeds(step) for step in steps)
            return tf.constant(0)

        tf.function(trace)()
    return seeds


def test_every_salted_draw_of_a_process_has_seeds_of_its_own():
    """A salt made of the step and a count of traces, added into the op seed, let two
    traces of one process take the same seeds: a first draw at step 94 489 and, 2999 draws
    later, another graph's first draw at step 0 (a review, 2026-12-07). Each salted draw now
    takes one plus a count of the process' draws from an offset: distinct within a process,
    the same again in a new process (reproducible), and in TensorFlow's range of op seeds,
    never (0, 0) (unseeded)."""
    traces = [[94_489], [7] * 2998, [0], list(range(2000))]
    seeds = _salted_seeds_of_traces(traces)
    assert len(set(seeds)) == sum(len(steps) for steps in traces)
    assert all(seed == 3 and 1 <= seed2 < 2 ** 31 - 1 for seed, seed2 in seeds)
    assert _salted_seeds_of_traces(traces) == seeds
