"""Shared projection settings for spectrally constrained DP layers (wraps deel-lip)."""

from __future__ import annotations

from deel.lip.normalizers import (
    DEFAULT_BETA_BJORCK,
    DEFAULT_EPS_BJORCK,
    DEFAULT_EPS_SPECTRAL,
    DEFAULT_MAXITER_BJORCK,
    _check_RKO_params,
)

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


def project_kernel(kernel, u, config, maxiter_spectral, orthogonalise=True):
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
    converges). Privacy never depends on this: bounds use certified norms.

    Returns:
        ``(projected kernel with the input's shape, new power-iteration vector)``.
    """
    import tensorflow as tf
    from deel.lip.normalizers import spectral_normalization

    from lipdp.layers._bjorck import GRAM_SPACE_MIN_ASPECT, normalised_gram_space_bjorck
    from lipdp.layers._bjorck import orthogonalise as orthogonalise_bjorck

    matrix = tf.reshape(kernel, [-1, kernel.shape[-1]])

    def bjorck(w):
        return orthogonalise_bjorck(w, eps=config.eps_bjorck, beta=config.beta_bjorck,
                                    maxiter=config.maxiter_bjorck)

    def recovered(candidate):
        return tf.cond(
            tf.reduce_all(tf.math.is_finite(candidate)),
            lambda: candidate,
            lambda: bjorck(matrix / (tf.norm(matrix) + config.eps_spectral)),
        )

    rows, cols = matrix.shape
    if (config.eps_bjorck is not None and orthogonalise is True
            and rows >= GRAM_SPACE_MIN_ASPECT * cols):
        # Every step orthogonalises a tall kernel: the power iteration and Björck share
        # one Gram matrix (`normalised_gram_space_bjorck`).
        candidate, u = normalised_gram_space_bjorck(
            matrix, u, config.eps_spectral, maxiter_spectral, config.eps_bjorck,
            config.beta_bjorck, config.maxiter_bjorck)
        return tf.reshape(recovered(candidate), kernel.shape), u
    normalised, u, _ = spectral_normalization(matrix, u, eps=config.eps_spectral,
                                              maxiter=maxiter_spectral)
    if config.eps_bjorck is not None and orthogonalise is not False:
        def orthogonalised():
            return recovered(bjorck(normalised))

        normalised = (orthogonalised() if orthogonalise is True
                      else tf.cond(orthogonalise, orthogonalised, lambda: normalised))
    return tf.reshape(normalised, kernel.shape), u


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

    def _build_projection(self, nb_outputs):
        """Create ``u`` and project once, so constraints hold from the first step on."""
        import tensorflow as tf

        self.u = self.add_weight(
            name="power_iteration_u", shape=(1, nb_outputs), trainable=False,
            initializer=tf.keras.initializers.RandomNormal(seed=None),
        )
        with tf.init_scope():
            self._project(BUILD_MAXITER_SPECTRAL)

    def _project(self, maxiter_spectral, orthogonalise=True):
        kernel, u = project_kernel(self.kernel, self.u, self.projection, maxiter_spectral,
                                   orthogonalise)
        self._store_projection(kernel)
        self.u.assign(u)

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
