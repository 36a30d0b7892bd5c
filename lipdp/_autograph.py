"""lipdp's own functions are traced as they are written, not rewritten by AutoGraph.

Inside a `tf.function`, AutoGraph rewrites each Python function it is handed (a Keras layer's
``call``, a function a traced function calls) into a graph-building version of its source:
``if``/``for`` on tensors become ``tf.cond``/``tf.while_loop``, and each rewrite parses,
transforms and compiles the function's source again. lipdp writes every control flow that
depends on a tensor with ``tf.cond``/``tf.while_loop``/``tf.numpy_function`` itself, so the
rewrite changes nothing but the time a trace takes. TensorFlow keeps a list of packages it
never rewrites (TensorFlow, Keras, NumPy, TensorFlow Probability: ``CONVERSION_RULES`` in
``tensorflow.python.autograph.core.config``); `skip_conversion` adds lipdp to it at import.

What stays as before: a function of the user's own module is still rewritten when Keras calls
it (a custom layer's ``call``, a loss: Keras converts them itself), and a `tf.function` the user
writes is converted, down to its own helpers. A user function that lipdp code calls directly
inside a traced function (a custom ``DP_Loss.call``, a layer's bound methods) runs as written,
as it does when Keras's own code calls it: tensor-dependent control flow there needs
``tf.cond``. What the traced graph computes is the same; building it is faster: the first
private step of the paper's CNN (its trace, less a step) in 0.70-0.72x the time, of the main
job's MLP 0.75-0.83x (2-core machine, separate processes alternating), the test suite
0.89-0.96x (paired whole runs).
"""

from __future__ import annotations

PACKAGE = "lipdp"


def skip_conversion() -> bool:
    """Add lipdp to AutoGraph's packages that are never converted (once); False when this
    TensorFlow has no such list (then lipdp's functions are converted: slower traces, the
    same graphs)."""
    try:
        from tensorflow.python.autograph.core import config
    except ImportError:  # pragma: no cover - TensorFlow moved its AutoGraph configuration
        return False
    rules = getattr(config, "CONVERSION_RULES", None)
    if rules is None or not hasattr(config, "DoNotConvert"):  # pragma: no cover
        return False
    if not any(isinstance(rule, config.DoNotConvert) and rule.matches(PACKAGE) for rule in rules):
        config.CONVERSION_RULES = (config.DoNotConvert(PACKAGE),) + tuple(rules)
    return True
