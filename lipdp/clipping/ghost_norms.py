"""Ghost norms: per-example gradient norms of a layer from its input and output cotangent.

For a layer ``z = op(a; W) + b`` the per-example gradient of W is a bilinear
function of the layer input ``a_i`` and of the cotangent ``g_i = d loss_i / d z_i``
(the gradient w.r.t. the pre-activation). Its squared norm can be computed
without forming that gradient (Goodfellow 2015; Lee & Kifer 2021, Sec. 5;
the "Gram" form of Li et al. 2022 for positions/patches):

* Dense on ``(batch, d_in)`` inputs: ``||a_i g_i^T||^2 = ||a_i||^2 ||g_i||^2``;
  bias: ``||g_i||^2``.
* Dense on ``(batch, T..., d_in)`` inputs (the kernel is applied at T
  positions): ``||sum_t a_it g_it^T||^2 = sum_{t,s} <a_it, a_is> <g_it, g_is>``;
  bias ``||sum_t g_it||^2``.
* Conv2D: the same Gram identity on the unfolded patches ``a_ip`` (one per
  output pixel p, extracted with the layer's own kernel size, strides and
  padding, so that ``z_ip = <a_ip, W>``): ``sum_{p,q} <a_ip,a_iq> <g_ip,g_iq>``,
  times ``N^2`` when the layer convolves with ``N * W`` (lipdp's
  `DP_QuickSpectralConv2D`); bias ``||sum_p g_ip||^2``.
* Embedding with ids ``(batch, T...)``: ``sum_{t,s} 1{id_it = id_is} <g_it, g_is>``.

Method ``"gram"`` (engine ``"ghost"``) always uses these identities: no
per-example gradient of the layer is ever formed. Gram matrices cost ``2 T^2``
numbers per example; when that is more than the ``m n`` entries of the layer's
per-example gradient (an early convolution: many patches, few channels), method
``"auto"`` (engine ``"mixed-ghost"``) takes the squared norm of
``sum_t a_it g_it^T`` instead, as Lee & Kifer's Algorithms 2-3 (bmm on im2col
patches) and the "mixed ghost clipping" of Bu et al. (2022) do: that layer's
per-example gradient exists transiently, chunk by chunk, and only its norm is
kept (it never enters the update, which comes from the reweighted backward
pass). For a convolution the direct form never unfolds patches: the gradient block of
each kernel offset is a strided slice of the padded input times the cotangent
(`_conv_direct_squared_norms`; 2.1x faster than the unfolded form on the zoo VGG's first
convolution, 1.9x on its second, at batch 2000). Both forms are computed over chunks of the
batch so that at most ``_CHUNK_ELEMENTS`` intermediate numbers live at once.

Rules are registered per *exact* layer class (`register_ghost_rule`): a
subclass may change ``call``, so it falls back to the exact engine until it is
registered itself.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Dict, List, Optional

import tensorflow as tf

from lipdp.layers.conv import DP_QuickSpectralConv2D
from lipdp.layers.dense import DP_QuickSpectralDense

# Most intermediate numbers (Gram entries, or entries of per-example layer gradients) held
# at once per chunk of the batch: 16 MiB of float32.
_CHUNK_ELEMENTS = 1 << 22


@dataclasses.dataclass(frozen=True)
class GhostRule:
    """How to get the per-example squared gradient norms of one layer type.

    Attributes:
        squared_norms: ``(layer, inputs, cotangent, method) -> [(batch,), ...]``
            aligned with ``variables(layer)``, where ``inputs`` is what ``call``
            received, ``cotangent`` the per-example gradient w.r.t. the
            pre-activation and ``method`` ``"gram"`` or ``"auto"``.
        variables: the layer's trainable variables the rule covers.
        unsupported: ``layer -> reason or None``; a reason sends the layer to
            the exact engine.
    """

    squared_norms: Callable
    variables: Callable
    unsupported: Callable


_REGISTRY: Dict[type, GhostRule] = {}


def _kernel_and_bias(layer) -> List[tf.Variable]:
    variables = [layer.kernel] + ([layer.bias] if getattr(layer, "use_bias", False) else [])
    return [v for v in variables if v.trainable]


def _always_supported(layer) -> Optional[str]:
    del layer
    return None


def register_ghost_rule(*layer_types, variables=_kernel_and_bias, unsupported=_always_supported):
    """Decorator registering ``squared_norms(layer, inputs, cotangent, method)`` for exact
    layer types."""

    def decorator(function):
        for layer_type in layer_types:
            _REGISTRY[layer_type] = GhostRule(function, variables, unsupported)
        return function

    return decorator


def ghost_rule(layer) -> Optional[GhostRule]:
    """The rule registered for ``type(layer)`` (exact type), or None."""
    return _REGISTRY.get(type(layer))


# --------------------------------------------------------------------------- helpers
def _map_chunks(function, tensors, elements_per_example: int, dtype) -> tf.Tensor:
    """``concat_c function(*chunk_c)`` over chunks of the batch, shape ``(batch,)``.

    Chunks hold at most ``_CHUNK_ELEMENTS // elements_per_example`` examples; the
    batch is split into equal chunks (zero-padded, the padding is dropped).
    """
    batch = tf.shape(tensors[0])[0]
    max_chunk = max(1, _CHUNK_ELEMENTS // max(1, int(elements_per_example)))
    nb_chunks = tf.maximum((batch + max_chunk - 1) // max_chunk, 1)
    chunk = tf.maximum((batch + nb_chunks - 1) // nb_chunks, 1)
    padding = nb_chunks * chunk - batch

    def split(t):
        t = tf.pad(t, [[0, padding]] + [[0, 0]] * (t.shape.rank - 1))
        return tf.reshape(t, tf.concat([[nb_chunks, chunk], tf.shape(t)[1:]], axis=0))

    out = tf.map_fn(lambda chunk_tensors: function(*chunk_tensors),
                    tuple(split(t) for t in tensors),
                    fn_output_signature=tf.TensorSpec([None], dtype),
                    parallel_iterations=1)  # one chunk in flight: the memory bound holds
    return tf.reshape(out, [-1])[:batch]


def uses_gram(positions, in_features, out_features, method="gram") -> bool:
    """Whether the Gram identity is used: always for ``"gram"``; for ``"auto"``
    when its ``2 T^2`` numbers per example are at most the ``m n`` of the gradient."""
    if method not in ("auto", "gram"):
        raise ValueError("Received an invalid value for `method`, expected 'auto' or 'gram'. "
                         f"Received: method={method!r}")
    if method == "gram" or positions is None:
        return True
    return 2 * positions * positions <= in_features * out_features


def _bilinear_squared_norms(inputs, g, in_features, method="gram",
                            features=lambda t: t) -> tf.Tensor:
    """``||sum_t a_t g_t^T||_F^2`` per example, ``a = features(inputs)`` of shape
    ``(B, T, in_features)``, ``g (B, T, n)``.

    Gram form ``sum_{t,s} <a_t, a_s> <g_t, g_s>`` or direct form (see `uses_gram`).
    `features` (e.g. the unfolding of convolution patches) runs chunk by chunk,
    so its output never exists for the whole batch.
    """
    positions, n = g.shape[1], int(g.shape[2])
    if uses_gram(positions, in_features, n, method):
        size = 2 * (positions or 1024) ** 2 + (positions or 1024) * in_features

        def chunk_norms(inputs_chunk, g_chunk):
            a_chunk = features(inputs_chunk)
            gram_a = tf.matmul(a_chunk, a_chunk, transpose_b=True)
            gram_g = tf.matmul(g_chunk, g_chunk, transpose_b=True)
            return tf.reduce_sum(gram_a * gram_g, axis=[1, 2])
    else:
        size = in_features * n + (positions or 1024) * in_features

        def chunk_norms(inputs_chunk, g_chunk):
            gradient = tf.matmul(features(inputs_chunk), g_chunk, transpose_a=True)  # (c, m, n)
            return tf.reduce_sum(tf.square(gradient), axis=[1, 2])

    return _map_chunks(chunk_norms, [inputs, g], size, g.dtype)


def _squared(t) -> tf.Tensor:
    """Squared norm over all non-batch axes."""
    return tf.reduce_sum(tf.reshape(tf.square(t), (tf.shape(t)[0], -1)), axis=1)


def _positions(t, channels) -> tf.Tensor:
    """``(B, T..., c) -> (B, T, c)``, with T static whenever the positions' shape is: in a
    `fit` the batch dimension is unknown, and ``-1`` would leave T unknown too (then
    `uses_gram` could not choose the cheaper form)."""
    static = t.shape[1:-1].is_fully_defined() and t.shape[-1] == channels
    positions = t.shape[1:-1].num_elements() if static else -1
    return tf.reshape(t, (tf.shape(t)[0], positions, channels))


# --------------------------------------------------------------------------- Dense
@register_ghost_rule(tf.keras.layers.Dense, DP_QuickSpectralDense)
def dense_squared_norms(layer, inputs, cotangent, method="gram"):
    """Kernel: ``||a||^2 ||g||^2`` (2D inputs) or the Gram identity; bias ``||sum_t g_t||^2``."""
    a = tf.cast(inputs, cotangent.dtype)
    if a.shape.rank == 2:
        g_squared = _squared(cotangent)
        kernel, bias = _squared(a) * g_squared, g_squared
    else:
        a3, g3 = _positions(a, a.shape[-1]), _positions(cotangent, cotangent.shape[-1])
        kernel = _bilinear_squared_norms(a3, g3, int(a.shape[-1]), method)
        bias = _squared(tf.reduce_sum(g3, axis=1))
    norms = {layer.kernel.ref(): kernel}
    if getattr(layer, "use_bias", False):
        norms[layer.bias.ref()] = bias
    return [norms[v.ref()] for v in _kernel_and_bias(layer)]


# --------------------------------------------------------------------------- Conv2D
def _conv_unsupported(layer) -> Optional[str]:
    if layer.data_format != "channels_last":
        return f"data_format={layer.data_format!r}"
    if tuple(layer.dilation_rate) != (1, 1):
        return f"dilation_rate={tuple(layer.dilation_rate)}"
    if getattr(layer, "groups", 1) != 1:
        return f"groups={layer.groups}"
    if str(layer.padding).lower() not in ("same", "valid"):
        return f"padding={layer.padding!r}"
    return None


def _same_padding(size, kernel, stride, out):
    """TensorFlow's 'same' padding ``(before, after)`` along one axis."""
    total = max((out - 1) * stride + kernel - size, 0)
    return total // 2, total - total // 2


def _conv_direct_squared_norms(layer, inputs, g):
    """``||sum_p patch_p(a_i) g_ip^T||_F^2`` per example, one kernel offset at a time.

    The kernel entry at offset ``(dy, dx)`` multiplies, at output pixel ``(y, x)``, the
    (padded) input pixel ``(y sh + dy, x sw + dx)``; so the per-example gradient block of
    that offset is ``sum_{y,x} a_pad[y sh + dy, x sw + dx, :] g[y, x, :]^T``, the product of
    a strided slice of the padded input with the cotangent (a batched C x P by P x F
    product). The blocks of the kh kw offsets are disjoint coordinates of the gradient, so
    its squared norm is the sum of theirs. No patch is materialised: the transient blocks
    hold ``C F`` numbers per example each (chunked over the batch like the other forms).
    """
    kh, kw = layer.kernel_size
    sh, sw = layer.strides
    height, width, channels = (int(d) for d in inputs.shape[1:])
    out_h, out_w, filters = (int(d) for d in g.shape[1:])
    if layer.padding.lower() == "same":
        pads = [_same_padding(height, kh, sh, out_h), _same_padding(width, kw, sw, out_w)]
    else:
        pads = [(0, 0), (0, 0)]

    def chunk_norms(a_chunk, g_chunk):
        padded = tf.pad(a_chunk, [[0, 0], list(pads[0]), list(pads[1]), [0, 0]])
        cotangents = tf.reshape(g_chunk, [-1, out_h * out_w, filters])
        total = 0.0
        for dy in range(kh):
            for dx in range(kw):
                window = padded[:, dy:dy + sh * (out_h - 1) + 1:sh,
                                dx:dx + sw * (out_w - 1) + 1:sw, :]
                block = tf.matmul(tf.reshape(window, [-1, out_h * out_w, channels]),
                                  cotangents, transpose_a=True)  # (c, C, F)
                total += tf.reduce_sum(tf.square(block), axis=[1, 2])
        return total

    size = channels * filters + height * width * channels + out_h * out_w * filters
    return _map_chunks(chunk_norms, [inputs, g], size, g.dtype)


def _conv_squared_norms(layer, inputs, cotangent, scale, method):
    kh, kw = layer.kernel_size
    sh, sw = layer.strides
    in_features = kh * kw * int(inputs.shape[-1])

    def patches(images):  # (c, H, W, C) -> (c, P, kh kw C), the rows the kernel multiplies
        unfolded = tf.image.extract_patches(images, sizes=[1, kh, kw, 1], strides=[1, sh, sw, 1],
                                            rates=[1, 1, 1, 1], padding=layer.padding.upper())
        return _positions(unfolded, in_features)

    g3 = _positions(cotangent, cotangent.shape[-1])
    a = tf.cast(inputs, cotangent.dtype)
    if uses_gram(g3.shape[1], in_features, int(g3.shape[2]), method) or \
            not inputs.shape[1:].is_fully_defined():
        kernel = _bilinear_squared_norms(a, g3, in_features, method, features=patches)
    else:
        kernel = _conv_direct_squared_norms(layer, a, cotangent)
    norms = {layer.kernel.ref(): (scale * scale) * kernel}
    if layer.use_bias:
        norms[layer.bias.ref()] = _squared(tf.reduce_sum(g3, axis=1))
    return [norms[v.ref()] for v in _kernel_and_bias(layer)]


@register_ghost_rule(tf.keras.layers.Conv2D, unsupported=_conv_unsupported)
def conv2d_squared_norms(layer, inputs, cotangent, method="gram"):
    """Bilinear norm on the layer's patches (``z_p = <patch_p, W> + b``)."""
    return _conv_squared_norms(layer, inputs, cotangent, 1.0, method)


@register_ghost_rule(DP_QuickSpectralConv2D, unsupported=_conv_unsupported)
def dp_conv2d_squared_norms(layer, inputs, cotangent, method="gram"):
    """As Conv2D, times ``coef^2``: the layer convolves with ``coef * kernel``."""
    return _conv_squared_norms(layer, inputs, cotangent, float(layer.coef), method)


# --------------------------------------------------------------------------- Embedding
def _embedding_unsupported(layer) -> Optional[str]:
    return "sparse=True" if getattr(layer, "sparse", False) else None


@register_ghost_rule(tf.keras.layers.Embedding, variables=lambda layer: [
    v for v in [layer.embeddings] if v.trainable], unsupported=_embedding_unsupported)
def embedding_squared_norms(layer, inputs, cotangent, method="gram"):
    """``sum_{t,s} 1{id_t = id_s} <g_t, g_s>``: rows hit by the same id add up (always
    this Gram form: the direct one would need a vocabulary-sized gradient)."""
    del method
    if not layer.embeddings.trainable:
        return []
    ids = tf.reshape(tf.cast(inputs, tf.int32), (tf.shape(inputs)[0], -1))
    g3 = _positions(cotangent, cotangent.shape[-1])
    if ids.shape[1] == 1:
        return [_squared(g3)]
    positions = int(ids.shape[1]) if ids.shape[1] is not None else 1024

    def chunk_norms(id_chunk, g_chunk):
        same = tf.cast(tf.equal(id_chunk[:, :, None], id_chunk[:, None, :]), g_chunk.dtype)
        return tf.reduce_sum(same * tf.matmul(g_chunk, g_chunk, transpose_b=True), axis=[1, 2])

    return [_map_chunks(chunk_norms, [ids, g3], 2 * positions * positions, g3.dtype)]
