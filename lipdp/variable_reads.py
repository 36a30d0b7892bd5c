"""Reads of trainable variables outside the calls of the layers that own them.

lipdp computes what it knows of a variable's per-example gradient layer by layer: Clipless'
bound of a variable covers the use its own layer's ``call`` makes of it (the layer's bound
methods), and the ghost engine's per-example norm of a variable is computed from its layer's
recorded input and output cotangent. Code elsewhere in the forward pass that reads the same
variable -- a ``Lambda`` reusing an embedding matrix as the output projection (tied weights),
a layer holding another layer's kernel in a closure -- adds a term to the variable's gradient
that neither sees. Measured (2026-12-05): a tied embedding under ghost clipping at C moved the
released sum by 268 C when one example was removed, while each example was clipped at C by its
embedding layer's norm. Keras lists such a variable under its owner only (a layer *tracking*
another layer lists that layer's variables: the variable is then shared between layers, which
lipdp refuses or falls back on), so the reads are looked up in the graph of the traced forward
pass: every operation consuming the variable's handle, placed by its creation order against
the calls of the layers that list the variable.

What counts as the variable's own use: any operation created during a call of a layer (not a
model) whose ``trainable_weights`` hold it, sub-layer calls and nested functions or control
flow created there included. Reads in the forward pass before or after those calls (in another
layer, in a model's own ``call``, in the loss) are *outside*. Operations created before or
after the forward pass (the bound pass, projections, optimizer) are not looked at. Variables
that no layer lists (model-level variables) are left to the callers' own rules.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Dict, List, Tuple

import tensorflow as tf

from lipdp.clipping.validation import _all_layers, wrapped_calls

__all__ = ["reads_outside_owners", "traced_reads_outside_owners", "describe_reads"]

Read = Tuple[tf.Variable, str]  # the variable, the name of the operation reading it


@contextlib.contextmanager
def reads_outside_owners(model: tf.keras.Model):
    """Record the calls of `model`'s layers while the block builds a graph (a traced step);
    on exit the yielded list holds a ``(variable, operation name)`` for every read of a
    trainable variable, by an operation the block created, outside every call of the layers
    that list the variable (module docstring). Executed eagerly the block is not recorded and
    the list stays empty: `traced_reads_outside_owners` traces a forward pass for that."""
    found: List[Read] = []
    if tf.executing_eagerly():
        yield found
        return
    graph = tf.compat.v1.get_default_graph()
    layers = [layer for layer in _all_layers(model)
              if layer.trainable_weights and not isinstance(layer, tf.keras.Model)]
    spans: Dict[int, List[Tuple[int, int]]] = {id(layer): [] for layer in layers}

    def wrap(layer, original):
        def wrapper(*args, **kwargs):
            here = tf.compat.v1.get_default_graph() is graph  # not a loop body's or branch's
            start = len(graph.get_operations())
            try:
                return original(*args, **kwargs)
            finally:
                if here:
                    spans[id(layer)].append((start, len(graph.get_operations())))

        return tf.autograph.experimental.do_not_convert(wrapper)

    first = len(graph.get_operations())
    with wrapped_calls(layers, wrap):
        yield found
    operations = graph.get_operations()
    created = {op.name: index for index, op in enumerate(operations) if index >= first}
    own: Dict[object, List[Tuple[int, int]]] = {}
    for layer in layers:
        for variable in layer.trainable_weights:
            own.setdefault(variable.ref(), []).extend(spans[id(layer)])
    handles = {id(external): internal for external, internal in graph.captures}
    for ref, calls in own.items():
        variable = ref.deref()
        internal = handles.get(id(variable.handle))
        for consumer in internal.consumers() if internal is not None else ():
            index = created.get(consumer.name)
            if index is not None and not any(a <= index < b for a, b in calls):
                found.append((variable, consumer.name))


def traced_reads_outside_owners(model: tf.keras.Model, forward: Callable[[], object]
                                ) -> List[Read]:
    """`reads_outside_owners` of ``forward()`` traced once in a scratch graph (nothing runs):
    for a forward pass executed eagerly, and for checks before any step."""
    found: List[Read] = []

    def traced():
        with reads_outside_owners(model) as reads:
            forward()
        found.extend(reads)

    # AutoGraph on, as in fit's own function: Keras converts a user layer's `call` (Python
    # control flow on tensors) only then.
    tf.function(traced).get_concrete_function()
    return found


def describe_reads(reads: List[Read]) -> str:
    """``'variable' read by operation 'name'`` for each read, ``; ``-separated."""
    return "; ".join(f"'{variable.name}' read by operation '{name}'" for variable, name in reads)
