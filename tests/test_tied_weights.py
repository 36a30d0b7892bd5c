"""Variables read outside their own layer's call in the forward pass (tied weights;
`lipdp.variable_reads`).

The ghost engine computes a variable's per-example norm from its own layer's input and output
cotangent. A ``Lambda`` reusing an ``Embedding`` matrix as the output projection (tied input and
output embeddings) adds a term to that matrix's gradient which the norm never saw: before the
check, removing one example moved the released sum by 268 C under clipping at C (2026-12-05,
`tests/test_tied_weights.py`'s model with a shift of 100), and by 1.9 C with the shift of 1
used here. The variables so read now get exact per-example gradients through the whole model,
as the vectorized engine takes them. Clipless DP-SGD refuses such a model (a DP layer of the
user's own reading another layer's kernel), since a bound covers one layer's use.
"""

import warnings

import numpy as np
import pytest
import tensorflow as tf

import lipdp
from lipdp.clipping import GhostFallbackWarning
from lipdp.layers import DP_BoundedInput, DP_QuickSpectralDense
from lipdp.layers.base import DPLayer
from lipdp.losses import DP_TauCategoricalCrossentropy
from lipdp.variable_reads import reads_outside_owners, traced_reads_outside_owners

D, C, VOCAB, WIDTH, LENGTH = 8, 1.0, 12, 4, 5


def _tied_embedding_model(engine):
    """Token ids -> Embedding -> mean over positions -> logits = (h + 1) E^T, E the embedding
    matrix read again by a Lambda."""
    inputs = tf.keras.Input((LENGTH,), dtype="int32")
    embedding = tf.keras.layers.Embedding(VOCAB, WIDTH, name="embedding")
    h = tf.keras.layers.GlobalAveragePooling1D()(embedding(inputs))
    h = tf.keras.layers.Lambda(lambda t: 1e-3 * t)(h)
    logits = tf.keras.layers.Lambda(
        lambda t: tf.matmul(t + 1.0, embedding.embeddings, transpose_b=True), name="tied")(h)
    metadata = lipdp.DatasetMetadata((LENGTH,), VOCAB, 64, 8, D, None, "shuffle")
    model = lipdp.DP_Model(inputs, logits, dataset_metadata=metadata, dp_parameters=lipdp.
                           DPParameters(0.0, 1e-5, mode="clipped", l2_norm_clip=C,
                                        engine=engine))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Keras' own warning on the Lambda's variable
        model.compile(loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      optimizer=tf.keras.optimizers.SGD(1.0))
    return model


def _batch():
    rng = np.random.default_rng(0)
    return (tf.constant(rng.integers(0, VOCAB, (D, LENGTH)), tf.int32),
            tf.constant(rng.integers(0, VOCAB, D), tf.int32))


def _sums(model, x, y, traced):
    """``D`` times the noise-free averaged gradient: the clipped sum."""
    step = tf.function(model.private_gradients) if traced else model.private_gradients
    with pytest.warns(GhostFallbackWarning, match="read outside their own layer's call") \
            if model.dp_parameters.engine != "vectorized" else warnings.catch_warnings():
        gradients = step(x, y)[0]
    return [D * g.numpy() for g in gradients]


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "traced"])
@pytest.mark.parametrize("engine", ["ghost", "mixed-ghost"])
def test_a_tied_embedding_is_clipped_on_its_whole_gradient(engine, traced):
    x, y = _batch()
    vectorized, model = _tied_embedding_model("vectorized"), _tied_embedding_model(engine)
    model.set_weights(vectorized.get_weights())
    reference = _sums(vectorized, x, y, traced)
    full = _sums(model, x, y, traced)
    for a, b in zip(full, reference):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    # The sensitivity itself: removing an example moves the sum by at most C.
    for i in range(D):
        keep = [j for j in range(D) if j != i]
        rest = _sums(model, tf.gather(x, keep), tf.gather(y, keep), traced)
        change = np.sqrt(sum(np.sum((a - b) ** 2) for a, b in zip(full, rest)))
        assert change <= C * (1 + 1e-5), (i, change)


class _TiedProjection(tf.keras.layers.Layer, DPLayer):
    """``x W^T W`` per example, W another layer's kernel held in a closure (not tracked):
    1-Lipschitz while ``||W|| <= 1``, but W's gradient gains a term its layer's bound omits."""

    def __init__(self, kernel_of, **kwargs):
        super().__init__(**kwargs)
        self._kernel_of = kernel_of

    def call(self, inputs):
        kernel = self._kernel_of()
        return tf.matmul(tf.matmul(inputs, kernel, transpose_b=True), kernel)

    def propagate_inputs(self, input_bound):
        return input_bound

    def backpropagate_inputs(self, input_bound, gradient_bound):
        return gradient_bound


def _clipless_model(tied_layer):
    first = DP_QuickSpectralDense(6, name="first")
    layers = [DP_BoundedInput(1.0, input_shape=(4,)), first,
              tied_layer(lambda: first.trainable_weights[0]), DP_QuickSpectralDense(3)]
    metadata = lipdp.DatasetMetadata((4,), 3, 64, 8, D, 1.0, "shuffle")
    return lipdp.DP_Sequential(layers, dp_parameters=lipdp.DPParameters(1.0, 1e-5),
                               dataset_metadata=metadata)


def test_clipless_refuses_a_dp_layer_reading_another_layers_kernel():
    model = _clipless_model(lambda kernel_of: _TiedProjection(kernel_of, name="tied"))
    with pytest.raises(ValueError, match=r"'first/.*' read by operation '.*tied/"):
        model.compile(loss=DP_TauCategoricalCrossentropy(1.0), optimizer="sgd")


class _Outer(tf.keras.layers.Layer):
    """Tracks an inner Dense and reads its kernel directly (the kernel is listed by both)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.inner = tf.keras.layers.Dense(3)

    def build(self, input_shape):
        self.inner.build(input_shape)

    def call(self, inputs):
        return self.inner(inputs) + tf.matmul(inputs, self.inner.kernel)


def test_reads_inside_a_layer_listing_the_variable_are_its_own():
    """No false alarm: a layer reading the kernel of a sub-layer it tracks, a plain Dense,
    and a forward pass traced in a scratch graph (eagerly nothing is recorded)."""
    inputs = tf.keras.Input((4,))
    outer = _Outer(name="outer")
    model = tf.keras.Model(inputs, tf.keras.layers.Dense(2)(outer(inputs)))
    x = tf.ones((2, 4))
    assert traced_reads_outside_owners(model, lambda: model(x, training=True)) == []
    with reads_outside_owners(model) as eager:
        model(x, training=True)
    assert eager == []
    lam = tf.keras.layers.Lambda(lambda t: tf.matmul(t, outer.inner.kernel, transpose_b=True))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tied = tf.keras.Model(inputs, lam(outer(inputs)))
        reads = traced_reads_outside_owners(tied, lambda: tied(x, training=True))
    assert [(v.name, name.split("/")[1]) for v, name in reads] == \
        [(outer.inner.kernel.name, lam.name)]
