"""Each DP layer's three bounds against exact vector-Jacobian products, and its certified
Lipschitz constant against a proven lower bound.

For a layer f, inputs ||x|| <= X and cotangents ||g|| <= G, the exact
quantities ||f(x)||, ||d<g, f(x)>/dv|| and ||d<g, f(x)>/dx|| (one example at a
time) must never exceed propagate_inputs, backpropagate_params and
backpropagate_inputs. Inputs: random, on the bound, +-constant images, one hot
pixel, with random, constant and output-aligned cotangents, and inputs/cotangents
optimised by gradient ascent. The Lipschitz constant (backpropagate_lipschitz) must
be above tests._soundness.lipschitz_lower_bound, and nearly attained where it is tight.
"""

import numpy as np
import pytest
import tensorflow as tf

from lipdp.layers import (DP_AddBias, DP_BoundedActivation, DP_BoundedInput, DP_ClipGradient, DP_Flatten,
                          DP_GlobalL2NormPooling2D, DP_GroupSort, DP_LayerCentering, DP_MaxPool2D,
                          DP_Patches, DP_Permute, DP_QuickFrobeniusDense, DP_QuickSpectralConv2D,
                          DP_QuickSpectralDense, DP_ReLU, DP_Reshape, DP_ScaledL2NormPooling2D,
                          DP_Scattering, DP_Sigmoid, DP_Softplus, DP_SpectralConv2D,
                          DP_SpectralDense, DP_Tanh)
from tests._soundness import (REL_TOL, adversarial_inputs, lipschitz_lower_bound,
                              perturb_weights, projected_ascent)

X_BOUND, G_BOUND = 2.5, 1.7


def _normalise(t, norm):
    return t / tf.norm(t) * norm


def _vjp(layer, x, g):
    """Exact output, parameter gradients and input gradient of <g, f(x)> for ONE example."""
    x = tf.convert_to_tensor(x[None], tf.float32)
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = layer(x)
        value = tf.reduce_sum(y * g[None])
    grads = tape.gradient(value, [x] + layer.trainable_variables)
    return y[0], grads[0][0], grads[1:]


def _bounds(layer):
    x_bound, g_bound = tf.constant(X_BOUND), tf.constant(G_BOUND)
    params = {v.ref(): float(b) for v, b in layer.backpropagate_params(x_bound, g_bound)}
    return (float(layer.propagate_inputs(x_bound)), params,
            float(layer.backpropagate_inputs(x_bound, g_bound)))


def _check(layer, x, g, ctx):
    out_bound, param_bounds, in_bound = _bounds(layer)
    y, gx, gparams = _vjp(layer, x, g)
    slack = 1 + REL_TOL
    assert float(tf.norm(y)) <= out_bound * slack, f"{ctx}: output norm"
    assert float(tf.norm(gx)) <= in_bound * slack, f"{ctx}: input cotangent"
    ratios = []
    for v, gv in zip(layer.trainable_variables, gparams):
        norm = float(tf.norm(gv))
        assert norm <= param_bounds[v.ref()] * slack, f"{ctx}: gradient of {v.name}: {norm}"
        ratios.append(norm / param_bounds[v.ref()])
    return ratios


def _adversarial_pairs(layer, in_shape, rng):
    """(name, x, g): inputs on the bound (random, +-constant image, one hot pixel), each with
    a random, a constant and an output-aligned cotangent of norm G."""
    out_shape = layer.compute_output_shape((1,) + in_shape)[1:]
    inputs = adversarial_inputs(rng, in_shape, X_BOUND, n=1, scales=(1.0,))
    names = ["random", "constant image", "negative constant image", "single pixel"]
    pairs = []
    for name, x in zip(names, tf.constant(inputs)):
        pairs.append((f"{name}, random cotangent", x,
                      _normalise(tf.constant(rng.normal(size=out_shape), tf.float32), G_BOUND)))
        pairs.append((f"{name}, constant cotangent", x, _normalise(tf.ones(out_shape), G_BOUND)))
        y = layer(x[None])[0]
        if float(tf.norm(y)) > 0:
            pairs.append((f"{name}, cotangent aligned with output", x, _normalise(y, G_BOUND)))
    return pairs


def _gradient_ascent(layer, in_shape, rng, steps=80):
    """Jointly optimise x (norm X) and g (norm G) to maximise the parameter gradient norm."""
    out_shape = layer.compute_output_shape((1,) + in_shape)[1:]
    x0 = _normalise(tf.constant(rng.normal(size=in_shape), tf.float32), X_BOUND)[None]
    g0 = _normalise(tf.constant(rng.normal(size=out_shape), tf.float32), G_BOUND)[None]

    def objective(x, g):
        with tf.GradientTape() as inner:
            value = tf.reduce_sum(layer(x) * g)
        grads = inner.gradient(value, layer.trainable_variables)
        return tf.add_n([tf.reduce_sum(tf.square(gv)) for gv in grads])

    x, g = projected_ascent(objective, [x0, g0], [X_BOUND, G_BOUND], [0.3] * steps, sphere=True)
    return x[0], g[0]


PARAM_LAYERS = [
    ("dense", lambda: DP_QuickSpectralDense(7), (12,)),
    ("dense no bias", lambda: DP_QuickSpectralDense(9, use_bias=False), (12,)),
    ("dense on sequences (bias broadcast over 5 positions)", lambda: DP_QuickSpectralDense(6), (5, 4)),
    ("dense without Björck", lambda: DP_QuickSpectralDense(7, eps_bjorck=None), (12,)),
    ("conv same s1", lambda: DP_QuickSpectralConv2D(4, 3), (8, 8, 3)),
    ("conv same s1 1 channel", lambda: DP_QuickSpectralConv2D(5, 3, use_bias=False), (8, 8, 1)),
    ("conv same s2", lambda: DP_QuickSpectralConv2D(3, 3, strides=2), (9, 9, 2)),
    ("conv valid s1", lambda: DP_QuickSpectralConv2D(3, 3, padding="valid"), (9, 9, 2)),
    ("conv valid 5x5", lambda: DP_QuickSpectralConv2D(2, 5, padding="valid"), (7, 7, 1)),
    ("conv patchify 2x2/2", lambda: DP_QuickSpectralConv2D(4, 2, strides=2, padding="valid"), (8, 8, 2)),
    ("conv rectangular 3x1", lambda: DP_QuickSpectralConv2D(3, (3, 1)), (6, 5, 2)),
    ("frobenius dense", lambda: DP_QuickFrobeniusDense(5), (12,)),
    ("frobenius dense on sequences", lambda: DP_QuickFrobeniusDense(3), (4, 6)),
    ("reparametrised spectral dense", lambda: DP_SpectralDense(7), (12,)),
    ("reparametrised spectral dense on tokens", lambda: DP_SpectralDense(6), (5, 6)),
    ("reparametrised conv same s1", lambda: DP_SpectralConv2D(4, 3), (8, 8, 3)),
    ("reparametrised conv valid s2", lambda: DP_SpectralConv2D(3, 3, strides=2, padding="valid"),
     (9, 9, 2)),
    ("add bias on vectors", lambda: DP_AddBias(2.0), (6,)),
    ("add bias on images (broadcast over 16 pixels)", lambda: DP_AddBias(0.5), (4, 4, 3)),
]

FREE_LAYERS = [
    ("bounded input", lambda: DP_BoundedInput(1.0), (4, 4, 2)),
    ("bounded activation", lambda: DP_BoundedActivation(1.0), (12,)),
    ("flatten", lambda: DP_Flatten(), (4, 4, 2)),
    ("groupsort2", lambda: DP_GroupSort(2), (6, 6, 4)),
    ("groupsort2 interleaved", lambda: DP_GroupSort(2, pairing="interleaved"), (6, 6, 4)),
    ("fullsort", lambda: DP_GroupSort(None), (10,)),
    ("l2 pooling", lambda: DP_ScaledL2NormPooling2D(2), (6, 6, 3)),
    ("l2 pooling 3x3, odd size", lambda: DP_ScaledL2NormPooling2D((3, 3)), (7, 7, 2)),
    ("global l2 pooling", lambda: DP_GlobalL2NormPooling2D(), (5, 5, 3)),
    ("max pooling 2x2", lambda: DP_MaxPool2D(2), (6, 6, 2)),
    ("max pooling 3x3/2 overlapping, same", lambda: DP_MaxPool2D(3, strides=2, padding="same"),
     (7, 7, 2)),
    ("relu", lambda: DP_ReLU(), (4, 4, 2)),
    ("tanh", lambda: DP_Tanh(), (12,)),
    ("sigmoid", lambda: DP_Sigmoid(), (12,)),
    ("softplus", lambda: DP_Softplus(), (12,)),
    ("reshape", lambda: DP_Reshape((8, 4)), (4, 4, 2)),
    ("permute", lambda: DP_Permute((2, 1)), (5, 3)),
    ("patches 2x2", lambda: DP_Patches(2), (4, 6, 2)),
    ("layer centering (channels)", lambda: DP_LayerCentering(), (4, 4, 3)),
    ("layer centering (all axes)", lambda: DP_LayerCentering((1, 2, 3)), (3, 3, 2)),
    ("clip gradient below G", lambda: DP_ClipGradient(1.0), (10,)),
    ("clip gradient above G", lambda: DP_ClipGradient(5.0), (10,)),
    ("scattering J=2, order weights",  # 4 angles: test_scattering.py holds kymatio's 8
     lambda: DP_Scattering(J=2, angles=4, order_weights=(0.5, 1.0, 4.0)), (8, 8, 1)),
]


@pytest.mark.parametrize("name,make,in_shape", PARAM_LAYERS + FREE_LAYERS,
                         ids=[c[0] for c in PARAM_LAYERS + FREE_LAYERS])
def test_layer_bounds_hold_on_adversarial_inputs(name, make, in_shape):
    rng = np.random.default_rng(0)
    layer = make()
    layer.build((None,) + in_shape)
    for ctx, x, g in _adversarial_pairs(layer, in_shape, rng):
        _check(layer, x, g, f"{name} / {ctx}")
    if layer.trainable_variables:
        x, g = _gradient_ascent(layer, in_shape, rng)
        _check(layer, x, g, f"{name} / gradient ascent")


@pytest.mark.parametrize("name,make,in_shape", PARAM_LAYERS, ids=[c[0] for c in PARAM_LAYERS])
def test_bounds_hold_with_adversarial_weights(name, make, in_shape):
    """Large biases and kernels perturbed away from the constraint set (as after a noisy
    step, before projection): the bounds are recomputed from the weights, so they still hold."""
    rng = np.random.default_rng(1)
    layer = make()
    layer.build((None,) + in_shape)
    perturb_weights(layer, rng, 0.5)
    for ctx, x, g in _adversarial_pairs(layer, in_shape, rng):
        _check(layer, x, g, f"{name} / perturbed weights / {ctx}")
    x, g = _gradient_ascent(layer, in_shape, rng)
    _check(layer, x, g, f"{name} / perturbed weights / gradient ascent")


# Least measured / certified Lipschitz constant asserted (default 0.9, above 1/1.4 so that a
# constant 1.4x too small fails the soundness assertion), measured values in comments.
# None: the certificate is loose at these tiny sizes, soundness only.
LIPSCHITZ_TIGHTNESS = {
    "conv same s1": 0.9,  # 0.969: the torus bound vs the zero-padded operator on 8x8
    "conv same s2": None,  # 0.64-0.78 depending on the weights: strided 3x3 on 9x9
    "conv valid s1": 0.9,  # 0.949
    "conv valid 5x5": None,  # 0.598: valid 5x5 on 7x7 leaves a 3x3 output
    "conv patchify 2x2/2": None,  # 0.512: the bound does not use the stride (sqrt(s) = 2)
    "reparametrised conv same s1": 0.9,  # 0.950
    "reparametrised conv valid s2": None,  # 0.678
    "softplus": 0.85,  # 0.897: softplus' = sigmoid(x) <= sigmoid(2.5) on the ball
    # The computed constant is a worst case over padding copies and the modulus that neither
    # these inputs nor the search reach: the adversarial checks above pass even with the output
    # bound divided by 4 (tried), so they show soundness only; tests/test_scattering.py checks
    # the constant's pieces exactly (a 1/1.4 error there fails).
    "scattering J=2, order weights": None,
}


@pytest.mark.parametrize("name,make,in_shape", PARAM_LAYERS + FREE_LAYERS,
                         ids=[c[0] for c in PARAM_LAYERS + FREE_LAYERS])
def test_layer_lipschitz_constant_is_sound_and_tight(name, make, in_shape):
    """certified (backpropagate_lipschitz with G = 1) >= a proven lower bound (power
    iteration on J^T J, then gradient ascent on ||f(a) - f(b)||, inputs in the ball of
    radius X), and the lower bound reaches LIPSCHITZ_TIGHTNESS x certified (all the dense
    layers, activations, poolings and reshapes attain their constants: measured >= 0.999),
    so that a layer constant 1.4x too small fails. With weights moved off the constraint
    set (as after a noisy step) the certificate must still hold."""
    rng = np.random.default_rng(2)
    layer = make()
    layer.build((None,) + in_shape)
    for weights in ("projected", "perturbed"):
        if weights == "perturbed":
            if not layer.trainable_variables:
                break
            perturb_weights(layer, rng, 0.5)
        certified = float(layer.backpropagate_lipschitz(tf.constant(X_BOUND), tf.constant(1.0)))
        measured, _ = lipschitz_lower_bound(layer, rng.normal(size=(8,) + in_shape), X_BOUND)
        assert measured <= certified * (1 + REL_TOL), (name, weights, measured, certified)
        minimum = LIPSCHITZ_TIGHTNESS.get(name, 0.9)
        if weights == "projected" and minimum is not None:
            assert measured >= minimum * certified, (name, measured, certified)


def test_conv_kernel_bound_is_tight_on_constant_images():
    """DESIGN.md: a constant image with an aligned cotangent nearly reaches the kernel bound
    (the variable is the orthonormal Psi and call() multiplies by N, so the bound is
    N sqrt(s) ||x|| ~ ||x||, not sqrt(s) ||x||)."""
    layer = DP_QuickSpectralConv2D(4, 3, use_bias=False)
    layer.build((None, 16, 16, 1))
    x = _normalise(tf.ones((16, 16, 1)), X_BOUND)
    ratios = _check(layer, x, _normalise(tf.ones((16, 16, 4)), G_BOUND), "constant")
    assert ratios[0] > 0.85, ratios
    assert float(layer.coef * np.sqrt(layer._multiplicity)) < 1.1


def test_dense_kernel_bound_is_attained():
    layer = DP_QuickSpectralDense(5, use_bias=False)
    layer.build((None, 8))
    x = _normalise(tf.constant(np.arange(1.0, 9.0), tf.float32), X_BOUND)
    ratios = _check(layer, x, _normalise(tf.ones((5,)), G_BOUND), "outer product")
    assert ratios[0] == pytest.approx(1.0, rel=1e-5)


def test_bounded_input_clips_in_forward_pass():
    layer = DP_BoundedInput(3.0)
    x = tf.constant(np.random.default_rng(0).normal(size=(5, 4, 4, 1)) * 10, tf.float32)
    norms = tf.norm(tf.reshape(layer(x), (5, -1)), axis=1).numpy()
    assert np.all(norms <= 3.0)
    small = x / 100.0
    np.testing.assert_allclose(layer(small).numpy(), small.numpy())


@pytest.mark.parametrize("n", [1, 784, 3969, 4096, 2 ** 20])
def test_clip_target_leaves_room_for_the_worst_case_rounding_of_n_coordinates(n):
    """t + (eps + u (1 + eps)) t + 3 UNDERFLOW <= X0 in exact arithmetic (the proof of
    `DP_BoundedInput.rounding_error` bounds the float32 output's distance to the t-ball's
    projection by that), and the room is what the proof needs, about ``n u / 2``, not a
    constant: a fixed 1e-6 below X0 is not enough from about 30 coordinates on."""
    from fractions import Fraction

    from lipdp.layers.basic import clip_target
    from lipdp.rounding import UNDERFLOW, UNIT_ROUNDOFF as u, gamma, rescaling_error

    for bound in (1.0, 3.0, 28.0, 1e4):
        t = clip_target(bound, n)
        assert float(np.float32(t)) == t  # what the layer computes with, exactly
        eps = rescaling_error(n)
        worst = Fraction(t) * (1 + Fraction(eps)) * (1 + Fraction(u)) + 3 * Fraction(UNDERFLOW)
        assert worst <= Fraction(bound)
        room = 1.0 - t / bound
        g = gamma(n + 1)
        assert 0.5 * n * u < room < 0.5 * g + g * g + 6 * u


def test_bounded_input_float32_outputs_never_exceed_the_bound():
    """Float32 inputs made to stress the norm's rounding (heavy tails, one dominant
    coordinate, equal coordinates, norms a few ulps above the bound): the float32 output's
    norm, taken in float64, is at most X0 (propagate_inputs' promise). Clipping at X0 itself
    instead of `clip_target` fails it."""
    rng = np.random.default_rng(7)
    for n, bound in [(784, 28.0), (784, 1.0), (4096, 3.0), (3969, 3.0)]:
        layer = DP_BoundedInput(bound)
        heavy = rng.standard_normal((400, n)) * np.exp(rng.uniform(-6, 6, (400, n)))
        dominant = rng.standard_normal((100, n)) * 1e-3
        dominant[:, 0] = 1e3
        equal = np.ones((100, n)) * rng.uniform(0.1, 10.0, (100, 1))
        near = rng.standard_normal((400, n))
        near *= bound * (1.0 + rng.uniform(0, 1e-6, (400, 1))) / np.linalg.norm(near, axis=1,
                                                                                 keepdims=True)
        x = np.concatenate([heavy, dominant, equal, near]).astype(np.float32)
        out = layer(tf.constant(x)).numpy().astype(np.float64)
        assert np.linalg.norm(out, axis=1).max() <= bound


@pytest.mark.parametrize("n", [2, 10, 100, 4096])
def test_row_clip_target_leaves_room_for_its_own_rounding_and_the_norms(n):
    """For float32 clip values C, the target ``t = fl(C fl(f_n))`` the clipping computes
    satisfies ``(1 + eps_n)(1 + u) t <= C (1 - 2^-40)`` in exact arithmetic (the proof in
    `lipdp.layers.gradient_clipping`); f_n with ``(1 + u)^2`` instead of ``(1 + u)^3`` in its
    denominator fails it."""
    from fractions import Fraction

    from lipdp.layers.gradient_clipping import row_clip_factor
    from lipdp.rounding import UNIT_ROUNDOFF as u, rescaling_error

    eps = Fraction(rescaling_error(n))
    factor = np.float32(row_clip_factor(n))
    clips = np.random.default_rng(n).uniform(0.01, 10.0, 400).astype(np.float32)
    for clip in clips:
        target = Fraction(float(np.float32(clip * factor)))  # float32 product, as the layer
        assert (1 + eps) * (1 + Fraction(u)) * target <= Fraction(float(clip)) * (
            1 - Fraction(2) ** -40)


def test_clipped_cotangent_rows_never_exceed_their_float32_bound():
    """Rows of cotangents clipped by `DP_ClipGradient` (the same code as `AdaptiveClipping`),
    with the stress rows of the input clipping: their float32 norms, taken in float64, stay
    within `clipped_norm_bound` (about min(G, C)), and never grow. Clipping at C itself
    instead of ``C f_n`` fails it."""
    from lipdp.layers.gradient_clipping import clipped_norm_bound

    rng = np.random.default_rng(8)
    for n, clip in [(10, 1.0), (10, 0.1), (100, 3.0), (4096, 0.5)]:
        layer = DP_ClipGradient(clip)
        heavy = rng.standard_normal((2000, n)) * np.exp(rng.uniform(-4, 4, (2000, n)))
        near = rng.standard_normal((2000, n))
        near *= clip * (1.0 + rng.uniform(0, 1e-6, (2000, 1))) / np.linalg.norm(near, axis=1,
                                                                                 keepdims=True)
        rows = tf.constant(np.concatenate([heavy, near]).astype(np.float32))
        x = tf.zeros_like(rows)
        with tf.GradientTape() as tape:
            tape.watch(x)
            out = layer(x)
        clipped = tape.gradient(out, x, output_gradients=rows).numpy().astype(np.float64)
        norms = np.linalg.norm(clipped, axis=1)
        before = np.linalg.norm(rows.numpy().astype(np.float64), axis=1)
        assert np.all(norms <= clipped_norm_bound(before, clip).numpy())
        assert np.all(norms <= before)


def test_bounded_input_needs_a_known_input_size():
    with pytest.raises(ValueError, match="known size"):
        DP_BoundedInput(3.0).build((None, None, 3))


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), "3"])
def test_bounded_input_rejects_bad_bounds(bad):
    with pytest.raises(ValueError, match="upper_bound"):
        DP_BoundedInput(bad)


def _with_ties(shape, seed=0):
    """Small integers (and zeros): about a third of the GroupSort2 pairs are ties."""
    values = np.random.default_rng(seed).integers(-1, 2, size=shape).astype("float32")
    return tf.constant(values * np.float32(0.37))


def _interleave(x):
    """Channel i -> 2i and channel i + C/2 -> 2i + 1 (halves pairing -> adjacent pairing)."""
    half = x.shape[-1] // 2
    return tf.reshape(tf.stack([x[..., :half], x[..., half:]], axis=-1), tf.shape(x))


def _deinterleave(x):
    return tf.concat([x[..., 0::2], x[..., 1::2]], axis=-1)


@pytest.mark.parametrize("pairing", ["halves", "interleaved"])
def test_groupsort2_is_deel_lips_groupsort2_up_to_a_fixed_channel_permutation(pairing):
    from deel.lip.layers import GroupSort2

    for x in [tf.random.stateless_normal((3, 5, 5, 6), seed=(0, 1)), _with_ties((3, 5, 5, 6))]:
        ours = DP_GroupSort(2, pairing=pairing)(x)
        if pairing == "interleaved":
            expected = GroupSort2()(x)
        else:
            expected = _deinterleave(GroupSort2()(_interleave(x)))
        np.testing.assert_array_equal(ours.numpy(), expected.numpy())


@pytest.mark.parametrize("pairing", ["halves", "interleaved"])
def test_groupsort2_backward_applies_the_forward_permutation_also_at_ties(pairing):
    """The input cotangent is the output cotangent permuted back: each input of a pair
    receives exactly one of the pair's two cotangents, the one of the output it went
    to (tf.minimum / tf.maximum give a tied pair (g1 + g2, 0): norm up to sqrt(2) G)."""
    x = _with_ties((64, 8), seed=1)
    g = tf.random.stateless_normal((64, 8), seed=(2, 3))
    layer = DP_GroupSort(2, pairing=pairing)
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = layer(x)
        value = tf.reduce_sum(y * g)
    grad = tape.gradient(value, x).numpy()
    x, y, g = x.numpy(), y.numpy(), g.numpy()
    pairs = ([(c, c + 4) for c in range(4)] if pairing == "halves"
             else [(2 * c, 2 * c + 1) for c in range(4)])
    ties = 0
    for first, second in pairs:
        low, high = np.minimum(x[:, first], x[:, second]), np.maximum(x[:, first], x[:, second])
        np.testing.assert_array_equal(y[:, first], low)
        np.testing.assert_array_equal(y[:, second], high)
        # One permutation per pair, shared by the forward and the backward pass.
        swapped = grad[:, first] == g[:, second]
        np.testing.assert_array_equal(grad[:, first], np.where(swapped, g[:, second], g[:, first]))
        np.testing.assert_array_equal(grad[:, second], np.where(swapped, g[:, first], g[:, second]))
        np.testing.assert_array_equal(y[:, first], np.where(swapped, x[:, second], x[:, first]))
        ties += int(np.sum(x[:, first] == x[:, second]))
    assert ties > 20
    # Each row of the input cotangent is a permutation of the output cotangent's (so its norm
    # is G): compared as sorted rows, exactly (float32 norms of the two rows may differ in the
    # last bit: a permutation changes the order of the sum).
    np.testing.assert_array_equal(np.sort(grad, axis=1), np.sort(g, axis=1))




@pytest.mark.parametrize("pairing", ["halves", "interleaved"])
def test_groupsort2_vectorised_over_examples_equals_one_example_at_a_time(pairing):
    """Per-example gradients (lipdp.per_example, the clipped engines) run layers inside
    tf.vectorized_map, which mis-vectorised tf.roll on axis=-1: outputs and input
    cotangents must be those of single examples."""
    layer = DP_GroupSort(2, pairing=pairing)
    x = tf.random.stateless_normal((5, 3, 3, 4), seed=(1, 2))
    g = tf.random.stateless_normal((5, 3, 3, 4), seed=(3, 4))

    def one(example):
        x_i, g_i = example[0][None], example[1][None]
        with tf.GradientTape() as tape:
            tape.watch(x_i)
            y_i = layer(x_i)
            value = tf.reduce_sum(y_i * g_i)
        return y_i[0], tape.gradient(value, x_i)[0]

    vectorised = tf.vectorized_map(one, (x, g))
    for i in range(len(x)):
        for got, expected in zip(vectorised, one((x[i], g[i]))):
            np.testing.assert_array_equal(got[i].numpy(), expected.numpy())


@pytest.mark.parametrize("k", [-1.0, -0.5, 0.0, float("nan"), float("inf")])
def test_l2_norm_pooling_refuses_a_coefficient_that_is_not_finite_and_positive(k):
    """A negative k_coef_lip entered the pooling's bounds as k, not |k|: in a residual branch
    k = -1 cancelled the skip path (Lipschitz bound 0, infinite certified radii, a zero
    gradient bound for the next kernel whose exact per-example gradient had norm 0.35)."""
    from lipdp.layers import DP_GlobalL2NormPooling2D, DP_ScaledL2NormPooling2D

    with pytest.raises(ValueError, match="k_coef_lip"):
        DP_ScaledL2NormPooling2D(pool_size=(1, 1), k_coef_lip=k)
    with pytest.raises(ValueError, match="k_coef_lip"):
        DP_GlobalL2NormPooling2D(k_coef_lip=k)


@pytest.mark.parametrize("eps", [0.0, 1e-39, -1e-6, float("nan"), 1e-20, 9.9e-13])
def test_l2_norm_pooling_refuses_a_square_root_epsilon_that_is_not_positive(eps):
    """deel-lip's square root backpropagates dy / (2 (sqrt(u) + eps)): with eps = 0 (or one
    flushed to 0 in float32) an all-zero window of a finite record gave a NaN gradient,
    which stopped the private step that sampled it (an audit)."""
    from lipdp.layers import DP_GlobalL2NormPooling2D, DP_ScaledL2NormPooling2D

    with pytest.raises(ValueError, match="eps_grad_sqrt"):
        DP_ScaledL2NormPooling2D(pool_size=(2, 2), eps_grad_sqrt=eps)
    with pytest.raises(ValueError, match="eps_grad_sqrt"):
        DP_GlobalL2NormPooling2D(eps_grad_sqrt=eps)


@pytest.mark.parametrize("fused", [True, False])
def test_l2_norm_pooling_gradients_stay_within_k_where_squares_underflow(fused):
    """Windows of activations from 1e-22 to 1e-17, whose squares underflow in float32: the
    gradient ``k dy x / (sqrt(u) + eps)`` of each window stays within k |dy| at the least
    eps allowed (`MIN_EPS_GRAD_SQRT`), in the fused kernel and deel-lip's computation; an
    eps below it (set past the check) goes beyond, as an audit found (2.4x at 1e-20)."""
    from deel.lip.layers import ScaledL2NormPooling2D
    from lipdp.layers import DP_ScaledL2NormPooling2D
    from lipdp.layers.base import MIN_EPS_GRAD_SQRT

    rng = np.random.default_rng(0)
    x = tf.constant(rng.normal(size=(64, 4, 4, 3)) * 10.0 ** rng.uniform(-22, -17, (64, 1, 1, 1)),
                    tf.float32)
    cotangent = tf.constant(rng.normal(size=(64, 2, 2, 3)), tf.float32)

    def worst_ratio(eps):
        layer = DP_ScaledL2NormPooling2D(pool_size=2) if fused else ScaledL2NormPooling2D(
            pool_size=2)
        layer.eps_grad_sqrt = eps
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = layer(x)
        gradient = tape.gradient(y, x, output_gradients=cotangent).numpy()
        windows = gradient.reshape(64, 2, 2, 2, 2, 3)  # (b, i, di, j, dj, c)
        norms = np.sqrt(np.sum(windows.astype(np.float64) ** 2, axis=(2, 4)))
        return np.max(norms / np.abs(cotangent.numpy()))

    assert worst_ratio(MIN_EPS_GRAD_SQRT) <= 1 + 1e-5
    assert worst_ratio(1e-20) > 1.5


def test_layer_arguments_that_cannot_run_are_refused_when_the_layer_is_made_or_built():
    """Accepted until an audit (2026-12-05), then failing later with TensorFlow's errors: L2
    pooling in channels_first ("AvgPoolingOp only supports NHWC"), a pool larger than its
    input (an empty output, then a slice error in the next kernel's certificate), a
    centring axis named twice, max pooling with 'causal' padding; a NumPy patch size."""
    from lipdp.layers import (DP_LayerCentering, DP_MaxPool2D, DP_Patches,
                              DP_ScaledL2NormPooling2D)

    with pytest.raises(ValueError, match="channels_last"):
        DP_ScaledL2NormPooling2D(pool_size=(2, 2), data_format="channels_first")
    with pytest.raises(ValueError, match="larger than its input"):
        DP_ScaledL2NormPooling2D(pool_size=(6, 6)).build((None, 5, 5, 4))
    with pytest.raises(ValueError, match="twice"):
        DP_LayerCentering(axis=(1, -3)).build((None, 3, 4, 2))
    with pytest.raises(ValueError, match="padding"):
        DP_MaxPool2D(2, padding="causal")
    assert DP_Patches(np.int64(2)).patch_size == (2, 2)
    with pytest.raises(ValueError, match="patch_size"):
        DP_Patches(True)


def test_max_pooling_bounds_follow_strides_changed_after_construction():
    """The multiplicity m entered the bounds as computed at construction, while `call`
    reads the strides as they are: strides set to 1 after `DP_MaxPool2D(2)` overlapped the
    windows (a pixel in 4 of them) under bounds for m = 1. One pixel maps to 4 outputs of
    its value: ``||f(e)|| = 2 ||e||``, which the bound must cover."""
    from lipdp.layers import DP_MaxPool2D

    pool = DP_MaxPool2D(2)
    pool.strides = (1, 1)
    spike = np.zeros((1, 4, 4, 1), np.float32)
    spike[0, 1, 1, 0] = 1.0
    assert np.linalg.norm(pool(spike)) == pytest.approx(2.0)
    assert float(pool.propagate_inputs(1.0)) >= 2.0
    assert float(pool.backpropagate_inputs(1.0, 1.0)) >= 2.0


def test_a_configuration_changed_after_build_is_refused_by_the_bounds():
    """A convolution built with strides 2 and set to 1 afterwards (its model already built)
    computed its outputs at stride 1 under bounds cached at build for stride 2: exact
    per-example gradients of its bias 1.8x the bound (an audit-style probe, 2026-12-05)."""
    import lipdp
    from lipdp.bounds import gradient_bounds
    from lipdp.layers import DP_GlobalL2NormPooling2D
    from lipdp.losses import DP_MulticlassKR

    conv = DP_QuickSpectralConv2D(2, 3, strides=2, padding="same")
    model = lipdp.DP_Sequential(
        [DP_BoundedInput(1.0, input_shape=(8, 8, 1)), conv, DP_GlobalL2NormPooling2D(),
         DP_QuickSpectralDense(2)], dp_parameters=lipdp.DPParameters(1.0, 1e-5),
        dataset_metadata=lipdp.DatasetMetadata((8, 8, 1), 2, 16, 16, 4, 1.0, "shuffle"))
    gradient_bounds(model, DP_MulticlassKR())  # as built: fine
    conv.trainable = False  # freezing is not a change of the bounds' settings
    gradient_bounds(model, DP_MulticlassKR())
    conv.trainable = True
    conv.strides = (1, 1)
    message = r"had its strides changed after it was built"
    with pytest.raises(ValueError, match=message):
        gradient_bounds(model, DP_MulticlassKR())
    with pytest.raises(ValueError, match=message):
        model.compile(loss=DP_MulticlassKR(), optimizer="sgd")


def test_the_input_clip_gives_finite_gradients_and_the_same_values_at_every_scale():
    """``min(1, t / ||x||)`` is computed as ``t / max(||x||, t)``: the same float32 values (so
    the same rounding proof), and inside the ball no gradient through the division, whose
    derivative overflowed there: with X0 = 1e19, a record of norm 1e-16 behind a kernel gave
    NaN gradients to that kernel (an audit, 2026-12-06), stopping the step that sampled it."""
    rng = np.random.default_rng(3)
    x = rng.normal(size=(40, 128)) * 10.0 ** rng.uniform(-25, 25, size=(40, 1))
    x = tf.constant(x, tf.float32)
    for bound in (1e-3, 10.0, 1e19, 1e30):
        layer = DP_BoundedActivation(bound)
        layer.build(x.shape)
        norms = tf.sqrt(tf.reduce_sum(tf.square(x), axis=1, keepdims=True))
        target = tf.constant(layer.target, tf.float32)
        before = x * tf.minimum(1.0, target / tf.maximum(norms, 1e-30))  # the old expression
        np.testing.assert_array_equal(layer(x).numpy(), before.numpy())
    kernel = tf.Variable(tf.eye(128))
    with tf.GradientTape() as tape:
        total = tf.reduce_sum(DP_BoundedActivation(1e19)(tf.fill((1, 128), 1e-17) @ kernel))
    gradient = tape.gradient(total, kernel).numpy()
    np.testing.assert_allclose(gradient, np.full((128, 128), 1e-17), rtol=1e-6)
