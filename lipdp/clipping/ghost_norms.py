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
kept (it never enters the update, which comes from the layer's output and its
reweighted cotangents). For a convolution the direct form never unfolds patches:
the gradient block of each kernel offset is a strided slice of the padded input times the cotangent
(`_conv_direct_squared_norms`; 2.1x faster than the unfolded form on the zoo VGG's first
convolution, 1.9x on its second, at batch 2000). Both forms are computed over chunks of the
batch so that at most ``_CHUNK_ELEMENTS`` intermediate numbers live at once.

Rounding. Every rule returns an *upper bound* of the exact squared norm of the
per-example gradient formed from the float32 inputs and cotangents it sees, never
an estimate that rounding can put below it. A Gram identity sums terms of both
signs: a record whose per-position gradients cancel (features alternating in sign
along a sequence or an image) had its float32 Gram sum come out near 0, or
negative, while the gradient's norm was several times C, and the example was
summed unclipped: 8.1 C was measured on a Dense layer over 64 positions with
inputs of 1e8 (2026-12-04; a negative sum gave a NaN factor and stopped the
step at that example instead). Hence, with ``S_i = sum_t ||a_it|| ||g_it||``
(float64; Cauchy-Schwarz bounds every Gram term by its share of ``S_i^2``):

* Gram forms: ``gamma' S_i^2`` is added to the sum of the products of the two
  Gram matrices, ``gamma' = 1.01 ((1 + gamma_d)(1 + gamma_n)(1 + gamma_{T+1})(1 +
  gamma64_T) - 1)`` for Gram entries that are float32 dot products of lengths d
  and n, products and row sums in float32 and the T row sums in float64
  (Higham's bounds, any summation order; the whole sum in float32 would need
  ``gamma_{T^2}``, 0.037 for a 28 x 28 image);
* direct forms: a float32 product summing T positions is off by at most
  ``gamma_T S`` in Frobenius norm, so ``(||fl(G)|| + gamma_T S)^2`` bounds
  ``||G||^2``, block by block for convolutions;
* sums of squares, the Dense product ``||a||^2 ||g||^2`` and the biases'
  ``||sum_t g_t||^2``: float64 throughout.

Each float64 result is multiplied by ``1 + 4 gamma64_k`` (k the most terms of one of
its float64 sums) and rounded up to float32. The price is some extra clipping: on a
plain Conv2D 32 -> 64 CNN trained 200 steps on Fashion-MNIST (``S^2 / N^2`` from 100
to 800), the bounds exceeded the exact squared norms by 0.64% (median of 256
examples) and 3.9% (largest) on the first convolution's Gram form, 0.38% and 1.1%
on the second's, and 0.1% and 0.23% at most in the direct forms. Outside: float32
entries below ``2^-126`` are read as 0 (TensorFlow flushes them, also float32 products
that fall below it): each Gram entry moves by at most ``d 2^-126`` (``n 2^-126``), so a
squared norm by about ``2^-126 T^2 (d max ||g_t||^2 + n max ||a_t||^2)``, far below
any threshold C used in practice.

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
from lipdp.gram_certificates import U64
from lipdp.rounding import UNIT_ROUNDOFF as U32

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
def _gamma(k, unit) -> tf.Tensor:
    """Higham's ``gamma_k = k u / (1 - k u)`` in float64, for a count k (an int or an int
    tensor: a number of positions may be known at run time only); inf when ``k u >= 1``."""
    ku = tf.cast(k, tf.float64) * unit
    return tf.where(ku < 1.0, ku / (1.0 - ku), tf.constant(float("inf"), tf.float64))


def _with_slack(value64, terms) -> tf.Tensor:
    """`value64` times ``1 + 4 gamma64_terms``: covers the float64 roundings of a result
    combining a few sums of at most `terms` terms each."""
    return value64 * (1.0 + 4.0 * _gamma(terms, U64))


def _float32_at_least(value64) -> tf.Tensor:
    """A float32 tensor at least the non-negative float64 `value64` (rounding to nearest
    after a ``2^-23`` relative increase cannot go below it; inf beyond float32's range)."""
    return tf.cast(value64 * (1.0 + 2.0 ** -23), tf.float32)


def _norms64(t) -> tf.Tensor:
    """L2 norms over the last axis, in float64."""
    return tf.sqrt(_squared64_last(t))


def _squared64_last(t) -> tf.Tensor:
    t = tf.cast(t, tf.float64)
    return tf.reduce_sum(t * t, axis=-1)


def _squared64(t) -> tf.Tensor:
    """Squared norm over all non-batch axes, in float64."""
    return _squared64_last(tf.reshape(t, (tf.shape(t)[0], -1)))


def _gram_sum(gram_a, gram_g) -> tf.Tensor:
    """``sum_{t,s} A_ts G_ts`` per example of two ``(c, T, T)`` float32 Gram matrices: the
    products and the sums of each row in float32, the T row sums in float64."""
    rows = tf.reduce_sum(gram_a * gram_g, axis=2)
    return tf.reduce_sum(tf.cast(rows, tf.float64), axis=1)


def _gram_bound(value64, spread, gram_lengths, positions) -> tf.Tensor:
    """``value + gamma' S^2`` (module docstring, "Rounding"): `value64` from `_gram_sum` of
    Gram entries that are float32 dot products of `gram_lengths`, over `positions` rows,
    `spread` S (float64)."""
    growth = (1.0 + _gamma(positions + 1, U32)) * (1.0 + _gamma(positions, U64))
    for length in gram_lengths:
        growth *= 1.0 + _gamma(length, U32)
    return value64 + 1.01 * (growth - 1.0) * spread * spread


def _direct_bound(gradient, spread, positions) -> tf.Tensor:
    """``(||fl(G)|| + gamma_T S)^2`` for a float32 per-example gradient ``(c, m, n)`` whose
    entries sum `positions` products (module docstring, "Rounding"), before the slack."""
    return tf.square(tf.sqrt(_squared64(gradient)) + _gamma(positions, U32) * spread)


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
    """A float64 upper bound of ``||sum_t a_t g_t^T||_F^2`` per example (module docstring,
    "Rounding"; before the final slack), ``a = features(inputs)`` of shape
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
            value = _gram_sum(gram_a, gram_g)
            spread = tf.reduce_sum(_norms64(a_chunk) * _norms64(g_chunk), axis=1)
            return _gram_bound(value, spread, [in_features, n], tf.shape(g_chunk)[1])
    else:
        size = in_features * n + (positions or 1024) * in_features

        def chunk_norms(inputs_chunk, g_chunk):
            a_chunk = features(inputs_chunk)
            gradient = tf.matmul(a_chunk, g_chunk, transpose_a=True)  # (c, m, n)
            spread = tf.reduce_sum(_norms64(a_chunk) * _norms64(g_chunk), axis=1)
            return _direct_bound(gradient, spread, tf.shape(g_chunk)[1])

    return _map_chunks(chunk_norms, [inputs, g], size, tf.float64)


def _positions(t, channels) -> tf.Tensor:
    """``(B, T..., c) -> (B, T, c)``, with T static whenever the positions' shape is: in a
    `fit` the batch dimension is unknown, and ``-1`` would leave T unknown too (then
    `uses_gram` could not choose the cheaper form)."""
    static = t.shape[1:-1].is_fully_defined() and t.shape[-1] == channels
    positions = t.shape[1:-1].num_elements() if static else -1
    return tf.reshape(t, (tf.shape(t)[0], positions, channels))


# --------------------------------------------------------------------------- Dense
def _bias_bound(g3) -> tf.Tensor:
    """``||sum_t g_t||^2`` of ``(B, T, n)`` cotangents, in float64 with its slack."""
    total = tf.reduce_sum(tf.cast(g3, tf.float64), axis=1)
    return _with_slack(_squared64(total), tf.shape(g3)[1] + tf.shape(g3)[2])


@register_ghost_rule(tf.keras.layers.Dense, DP_QuickSpectralDense)
def dense_squared_norms(layer, inputs, cotangent, method="gram"):
    """Kernel: ``||a||^2 ||g||^2`` (2D inputs) or the bilinear bound; bias ``||sum_t g_t||^2``;
    float32 upper bounds (module docstring, "Rounding")."""
    a = tf.cast(inputs, cotangent.dtype)
    if a.shape.rank == 2:
        g_squared = _squared64(cotangent)
        terms = tf.shape(a)[1] + tf.shape(cotangent)[1]
        kernel = _with_slack(_squared64(a) * g_squared, terms)
        bias = _with_slack(g_squared, terms)
    else:
        a3, g3 = _positions(a, a.shape[-1]), _positions(cotangent, cotangent.shape[-1])
        kernel = _bilinear_squared_norms(a3, g3, int(a.shape[-1]), method)
        kernel = _with_slack(kernel, _bilinear_terms(tf.shape(g3)[1], int(a.shape[-1]),
                                                     int(g3.shape[2])))
        bias = _bias_bound(g3)
    norms = {layer.kernel.ref(): _float32_at_least(kernel)}
    if getattr(layer, "use_bias", False):
        norms[layer.bias.ref()] = _float32_at_least(bias)
    return [norms[v.ref()] for v in _kernel_and_bias(layer)]


def _bilinear_terms(positions, in_features: int, out_features: int) -> tf.Tensor:
    """The most terms of one float64 sum in `_bilinear_squared_norms` (positions,
    features, or the entries of a per-example gradient), for its slack."""
    return tf.maximum(positions + in_features + out_features, in_features * out_features)


# --------------------------------------------------------------------------- Conv2D
def _conv_unsupported(layer) -> Optional[str]:
    built = getattr(layer, "_build_input_shape", None)
    if built is not None and len(tf.TensorShape(built)) != 4:
        # Keras folds extra leading dimensions into the batch (an audit, 2026-12-07: every
        # step of a Conv2D on (B, T, H, W, C) inputs failed in both ghost engines).
        return f"inputs of rank {len(tf.TensorShape(built))} (the rule takes (B, H, W, C))"
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
    """A float64 upper bound of ``||sum_p patch_p(a_i) g_ip^T||_F^2`` per example (module
    docstring, "Rounding"; before the final slack), one kernel offset at a time.

    The kernel entry at offset ``(dy, dx)`` multiplies, at output pixel ``(y, x)``, the
    (padded) input pixel ``(y sh + dy, x sw + dx)``; so the per-example gradient block of
    that offset is ``sum_{y,x} a_pad[y sh + dy, x sw + dx, :] g[y, x, :]^T``, the product of
    a strided slice of the padded input with the cotangent (a batched C x P by P x F
    product). The blocks of the kh kw offsets are disjoint coordinates of the gradient, so
    its squared norm is the sum of theirs, each bounded with its own ``S``. No patch is
    materialised: the transient blocks hold ``C F`` numbers per example each (chunked over
    the batch like the other forms).
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
        cotangent_norms = _norms64(cotangents)
        total = 0.0
        for dy in range(kh):
            for dx in range(kw):
                window = tf.reshape(padded[:, dy:dy + sh * (out_h - 1) + 1:sh,
                                           dx:dx + sw * (out_w - 1) + 1:sw, :],
                                    [-1, out_h * out_w, channels])
                block = tf.matmul(window, cotangents, transpose_a=True)  # (c, C, F)
                spread = tf.reduce_sum(_norms64(window) * cotangent_norms, axis=1)
                total += _direct_bound(block, spread, out_h * out_w)
        return total

    size = channels * filters + height * width * channels + out_h * out_w * filters
    return _map_chunks(chunk_norms, [inputs, g], size, tf.float64)


def _conv_squared_norms(layer, inputs, cotangent, scale, method):
    if inputs.shape.rank != 4:  # a layer built by hand before (`_conv_unsupported` reads the
        # shape Keras' call built it on): a message instead of a failed unpacking (a review)
        raise ValueError(
            f"Ghost clipping: Conv2D '{layer.name}' receives inputs of rank "
            f"{inputs.shape.rank}, and its ghost norm takes (B, H, W, C): use "
            "engine='vectorized', or build the layer by calling it on its inputs.")
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
    terms = _bilinear_terms(tf.shape(g3)[1], in_features, int(g3.shape[2])) + kh * kw
    norms = {layer.kernel.ref(): _float32_at_least(_with_slack((scale * scale) * kernel, terms))}
    if layer.use_bias:
        norms[layer.bias.ref()] = _float32_at_least(_bias_bound(g3))
    return [norms[v.ref()] for v in _kernel_and_bias(layer)]


@register_ghost_rule(tf.keras.layers.Conv2D, unsupported=_conv_unsupported)
def conv2d_squared_norms(layer, inputs, cotangent, method="gram"):
    """Bilinear bound on the layer's patches (``z_p = <patch_p, W> + b``)."""
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
    this Gram form: the direct one would need a vocabulary-sized gradient); a float32
    upper bound (module docstring, "Rounding": the one-hot rows have norm 1 and exact
    Gram entries, so ``S = sum_t ||g_t||``)."""
    del method
    if not layer.embeddings.trainable:
        return []
    ids = tf.reshape(tf.cast(inputs, tf.int32), (tf.shape(inputs)[0], -1))
    g3 = _positions(cotangent, cotangent.shape[-1])
    n = int(g3.shape[2])
    if ids.shape[1] == 1:
        return [_float32_at_least(_with_slack(_squared64(g3), n))]
    positions = int(ids.shape[1]) if ids.shape[1] is not None else 1024

    def chunk_norms(id_chunk, g_chunk):
        same = tf.cast(tf.equal(id_chunk[:, :, None], id_chunk[:, None, :]), g_chunk.dtype)
        value = _gram_sum(same, tf.matmul(g_chunk, g_chunk, transpose_b=True))
        spread = tf.reduce_sum(_norms64(g_chunk), axis=1)
        return _gram_bound(value, spread, [n], tf.shape(g_chunk)[1])

    bound = _map_chunks(chunk_norms, [ids, g3], 2 * positions * positions, tf.float64)
    return [_float32_at_least(_with_slack(bound, tf.shape(g3)[1] + n))]
