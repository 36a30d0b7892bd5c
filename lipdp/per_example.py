"""Exact per-example gradients, vectorised over the batch.

Used where the gradients themselves are wanted, not only their bound: the
tightness report (`lipdp.bounds.tightness`), run reports (`lipdp.reports`) and
classic clipped DP-SGD.
"""

from __future__ import annotations

from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf


def per_example_gradients(model: tf.keras.Model, per_example_loss: Callable, x, y,
                          variables: Sequence[tf.Variable] = None
                          ) -> Tuple[List[tf.Tensor], tf.Tensor, tf.Tensor]:
    """``(gradients, losses, y_pred)`` with ``gradients[v][i] = grad_v loss(f(x_i), y_i)``.

    Each example goes through the model alone (a batch of one) inside
    `tf.vectorized_map` (`tf.map_fn` through a recurrent layer's time loop:
    `loops_over_time`), so row i depends on example i only, by construction,
    and the cost grows linearly with the batch. (The Jacobian of the vector of
    per-example losses would give the same values, but its vectorised backward
    pass runs over the whole batch for every example: quadratic time and memory.)
    Memory grows as ``batch x number of parameters``: callers chunk large batches.

    Args:
        model: a Keras model (called with ``training=True``).
        per_example_loss: ``(y_true, y_pred) -> (batch,)`` losses.
        x, y: a batch.
        variables: defaults to ``model.trainable_variables``.

    Returns:
        gradients aligned with `variables`, each of shape ``(batch,) + v.shape``
        (zeros for a variable the loss does not depend on); the per-example
        losses ``(batch,)``; the model's outputs ``(batch, ...)``.
    """
    variables = list(model.trainable_variables if variables is None else variables)

    def one(example):
        x_i, y_i = tf.nest.map_structure(lambda t: tf.expand_dims(t, 0), example)
        with tf.GradientTape() as tape:
            y_pred = model(x_i, training=True)
            loss = tf.reduce_sum(per_example_loss(y_i, y_pred))
        gradients = tape.gradient(loss, variables,
                                  unconnected_gradients=tf.UnconnectedGradients.ZERO)
        return [tf.convert_to_tensor(g) for g in gradients], loss, y_pred[0]

    gradients, losses, y_pred = map_examples(one, (x, y), loops_over_time([model]))
    return list(gradients), losses, y_pred


def loops_over_time(layers: Iterable[tf.keras.layers.Layer]) -> bool:
    """Whether any of `layers` or of their sub-layers is a Keras recurrent layer that runs
    a symbolic loop over time (``unroll=False``: LSTM, GRU, SimpleRNN, any ``RNN`` cell,
    alone or in ``Bidirectional``). TensorFlow 2.15's `tf.vectorized_map` cannot vectorise
    the gradient of that loop (its converters fail on the loop's TensorList state with a
    `TypeError`), so per-example gradients through such a layer go one example after the
    other (`map_examples`)."""
    return any(isinstance(sub, tf.keras.layers.RNN) and not sub.unroll
               for layer in layers
               for sub in layer._flatten_layers(include_self=True, recursive=True))


def map_examples(one: Callable, elems, sequential: bool = False):
    """``one`` applied to each example of `elems` (tensors batched along their first axis),
    the results stacked: `tf.vectorized_map`, or with `sequential` `tf.map_fn` (a loop over
    the examples: the same values, the batch's cost times its size), its output
    signature read from a trace of `one` in a graph of its own (no op of that trace
    enters the caller's graph)."""
    if not sequential:
        try:
            return tf.vectorized_map(one, elems)
        except ValueError as error:
            writes = _variable_writes(_traced_alone(one, elems))
            if not writes:
                raise
            raise ValueError(
                "Per-example gradients run each example through the layers alone, inside "
                "tf.vectorized_map, which cannot run a variable write per example; these "
                f"calls write variables in training mode: {', '.join(writes)}. "
                "deel-lip's SpectralDense and SpectralConv2D update their power-iteration "
                "vectors in every training call: use lipdp's layers (lipdp.layers."
                "DP_SpectralDense, DP_SpectralConv2D project after the step instead), or "
                "layers whose call writes no variable.") from error
    traced = _traced_alone(one, elems)
    signature = tf.nest.map_structure(lambda t: tf.TensorSpec(t.shape, t.dtype),
                                      traced.structured_outputs)
    return tf.map_fn(one, elems, fn_output_signature=signature)


def _traced_alone(one: Callable, elems) -> tf.types.experimental.ConcreteFunction:
    """`one` traced on a single example of `elems` in a graph of its own (nothing it creates
    enters the caller's graph, nothing of it runs)."""
    element = tf.nest.map_structure(
        lambda t: tf.TensorSpec(tf.convert_to_tensor(t).shape[1:], t.dtype), elems)
    return tf.function(one, autograph=False).get_concrete_function(element)


_WRITES = ("AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp")


def _variable_writes(traced: tf.types.experimental.ConcreteFunction) -> List[str]:
    """The name scopes (the layers' paths, e.g. ``sequential/spectral_dense``) of the
    operations of `traced` that assign or scatter into a variable, directly or in a function
    they call (a layer's traced call, a loop's body)."""
    graph = traced.graph.as_graph_def()
    bodies = {f.signature.name: f.node_def for f in graph.library.function}
    known: Dict[str, bool] = {}

    def called(node):
        for value in node.attr.values():
            yield from ([value.func.name] if value.func.name else [])
            yield from (f.name for f in value.list.func)

    def writes(node) -> bool:
        if node.op in _WRITES or node.op.startswith("ResourceScatter"):
            return True
        for name in called(node):
            if name not in known:
                known[name] = False  # a recursive reference adds no write
                known[name] = any(writes(n) for n in bodies.get(name, ()))
            if known[name]:
                return True
        return False

    return sorted({node.name.rpartition("/")[0] or node.name
                   for node in graph.node if writes(node)})


def per_example_gradient_norms(gradients: Sequence[tf.Tensor]) -> List[tf.Tensor]:
    """The ``(batch,)`` L2 norm of each per-example gradient tensor."""
    return [tf.sqrt(tf.reduce_sum(tf.square(tf.reshape(g, (tf.shape(g)[0], -1))), axis=1))
            for g in gradients]


def chunked_gradient_norms(model: tf.keras.Model, per_example_loss: Callable,
                           batches: Iterable, chunk_size: int = 64,
                           variables: Sequence[tf.Variable] = None,
                           function_cache: Optional[Dict] = None) -> List[np.ndarray]:
    """The exact per-example gradient norm of each variable over every example of `batches`.

    Args:
        model, per_example_loss, variables: as for `per_example_gradients`.
        batches: an iterable of ``(x, y)`` batches (a `tf.data.Dataset`, a list).
        chunk_size: examples whose per-example gradients are held in memory at once
            (memory: chunk x number of parameters).
        function_cache: a dict that keeps the traced function between calls, keyed by
            model, loss and variables, for a caller that asks again and again (a callback
            every epoch): without it, each call traces the vectorised gradients anew.

    Returns:
        One ``(n,)`` array per variable (aligned with `variables`), n the number of
        examples; one traced function serves every chunk.
    """
    variables = list(model.trainable_variables if variables is None else variables)
    key = (id(model), per_example_loss, tuple(v.ref() for v in variables))
    norms_fn = None if function_cache is None else function_cache.get(key)
    if norms_fn is None:
        norms_fn = tf.function(lambda x, y: per_example_gradient_norms(
            per_example_gradients(model, per_example_loss, x, y, variables)[0]),
            reduce_retracing=True)
        if function_cache is not None:
            function_cache[key] = norms_fn
    chunks = [norms_fn(x[start:start + chunk_size], y[start:start + chunk_size])
              for x, y in batches for start in range(0, int(tf.shape(x)[0]), chunk_size)]
    return [np.concatenate([chunk[j].numpy() for chunk in chunks]) if chunks
            else np.zeros(0) for j in range(len(variables))]
