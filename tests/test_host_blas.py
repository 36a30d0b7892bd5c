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
