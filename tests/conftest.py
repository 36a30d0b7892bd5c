"""Test-session set-up: TensorFlow's oneDNN CPU kernels are switched off, every test starts
from the same seeds, and hypothesis draws the same examples on every run.

TensorFlow 2.15's oneDNN kernels (on by default on x86 CPUs, in both the
``tensorflow`` and ``tensorflow-cpu`` wheels) have two bugs the tests reach:

* ``Conv2DBackpropFilter`` of a 1x1 kernel with strides (2, 1) and 'same'
  padding fails with "could not create a primitive descriptor for a reorder
  primitive" or corrupts the heap and aborts the process (reproduced with a
  plain ``GradientTape`` on ``Conv2D(2, 1, strides=(2, 1), padding="same")`` and
  a (1, 6, 7, 3) input, no lipdp code involved);
* a convolution of an empty batch returns a tensor of its *input's* shape.

Both are TensorFlow's (the README lists them under "Sharp edges"); the Eigen
kernels used without oneDNN are correct. The variable must be set before
TensorFlow is first imported, which is why it lives here.
"""

import json
import os
import tempfile

os.environ["TF_ENABLE_ONEDNN_OPTS"] = "0"


def _share_the_cores_between_workers():
    """Under pytest-xdist each worker gets its share of the cores for TensorFlow's and the
    BLAS' thread pools (also read before they start, hence here): by default every worker's
    pools take every core, and two workers on two cores then run four busy threads. On a
    2-core machine the whole suite ran in 0.93x the wall time (paired, two rounds).
    Variables the user set are kept."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers < 1:
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    share = str(max(1, (cores or 1) // workers))
    for name in ("TF_NUM_INTRAOP_THREADS", "TF_NUM_INTEROP_THREADS", "OMP_NUM_THREADS",
                 "OPENBLAS_NUM_THREADS"):
        os.environ.setdefault(name, share)


_share_the_cores_between_workers()


def _write_art_config():
    """adversarial-robustness-toolbox writes ``~/.art/config.json`` at its first import, with
    no lock: on a fresh machine, pytest-xdist workers importing it at once race, and one that
    sees the file appear between ART's two checks fails its collection with ``NameError:
    name '_config' is not defined``. The session writes ART's default file first (this
    conftest is loaded before the workers start), atomically."""
    home = os.path.expanduser("~")
    folder = os.path.join(home if os.access(home, os.W_OK) else "/tmp", ".art")
    path = os.path.join(folder, "config.json")
    if os.path.exists(path):
        return
    os.makedirs(folder, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=folder, delete=False, suffix=".tmp") as out:
        json.dump({"ART_DATA_PATH": os.path.join(folder, "data")}, out, indent=4)
    os.replace(out.name, path)


_write_art_config()

import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

# Every hypothesis test draws the same examples on every run: a draw decides pass/fail, so a
# random draw would make a failure unreproducible (and the false-failure rate unknown).
settings.register_profile("lipdp", derandomize=True, deadline=None)
settings.load_profile("lipdp")


@pytest.fixture(autouse=True)
def _seed_everything():
    """Seed Python, NumPy and TensorFlow before every test, so that weight initialisers and
    every draw a test does not seed itself are the same on every run (tests that draw also
    use explicit seeds: `np.random.default_rng(k)`, `tf.keras.utils.set_random_seed(k)`)."""
    import tensorflow as tf  # after TF_ENABLE_ONEDNN_OPTS is set above

    from lipdp import noise, weight_copies

    tf.keras.utils.set_random_seed(0)
    # Seeded, the models of two tests train to the same values: each test starts with no
    # value remembered, as a program of its own would (`lipdp.weight_copies.clear`).
    weight_copies.clear()
    # and with no noise draw salted: a test's noise does not depend on the tests its worker
    # ran before it (`lipdp.noise.salted_seeds` counts the process's draws).
    noise._forget_salted_draws()
    yield
