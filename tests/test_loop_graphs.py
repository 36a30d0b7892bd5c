"""No sum of three or more tensors inside a loop of a training step, after Grappler.

Grappler's arithmetic optimizer turns a tree of same-shape additions into one ``AddN``; when
that ``AddN``'s inputs are live at the estimated peak memory, its memory optimizer rewrites it
into a ``TemporaryVariable`` accumulated with ``AssignAdd``. Inside a ``while`` loop that
variable already exists in the loop's second iteration, and the step fails with
``AlreadyExistsError`` (tensorflow/tensorflow#23780). Which ``AddN`` the memory optimizer
picks depends on the whole step's memory estimate: the paper's CNN trained with the ghost
engine failed at batch 256 and not at 192. So lipdp's loop bodies must not contain an ``AddN``
of more than two inputs after the arithmetic optimizer, whatever the batch size.

The graphs are optimized as ``tf.function`` optimizes them (Grappler's default rewrites, here
on graphs of any size) and inspected after control flow is lowered to frames: a node is in a
loop when it is reachable from an ``Enter`` node without passing an ``Exit`` node.
"""

import collections
import os

import pytest
import tensorflow as tf
from tensorflow.core.protobuf import config_pb2
from tensorflow.python.grappler import tf_optimizer

from lipdp.layers._bjorck import (gram_space_bjorck, kernel_space_bjorck,
                                  normalised_gram_space_bjorck)

REPO_CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                           "configs", "fashion_mnist_cnn.yaml")


def _optimized(concrete_function):
    graph = concrete_function.graph
    with graph.as_default():
        meta_graph = tf.compat.v1.train.export_meta_graph(graph=graph,
                                                          graph_def=graph.as_graph_def())
    meta_graph.collection_def["train_op"].node_list.value.extend(
        [t.name for t in concrete_function.outputs])
    config = config_pb2.ConfigProto()
    config.graph_options.rewrite_options.min_graph_nodes = -1  # small graphs too
    return tf_optimizer.OptimizeGraph(config, meta_graph)


def loops_and_sums(concrete_function):
    """``(loops, sums)`` of `concrete_function`'s graph as Grappler leaves it: the number of
    ``Enter`` nodes (one per loop variable of each loop) and the names of the ``AddN`` nodes of
    more than two inputs inside a loop frame."""
    graph = _optimized(concrete_function)
    consumers = collections.defaultdict(list)
    for node in graph.node:
        for name in node.input:
            consumers[name.lstrip("^").split(":")[0]].append(node)
    enters = [n for n in graph.node if n.op == "Enter"]
    in_loop, frontier = set(), list(enters)
    while frontier:
        node = frontier.pop()
        if node.name in in_loop or node.op == "Exit":
            continue
        in_loop.add(node.name)
        frontier.extend(consumers[node.name])
    return len(enters), sorted(n.name for n in graph.node if n.op == "AddN"
                               and n.name in in_loop
                               and sum(not i.startswith("^") for i in n.input) > 2)


@pytest.mark.parametrize("shape", [(3136, 512), (64, 600)])
@pytest.mark.parametrize("beta", [0.5, 0.4])
def test_gram_space_bjorck_loop_has_no_sum_of_three(shape, beta):
    function = tf.function(lambda w: gram_space_bjorck(w, 1e-6, beta, 15))
    loops, sums = loops_and_sums(function.get_concrete_function(tf.TensorSpec(shape)))
    assert loops > 0  # the check sees the loop
    assert sums == []


@pytest.mark.parametrize("shape", [(784, 1024), (1024, 784), (64, 60)])
def test_kernel_space_bjorck_loop_has_no_sum_of_three(shape):
    """The square-ish kernels' loop, its Gram matrix in blocks (the main job's 784 x 1024
    kernel) or in one product."""
    function = tf.function(lambda w: kernel_space_bjorck(w, 1e-6, 0.5, 15))
    loops, sums = loops_and_sums(function.get_concrete_function(tf.TensorSpec(shape)))
    assert loops > 0
    assert sums == []


def test_normalised_gram_space_bjorck_loop_has_no_sum_of_three():
    function = tf.function(lambda w, u: normalised_gram_space_bjorck(w, u, 1e-3, 10, 1e-6,
                                                                     0.5, 15)[0])
    _, sums = loops_and_sums(function.get_concrete_function(tf.TensorSpec([3136, 512]),
                                                            tf.TensorSpec([1, 512])))
    assert sums == []


def test_the_check_finds_a_sum_of_three_in_a_loop():
    """The detector itself: the loop of the Björck increment as it was written when the
    paper's CNN failed (``Q + b D + b Q D``) is reported; with its two sums it is not."""

    def loop(update):
        def function(w):
            deviation = tf.eye(64) - tf.matmul(w, w, transpose_a=True)
            return tf.while_loop(lambda i, q, d: i < 3,
                                 lambda i, q, d: (i + 1, update(q, d), tf.matmul(d, d)),
                                 (0, 0.5 * deviation, deviation))[1]

        return tf.function(function).get_concrete_function(tf.TensorSpec([300, 64]))

    assert len(loops_and_sums(loop(lambda q, d: q + 0.5 * d + 0.5 * tf.matmul(q, d)))[1]) == 1
    assert loops_and_sums(loop(lambda q, d: q + 0.5 * (d + tf.matmul(q, d))))[1] == []


def test_the_papers_cnn_ghost_step_has_no_sum_of_three_in_a_loop():
    """The step that failed: the paper's CNN (its Gram-space Björck on the 3136 x 512 dense
    kernel, deel-lip's on the convolutions, power iterations) with ghost clipping's chunk
    loops, traced at batch 256."""
    from lipdp.config import build_model, load_config
    from lipdp.losses import DP_TauCategoricalCrossentropy
    from lipdp.metadata import DatasetMetadata, DPParameters

    batch = 256
    metadata = DatasetMetadata(input_shape=(28, 28, 1), nb_classes=10, nb_samples_train=2048,
                               nb_samples_test=256, batch_size=batch, max_norm=1.0,
                               sampling="shuffle")
    parameters = DPParameters(1.0, 1e-5, mode="clipped", clipping="flat", l2_norm_clip=1.0,
                              engine="ghost")
    tf.keras.utils.set_random_seed(0)
    model = build_model(load_config(REPO_CONFIG)["model"], metadata, parameters)
    model.compile(loss=DP_TauCategoricalCrossentropy(8.0),
                  optimizer=tf.keras.optimizers.Adam(1e-3))
    step = tf.function(lambda x, y: model.train_step((x, y)))
    loops, sums = loops_and_sums(step.get_concrete_function(
        tf.TensorSpec([batch, 28, 28, 1]), tf.TensorSpec([batch, 10])))
    assert loops > 10
    assert sums == []
