"""Shared projection settings for spectrally constrained DP layers (wraps deel-lip)."""

from __future__ import annotations

import contextlib
import functools
import math

from deel.lip.normalizers import (
    DEFAULT_BETA_BJORCK,
    DEFAULT_EPS_BJORCK,
    DEFAULT_EPS_SPECTRAL,
    DEFAULT_MAXITER_BJORCK,
    _check_RKO_params,
)

# Whether projections traced now certify their kernels for the bound pass (`uncertified`).
_CERTIFYING = [True]


@contextlib.contextmanager
def uncertified():
    """Within this context, projections do not certify their kernels (no host call: what
    classic DP-SGD's step, whose privacy rests on clipping and which may be compiled with
    XLA, traces); the bound pass then certifies those kernels from their weights."""
    _CERTIFYING.append(False)
    try:
        yield
    finally:
        _CERTIFYING.pop()


# Power iteration runs from the vector cached at the previous step, so a few
# iterations per step keep it converged; more at build, from a random start.
DEFAULT_MAXITER_SPECTRAL = 10
BUILD_MAXITER_SPECTRAL = 100


class ProjectionConfig:
    """Validated hyper-parameters of the RKO / spectral + Björck projection.

    Args:
        eps_spectral: stopping tolerance of the cached power iteration.
        maxiter_spectral: power iterations per projection.
        eps_bjorck: stopping tolerance of Björck orthogonalisation; ``None``
            disables it (the kernel is then only spectrally normalised).
        beta_bjorck: Björck step size, in (0, 0.5].
        maxiter_bjorck: Björck iterations per projection.
    """

    KEYS = ("eps_spectral", "maxiter_spectral", "eps_bjorck", "beta_bjorck", "maxiter_bjorck")

    def __init__(self, eps_spectral=DEFAULT_EPS_SPECTRAL, maxiter_spectral=DEFAULT_MAXITER_SPECTRAL,
                 eps_bjorck=DEFAULT_EPS_BJORCK, beta_bjorck=DEFAULT_BETA_BJORCK,
                 maxiter_bjorck=DEFAULT_MAXITER_BJORCK):
        _check_RKO_params(eps_spectral, eps_bjorck, beta_bjorck)
        for name, value in (("maxiter_spectral", maxiter_spectral), ("maxiter_bjorck", maxiter_bjorck)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"Received an invalid value for `{name}`, expected a positive integer. "
                    f"Received: {name}={value!r}"
                )
        self.eps_spectral = float(eps_spectral)
        self.maxiter_spectral = maxiter_spectral
        self.eps_bjorck = None if eps_bjorck is None else float(eps_bjorck)
        self.beta_bjorck = float(beta_bjorck)
        self.maxiter_bjorck = maxiter_bjorck

    def get_config(self):
        return {key: getattr(self, key) for key in self.KEYS}

    def from_cold_start(self):
        """This configuration for a kernel far from orthogonal (at build): at least
        deel-lip's iteration count, so that fewer iterations a step (``maxiter_bjorck=1``)
        start from a converged kernel and each later projection from the last one."""
        return ProjectionConfig(**{**self.get_config(), "maxiter_bjorck": max(
            self.maxiter_bjorck, DEFAULT_MAXITER_BJORCK)})


def project_kernel(kernel, u, config, maxiter_spectral, orthogonalise=True, certify=False):
    """Project a kernel onto (approximately) the orthonormal matrices, robustly.

    The kernel is reshaped to ``(-1, out)`` (RKO for convolutions), divided by
    the spectral norm estimated by deel-lip's cached power iteration, then
    (when `orthogonalise` holds: a Python bool, or a boolean tensor for a
    schedule decided in the graph) orthogonalised with deel-lip's Björck
    iteration (computed in Gram space for elongated kernels, `lipdp.layers._bjorck`;
    a tall one orthogonalised at every step runs its power iteration there too, from
    the same Gram matrix); without it the kernel is only spectrally normalised. Björck
    only converges when every singular value is below sqrt(3); after a large noisy step
    the cached vector can under-estimate the spectral norm by more than that, and Björck
    blows up. When its result is not finite, the projection restarts from the
    kernel divided by its Frobenius norm (>= its spectral norm, so Björck
    converges; computed without overflow). A kernel only spectrally normalised whose
    estimate fails (0 or not finite: the power iteration overflowed on a kernel of norm
    above ~4e9) is divided by its Frobenius norm too, and a power-iteration vector that is
    0 or not finite (left by such a step, or loaded) is replaced by a fixed start. Privacy
    never depends on this: bounds use certified norms.

    With `certify`, a kernel orthogonalised at every step whose sides differ by less than
    `GRAM_SPACE_MIN_ASPECT`, or one orthogonalised at every step with one Björck iteration
    (``maxiter_bjorck=1``) whose certificate from scratch would be the chunked Gram matrix
    (`lipdp.layers._bjorck.runs_certifying_bjorck`), runs `lipdp.layers._bjorck.certifying_bjorck`
    (deel-lip's iterates, to float32 rounding) and its result comes with a certified
    spectral norm.

    Inside a traced function, the projection is a call of a graph function shared by every
    kernel of the same shape, dtype and projection settings in the process
    (`_traced_projection`): it is traced once, not once per layer and per traced step. The
    function is pure (the kernel and the power-iteration vector in, the projection out; the
    caller writes the variables), so sharing it changes no value.

    Returns:
        ``(projected kernel with the input's shape, new power-iteration vector,
        certificate)``: the certificate is a float32 scalar tensor ``>= ||projected||_2``
        (of the kernel reshaped to ``(-1, out)``; inf when it could not be certified), or
        None when this projection does not certify.
    """
    import tensorflow as tf

    from lipdp.layers._bjorck import runs_certifying_bjorck
    from lipdp.operator_norms import float32_products_rounded_to_nearest

    rows, cols = math.prod(kernel.shape[:-1]), kernel.shape[-1]
    every_step = config.eps_bjorck is not None and orthogonalise is True
    certified = (certify and every_step
                 and runs_certifying_bjorck(rows, cols, config.maxiter_bjorck)
                 and float32_products_rounded_to_nearest(device_products=True))
    if tf.executing_eagerly():  # at build: one projection, run op by op
        return _projected(kernel, u, config, maxiter_spectral, orthogonalise, certified)
    scheduled = not isinstance(orthogonalise, bool)
    projection = _traced_projection(
        tuple(kernel.shape), tf.as_dtype(kernel.dtype).name, tuple(config.get_config().items()),
        maxiter_spectral, None if scheduled else orthogonalise, certified)
    schedule = (tf.convert_to_tensor(orthogonalise, tf.bool),) if scheduled else ()
    return projection(tf.convert_to_tensor(kernel), tf.convert_to_tensor(u), *schedule)


@functools.lru_cache(maxsize=256)
def _traced_projection(shape, dtype, config_items, maxiter_spectral, orthogonalise, certified):
    """The graph function of `_projected` for kernels of `shape` and `dtype`, with these
    settings (``orthogonalise=None``: a schedule's boolean tensor is its third argument).
    Every static choice the graph depends on is in the arguments: the projection settings,
    and `certified`, decided by the caller from the module settings in force."""
    import tensorflow as tf

    config = ProjectionConfig(**dict(config_items))

    def projection(kernel, u, *schedule):
        return _projected(kernel, u, config, maxiter_spectral,
                          schedule[0] if orthogonalise is None else orthogonalise, certified)

    return tf.function(projection, autograph=False)


def _projected(kernel, u, config, maxiter_spectral, orthogonalise, certified):
    """`project_kernel`, with whether Björck certifies its result (`certified`) decided."""
    import tensorflow as tf
    from deel.lip.normalizers import spectral_normalization

    from lipdp.layers._bjorck import (GRAM_SPACE_MIN_ASPECT, certifying_bjorck,
                                      normalised_gram_space_bjorck)
    from lipdp.layers._bjorck import orthogonalise as orthogonalise_bjorck

    matrix = tf.reshape(kernel, [-1, kernel.shape[-1]])
    rows, cols = matrix.shape
    every_step = config.eps_bjorck is not None and orthogonalise is True
    u = _usable_vector(u)

    def bjorck(w):
        if certified:
            return certifying_bjorck(w, eps=config.eps_bjorck, beta=config.beta_bjorck,
                                     maxiter=config.maxiter_bjorck)
        return orthogonalise_bjorck(w, eps=config.eps_bjorck, beta=config.beta_bjorck,
                                    maxiter=config.maxiter_bjorck), None

    def recovered(candidate, certificate):
        """``(candidate, certificate)``, or Björck's restart from the Frobenius scaling when
        the candidate is not finite."""
        finite = tf.reduce_all(tf.math.is_finite(candidate))

        def restart():
            return bjorck(matrix / (_frobenius_norm(matrix) + config.eps_spectral))

        if certificate is None:
            return tf.cond(finite, lambda: candidate, lambda: restart()[0]), None
        return tf.cond(finite, lambda: (candidate, certificate), restart)

    if every_step and not certified and rows >= GRAM_SPACE_MIN_ASPECT * cols:
        # Every step orthogonalises a tall kernel: the power iteration and Björck share
        # one Gram matrix (`normalised_gram_space_bjorck`).
        candidate, u = normalised_gram_space_bjorck(
            matrix, u, config.eps_spectral, maxiter_spectral, config.eps_bjorck,
            config.beta_bjorck, config.maxiter_bjorck)
        projected, certificate = recovered(candidate, None)
        return tf.reshape(projected, kernel.shape), u, certificate
    normalised, u, sigma = spectral_normalization(matrix, u, eps=config.eps_spectral,
                                                  maxiter=maxiter_spectral)

    def spectrally_normalised():
        """The estimate is 0 or not finite when the power iteration overflowed (a kernel of
        norm above ~4e9: ``||W^T W u||^2`` beyond float32) or its vector lies in the kernel's
        null space: the kernel was then multiplied by 1 / eps_spectral (an audit: 1000x a
        step, silently). The Frobenius scaling (>= the spectral norm) serves instead. (Björck
        needs no such guard: from such a kernel it diverges, and `recovered` restarts it.)"""
        estimated = tf.reshape(tf.logical_and(tf.math.is_finite(sigma), sigma > 0.0), [])
        return tf.cond(estimated, lambda: normalised,
                       lambda: matrix / (_frobenius_norm(matrix) + config.eps_spectral))

    certificate = None
    if config.eps_bjorck is None or orthogonalise is False:
        normalised = spectrally_normalised()
    elif every_step:
        normalised, certificate = recovered(*bjorck(normalised))
    else:
        normalised = tf.cond(orthogonalise, lambda: recovered(*bjorck(normalised))[0],
                             spectrally_normalised)
    return tf.reshape(normalised, kernel.shape), u, certificate


def _usable_vector(u):
    """`u`, a power-iteration vector, when it is finite and not zero; else a fixed start
    (entries spread over [0.5, 1.5], as deel-lip's random starts are positive). A power
    iteration from 0 or NaN stays there: after one overflowing step a layer's stored vector
    was 0 for good and every later projection multiplied its kernel by 1 / eps_spectral (an
    audit). The vector is normalised before use, so its scale does not matter."""
    import numpy as np
    import tensorflow as tf

    squares = tf.reduce_sum(tf.square(u))  # not finite, or 0, exactly when u is unusable
    start = np.linspace(0.5, 1.5, u.shape.num_elements()).reshape(u.shape)
    usable = tf.logical_and(squares > 0.0, squares < np.inf)
    return tf.where(usable, u, tf.constant(start, u.dtype))


def _frobenius_norm(matrix):
    """``||matrix||_F`` without overflow: ``m ||matrix / m||_F`` with m its largest magnitude
    (`tf.norm` squares the entries: inf above ~1.8e19, and Björck's restart then divided the
    kernel by inf, to zero). Zero for a zero matrix; not finite for a non-finite one."""
    import tensorflow as tf

    largest = tf.reduce_max(tf.abs(matrix))
    scale = tf.where(largest > 0.0, largest, tf.ones_like(largest))
    return scale * tf.norm(matrix / scale)


def projection_config(eps_spectral=None, maxiter_spectral=None, eps_bjorck="default",
                      beta_bjorck=None, maxiter_bjorck=None):
    """Build a ProjectionConfig from layer arguments, keeping the defaults for unset ones.

    ``eps_bjorck="default"`` keeps deel-lip's tolerance; ``None`` disables Björck.
    """
    kwargs = {"eps_spectral": eps_spectral, "maxiter_spectral": maxiter_spectral,
              "beta_bjorck": beta_bjorck, "maxiter_bjorck": maxiter_bjorck}
    kwargs = {key: value for key, value in kwargs.items() if value is not None}
    if eps_bjorck != "default":
        kwargs["eps_bjorck"] = eps_bjorck
    return ProjectionConfig(**kwargs)


# Keras arguments that would change the variables or the loss behind the bounds' back.
_FORBIDDEN_KWARGS = ("kernel_constraint", "kernel_regularizer", "bias_regularizer",
                     "activity_regularizer")


class ProjectedKernelMixin:
    """What spectrally constrained DP layers share: argument checks, the cached
    power-iteration vector ``u`` (a non-trainable weight, saved with the model),
    the projection, the bias norm and the config."""

    @staticmethod
    def _pop_forbidden_kwargs(layer_name, kwargs):
        for key in _FORBIDDEN_KWARGS:
            if kwargs.pop(key, None) is not None:
                raise ValueError(f"{layer_name} does not accept `{key}`.")

    #: Whether the layer gets a certificate cache (`_build_certificate_cache`), through which
    #: its projection's certificate serves the bound pass: for layers whose certified norm is
    #: the spectral norm of the kernel the projection returns (dense layers; a convolution's
    #: is its operator norm), when that kernel's sides differ by less than a factor 3 or its
    #: projection runs one Björck iteration on a kernel large enough for the chunked
    #: certificate (`runs_certifying_bjorck`). The projections of a layer with a cache certify.
    _keeps_projection_certificate = False

    def _build_projection(self, nb_outputs):
        """Create ``u`` (and the certificate cache), and project once, so constraints hold
        from the first step on."""
        import tensorflow as tf

        from lipdp.layers._bjorck import runs_certifying_bjorck

        self.u = self.add_weight(
            name="power_iteration_u", shape=(1, nb_outputs), trainable=False,
            initializer=tf.keras.initializers.RandomNormal(seed=None),
        )
        if self._keeps_projection_certificate and runs_certifying_bjorck(
                math.prod(self.kernel.shape[:-1]), self.kernel.shape[-1],
                self.projection.maxiter_bjorck):
            self._build_certificate_cache()
        with tf.init_scope():
            self._project(BUILD_MAXITER_SPECTRAL, cold_start=True)

    def _build_certificate_cache(self):
        """``(certified kernel, its certified spectral norm)``: what the last certifying
        projection wrote (`certificate_cache`). Plain variables kept out of the layer's
        weights: saved models, checkpoints and ``get_weights`` stay as they were; a model
        restored without them certifies its kernels from scratch."""
        import tensorflow as tf

        kernel = self.bounded_kernel()
        with tf.init_scope():
            cache = (tf.Variable(tf.zeros(kernel.shape, kernel.dtype), trainable=False,
                                 name="certified_kernel",
                                 aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA),
                     tf.Variable(float("inf"), dtype=tf.float32, trainable=False,
                                 name="certified_kernel_norm",
                                 aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA))
        object.__setattr__(self, "_certificate_cache", cache)  # not tracked by Keras

    def certificate_cache(self):
        """``(fresh, norm)`` for the bound pass: ``fresh`` (a boolean tensor) holds when the
        kernel the forward pass uses is, entry for entry, the one the last certifying
        projection returned, and ``norm`` is then a certified upper bound of its spectral
        norm (`lipdp.layers._bjorck.certifying_bjorck`); None for a layer without a cache.
        Any other write to the kernel (an optimizer step, ``set_weights``, a restored
        checkpoint, a projection without Björck) makes it stale."""
        import tensorflow as tf

        cache = getattr(self, "_certificate_cache", None)
        if cache is None:
            return None
        certified_kernel, norm = cache
        return tf.reduce_all(tf.equal(self.bounded_kernel(), certified_kernel)), norm

    def _project(self, maxiter_spectral, orthogonalise=True, cold_start=False):
        cache = getattr(self, "_certificate_cache", None)
        config = self.projection.from_cold_start() if cold_start else self.projection
        kernel, u, certificate = project_kernel(
            self.kernel, self.u, config, maxiter_spectral, orthogonalise,
            certify=cache is not None and _CERTIFYING[-1])
        self._store_projection(kernel)
        self.u.assign(u)
        if certificate is not None:
            certified_kernel, norm = cache
            certified_kernel.assign(kernel)
            norm.assign(certificate)

    def _store_projection(self, projected):
        """Where the projected kernel goes: into the trained variable itself by default."""
        self.kernel.assign(projected)

    def project(self, orthogonalise=True):
        """Spectral normalisation, then Björck when `orthogonalise` holds (see
        `project_kernel`; `lipdp.DP_Model.compile`'s ``bjorck_every`` schedules it)."""
        self._project(self.projection.maxiter_spectral, orthogonalise)

    def _projected_config(self, config, hidden=()):
        """Drop the Keras arguments this layer refuses; add the projection's."""
        for key in _FORBIDDEN_KWARGS + ("activation", "bias_constraint") + tuple(hidden):
            config.pop(key, None)
        return {**config, **self.projection.get_config()}


class ReparametrizedKernelMixin(ProjectedKernelMixin):
    """The forward pass uses ``Wbar = Pi(V)``, the projection of a free variable V.

    ``Wbar`` (a non-trainable weight, saved with the model) is recomputed from V
    after every step; V itself is never modified by the projection. The forward
    pass uses exactly ``Wbar``, and the gradient w.r.t. V is taken *straight
    through* the projection: ``dloss/dV := dloss/dWbar``. Differentiating through
    Björck iterations has no useful bound, whereas this makes every bound that
    holds for a kernel Wbar hold for V. Since ``Pi(c V) = Pi(V)`` for c > 0, this
    is projected gradient descent with the projection kept aside.
    """

    def _build_reparametrization(self):
        import tensorflow as tf

        self.projected_kernel = self.add_weight(
            name="projected_kernel", shape=self.kernel.shape, trainable=False,
            initializer="zeros")
        with tf.init_scope():
            self.projected_kernel.assign(self.kernel)

    def _store_projection(self, projected):
        self.projected_kernel.assign(projected)

    def bounded_kernel(self):
        """The value of the kernel the forward pass uses: ``Wbar``."""
        return self.projected_kernel

    def forward_kernel(self):
        """``Wbar`` in value, with the gradient going straight to V."""
        import tensorflow as tf

        @tf.custom_gradient
        def straight_through(free, projected):
            return tf.identity(projected), lambda g: (g, tf.zeros_like(projected))

        return straight_through(tf.convert_to_tensor(self.kernel),
                                tf.convert_to_tensor(self.projected_kernel))
