"""Independent references for the soundness tests: exact per-example gradients."""

import numpy as np
import tensorflow as tf

# float32 forward/backward passes and float64-certified bounds agree to ~1e-6
# relative; 1e-4 leaves room for accumulation over a few thousand terms while
# staying far below any real violation (a wrong constant is off by >= 1%).
REL_TOL = 1e-4


def per_example_gradient_norms(model, loss, x, y):
    """||grad_v loss(f(x_i), y_i)|| for every example i and trainable variable v.

    Computed one example at a time with its own GradientTape: no per-example
    trick that could share a bug with the library. Returns {name: (n,) array}.
    """
    from lipdp.bounds import variable_names  # the keys gradient_bounds() uses

    names = variable_names(model)
    norms = {names[v.ref()]: [] for v in model.trainable_variables}
    for i in range(len(x)):
        with tf.GradientTape() as tape:
            value = tf.reduce_sum(loss.call(y[i:i + 1], model(x[i:i + 1], training=True)))
        for v, g in zip(model.trainable_variables, tape.gradient(value, model.trainable_variables)):
            norms[names[v.ref()]].append(0.0 if g is None else float(tf.norm(g)))
    return {k: np.asarray(v) for k, v in norms.items()}


def assert_within_bounds(norms, bounds, context=""):
    for name, values in norms.items():
        worst = float(np.max(values))
        assert worst <= bounds[name] * (1 + REL_TOL), (
            f"{context}: per-example gradient of {name} has norm {worst} > bound {bounds[name]}")


def maximize_gradient_norm(model, loss, x0, y, variable, max_norm, steps=60, lr=0.5):
    """Gradient ascent on the input to maximise ||grad_variable loss||, inside the input ball."""
    x = tf.Variable(x0)
    for _ in range(steps):
        with tf.GradientTape() as outer:
            with tf.GradientTape() as inner:
                value = tf.reduce_sum(loss.call(y, model(x, training=True)))
            g = inner.gradient(value, variable)
            objective = tf.reduce_sum(tf.square(g))
        direction = outer.gradient(objective, x)
        if direction is None:
            break
        step = direction / (tf.norm(direction) + 1e-12) * lr * max_norm
        new = x + step
        axes = list(range(1, new.shape.rank))
        norms = tf.sqrt(tf.reduce_sum(tf.square(new), axis=axes, keepdims=True))
        x.assign(new * tf.minimum(1.0, max_norm / tf.maximum(norms, 1e-12)))
    return x.numpy()
