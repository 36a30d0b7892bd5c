"""numpy's BLAS on one thread while a private step runs: its certificates share the cores with
TensorFlow's threads.

The certified norms run in numpy inside the train step (`lipdp.operator_norms`), on one of
TensorFlow's threads, beside the forward and backward pass, whose own thread pools keep every
core busy. numpy's BLAS (OpenBLAS in numpy's wheels) splits a product above a size threshold
over threads of its own, one per core, which then spin-wait for more work before they sleep:
in the step they only take cycles from TensorFlow's threads. On the paper's CNN at batch 1024
(this 2-core machine, the limit set around each step, paired in one process, 16 and 30
rounds) the clipless step used 409 against 376, 403 against 394, 391 against 369 and 347
against 344 ms of process CPU time with one BLAS thread, and ran 1.128x / 1.073x, 1.109x /
1.110x, 1.115x / 1.087x and 1.075x / 1.071x its twin (default / one thread); at batch 256 and
4096 it read the same either way.

With threadpoolctl installed (``pip install lipdp[speed]``; scikit-learn brings it too),
`DP_Model.make_train_function` (`fit`, `train_on_batch`) of a clipless model whose
certificates' host products are all small (`limit_pays`) runs each call of Keras' train
function inside `limited_blas_threads`, in the thread that calls it, which restores the
setting afterwards. Not inside the host call, on TensorFlow's thread: there OpenBLAS 0.3.23
ignored the raise back to the main thread's setting (seen here: set from a second thread
after the main one lowered it, the count stayed at 1). ``LIPDP_HOST_BLAS_THREADS=N`` sets N
threads, ``0`` leaves the libraries alone. It changes no number: the certificates' proofs
hold for any summation order a BLAS uses.
"""

from __future__ import annotations

import contextlib
import os

try:  # the `speed` extra (scikit-learn, the `audit` extra's, brings it too)
    from threadpoolctl import ThreadpoolController
except ImportError:  # without it the step runs as before
    ThreadpoolController = None

#: BLAS threads in a private step unless ``LIPDP_HOST_BLAS_THREADS`` says otherwise.
HOST_BLAS_THREADS = 1
#: Most multiply-adds of a certificate's largest float64 product (`lipdp.operator_norms.
#: host_work`) for which a private step limits the BLAS threads (`limit_pays`).
LIMITED_MAX_WORK = 2 ** 26

_CONTROLLER = []


def host_blas_threads() -> int:
    """The BLAS threads a private step gets: ``LIPDP_HOST_BLAS_THREADS`` when set (0: the
    libraries are left alone), else `HOST_BLAS_THREADS`."""
    value = os.environ.get("LIPDP_HOST_BLAS_THREADS", "").strip()
    if not value:
        return HOST_BLAS_THREADS
    if not value.isdigit():
        raise ValueError("LIPDP_HOST_BLAS_THREADS must be a non-negative integer (0: leave the "
                         f"BLAS libraries alone). Received: {value!r}")
    return int(value)


def limit_pays(host_works) -> bool:
    """Whether limiting the BLAS threads pays in a private step whose certificates' largest
    float64 products take `host_works` multiply-adds: when every one is below
    `LIMITED_MAX_WORK` (about 3 ms on one core). A larger one, on the step's critical path,
    runs faster on every core: the main job's 784 x 1024 kernel, certified from scratch on the
    steps a `bjorck_every=4` schedule leaves (629M multiply-adds), made that step 1.10x
    slower with one thread (paired, 12 rounds of 4-step periods, batch 256); the paper's
    CNN's largest is 45M (its 512 x 512 Cholesky test)."""
    return all(work < LIMITED_MAX_WORK for work in host_works)


def _controller():
    """threadpoolctl's view of the libraries loaded now (numpy's BLAS among them), once."""
    if not _CONTROLLER:
        _CONTROLLER.append(ThreadpoolController())
    return _CONTROLLER[0]


@contextlib.contextmanager
def limited_blas_threads():
    """Within this context the BLAS libraries run on `host_blas_threads` threads; their
    setting is restored when it ends. Enter and leave it in the same thread. Without
    threadpoolctl it changes nothing."""
    threads = host_blas_threads()
    if threads == 0 or ThreadpoolController is None:
        yield
        return
    with _controller().limit(limits=threads, user_api="blas"):
        yield


def with_limited_blas_threads(call):
    """`call`, each call of it run inside `limited_blas_threads`; the function returned is
    marked ``limits_blas_threads = True`` (so that it is not wrapped twice)."""

    def limited(*args, **kwargs):
        with limited_blas_threads():
            return call(*args, **kwargs)

    limited.limits_blas_threads = True
    return limited
