"""Gaussian noise of the private step: the Box–Muller transform of TF uniforms, vectorised.

``add_gaussian_noise(tensors, stddevs)`` returns ``tensors[i] + stddevs[i] * z_i``, what the
private step releases: on the CPU, for float32, one fused kernel per tensor
(`lipdp.kernels`, ``gaussian_noise.cc``) that draws ``tf.random.uniform``'s own uniforms
(the same Philox stream, seeded the same way) and applies the Box–Muller transform below in
one pass over the tensor; elsewhere (float64, XLA, a GPU, no compiler) ``tensor +
gaussian_noise(...)``. Both give ``fl(x + fl(stddev * z))`` with ``z`` the transform of
uniforms of the same generator: the fused transform is within 1.2 * 2^-23 (radius, relative)
and 1.7 * 2^-24 (cosine and sine, absolute) of exact on every one of its inputs, the TF-ops
one within the accuracy of TensorFlow's float32 ``log``, ``cos`` and ``sin`` of a rounded
``2 pi v``. The kernel (with the private step's finiteness check in its pass) made the
clipless step 0.96x (the paper's CNN, batch 1024) and 0.91-0.93x (the main job's MLP, batch
256 and 1024) the time, paired (docs/speed.md, "Noise added by one fused kernel").

``gaussian_noise(like, stddevs)`` returns ``stddev_i * z_i`` with ``z_i`` shaped like
``like[i]`` and every coordinate of every ``z_i`` independent ``N(0, 1)``: ``u, v`` uniform
on [0, 1) (``tf.random.uniform``: TensorFlow's stateful Philox generator, seeded as every TF
random op is: never, unless the program sets a seed), then ``sqrt(-2 log(1 - u)) *
(cos(2 pi v), sin(2 pi v))``, the Box–Muller transform: for independent uniforms the two
outputs are exactly independent standard normals.

``tf.random.normal``'s CPU kernel computes the same transform of the same generator's
uniforms one scalar pair at a time; here it runs as vectorised TensorFlow ops: the 1.63M
coordinates of the paper's CNN in about 0.52x the time on this 2-core CPU (4.3 against
8.4 ms; `benchmarks/run.py`'s breakdown prints the noise's share of a step).

Float artefacts, no worse than ``tf.random.normal``'s: a float32 ``u`` is a multiple of 2^-23,
so the radius takes finitely many values and never exceeds ``sqrt(2 * 23 * log 2) = 5.65``
(tf.random.normal clamps ``u`` at 1e-7: 5.68, in float32 and float64 alike); a float64
``like`` tensor is drawn from float64 uniforms (multiples of 2^-52: radius up to 8.49). No
floating-point sampler is exactly Gaussian, nor is TensorFlow's generator cryptographically
secure (README, sharp edges).
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import math
import secrets
import warnings
from typing import Sequence

import tensorflow as tf

from lipdp import kernels

__all__ = ["SeededNoiseWarning", "add_gaussian_noise", "drawing_at_step", "gaussian_noise",
           "salted_seeds", "standard_normal", "warn_if_seeded"]


class SeededNoiseWarning(UserWarning):
    """Issued when a private step runs in a program that set TensorFlow's global seed: the
    noise is then a function of that seed."""


def warn_if_seeded(stacklevel: int = 3) -> None:
    """Warn (`SeededNoiseWarning`) when TensorFlow's global seed is set
    (``tf.random.set_seed``, ``tf.keras.utils.set_random_seed``): every random op, lipdp's
    noise included, then draws from that seed and its place in the program, so whoever
    knows the seed and the code regenerates the noise of every step and subtracts it from
    what was released; and two runs of one seed (the program run again in another process, on
    neighbouring data or resumed twice from one checkpoint) draw the same noise, which the
    difference of their releases cancels whether or not the seed is known (within one
    process no two salted noise draws share seeds: `salted_seeds`). Read without drawing
    (``tf.compat.v1.random.get_seed`` would advance the program's op seeds)."""
    from tensorflow.python.eager import context  # the global seed, read without a draw

    seed = context.global_seed()
    if seed is None:
        return
    warnings.warn(SeededNoiseWarning(
        f"TensorFlow's global random seed is set ({seed}): the noise of every private step is "
        "a function of this seed and of the program, so whoever knows both can regenerate "
        "the noise and subtract it, and the reported epsilon holds only while the seed stays "
        "secret (keep it out of published code and configs) and only one run of this seed "
        "is released: the same program run again with it in another process (on other data, "
        "or resumed again from one checkpoint) draws the same noise, and the difference of "
        "the two runs' releases cancels it, secret seed or not. To reproduce the weights' "
        "initialisation, seed before building the model and call tf.random.set_seed(None) "
        "before training; lipdp never seeds the noise."), stacklevel=stacklevel)


# Seeds of the noise draws salted in this process (`salted_seeds`): an offset fixed at the
# first salted draw, and the count of salted draws, never reset.
_SALTING = {"offset": None, "draws": itertools.count()}
_SEED_RANGE = 2 ** 31 - 1  # TensorFlow truncates op seeds modulo this


def _forget_salted_draws() -> None:
    """Start counting salted draws again, as a new process would (for the test suite: each
    test's noise then does not depend on the tests its process ran before it)."""
    _SALTING.update(offset=None, draws=itertools.count())


def salted_seeds(salt=None):
    """``(seed, seed2)`` for a noise draw, as ``tf.compat.v1.random.get_seed(None)`` gives
    them, with the op seed replaced, when the program set a global seed and `salt` is given
    (the private step count when the step is traced), by one no other salted draw of this
    process has: ``1 + (offset + n) mod (2^31 - 2)``, n the count of salted draws before it
    in the process, the offset a hash of the global seed and the `salt` of the process's
    first salted draw. Distinct for the first 2^31 - 2 salted draws of a process, whatever
    their graphs, steps and models.

    A seeded program seeds each random op from the global seed and the op's position in its
    graph, so a train step traced again (after a new `compile`), or another model's step of
    the same graph, drew the very noise of an earlier trace: the noise of two segments or two
    models was the same draws, scaled, and a difference of two released gradients cancelled
    it (two models traced at step 0 after one ``tf.keras.utils.set_random_seed``, trained on
    datasets differing in one record, released updates whose difference was the noiseless
    one, to 5e-5 against a noise std of 0.53: an audit, 2026-12-07). A salt made of the step
    and a count of traces, added into the op seed, still let two traces collide (a count
    gap of 2999 traces made up for a step gap of 94 489: a review); a count of draws cannot.
    The offset separates a process resumed from a checkpoint at step k (its first draw at
    step k) from the first run (its first draw at step 0); a seeded program run again in a
    new process draws its noise again, and so does a resumed process that draws noise at
    the first run's steps before it restores the checkpoint (a review: a `train_on_batch`
    before `load_weights` repeated 8 of 9 noise vectors): the runs of one seed
    (`warn_if_seeded`), which no seeded generator can tell apart. Without a global seed
    TensorFlow seeds every op at random: returned unchanged.
    """
    seed, seed2 = tf.compat.v1.random.get_seed(None)
    if seed is None or salt is None:
        return seed, seed2
    if _SALTING["offset"] is None:
        digest = hashlib.sha256(f"lipdp noise {int(seed)} {int(salt)}".encode()).digest()
        _SALTING["offset"] = int.from_bytes(digest[:8], "little") % (_SEED_RANGE - 1)
    return seed, 1 + (_SALTING["offset"] + next(_SALTING["draws"])) % (_SEED_RANGE - 1)


# The step counter of the private step being traced (`drawing_at_step`), for draws under XLA.
_STEP_COUNTER = None


@contextlib.contextmanager
def drawing_at_step(counter):
    """Within this context (while a private step is traced), noise drawn under XLA takes
    `counter` (an integer tensor, e.g. the model's count of private steps, different at
    every step) as its stateless draws' counter (`standard_normal`)."""
    global _STEP_COUNTER
    outer, _STEP_COUNTER = _STEP_COUNTER, counter
    try:
        yield
    finally:
        _STEP_COUNTER = outer


def _xla_seed(seed):
    """The seed of a stateless draw under XLA: a key folded with the step counter.

    XLA compiles TensorFlow's stateful random ops to a generator whose state starts from the
    op's seeds, and an unseeded op has seeds (0, 0) there: every process then draws the same
    "random" noise, which a difference of two runs' released gradients cancels (an audit
    recovered the noiseless difference of two neighbouring datasets to 1.9e-8). The key is
    two 63-bit integers from the operating system's generator (`secrets`) when the trace
    is made, in a program without a global seed (never stored: not in the model, its
    checkpoints or its saved files), or the global seed and `seed` (the op's salted seed) in
    a seeded one (which repeats its run, as outside XLA); the counter makes each step's draw
    another one.
    """
    if _STEP_COUNTER is None:
        raise RuntimeError(
            "Noise drawn under XLA (jit_compile) needs the private step's counter "
            "(lipdp.noise.drawing_at_step): outside a step it would repeat at every call.")
    global_seed = tf.compat.v1.random.get_seed(None)[0]
    if global_seed is None:
        key = [secrets.randbits(63), secrets.randbits(63)]
    else:
        key = [int(global_seed), int(seed if seed is not None else 0)]
    return tf.random.experimental.stateless_fold_in(
        tf.constant(key, tf.int64), tf.cast(_STEP_COUNTER, tf.int64))


def standard_normal(n, dtype=tf.float32, seed=None) -> tf.Tensor:
    """``n`` independent ``N(0, 1)`` samples (a 1-D tensor; `n` an int or a scalar tensor),
    in float32 (float64 for ``dtype=tf.float64``, from float64 uniforms); `seed` is the op
    seed of ``tf.random.uniform``. Under XLA the uniforms are a stateless draw keyed per
    trace and per step (`_xla_seed`; inside `drawing_at_step` only)."""
    compute = tf.float64 if tf.as_dtype(dtype) == tf.float64 else tf.float32
    n = tf.cast(n, tf.int32)
    shape = tf.stack([2, (n + 1) // 2])
    if kernels.in_xla_context():
        uniforms = tf.random.stateless_uniform(shape, seed=_xla_seed(seed), dtype=compute)
    else:
        uniforms = tf.random.uniform(shape, dtype=compute, seed=seed)
    radius = tf.sqrt(-2.0 * tf.math.log1p(-uniforms[0]))  # u < 1: 1 - u in (0, 1]
    angle = (2.0 * math.pi) * uniforms[1]
    return tf.concat([radius * tf.cos(angle), radius * tf.sin(angle)], 0)[:n]


def gaussian_noise(like: Sequence[tf.Tensor], stddevs, salt=None) -> list:
    """``[stddevs[i] * z_i]``, ``z_i`` independent standard normal tensors shaped like
    ``like[i]`` and of its dtype (one `standard_normal` draw each).

    Args:
        like: tensors giving the shapes and dtypes (e.g. the gradients).
        stddevs: one standard deviation per tensor (scalars or scalar tensors).
        salt: mixed into each draw's seed in a seeded program (`salted_seeds`).
    """
    noise = []
    for tensor, stddev in zip(like, stddevs):
        tensor = tf.convert_to_tensor(tensor)
        z = standard_normal(tf.size(tensor), tensor.dtype, seed=salted_seeds(salt)[1])
        z = tf.cast(tf.reshape(z, tf.shape(tensor)), tensor.dtype)
        noise.append(tf.cast(stddev, tensor.dtype) * z)
    return noise


def add_gaussian_noise(tensors: Sequence[tf.Tensor], stddevs, non_finite_messages=None,
                       salt=None) -> list:
    """``[tensors[i] + stddevs[i] * z_i]``, ``z_i`` independent standard normal tensors shaped
    like ``tensors[i]``: the fused kernel where `lipdp.kernels.usable_for` the tensor (float32
    on the CPU, outside XLA), else ``tensor + gaussian_noise([tensor], [stddev])[0]``.

    The kernel is seeded as ``tf.random.uniform`` is (``tf.compat.v1.random.get_seed``: the
    global seed and the op's, or a random seed when the program sets none), so a seeded
    program repeats its noise and an unseeded one never does; `salt` (the private step
    count when the step is traced) gives each trace of a seeded program its own noise
    (`salted_seeds`).

    Args:
        tensors: the tensors to noise (e.g. the averaged gradients).
        stddevs: one standard deviation per tensor (scalars or scalar tensors), used in the
            tensor's dtype: a float64 standard deviation for a float32 tensor is rounded to
            nearest, so round it up first (`lipdp.layers.base.round_up_to_float32`, as the
            private step does).
        non_finite_messages: optional, one message per tensor: a tensor with a NaN or an
            infinity then fails the computation with ``InvalidArgumentError(message)``, as
            ``tf.debugging.check_numerics`` does (the kernel checks in its own pass).
    """
    messages = non_finite_messages or [None] * len(tensors)
    noisy = []
    for tensor, stddev, message in zip(tensors, stddevs, messages):
        tensor = tf.convert_to_tensor(tensor)
        if kernels.usable_for(tensor):
            seed, seed2 = salted_seeds(salt)
            noisy.append(kernels.fused_ops().lipdp_add_gaussian_noise(
                tensor, tf.cast(stddev, tf.float32), seed=seed or 0, seed2=seed2 or 0,
                message=message or ""))
        else:
            noisy.append(_noised_by_tf_ops(tensor, stddev, message, salt))
    return noisy


def _noised_by_tf_ops(tensor, stddev, message=None, salt=None):
    """`add_gaussian_noise` of one tensor where the fused kernel is not usable:
    ``tf.debugging.check_numerics`` with `message` (when given), then ``tensor +
    gaussian_noise([tensor], [stddev])[0]``."""
    if message:
        tensor = tf.debugging.check_numerics(tensor, message)
    return tensor + gaussian_noise([tensor], [stddev], salt)[0]
