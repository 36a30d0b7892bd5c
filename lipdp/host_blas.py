"""numpy's BLAS on one thread while a private step runs: its certificates share the cores with
TensorFlow's threads.

The certified norms run in numpy inside the train step (`lipdp.operator_norms`), on one of
TensorFlow's threads, beside the forward and backward pass, whose own thread pools keep every
core busy. numpy's BLAS (OpenBLAS in numpy's wheels) splits a product above a size threshold
over threads of its own, one per core, which then spin-wait for more work before they sleep:
in the step they only take cycles from TensorFlow's threads. On the paper's CNN at batch 1024
(this 2-core machine, the limit set around each step, paired in one process, 16 and 30
rounds) the clipless step used 409 against 376, 403 against 394 and 391 against 369 ms of
process CPU time with one BLAS thread, and ran 1.128x / 1.073x, 1.109x / 1.110x and 1.115x /
1.087x its twin (default / one thread).

With threadpoolctl installed (``pip install lipdp[speed]``; scikit-learn brings it too),
`DP_Model.make_train_function` (`fit`, `train_on_batch`) runs each call of Keras' train
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
