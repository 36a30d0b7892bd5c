"""Independent references for the soundness tests (the one home of these helpers).

Everything here is computed from forward passes and plain ``tf.GradientTape``s,
one example at a time where a per-example quantity is meant, so that no
vectorisation trick or bound formula is shared with the library under test:

* `per_example_gradients` / `per_example_gradient_norms`: exact per-example
  gradients (one tape per example) and `assert_within_bounds` against
  `lipdp.bounds.gradient_bounds`; `assert_same_gradient_bounds` for two models with the
  same weights;
* `adversarial_inputs`: random inputs inside, on and far beyond the input bound,
  +-constant images on the bound, one hot pixel on the bound;
* `perturb_weights`: move every trainable variable off its constraint set, as a
  noisy step leaves it before the projection;
* `projected_ascent`, the one gradient-ascent engine: `maximize_gradient_norm`
  (inputs that maximise a variable's per-example gradient norm), the layer tests'
  joint (input, cotangent) search, and the pair search of `lipschitz_lower_bound`;
* `lipschitz_lower_bound`: a *proven* lower bound of a map's Lipschitz constant,
  ``max ||f(a) - f(b)|| / ||a - b||`` over pairs found by power iteration on
  ``J^T J`` and gradient ascent on the ratio.
"""

import numpy as np
import tensorflow as tf

# float32 forward/backward passes and float32 certified bounds agree to ~1e-6
# relative; 1e-4 leaves room for accumulation over a few thousand terms while
# staying far below any real violation (a wrong constant is off by >= 1%).
REL_TOL = 1e-4


#: How far apart the gradient bounds of two models with the same weights may be: a kernel as
#: its last projection left it is certified by that projection (up to 0.35% looser than from
#: its weights alone, `lipdp.layers._bjorck.certifying_bjorck`), one loaded from disk is not.
PROJECTION_CERTIFICATE_SLACK = 3.5e-3


def assert_same_gradient_bounds(bounds, expected):
    """`lipdp.bounds.gradient_bounds` of two models with the same weights: the same
    variables, each bound within `PROJECTION_CERTIFICATE_SLACK` of the other's."""
    assert list(bounds) == list(expected)
    for name, bound in bounds.items():
        assert abs(bound / expected[name] - 1) <= PROJECTION_CERTIFICATE_SLACK, (
            name, bound, expected[name])


# --------------------------------------------------------------------------- #
# Exact per-example gradients.
# --------------------------------------------------------------------------- #
def _loss_fn(loss):
    """Per-example loss values: `DP_Loss.call` / `Loss.call`, or a Keras loss by name."""
    return loss.call if isinstance(loss, tf.keras.losses.Loss) else tf.keras.losses.get(loss)


def per_example_gradients(model, loss, x, y, traced=False):
    """``[example][variable]`` numpy gradients of ``loss(f(x_i), y_i)``, one tape per example;
    with `traced`, inside a `tf.function` (as the train step takes them: graph-only paths
    such as lipdp's fused GroupSort2 + pooling kernel run; eagerly they do not).

    A variable the loss does not depend on gets a zero gradient.
    """
    fn = _loss_fn(loss)

    def gradients(x_i, y_i):
        with tf.GradientTape() as tape:
            value = tf.reduce_sum(fn(y_i, model(x_i, training=True)))
        return tape.gradient(value, model.trainable_variables)

    if traced:
        gradients = tf.function(gradients)
    out = []
    for i in range(len(x)):
        grads = gradients(x[i:i + 1], y[i:i + 1])
        out.append([np.zeros(v.shape, np.float32) if g is None else tf.convert_to_tensor(g).numpy()
                    for g, v in zip(grads, model.trainable_variables)])
    return out


def per_example_gradient_norms(model, loss, x, y, traced=False):
    """``{name: (n,) array}`` of ``||grad_v loss(f(x_i), y_i)||`` for every trainable variable v,
    with the names of `lipdp.bounds.variable_names` (the keys of `gradient_bounds`);
    `traced` as in `per_example_gradients`."""
    from lipdp.bounds import variable_names

    names = variable_names(model)
    per_example = per_example_gradients(model, loss, x, y, traced)
    return {names[v.ref()]: np.array([np.linalg.norm(grads[j]) for grads in per_example])
            for j, v in enumerate(model.trainable_variables)}


def assert_within_bounds(norms, bounds, context=""):
    """Every per-example gradient norm is at most its bound (relative slack `REL_TOL`)."""
    for name, values in norms.items():
        worst = float(np.max(values))
        assert worst <= bounds[name] * (1 + REL_TOL), (
            f"{context}: per-example gradient of {name} has norm {worst} > bound {bounds[name]}")


# --------------------------------------------------------------------------- #
# Adversarial inputs and weights.
# --------------------------------------------------------------------------- #
def adversarial_inputs(rng, shape, bound, n=6, scales=(0.5, 1.0, 50.0)):
    """``n`` random inputs of norms ``scales * bound`` (cycled: inside, on and far beyond the
    bound), then +-constant images on the bound and one hot pixel on the bound (float32)."""
    x = rng.normal(size=(n,) + shape)
    norms = np.array([scales[i % len(scales)] for i in range(n)]) * bound
    x *= (norms / np.linalg.norm(x.reshape(n, -1), axis=1)).reshape((n,) + (1,) * len(shape))
    constant = np.ones((2,) + shape) * (np.array([bound, -bound]) / np.sqrt(np.prod(shape))
                                        ).reshape((2,) + (1,) * len(shape))
    pixel = np.zeros((1,) + shape)
    pixel[(0,) * (len(shape) + 1)] = bound
    return np.concatenate([x, constant, pixel]).astype("float32")


def one_hot_labels(rng, n, k):
    return np.eye(k, dtype="float32")[rng.integers(0, k, n)]


def perturb_weights(owner, rng, scale):
    """Add N(0, scale^2) to every trainable variable of `owner` (a model or a layer): the
    weights leave their constraint set, as after a noisy step before projection."""
    for v in owner.trainable_variables:
        v.assign(v + tf.constant(rng.normal(scale=scale, size=v.shape), v.dtype))


# --------------------------------------------------------------------------- #
# Gradient ascent.
# --------------------------------------------------------------------------- #
def _per_example_norms(t):
    return tf.sqrt(tf.reduce_sum(tf.square(t), axis=list(range(1, t.shape.rank)), keepdims=True))


def _unit(t):
    return t / tf.maximum(_per_example_norms(t), 1e-30)


def _onto(t, radius, sphere):
    """Per-example projection onto the ball (or the sphere) of radius `radius`."""
    norms = tf.maximum(_per_example_norms(t), 1e-30)
    return t * (radius / norms if sphere else tf.minimum(1.0, radius / norms))


def projected_ascent(objective, starts, radii, step_sizes, sphere=False, one_at_a_time=False):
    """Projected normalised gradient ascent on ``objective(*variables)``.

    Each start is a batch (first axis: independent examples); at step t each example of
    variable j moves by ``step_sizes[t][j] * radii[j]`` (a float ``step_sizes[t]``: the same
    for every variable) along its own normalised gradient, and is projected back onto the
    ball (or, where `sphere` is true, the sphere) of its radius. The objective must be a sum
    over examples, so that examples do not interact. Returns the final points (numpy).

    With `one_at_a_time`, the examples ascend one after the other through one traced step
    on batches of one: the objective is called as ``objective(*variables, example=i)``, `i`
    the example's index (a scalar int32 tensor). Its graph is built once instead of holding
    one copy per example (what a per-example objective, such as a per-example gradient,
    otherwise needs), for the same points.
    """
    batches = ([[s[i:i + 1] for s in starts] for i in range(len(starts[0]))] if one_at_a_time
               else [starts])
    variables = [tf.Variable(tf.cast(s, tf.float32)) for s in batches[0]]
    example = tf.Variable(0, dtype=tf.int32)
    spheres = sphere if isinstance(sphere, (list, tuple)) else [sphere] * len(variables)

    @tf.function  # traced once per call: eager nested tapes would dominate the test time
    def step(lrs):
        with tf.GradientTape() as tape:
            value = (objective(*variables, example=example.read_value()) if one_at_a_time
                     else objective(*variables))
        for j, (v, d) in enumerate(zip(variables, tape.gradient(value, variables))):
            if d is not None:  # None: the objective does not depend on v (e.g. a bias gradient)
                v.assign(_onto(v + lrs[j] * radii[j] * _unit(d), radii[j], spheres[j]))

    points = []
    for i, batch in enumerate(batches):
        example.assign(i)
        for v, s in zip(variables, batch):
            v.assign(tf.cast(s, tf.float32))
        for lr in step_sizes:
            lrs = lr if isinstance(lr, (list, tuple)) else [lr] * len(variables)
            step(tf.constant(lrs, tf.float32))
        points.append([v.numpy() for v in variables])
    return [np.concatenate(p) for p in zip(*points)]


def maximize_gradient_norm(model, loss, x0, y, variable, max_norm, steps=60, lr=0.5):
    """Inputs (inside the ball of radius `max_norm`) maximising ``||grad_variable loss||``,
    by projected gradient ascent from `x0`, each example on its own (one traced step, on
    batches of one, serves them all)."""
    fn = _loss_fn(loss)
    labels = tf.constant(np.asarray(y))

    def objective(x, example):
        with tf.GradientTape() as inner:  # the example's own gradient
            value = tf.reduce_sum(fn(tf.gather(labels, [example]), model(x, training=True)))
        g = inner.gradient(value, variable)
        return tf.reduce_sum(tf.square(g)) if g is not None else tf.zeros(())

    return projected_ascent(objective, [x0], [max_norm], [lr] * steps, one_at_a_time=True)[0]


def adversarial_gradient_norms(model, loss, rng, shape, bound, k, ascent_steps=30):
    """`per_example_gradient_norms` on `adversarial_inputs` (nine: inside, on and 50x beyond
    `bound`, constant and one-pixel inputs) and, for every trainable variable, four inputs
    found by `maximize_gradient_norm` on that variable's gradient (labels one-hot of k)."""
    inputs = adversarial_inputs(rng, shape, bound, n=9)
    labels = one_hot_labels(rng, len(inputs), k)
    for variable in model.trainable_variables:
        ascended = maximize_gradient_norm(model, loss, inputs[:4], labels[:4], variable, bound,
                                          steps=ascent_steps)
        inputs = np.concatenate([inputs, ascended])
        labels = np.concatenate([labels, labels[:4]])
    return per_example_gradient_norms(model, loss, inputs, labels)


# --------------------------------------------------------------------------- #
# Lipschitz lower bounds.
# --------------------------------------------------------------------------- #
def _difference_jv(f, x, v, h):
    """``(f(x), J v)`` at `x`, with ``J v`` the forward difference ``(f(x + h v) - f(x)) / h``
    from one forward pass of the batch ``[x, x + h v]`` (float32 rounding makes it accurate
    to ~1e-4 relative for h = 1e-3 of the input scale). Forward-mode differentiation gives
    J v exactly but its graph costs twice as long to build (8.8 s vs 4.8 s for kymatio's
    scattering): the power iteration only seeds the pairs whose finite differences are the
    bound."""
    y, moved = tf.split(f(tf.concat([x, x + h * v], axis=0)), 2)
    return y, (moved - y) / h


def _jtjv(f, x, v, h):
    """``J^T (J v)`` at `x`: `_difference_jv`'s J v pulled back through f by a tape."""
    with tf.GradientTape() as tape:
        tape.watch(x)
        y, jv = _difference_jv(f, x, v, h)
    g = tape.gradient(y, x, output_gradients=jv)
    return tf.zeros_like(x) if g is None else g


def top_singular_directions(f, x, step, iterations=40, seed=0):
    """Per-example power iteration on ``J_f(x_i)^T J_f(x_i)`` (`_jtjv`, difference step
    `step`); returns (sigma (n,), unit directions).

    ``sigma_i = sqrt(||J^T J u||)`` for the unit u of the last iteration: at most the largest
    singular value of the Jacobian at ``x_i`` (``||J^T J u|| <= ||J||^2``) and at least
    ``||J u||`` (Cauchy-Schwarz: ``||J u||^2 = <u, J^T J u>``), so it is no looser than the
    quotient of u's own pair and costs no pass of f beyond the loop's (a final ``J v``
    traced f's graph once more: 2.8 of the 13 s of the scattering's power iteration). It
    seeds `lipschitz_lower_bound`'s pairs, and a test may compare it with a bound.
    """
    x = tf.cast(x, tf.float32)

    @tf.function  # traced once: f's graph is built for the loop body only
    def iterate(v):
        sigma = tf.zeros([tf.shape(x)[0]])
        for _ in tf.range(iterations):  # a graph loop: traced once, not unrolled
            w = _jtjv(f, x, v, step)
            norms = _per_example_norms(w)
            sigma = tf.sqrt(tf.reshape(norms, [-1]))
            v = tf.where(norms > 0, _unit(w), v)
        return v, sigma

    v, sigma = iterate(_unit(tf.random.stateless_normal(tf.shape(x), seed=[seed, 1])))
    return sigma.numpy(), v


# Float32 rounding of a forward pass, relative to the output norms: ~1e-7 per operation,
# 1e-5 leaves a wide margin (it lowers the reported ratios by ~1e-4 on the tight cases).
ROUNDING = 1e-5


def pair_ratios(f, a, b):
    """``(||f(a_i) - f(b_i)|| - e_i) / ||a_i - b_i||`` in float64 from float32 forward passes,
    ``e_i = ROUNDING (||f(a_i)|| + ||f(b_i)||)`` covering the rounding of both passes: a
    lower bound of the exact ratio. The outputs must be finite."""
    fa = np.asarray(f(tf.constant(a)), np.float64).reshape(len(a), -1)
    fb = np.asarray(f(tf.constant(b)), np.float64).reshape(len(b), -1)
    assert np.all(np.isfinite(fa)) and np.all(np.isfinite(fb)), "non-finite outputs"
    rounding = ROUNDING * (np.linalg.norm(fa, axis=1) + np.linalg.norm(fb, axis=1))
    dx = np.linalg.norm((np.asarray(a, np.float64) - np.asarray(b, np.float64)).reshape(len(a), -1),
                        axis=1)
    return (np.linalg.norm(fa - fb, axis=1) - rounding) / dx


def lipschitz_lower_bound(f, x, radius, iterations=40, ascent_steps=60, seed=0):
    """A proven lower bound of the L2 Lipschitz constant of `f` (a model or a layer, batched).

    1. Power iteration on ``J^T J`` at each point of `x` (moved inside the ball of radius
       ``0.9 radius``) gives the direction ``v_i`` the Jacobian stretches most.
    2. Pairs ``(a_i, a_i + d_i)``, starting from ``(x_i, h v_i)`` with ``|d_i| = h = 0.05
       radius`` fixed, are improved by projected gradient ascent on ``||f(a + d) - f(a)||``
       over ``a`` (in the ball of radius ``0.95 radius``, inside which the input clipping of
       `DP_BoundedInput` is the identity) and ``d`` (on the sphere of radius h). The
       separation is fixed so that float32 rounding stays negligible: pairs that close in
       on each other would measure rounding noise, not the map.
    3. The result is the largest `pair_ratios` (rounding allowance subtracted) of the
       starting and the final pairs: a finite difference, so a lower bound of the Lipschitz
       constant with no differentiability assumption.

    Returns ``(lower_bound, jacobian_norm)``; the second, the largest power-iteration
    estimate ``sigma_max(J(x_i))``, is reported for diagnostics only.
    """
    x = _onto(tf.cast(x, tf.float32), 0.9 * radius, sphere=False)
    sigma, v = top_singular_directions(f, x, 1e-3 * radius, iterations, seed)
    h = 0.05 * radius
    d = h * v
    best = float(np.max(pair_ratios(f, x.numpy(), (x + d).numpy())))

    def log_distance(a, d):  # the log: each pair's step does not depend on its scale
        moved, start = tf.split(f(tf.concat([a + d, a], axis=0)), 2)  # f is per-example
        diff = tf.reshape(moved - start, [len(x), -1])
        return 0.5 * tf.reduce_sum(tf.math.log(tf.reduce_sum(tf.square(diff), axis=1) + 1e-30))

    # a moves by 2% (then 0.5%) of the radius per step, d turns by ~0.3 (then 0.1) rad.
    schedule = [(0.02, 0.3)] * (ascent_steps // 2) + [(0.005, 0.1)] * (ascent_steps - ascent_steps // 2)
    a, d = projected_ascent(log_distance, [x, d], [0.95 * radius, h], schedule,
                            sphere=[False, True])
    return max(best, float(np.max(pair_ratios(f, a, a + d)))), float(np.max(sigma))
