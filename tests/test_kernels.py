"""The fused CPU kernels of lipdp.kernels against the reference layers they replace.

GroupSort2 must be the reference bit for bit (comparisons and copies only), forward and
backward, at ties, signed zeros, infinities and NaNs; L2-norm pooling must be deel-lip's
computation (same order of operations, so the rounding bound of
lipdp.rounding.block_norm_error keeps holding): bit for bit here too, on window sizes whose
division is exact and not. GroupSort2 followed by L2-norm pooling runs as one kernel that
must give the two kernels' values bit for bit. Then: the layers really run the kernels in a
traced step, fall back under XLA, vectorise under tf.vectorized_map without a while loop,
have second-order gradients; and the loader falls back, with a warning, when it cannot
compile.
"""

import contextlib
import io
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import tensorflow as tf
from deel.lip.layers import ScaledL2NormPooling2D

from lipdp import kernels
from lipdp.layers import DP_GroupSort, DP_ScaledL2NormPooling2D
from lipdp.layers._pair_sort import reference_sort_pairs

pytestmark = pytest.mark.skipif(kernels.fused_ops() is None,
                                reason=f"fused kernels unavailable: {kernels.status()}")

SPECIALS = np.array([0.0, -0.0, 1.0, -1.0, np.inf, -np.inf, np.nan, 1e-45, -1e-45, 3.0e38],
                    np.float32)


def _activations(shape, seed):
    """Values drawn from a small set (many exact ties) and from special values."""
    rng = np.random.default_rng(seed)
    values = np.where(rng.uniform(size=shape) < 0.3, rng.choice(SPECIALS, size=shape),
                      np.round(rng.normal(size=shape), 1))
    return tf.constant(values, tf.float32)


def _same(a, b):
    """Bitwise equality of two float32 arrays (NaNs included)."""
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


def _value_and_input_gradient(function, x, cotangent):
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = function(x)
        value = tf.reduce_sum(y * cotangent)
    return y, tape.gradient(value, x)


def _ops_in(function, *args):
    """The op types of `function`'s graph for `args`, its library functions included."""
    graph = function.get_concrete_function(*args).graph
    kinds = {op.type for op in graph.get_operations()}
    for library_function in graph._functions.values():  # pylint: disable=protected-access
        kinds |= {node.op for node in library_function.definition.node_def}
    return kinds


@pytest.mark.parametrize("pairing", ["halves", "interleaved"])
@pytest.mark.parametrize("shape", [(64, 8), (3, 7, 5, 32), (2, 2)])
def test_fused_groupsort2_is_the_reference_bit_for_bit(pairing, shape):
    x = _activations(shape, seed=sum(shape))
    cotangent = tf.random.stateless_normal(shape, seed=(1, len(shape)))
    layer = DP_GroupSort(2, pairing=pairing)
    fused = tf.function(lambda x: _value_and_input_gradient(layer, x, cotangent))
    reference = tf.function(lambda x: _value_and_input_gradient(
        lambda t: reference_sort_pairs(t, pairing), x, cotangent))
    assert "LipdpPairPermute" in _ops_in(fused, x)
    assert "LipdpPairPermute" not in _ops_in(reference, x)
    for got, expected in zip(fused(x), reference(x)):
        assert _same(got, expected)
    if x.shape.num_elements() >= 64:  # the draw has NaNs and tied pairs
        assert np.any(np.isnan(x.numpy()))
        assert np.any(reference_sort_pairs(x, pairing).numpy() == x.numpy())


@pytest.mark.parametrize("pool_size", [2, (2, 4), 3, (2, 3)])
@pytest.mark.parametrize("spatial", [(8, 6), (7, 5)])
def test_fused_l2_norm_pooling_is_deel_lips_computation(pool_size, spatial):
    """Forward bit for bit (what the certified radii's rounding bound is about). Backward
    bit for bit when the window's area is a power of 2; otherwise TensorFlow's own average
    pooling gradient multiplies by a rounded 1/area in its Eigen kernel (the tests run
    without oneDNN, `conftest.py`) and divides in its oneDNN one: within 2 ulps of it.
    (7, 5) leaves rows/columns no window covers; a window of zeros has gradient 0 (not
    NaN), through deel-lip's eps in the square root's derivative."""
    x = tf.random.stateless_normal((3,) + spatial + (6,), seed=(2, 3))
    zero_window = [[0, i, j, c] for i in range(2) for j in range(2) for c in range(6)]
    x = tf.tensor_scatter_nd_update(x, zero_window, tf.zeros(len(zero_window)))
    ours, theirs = DP_ScaledL2NormPooling2D(pool_size), ScaledL2NormPooling2D(pool_size)
    cotangent = tf.random.stateless_normal(ours.compute_output_shape(x.shape), seed=(4, 5))
    fused = tf.function(lambda x: _value_and_input_gradient(ours, x, cotangent))
    reference = tf.function(lambda x: _value_and_input_gradient(theirs, x, cotangent))
    assert {"LipdpL2NormPool", "LipdpL2NormPoolGrad"} <= _ops_in(fused, x)
    (y, dx), (y_ref, dx_ref) = fused(x), reference(x)
    assert _same(y, y_ref)
    if np.prod(ours.pool_size) in (2, 4, 8):
        assert _same(dx, dx_ref)
    else:
        np.testing.assert_allclose(dx.numpy(), dx_ref.numpy(), rtol=2.5e-7, atol=0)
    assert np.all(np.isfinite(dx.numpy())) and not np.any(dx.numpy()[0, :2, :2])


@pytest.mark.parametrize("pairing", ["halves", "interleaved"])
@pytest.mark.parametrize("pool_size", [2, (2, 3)])
@pytest.mark.parametrize("spatial", [(8, 6), (7, 5)])
def test_groupsort2_then_pooling_run_as_one_kernel_with_the_same_values(pairing, pool_size,
                                                                         spatial):
    """``DP_GroupSort(2)`` then ``DP_ScaledL2NormPooling2D`` in a traced function become
    ``LipdpSortPool`` (and its gradient): bit for bit the two fused kernels one after the
    other, forward and backward, at ties, signed zeros, infinities, NaNs and uncovered
    border pixels; and the reference layers' values (forward bit for bit; backward bit for
    bit on areas that are powers of 2 and normal inputs, as the pooling kernel alone)."""
    x = _activations((3,) + spatial + (8,), seed=sum(spatial))
    sort, pool = DP_GroupSort(2, pairing=pairing), DP_ScaledL2NormPooling2D(pool_size)
    cotangent = tf.random.stateless_normal(pool.compute_output_shape(x.shape), seed=(4, 6))
    ops = kernels.fused_ops()
    pool.build(x.shape)
    coef = float(pool._get_coef())  # pylint: disable=protected-access
    attrs = dict(pool_h=pool.pool_size[0], pool_w=pool.pool_size[1], coef=coef,
                 eps=float(pool.eps_grad_sqrt))

    def one_after_the_other(t):
        return ops.lipdp_l2_norm_pool(ops.lipdp_pair_permute(
            t, t, interleaved=pairing == "interleaved"), **attrs)

    fused = tf.function(lambda x: _value_and_input_gradient(lambda t: pool(sort(t)), x,
                                                            cotangent))
    separate = tf.function(lambda x: _value_and_input_gradient(one_after_the_other, x,
                                                               cotangent))
    theirs = ScaledL2NormPooling2D(pool_size)
    reference = tf.function(lambda x: _value_and_input_gradient(
        lambda t: theirs(reference_sort_pairs(t, pairing)), x, cotangent))
    assert {"LipdpSortPool", "LipdpSortPoolGrad"} <= _ops_in(fused, x)
    assert not {"LipdpL2NormPool", "LipdpL2NormPoolGrad"} & _ops_in(fused, x)
    (y, dx), (y_sep, dx_sep), (y_ref, _) = fused(x), separate(x), reference(x)
    assert _same(y, y_sep) and _same(dx, dx_sep)
    assert _same(y, y_ref)
    if np.prod(pool.pool_size) in (2, 4, 8):  # backward, on inputs without special values
        finite = tf.random.stateless_normal(x.shape, seed=(5, 6))
        assert _same(fused(finite)[1], reference(finite)[1])
    assert np.any(np.isnan(y.numpy())) and np.any(np.isnan(dx.numpy()))


def test_only_a_groupsort2_output_is_pooled_in_one_kernel():
    """The pooling fuses with its input's producer only when that is GroupSort2's forward
    kernel (keys = values); eagerly, or after another op, it pools alone."""
    x = _activations((2, 4, 4, 6), seed=3)
    pool = DP_ScaledL2NormPooling2D(2)
    ops = kernels.fused_ops()
    after_backward_permute = tf.function(lambda x: pool(ops.lipdp_pair_permute(x, 2.0 * x)))
    after_another_op = tf.function(lambda x: pool(tf.abs(DP_GroupSort(2)(x))))
    for function in (after_backward_permute, after_another_op):
        assert "LipdpSortPool" not in _ops_in(function, x)
        assert "LipdpL2NormPool" in _ops_in(function, x)
    assert _same(pool(DP_GroupSort(2)(x)), tf.function(lambda x: pool(DP_GroupSort(2)(x)))(x))


def test_layers_fall_back_to_the_reference_under_xla():
    x = _activations((4, 6, 6, 8), seed=5)
    for layer in (DP_GroupSort(2), DP_ScaledL2NormPooling2D(2)):
        compiled = tf.function(layer, jit_compile=True)
        assert not any(op.startswith("Lipdp") for op in _ops_in(compiled, x))
        assert _same(compiled(x), layer(x))


@pytest.mark.parametrize("layer", [
    DP_GroupSort(2), DP_GroupSort(2, pairing="interleaved"), DP_ScaledL2NormPooling2D(2),
    tf.keras.Sequential([DP_GroupSort(2, pairing="interleaved"), DP_ScaledL2NormPooling2D(2)]),
], ids=["gs-halves", "gs-interleaved", "pool", "gs-then-pool"])
def test_per_example_gradients_vectorise_without_a_while_loop(layer):
    """lipdp.per_example and the clipped engines run layers inside tf.vectorized_map: the
    kernels have converters (a loop would be correct but slow), and each row must be that
    example's own output and input gradient."""
    x = tf.random.stateless_normal((5, 6, 6, 4), seed=(6, 7))
    g = tf.random.stateless_normal((5,) + tuple(layer.compute_output_shape((1, 6, 6, 4))[1:]),
                                   seed=(8, 9))
    wanted = {"LipdpSortPool", "LipdpSortPoolGrad"} if len(getattr(layer, "layers", [])) else set()

    def one(example):
        y, dx = _value_and_input_gradient(layer, example[0][None], example[1][None])
        return y[0], dx[0]

    vectorised = tf.function(lambda x, g: tf.vectorized_map(one, (x, g)))
    graph_ops = _ops_in(vectorised, x, g)
    assert any(op.startswith("Lipdp") for op in graph_ops) and wanted <= graph_ops
    assert not {"While", "StatelessWhile"} & graph_ops
    rows = vectorised(x, g)
    for i in range(len(x)):
        for got, expected in zip(rows, one((x[i], g[i]))):
            assert _same(got[i], expected)


@pytest.mark.parametrize("fused_layer, reference", [
    (DP_GroupSort(2), lambda x: reference_sort_pairs(x, "halves")),
    (DP_ScaledL2NormPooling2D(2), ScaledL2NormPooling2D(2)),
    (tf.keras.Sequential([DP_GroupSort(2), DP_ScaledL2NormPooling2D(2)]),
     lambda x: ScaledL2NormPooling2D(2)(reference_sort_pairs(x, "halves"))),
], ids=["groupsort2", "l2-norm-pooling", "groupsort2-then-pooling"])
def test_second_order_gradients_match_the_reference(fused_layer, reference):
    x = tf.random.stateless_normal((3, 4, 4, 6), seed=(10, 11))
    direction = tf.random.stateless_normal(x.shape, seed=(12, 13))

    def hessian_vector(function):
        with tf.GradientTape() as outer:
            outer.watch(x)
            with tf.GradientTape() as inner:
                inner.watch(x)
                value = tf.reduce_sum(function(x) ** 3)
            slope = tf.reduce_sum(inner.gradient(value, x) * direction)
        return outer.gradient(slope, x).numpy()

    expected = hessian_vector(reference)
    np.testing.assert_allclose(hessian_vector(fused_layer), expected,
                               rtol=1e-5, atol=1e-6 * np.max(np.abs(expected)))


def test_kernels_refuse_malformed_inputs():
    ops = kernels.fused_ops()
    with pytest.raises(tf.errors.InvalidArgumentError, match="even size"):
        ops.lipdp_pair_permute(tf.ones((2, 3)), tf.ones((2, 3)))
    with pytest.raises((tf.errors.InvalidArgumentError, ValueError), match="shape"):
        ops.lipdp_pair_permute(tf.ones((2, 4)), tf.ones((2, 6)))
    with pytest.raises((tf.errors.InvalidArgumentError, ValueError), match="rank"):
        ops.lipdp_l2_norm_pool(tf.ones((2, 4, 4)), pool_h=2, pool_w=2, coef=1.0, eps=0.0)
    with pytest.raises(tf.errors.InvalidArgumentError, match="even size"):
        ops.lipdp_sort_pool(tf.ones((2, 4, 4, 3)), pool_h=2, pool_w=2, coef=1.0, eps=0.0)
    with pytest.raises((tf.errors.InvalidArgumentError, ValueError), match="shape"):
        ops.lipdp_sort_pool_grad(tf.ones((2, 4, 4, 2)), tf.ones((2, 4, 4, 2)), pool_h=2,
                                 pool_w=2, coef=1.0, eps=0.0)


def _run_python(code, **env):
    """Run `code` in a fresh interpreter with `env` added; returns its stdout and stderr."""
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=300, env={**os.environ, **env},
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout, done.stderr


_FALLBACK_CHECK = """
    import numpy as np, tensorflow as tf
    from lipdp import kernels
    from lipdp.layers import DP_GroupSort, DP_ScaledL2NormPooling2D
    x = tf.random.stateless_normal((2, 4, 4, 6), seed=(0, 1))
    step = tf.function(lambda x: DP_ScaledL2NormPooling2D(2)(DP_GroupSort(2)(x)))
    ops = {op.type for op in step.get_concrete_function(x).graph.get_operations()}
    print("STATUS", kernels.status())
    print("FUSED", any(op.startswith("Lipdp") for op in ops))
    print("VALUE", float(tf.reduce_sum(step(x))))
    from lipdp.noise import add_gaussian_noise
    noise = tf.function(lambda x: add_gaussian_noise([x], [1.0]))
    print("NOISE_FUSED", "LipdpAddGaussianNoise" in {
        op.type for op in noise.get_concrete_function(x).graph.get_operations()})
"""


def test_without_a_compiler_the_layers_fall_back_with_a_warning(tmp_path):
    out, err = _run_python(_FALLBACK_CHECK, CXX="false", PATH=str(tmp_path),
                           LIPDP_KERNEL_CACHE=str(tmp_path / "cache"))
    assert "FUSED False" in out and "no C++ compiler found" in out
    assert "NOISE_FUSED False" in out
    assert "fused GroupSort2 / L2-norm pooling / noise kernels are unavailable" in err
    fused = io.StringIO()  # the same check in this process, whose kernels are loaded
    with contextlib.redirect_stdout(fused):
        exec(textwrap.dedent(_FALLBACK_CHECK), {})
    fused_out = fused.getvalue()
    assert "FUSED True" in fused_out and "NOISE_FUSED True" in fused_out
    value = [line for line in out.splitlines() if line.startswith("VALUE")]
    assert value == [line for line in fused_out.splitlines() if line.startswith("VALUE")]


def test_a_failed_compilation_falls_back_and_the_switch_disables_silently(tmp_path):
    out, err = _run_python(_FALLBACK_CHECK, CXX=sys.executable,  # not a C++ compiler
                           LIPDP_KERNEL_CACHE=str(tmp_path / "cache"))
    assert "FUSED False" in out and "compilation failed" in out and "unavailable" in err
    assert not list((tmp_path / "cache").glob("*.so"))  # nothing half-written is kept
    out, err = _run_python(_FALLBACK_CHECK, LIPDP_FUSED_KERNELS="0")
    assert "FUSED False" in out and "disabled by LIPDP_FUSED_KERNELS=0" in out
    assert "unavailable" not in err


def test_a_saved_model_that_ran_the_kernels_loads_once_they_are_loaded(tmp_path):
    """A SavedModel holds the custom ops: another process refuses it after `import lipdp`
    alone (which loads nothing) and loads it once lipdp.kernels.fused_ops() has run."""
    model = tf.keras.Sequential([tf.keras.layers.Input((6, 6, 4)), DP_GroupSort(2),
                                 DP_ScaledL2NormPooling2D(2)])
    tf.saved_model.save(model, str(tmp_path / "model"))
    x = tf.random.stateless_normal((2, 6, 6, 4), seed=(14, 15))
    np.save(tmp_path / "x.npy", x.numpy())
    out, _ = _run_python(f"""
        import numpy as np, tensorflow as tf
        import lipdp

        def load(when):
            try:
                loaded = tf.saved_model.load({str(tmp_path / "model")!r})
                y = loaded.signatures["serving_default"](
                    tf.constant(np.load({str(tmp_path / "x.npy")!r})))
                np.save({str(tmp_path / "y.npy")!r}, list(y.values())[0].numpy())
                print(when, "LOADED")
            except Exception as error:
                print(when, "REFUSED", type(error).__name__)

        load("IMPORTED")
        lipdp.kernels.fused_ops()
        load("FUSED_OPS")
    """)  # one process: the refusal, then the load once the kernels are loaded
    assert "IMPORTED REFUSED" in out and "IMPORTED LOADED" not in out
    assert "FUSED_OPS LOADED" in out and _same(np.load(tmp_path / "y.npy"), model(x))
