"""Fused CPU kernels for GroupSort2, L2-norm pooling and the private step's Gaussian noise,
compiled on first use.

TensorFlow runs every elementwise op as its own pass over memory. lipdp's GroupSort2 took
five of them forward and two backward (a partner tensor, comparisons, selections), and
deel-lip's L2-norm pooling four: on the paper's CNN the two layers made the Lipschitz
network's forward+backward pass about 1.8x a plain ReLU / max-pooling CNN's. The kernels in
``lipdp_ops.cc`` read each input once and write each output once, and compute **the same
values** as the reference implementations (`lipdp.layers._pair_sort.reference_sort_pairs`,
deel-lip's ``ScaledL2NormPooling2D.call``): GroupSort2 bit for bit (comparisons and copies
only), L2-norm pooling with deel-lip's order of operations (so
`lipdp.rounding.block_norm_error` still bounds its rounding). `tests/test_kernels.py` holds
both against the references, ties and NaNs included.

``gaussian_noise.cc`` adds the private step's Gaussian noise to a gradient in one pass
(`lipdp.noise.add_gaussian_noise`): TensorFlow's Philox uniforms, drawn as
``tf.random.uniform`` draws them, and the Box-Muller transform, vectorised
(`tests/test_noise.py` checks the stream bit for bit and the transform on every input).

The sources are compiled with the C++ compiler of the machine (``$CXX``, else ``g++``,
``c++`` or ``clang++``) against the installed TensorFlow's headers, a few seconds, once: the
shared library is cached under ``$LIPDP_KERNEL_CACHE`` (default
``$XDG_CACHE_HOME/lipdp/kernels``, else ``~/.cache/lipdp/kernels``), named by a hash of the
sources, the TensorFlow version and the flags, and written atomically (parallel test workers
may compile at the same time). When no compiler works, or ``LIPDP_FUSED_KERNELS=0``, the
layers use their reference implementation, the noise its TensorFlow-ops version
(`lipdp.noise.gaussian_noise`), and `status` says why (with one warning, unless the switch
turned them off).

The layers choose per call, when they are traced: the fused kernel for float32 tensors on
the CPU outside XLA (no GPU visible, no ``jit_compile``); the reference otherwise. Both
have registered gradients (second order included) and ``tf.vectorized_map`` converters.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path

SOURCES = tuple(Path(__file__).with_name(name) for name in ("lipdp_ops.cc", "gaussian_noise.cc"))
CXX_FLAGS = ("-O3", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=off", "-shared",
             "-fPIC")
COMPILE_TIMEOUT_S = 600
ENV_SWITCH = "LIPDP_FUSED_KERNELS"
ENV_CACHE = "LIPDP_KERNEL_CACHE"

_lock = threading.Lock()
_layers_fuse = contextvars.ContextVar("lipdp_layers_fuse", default=True)
_state = {"loaded": False, "ops": None, "status": "not loaded yet"}


def cache_dir() -> Path:
    """Where compiled kernels are kept (`ENV_CACHE`, else the user's cache directory)."""
    if os.environ.get(ENV_CACHE):
        return Path(os.environ[ENV_CACHE])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "lipdp" / "kernels"


def _compiler():
    for candidate in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if candidate and shutil.which(candidate):
            return shutil.which(candidate)
    return None


def _library_path(tf_flags) -> Path:
    import tensorflow as tf

    digest = hashlib.sha256()
    sources = [source.read_bytes() for source in SOURCES]
    for part in (*sources, tf.__version__.encode(), " ".join(CXX_FLAGS).encode(),
                 " ".join(tf_flags).encode()):
        digest.update(part)
        digest.update(b"\0")
    return cache_dir() / f"lipdp_ops_{digest.hexdigest()[:16]}.so"


def _compile(compiler, target: Path, tf_flags):
    """Compile the sources into `target`, atomically (a temporary file, then a rename)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(handle)
    try:
        command = [compiler, *CXX_FLAGS, *map(str, SOURCES), "-o", temporary, *tf_flags]
        done = subprocess.run(command, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
        if done.returncode != 0:
            raise RuntimeError(f"{compiler} failed ({done.returncode}): "
                               f"{(done.stderr or done.stdout).strip()[-2000:]}")
        os.replace(temporary, target)
    finally:
        if os.path.exists(temporary):
            os.remove(temporary)


def _load():
    if os.environ.get(ENV_SWITCH, "1").strip().lower() in ("0", "false", "off", "no"):
        return None, f"disabled by {ENV_SWITCH}={os.environ[ENV_SWITCH]}"
    import tensorflow as tf

    tf_flags = tf.sysconfig.get_compile_flags() + tf.sysconfig.get_link_flags()
    target = _library_path(tf_flags)
    if not target.exists():
        compiler = _compiler()
        if compiler is None:
            return None, "no C++ compiler found (set CXX, or install g++)"
        try:
            _compile(compiler, target, tf_flags)
        except (OSError, RuntimeError, subprocess.TimeoutExpired) as error:
            return None, f"compilation failed: {error}"
    try:
        ops = tf.load_op_library(str(target))
    except (tf.errors.NotFoundError, OSError) as error:
        return None, f"loading {target} failed: {error}"
    from lipdp.kernels import _registrations

    _registrations.register(ops)
    return ops, f"loaded from {target}"


def fused_ops():
    """The loaded op module, or None when the fused kernels are unavailable (`status`)."""
    if not _state["loaded"]:
        with _lock:
            if not _state["loaded"]:
                ops, message = _load()
                _state.update(loaded=True, ops=ops, status=message)
                if ops is None and not message.startswith("disabled"):
                    warnings.warn(f"lipdp's fused GroupSort2 / L2-norm pooling / noise kernels "
                                  f"are unavailable, using the slower reference layers and "
                                  f"noise (same values, same distribution): {message}. "
                                  f"Set {ENV_CACHE} to a writable directory or CXX to a C++ "
                                  f"compiler, or {ENV_SWITCH}=0 "
                                  f"to silence this.", RuntimeWarning, stacklevel=2)
    return _state["ops"]


def status() -> str:
    """Whether the fused kernels are in use, and why not when they are not."""
    fused_ops()
    return _state["status"]


def usable_for(tensor) -> bool:
    """Whether a layer (or the noise) may run its fused kernel on `tensor` in the graph being
    traced: a float32 tensor, kernels loaded, no GPU visible (the kernels are CPU only) and no
    XLA compilation (``jit_compile``: XLA cannot compile a custom op)."""
    import tensorflow as tf

    if tensor.dtype != tf.float32 or fused_ops() is None:
        return False
    if tf.config.list_logical_devices("GPU"):
        return False
    return not in_xla_context()


def in_xla_context() -> bool:
    """Whether the graph being traced is compiled by XLA (``jit_compile``)."""
    import tensorflow as tf
    from tensorflow.python.ops import control_flow_util

    return not tf.executing_eagerly() and control_flow_util.GraphOrParentsInXlaContext(
        tf.compat.v1.get_default_graph())


def layers_may_fuse() -> bool:
    """Whether layers traced now may run as one kernel across layer boundaries (GroupSort2
    then L2-norm pooling: `lipdp.layers.DP_ScaledL2NormPooling2D`); not inside
    `separate_layers`."""
    return _layers_fuse.get()


@contextlib.contextmanager
def separate_layers():
    """Trace every layer as its own kernels: no fusion across layer boundaries.

    A fused pair leaves the first layer's output out of the autodiff graph (the pair
    differentiates from the first layer's input). Code that differentiates with respect to
    recorded layer outputs (the ghost-clipping engine's cotangents, `lipdp.clipping.ghost`)
    traces its forward pass in this context: a layer whose output ends in GroupSort2 before
    an L2-norm pooling would otherwise get no cotangent, hence a zero per-example norm.
    """
    token = _layers_fuse.set(False)
    try:
        yield
    finally:
        _layers_fuse.reset(token)
