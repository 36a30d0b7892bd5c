"""Float32 rounding errors of DP layers: the arithmetic model and the lemmas layers share.

`lipdp.certify` certifies the model **as evaluated in float32**. Write F for the
exact-arithmetic network on the stored float32 weights (the map whose Lipschitz
constant `lipdp.bounds.lipschitz_bound` certifies) and F^ for its float32
evaluation. Every DP layer bounds its *own* error (`DPLayer.rounding_error(X)`:
``sup ||f^(x) - f(x)||_2`` over the inputs of norm <= X the layer receives), and
`lipdp.layers.base.chain_rounding_error` composes them: for an exact input x with
``||x|| <= X`` (`propagate_inputs`) and a computed one with ``||x^ - x|| <= E``,

    ||f^(x^) - f(x)|| <= ||f(x^) - f(x)|| + ||f^(x^) - f(x^)|| <= Lip E + e(X + E).

Starting from the raw input (exact: E = 0), the bound at the logits is
``E >= sup_z ||F^(z) - F(z)||`` over every raw input z of norm <= 2^62.

Arithmetic model (the assumptions of every bound here):

A1. IEEE binary32 with rounding to nearest: ``+ - * / sqrt`` return
    ``op(a', b') (1 + d) + h`` with ``|d| <= u = 2^-24`` and ``|h| <= mu = 2^-126``,
    where a', b' are the operands, possibly flushed to zero when subnormal
    (``|a - a'| <= mu``). This covers gradual underflow as well as TensorFlow's
    flush-to-zero / denormals-are-zero modes. Comparisons, max, min, sort and
    select return one of their operands (possibly compared after flushing).
    TensorFlow's CPU kernels return correctly rounded ``/`` and ``sqrt`` on every
    normal input checked (`tests/test_certify_rounding.py`).
A2. A matrix product or a convolution computes each output coordinate of one
    example as a sum of its products (possibly fused, FMA), along a summation
    tree that is **the same for all output coordinates of that example** (it may
    change between calls, batches and examples; zero products, e.g. padding, may
    be skipped). TensorFlow's CPU kernels (Eigen, and oneDNN) do so: a kernel whose
    output columns are identical gives bit-identical outputs (checked by the
    tests, with oneDNN off and, in a process of its own, on). This is what keeps the bound near ``n u ||A||_2 ||x||`` instead of the
    textbook ``gamma_n || |A| |x| ||``, about sqrt(#outputs) times larger. TF32
    (the default for float32 products on NVIDIA Ampere and later GPUs; disable it
    with ``tf.config.experimental.enable_tensor_float_32_execution(False)``) and
    Winograd or FFT convolution algorithms fall outside this model.
A3. ``tanh``, ``sigmoid``, ``softplus``: ``|fl(phi(t)) - phi(t)| <= K u |phi(t)| + mu``
    with ``K = 16``, twice the largest error measured over *every* float32 input on
    TensorFlow 2.15's CPU kernels (tanh 6.89, sigmoid 3.52, softplus 7.75, in units
    of ``u |phi(t)|``, beyond mu).
A4. Per example, activations have fewer than 2^32 coordinates, and every norm
    bound plus its error stays below 2^60 (`chain_rounding_error` returns inf
    otherwise); raw inputs have norm at most 2^62. No square, product or partial
    sum then overflows.

Lemmas (proofs below each function): matrix products (`product_error`), adding a
vector (`addition_error`), element-wise functions (`elementwise_error`),
comparisons (`comparison_error`), scaled L2 norms of blocks (`block_norm_error`),
the ratio of a rescaling to a given norm (`rescaling_error`).
Underflow terms are per coordinate, multiplied by ``2^16 > sqrt(coordinates)``
(A4) to bound their L2 norm: about 1e-33, kept only so that the bounds are proofs.

Bounds are computed in float64 from float32 weights: norms of fewer than 2^31
entries (relative error below 2^-22 in any summation order), then sums and
products of non-negative terms (2^-53 each), so `lipdp.certify` multiplies the
result by ``1 + 2^-20``. The certified norms the layers already report (``||W||_2``,
`propagate_inputs`, Lipschitz constants) are used as they are.
"""

from __future__ import annotations

import math

#: u, the unit roundoff of float32 (rounding to nearest).
UNIT_ROUNDOFF = 2.0 ** -24
#: mu, the smallest normal float32: the most an underflow moves a value.
SMALLEST_NORMAL = 2.0 ** -126
#: 2^16 mu: a per-coordinate underflow term, in L2 norm over < 2^32 coordinates (A4).
UNDERFLOW = 2.0 ** 16 * SMALLEST_NORMAL
#: K of A3: relative accuracy of tanh, sigmoid and softplus, in units of u.
ELEMENTWISE_ULPS = 16.0
#: Largest activation norm (plus error) for which bounds are claimed (A4).
ACTIVATION_RANGE = 2.0 ** 60
#: Largest raw-input norm covered by the certificate (A4).
INPUT_DOMAIN = 2.0 ** 62

_U = UNIT_ROUNDOFF


def gamma(k) -> float:
    """``gamma_k = k u / (1 - k u)``: ``prod (1 + d_i)^(+-1)`` over k roundings lies in
    ``[1 - gamma_k, 1 + gamma_k]`` (Higham, Lemma 3.1); inf when ``k u >= 1``."""
    return k * _U / (1.0 - k * _U) if k * _U < 1.0 else math.inf


def product_error(fan_in, partial_sums, products, input_bound, max_entry) -> float:
    """Lemma 1: ``||fl(A x) - A x||_2`` for a matrix product or convolution, under A2.

    Every output coordinate j is ``y_j = sum_i a_ji x_i`` over ``n = fan_in``
    products. Assumptions on the arguments, for every input x:

    - ``partial_sums >= ||A_S x_S|| / ||x||`` for every subset S of the product
      indices (A_S keeps the products indexed by S, in every coordinate);
    - ``products >= || |A| |x| || / ||x||`` (absolute values entry-wise);
    - ``input_bound >= ||x||``, ``max_entry >= max |a_ji|``.

    Bound: ``(1 + u)^(n-1) u ((n-1) partial_sums + products) X + 2 (n (a + X + 2) + 2) UNDERFLOW``.

    Proof. Node v of the summation tree adds the products over a set ``S_v``; its
    exact value is ``s_v`` and its computed value ``(s^_l + s^_r)(1 + d_v)``, so its
    error obeys ``|e_v| <= (1 + u)(|e_l| + |e_r|) + u |s_v|``; a leaf ``fl(a x)`` errs by
    at most ``u |a x|`` (nothing when fused into an FMA). Unrolled over a depth of at
    most ``n - 1``: ``|y^_j - y_j| <= (1 + u)^(n-1) u (sum_v |s_vj| + sum_i |a_ji x_i|)``.
    Take the L2 norm over j and the triangle inequality over the ``n - 1`` internal
    nodes: as the sets ``S_v`` are the same for every coordinate (A2), node v
    contributes ``||A_{S_v} x_{S_v}|| <= partial_sums ||x||``, and the leaves
    ``|| |A| |x| || <= products ||x||``. (With a tree per coordinate only the
    ``|A| |x|`` bound would remain: about sqrt(#outputs) times larger.) Underflow
    (A1): flushing an operand moves a product by at most ``mu (|a| + |x_i|)``, each
    of the ``<= 2n + 1`` results (products, additions, a bias) by at most mu, and
    the ``<= n`` later additions multiply these by ``(1 + u)^n <= 2``. QED

    Dense kernels W: ``partial_sums = ||W||_2`` (a submatrix has no larger norm),
    ``products = ||W||_F``. Convolutions (rows of the im2col matrix, kernel
    reshaped to ``(kh kw C) x F``, each pixel in at most m windows):
    ``sqrt(m) ||K||_2`` and ``sqrt(m) ||K||_F``.
    """
    n = int(fan_in)
    if n < 1:
        return 0.0
    rounding = (1.0 + _U) ** (n - 1) * _U * ((n - 1) * partial_sums + products) * input_bound
    return rounding + 2.0 * (n * (max_entry + input_bound + 2.0) + 2.0) * UNDERFLOW


def addition_error(input_error, output_bound) -> float:
    """Lemma 2: ``||fl(v^ + b) - (v + b)||_2`` when ``||v^ - v|| <= input_error`` and
    ``||v + b|| <= output_bound`` (element-wise sum, e.g. a bias add).

    Bound: ``(1 + u) input_error + u output_bound + 4 UNDERFLOW``.

    Proof. Coordinate-wise ``fl(v^_i + b_i) = (v'_i + b'_i)(1 + d_i) + h_i`` with the
    operands possibly flushed (``|v'_i - v^_i| + |b'_i - b_i| <= 2 mu``), so the error is
    at most ``(1 + u)|v^_i - v_i| + u |v_i + b_i| + 2 mu (1 + u) + mu``. Take L2 norms. QED
    """
    return (1.0 + _U) * input_error + _U * output_bound + 4.0 * UNDERFLOW


def elementwise_error(output_bound) -> float:
    """Lemma 3: ``||fl(phi(x)) - phi(x)||_2`` for tanh, sigmoid or softplus (A3), given
    ``||phi(x)|| <= output_bound``.

    Bound: ``K u output_bound + 3 UNDERFLOW``.

    Proof. A flushed input moves ``phi(t)`` by at most mu (these functions are
    1-Lipschitz), then A3 adds ``K u |phi(t')| + mu <= K u |phi(t)| + (1 + K u) mu``.
    Take L2 norms (``K u < 1``). QED
    """
    return ELEMENTWISE_ULPS * _U * output_bound + 3.0 * UNDERFLOW


def comparison_error() -> float:
    """Lemma 4: layers that only compare and select (ReLU, GroupSort, max pooling).

    Bound: ``3 UNDERFLOW``.

    Proof. Each output is one of the inputs (A1), possibly multiplied by the
    constant 1 (deel-lip's sort), which is exact but for flushing (mu). Comparisons
    that see flushed values order them as the values ``x'`` with ``|x' - x| <= mu``
    would be ordered, and order statistics (max, sort) are 1-Lipschitz in the max
    norm: each output is within ``3 mu`` of its exact value. QED
    """
    return 3.0 * UNDERFLOW


def rescaling_error(n) -> float:
    """Lemma 6: the ratio ``q^ = fl(t / fl(||z||_2))`` of a rescaling to norm t, on n
    coordinates (the clipping of `DP_BoundedInput` and of `DP_ClipGradient`).

    Bound: ``|q^ - q| <= eps q`` with ``q = t / ||z||`` and ``eps = max((1 + u) /
    (sqrt(1 - g) (1 - u)) - 1, 1 - (1 - u) / (sqrt(1 + g) (1 + u)))``, ``g = gamma_{n+1}``,
    whenever ``||z||^2 >= 4 n mu / u``; inf when ``g >= 1``.

    Proof. The sum of squares is ``s (1 + t1) + h`` with ``|t1| <= gamma_n`` (any order)
    and ``|h| <= 4 n mu``, so ``s (1 + t1')`` with ``|t1'| <= gamma_{n+1}`` when
    ``|h| <= u s``; the square root and the division are correctly rounded (A1):
    ``q^ = q (1 + d3) / (sqrt(1 + t1') (1 + d2))``. QED
    """
    g = gamma(n + 1)
    if g >= 1.0:
        return math.inf
    return max((1.0 + _U) / (math.sqrt(1.0 - g) * (1.0 - _U)) - 1.0,
               1.0 - (1.0 - _U) / (math.sqrt(1.0 + g) * (1.0 + _U)))


def block_norm_error(block_size, divisor, coefficient, output_bound) -> float:
    """Lemma 5: scaled L2 norms of disjoint blocks, ``y_c = k ||x_c||_2``, computed as
    ``fl(c32 * sqrt(fl(fl(sum_{i in c} fl(x_i^2)) / divisor)))``.

    Arguments: ``block_size`` a (coordinates per block), ``divisor`` d (1 when
    there is no division), ``coefficient`` k, ``output_bound >= ||y||``; the
    float32 constant ``c32`` is ``k sqrt(d)`` rounded from float64 (relative error
    ``<= 2 u``). Division may also be a multiplication by a rounded reciprocal.

    Bound: ``eps ||y|| + (k (1 + 2u)(1 + u)^2 sqrt((6a + 1) mu) + mu) 2^16`` with
    ``eps = (1 + 2u)(1 + u)^4 (1 + gamma_a) - 1``.

    Proof. The sum of the a squares (non-negative terms, any summation order) is
    ``||x_c||^2 (1 + t) + h`` with ``|t| <= gamma_a`` (each term goes through at most
    a roundings) and ``|h| <= 4 a mu`` (flushed squares and sums, carried by
    ``(1 + u)^a <= 2``). After the division (``(1 + u)^2``, ``+ mu``, and ``+ mu`` for a
    flushed operand of the square root), with the factor d folded into c32, the
    square root acts on ``(||x_c||^2 (1 + t') + h') / d`` with
    ``|t'| <= (1 + gamma_a)(1 + u)^2 - 1`` and ``|h'| <= (6a + 1) mu``; as
    ``|sqrt(A + B) - sqrt(A)| <= sqrt|B|`` and ``|sqrt(1 + t) - 1| <= |t|``, it errs by
    at most ``||x_c|| |t'| + sqrt((6a + 1) mu)`` before its own rounding (u); the
    product with c32 (2u, then u, then mu) gives the per-block bound; take L2 norms. QED
    """
    eps = (1.0 + 2 * _U) * (1.0 + _U) ** 4 * (1.0 + gamma(block_size)) - 1.0
    absolute = (coefficient * (1.0 + 2 * _U) * (1.0 + _U) ** 2
                * math.sqrt((6.0 * block_size + 1.0) * SMALLEST_NORMAL) + SMALLEST_NORMAL)
    return eps * output_bound + absolute * 2.0 ** 16
