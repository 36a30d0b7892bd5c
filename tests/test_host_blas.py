"""`lipdp.host_blas`: numpy's BLAS on one thread while `fit` / `train_on_batch` run a private
step (its certificates' host call sees the limit), the setting restored after, the variable,
and nothing changed without threadpoolctl."""

import numpy as np
import pytest
import tensorflow as tf
from threadpoolctl import ThreadpoolController

from lipdp import host_blas, operator_norms
from lipdp.losses import DP_TauCategoricalCrossentropy
from tests._models import cnn


def _blas_threads():
    return {lib.num_threads
            for lib in ThreadpoolController().select(user_api="blas").lib_controllers}


@pytest.fixture
def two_threads(monkeypatch):
    """numpy's BLAS on 2 threads around the test (the limit then has something to change),
    and no ``LIPDP_HOST_BLAS_THREADS``."""
    monkeypatch.delenv("LIPDP_HOST_BLAS_THREADS", raising=False)
    controller = ThreadpoolController()
    if not controller.select(user_api="blas").lib_controllers:
        pytest.skip("no BLAS library that threadpoolctl can see")
    with controller.limit(limits=2, user_api="blas"):
        assert _blas_threads() == {2}
        yield


def test_the_limit_holds_inside_and_is_restored_after(two_threads):
    with host_blas.limited_blas_threads():
        assert _blas_threads() == {1}
        with host_blas.limited_blas_threads():
            assert _blas_threads() == {1}
        assert _blas_threads() == {1}
    assert _blas_threads() == {2}


def test_the_variable_sets_the_threads_and_zero_leaves_blas_alone(two_threads, monkeypatch):
    monkeypatch.setenv("LIPDP_HOST_BLAS_THREADS", "0")
    with host_blas.limited_blas_threads():
        assert _blas_threads() == {2}
    monkeypatch.setenv("LIPDP_HOST_BLAS_THREADS", "3")
    with host_blas.limited_blas_threads():
        assert _blas_threads() == {3}
    assert _blas_threads() == {2}
    for bad in ("-1", "one", "1.5"):
        monkeypatch.setenv("LIPDP_HOST_BLAS_THREADS", bad)
        with pytest.raises(ValueError, match="LIPDP_HOST_BLAS_THREADS"):
            host_blas.host_blas_threads()


def test_without_threadpoolctl_nothing_changes(two_threads, monkeypatch):
    monkeypatch.setattr(host_blas, "ThreadpoolController", None)
    monkeypatch.setattr(host_blas, "_CONTROLLER", [])
    with host_blas.limited_blas_threads():
        assert _blas_threads() == {2}


def test_fit_and_train_on_batch_certify_on_one_blas_thread(two_threads, monkeypatch):
    seen = []
    real = operator_norms.conv_norm_upper  # every step: the kernels moved
    monkeypatch.setattr(operator_norms, "conv_norm_upper",
                        lambda *args: seen.append(_blas_threads()) or real(*args))
    model = cnn()
    model.compile(loss=DP_TauCategoricalCrossentropy(5.0), optimizer=tf.keras.optimizers.SGD(0.1))
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 8, 8, 2)).astype(np.float32)
    y = np.eye(4, dtype=np.float32)[rng.integers(0, 4, 64)]
    seen.clear()  # building and compiling certified eagerly
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert seen and all(threads == {1} for threads in seen)
    assert _blas_threads() == {2}
    seen.clear()
    model.train_on_batch(x[:16], y[:16])
    assert seen and all(threads == {1} for threads in seen)
    assert _blas_threads() == {2}
    model.sensitivities()  # eager, outside a step: the libraries as the user set them
    assert seen[-1] == {2}


def test_the_limit_is_taken_only_where_every_host_product_is_small():
    from lipdp import DP_Sequential, DPParameters
    from lipdp.layers import DP_BoundedInput, DP_GroupSort, DP_QuickSpectralDense
    from tests._models import metadata

    small = cnn()
    small.compile(loss=DP_TauCategoricalCrossentropy(5.0), optimizer=tf.keras.optimizers.SGD(0.1))
    assert small.limits_host_blas()
    assert getattr(small.make_train_function(), "limits_blas_threads", False)

    def wide(mode):  # the main job's 784 x 1024 kernel: its float64 Gram matrix is 629M
        parameters = (DPParameters(1.0, 1e-5) if mode == "clipless"
                      else DPParameters(1.0, 1e-5, mode="clipped", l2_norm_clip=1.0))
        model = DP_Sequential(
            [DP_BoundedInput(1.0, input_shape=(784,)), DP_QuickSpectralDense(1024),
             DP_GroupSort(2), DP_QuickSpectralDense(10)],
            dp_parameters=parameters, dataset_metadata=metadata((784,), 10))
        model.compile(loss=DP_TauCategoricalCrossentropy(5.0),
                      optimizer=tf.keras.optimizers.SGD(0.1))
        return model

    for mode in ("clipless", "clipped"):  # clipped: no certificate in its step
        model = wide(mode)
        assert not model.limits_host_blas()
        assert not getattr(model.make_train_function(), "limits_blas_threads", False)


def test_host_work_counts_the_largest_float64_product():
    kernel = lambda *shape: tf.zeros(shape)  # noqa: E731
    assert operator_norms.host_work(("dense", kernel(784, 1024), None)) == 1024 * 784 ** 2
    assert operator_norms.host_work(("dense", kernel(3, 3, 32, 64), None)) == 288 * 64 ** 2
    assert operator_norms.host_work(("cached-dense", kernel(3136, 512), None)) == 512 ** 3 // 3
    # The paper's CNN's second convolution on its 16 x 16 torus: by tap pairs, (144 + 64)
    # (9 * 32)^2 multiply-adds and 144 * 36 twiddles at 256 each.
    assert operator_norms.host_work(("conv", kernel(3, 3, 32, 64), (16, 16))) == (
        208 * 288 ** 2 + 256 * 144 * 36)
    assert host_blas.limit_pays([18579456, 44739242]) and not host_blas.limit_pays([2 ** 26])
