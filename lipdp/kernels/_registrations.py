"""Gradients and ``tf.vectorized_map`` converters of the fused kernels (registered once,
when `lipdp.kernels` loads them)."""

from __future__ import annotations

import tensorflow as tf
from deel.lip.layers import ScaledL2NormPooling2D
from tensorflow.python.ops.parallel_for.pfor import RegisterPFor, wrap


def _pool_attrs(node):
    """The pooling attributes of an op, or of the op a pfor converter is given."""
    return {key: node.get_attr(key) for key in ("pool_h", "pool_w", "coef", "eps")}


def _sort_pool_attrs(node):
    """The attributes of a ``LipdpSortPool`` op (or its gradient's), or of the op a pfor
    converter is given."""
    return {**_pool_attrs(node), "interleaved": node.get_attr("interleaved")}


def reference_l2_norm_pool(x, pool_h, pool_w, coef, eps):
    """deel-lip's ScaledL2NormPooling2D in TensorFlow ops: ``coef * sqrt(avg_pool(x^2))``,
    with its square-root gradient ``dy / (2 (sqrt(u) + eps))`` (deel-lip's own op)."""
    pooled = tf.nn.avg_pool2d(tf.square(x), (pool_h, pool_w), (pool_h, pool_w), "VALID")
    return ScaledL2NormPooling2D._sqrt(eps)(pooled) * coef  # pylint: disable=protected-access


def reference_sort_pool(x, pool_h, pool_w, coef, eps, interleaved):
    """GroupSort2 then `reference_l2_norm_pool`, in TensorFlow ops (what ``LipdpSortPool``
    computes in one pass)."""
    from lipdp.layers._pair_sort import reference_sort_pairs

    pairs = reference_sort_pairs(x, "interleaved" if interleaved else "halves")
    return reference_l2_norm_pool(pairs, pool_h, pool_w, coef, eps)


def _second_order(reference, x, dy, attrs, grad):
    """Gradient of a fused backward op ``dx(x, dy)``: `reference`'s backward pass,
    differentiated by TensorFlow (rarely needed)."""
    with tf.GradientTape() as outer:
        outer.watch([x, dy])
        with tf.GradientTape() as inner:
            inner.watch(x)
            y = reference(x, **attrs)
        dx = inner.gradient(y, x, output_gradients=dy)
    return outer.gradient(dx, [x, dy], output_gradients=grad)


def register(ops):
    """Register the gradients and vectorisation rules of the op module `ops`."""

    @tf.RegisterGradient("LipdpPairPermute")
    def _pair_permute_grad(op, grad):
        # Values are permuted by a permutation that only depends on the keys (piecewise
        # constant): the keys get no gradient, the values the transposed permutation, which
        # is the same pair swap.
        keys = op.inputs[0]
        return None, ops.lipdp_pair_permute(keys, grad,
                                            interleaved=op.get_attr("interleaved"))

    @RegisterPFor("LipdpPairPermute")
    def _pair_permute_pfor(pfor_input):
        # Pairs lie along the last axis: a leading loop axis changes nothing.
        pfor_input.stack_inputs()
        return wrap(ops.lipdp_pair_permute(
            pfor_input.stacked_input(0), pfor_input.stacked_input(1),
            interleaved=pfor_input.get_attr("interleaved")), True)

    def _merge_loop_axis(stacked):
        shape = tf.shape(stacked)
        return tf.reshape(stacked, tf.concat([[-1], shape[2:]], 0)), shape[:2]

    def _split_loop_axis(tensor, loop_shape):
        return tf.reshape(tensor, tf.concat([loop_shape, tf.shape(tensor)[1:]], 0))

    def register_pooling(name, forward, backward, reference, attrs_of):
        """Gradients (second order: `reference` differentiated) and vectorisation rules of
        the window-pooling op `name` and its gradient op ``name + "Grad"``: NHWC, the
        loop axis merged into the batch axis."""

        @tf.RegisterGradient(name)
        def _grad(op, grad):
            return backward(op.inputs[0], grad, **attrs_of(op))

        @tf.RegisterGradient(name + "Grad")
        def _grad_grad(op, grad):
            return _second_order(reference, *op.inputs, attrs_of(op), grad)

        @RegisterPFor(name)
        def _pfor(pfor_input):
            x, loop_shape = _merge_loop_axis(pfor_input.stacked_input(0))
            y = forward(x, **attrs_of(pfor_input))
            return wrap(_split_loop_axis(y, loop_shape), True)

        @RegisterPFor(name + "Grad")
        def _grad_pfor(pfor_input):
            pfor_input.stack_inputs()
            x, loop_shape = _merge_loop_axis(pfor_input.stacked_input(0))
            dy, _ = _merge_loop_axis(pfor_input.stacked_input(1))
            dx = backward(x, dy, **attrs_of(pfor_input))
            return wrap(_split_loop_axis(dx, loop_shape), True)

    register_pooling("LipdpL2NormPool", ops.lipdp_l2_norm_pool, ops.lipdp_l2_norm_pool_grad,
                     reference_l2_norm_pool, _pool_attrs)
    register_pooling("LipdpSortPool", ops.lipdp_sort_pool, ops.lipdp_sort_pool_grad,
                     reference_sort_pool, _sort_pool_attrs)
