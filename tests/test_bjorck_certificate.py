"""The certificate of the last Björck iteration (`lipdp.layers._bjorck.certifying_bjorck`,
`lipdp.gram_certificates.bjorck_step_norm_upper`) and the cache that hands it to the bound pass.

The certificate must bound the exact spectral norm (float64 SVD) of the float32 kernel the
iteration returns, whatever its input: near-orthogonal kernels after a step, spread spectra,
spectra past the range where Björck contracts (``lambda > 4``), other step sizes. Its rounding
terms are what lift it above the exact norm: without them it is sqrt(max f) = 1 exactly, below
the 1 + 2e-7 to 1 + 5e-7 that rounding leaves on every kernel here (checked by removing them).
The cache must serve only the kernel the projection certified: any other write makes the
bound pass certify the kernel from scratch.
"""

import numpy as np
import pytest
import tensorflow as tf
from deel.lip.normalizers import bjorck_normalization

import lipdp.operator_norms as operator_norms
from lipdp.bounds import gradient_bounds
from lipdp.gram_certificates import bjorck_step_norm_upper
from lipdp.layers import (DP_BoundedInput, DP_GroupSort, DP_QuickSpectralConv2D,
                          DP_QuickSpectralDense, DP_SpectralDense)
from lipdp.layers._bjorck import certifying_bjorck
from lipdp.layers._projection import ProjectionConfig, project_kernel
from lipdp.losses import DP_TauCategoricalCrossentropy
from lipdp.metadata import DatasetMetadata, DPParameters
from lipdp.model import DP_Sequential
from lipdp.operator_norms import (certified_norms, dense_spectral_norm_upper,
                                  without_projection_certificate)
from tests._soundness import (adversarial_inputs, assert_within_bounds, maximize_gradient_norm,
                              one_hot_labels, per_example_gradient_norms)

SHAPES = [(784, 1024), (1024, 784), (300, 200), (64, 64), (9, 16)]


def _near_orthogonal(shape, seed, step):
    rng = np.random.default_rng(seed)
    q, _ = np.linalg.qr(rng.standard_normal((max(shape), min(shape))))
    w = (q if shape[0] >= shape[1] else q.T) + step * rng.choice([-1.0, 1.0], size=shape)
    return (w / np.linalg.norm(w, 2)).astype(np.float32)


def _with_spectrum(shape, singular_values, seed):
    rng = np.random.default_rng(seed)
    left, _ = np.linalg.qr(rng.standard_normal((shape[0], min(shape))))
    right, _ = np.linalg.qr(rng.standard_normal((shape[1], min(shape))))
    return ((left * singular_values) @ right.T).astype(np.float32)


def _norm(w):
    return np.linalg.svd(np.asarray(w, np.float64), compute_uv=False)[0]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("start", ["step 1e-3", "step 5e-2", "spread"])
def test_certificate_bounds_the_result_and_is_tight(shape, start):
    """From a kernel after an Adam-like step (deel-lip's default tolerance: 2 to 4 iterations)
    or a spread Gaussian one (many iterations): the certificate bounds the returned kernel's
    norm, within 0.35% on the main job's 784 x 1024 kernel (the worst-case float32 error of its
    Gram matrix in blocks of 128 rows and of the product) and closer on smaller ones."""
    if start == "spread":
        w = np.random.default_rng(3).standard_normal(shape)
        w = (w / np.linalg.norm(w, 2)).astype(np.float32)
    else:
        w = _near_orthogonal(shape, seed=1, step=float(start.split()[1]))
    result, certificate = certifying_bjorck(tf.constant(w), eps=1e-3, beta=0.5, maxiter=15)
    norm, certificate = _norm(result), float(certificate)
    assert norm <= certificate <= norm * (1 + 3.5e-3), (norm, certificate)
    if min(shape) <= 200:
        assert certificate <= norm * (1 + 6e-4)


@pytest.mark.parametrize("shape", [(784, 1024), (300, 200), (200, 300)])
@pytest.mark.parametrize("iterations", [1, 2, 3])
def test_iterates_are_deel_lips(shape, iterations):
    """Same recursion (deel-lip's ``(1 + b) W - b W W^T W``, here ``W P^``) to float32
    rounding, with a fixed number of iterations and with deel-lip's stopping rule."""
    w = tf.constant(_near_orthogonal(shape, seed=iterations, step=3e-3))
    expected = bjorck_normalization(w, eps=1e-30, beta=0.5, maxiter=iterations).numpy()
    got = certifying_bjorck(w, eps=1e-30, beta=0.5, maxiter=iterations)[0].numpy()
    np.testing.assert_allclose(got, expected, rtol=0, atol=2e-6)
    expected = bjorck_normalization(w, eps=1e-3, beta=0.5, maxiter=15).numpy()
    got = certifying_bjorck(w, eps=1e-3, beta=0.5, maxiter=15)[0].numpy()
    np.testing.assert_allclose(got, expected, rtol=0, atol=2e-6)


@pytest.mark.parametrize("beta", [0.5, 0.3, 0.25, 0.1])
@pytest.mark.parametrize("top", [1.0, 1.6, 2.5])
def test_one_iteration_from_any_spectrum(beta, top):
    """One iteration from singular values spread up to `top`: lambda_max up to 6.25, past
    ``a / b`` for every step size here, where ``f(l) = l (a - b l)^2`` grows again. The
    certificate bounds the result, which is the exact-arithmetic ``sqrt(max_i f(lambda_i))``
    to 1e-4; and it is ``sqrt(max_[0, l] f)`` (l: the largest row sum of ``|V^T V|``, not
    lambda_max: a looser, still valid bound on a spread spectrum) plus rounding terms that
    stay below 0.1%."""
    shape = (300, 120)
    singular = np.linspace(0.05, top, min(shape))
    w = _with_spectrum(shape, singular, seed=int(10 * top))
    result, certificate = certifying_bjorck(tf.constant(w), eps=1e-30, beta=beta, maxiter=1)
    norm, certificate = _norm(result), float(certificate)
    a, b = float(np.float32(1 + beta)), float(np.float32(beta))

    def f(x):
        return x * (a - b * x) ** 2

    lam = singular.astype(np.float64) ** 2
    assert norm <= certificate, (norm, certificate)
    assert abs(norm / np.sqrt(np.max(f(lam))) - 1) < 1e-4
    w64 = w.astype(np.float64)
    row_sums = np.max(np.sum(np.abs(w64.T @ w64), 0))
    assert certificate <= np.sqrt(max(f(min(row_sums, a / (3 * b))), f(row_sums))) * 1.001


def test_uncertifiable_kernels_get_no_certificate():
    """Entries below 2^-40 (float32 products underflow), non-finite entries and a diverged
    iteration give inf: the bound pass then certifies the kernel itself."""
    w = _near_orthogonal((64, 48), seed=0, step=1e-3)
    for bad in (w * 1e-13, np.where(np.arange(w.size).reshape(w.shape) == 5, np.nan, w)):
        assert np.isinf(float(certifying_bjorck(tf.constant(bad.astype(np.float32)), 1e-3,
                                                0.5, 15)[1]))
    diverging = (w * 40.0).astype(np.float32)
    result, certificate = certifying_bjorck(tf.constant(diverging), 1e-3, 0.5, 15)
    assert not np.all(np.isfinite(result.numpy())) and np.isinf(float(certificate))
    assert np.isinf(bjorck_step_norm_upper(64, 48, 64, 1, 1.5, 0.5, np.inf, 1.0, 1.0, 1.0,
                                           1.0, 1.0))


def test_the_projection_certifies_squarish_kernels_orthogonalised_every_step():
    """`project_kernel(..., certify=True)` certifies deel-lip-loop kernels projected with
    Björck, and only them: not elongated kernels (Gram-space Björck), not a schedule decided
    in the graph, not a projection without Björck, not without `certify`."""
    config = ProjectionConfig()
    u = tf.ones((1, 48))
    square = tf.constant(_near_orthogonal((64, 48), seed=0, step=1e-3))
    projected, _, certificate = project_kernel(square, u, config, 10, certify=True)
    assert _norm(projected) <= float(certificate) <= _norm(projected) * 1.001
    tall = tf.constant(_near_orthogonal((400, 48), seed=0, step=1e-3))
    assert project_kernel(tall, u, config, 10, certify=True)[2] is None
    assert project_kernel(square, u, config, 10, tf.constant(True), certify=True)[2] is None
    assert project_kernel(square, u, config, 10, False, certify=True)[2] is None
    assert project_kernel(square, u, config, 10)[2] is None
    no_bjorck = ProjectionConfig(eps_bjorck=None)
    assert project_kernel(square, u, no_bjorck, 10, certify=True)[2] is None
    # One iteration a projection: an elongated kernel runs the certifying loop too when it is
    # large enough for a chunked certificate (its threshold lowered here), not below.
    one = ProjectionConfig(maxiter_bjorck=1)
    for shape in ((400, 48), (48, 400)):
        kernel = tf.constant(_near_orthogonal(shape, seed=0, step=1e-3))
        assert project_kernel(kernel, tf.ones((1, shape[1])), one, 10, certify=True)[2] is None
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(operator_norms, "CHUNKED_GRAM_MIN_WORK", 400 * 48 * 48)
            projected, _, certificate = project_kernel(kernel, tf.ones((1, shape[1])), one,
                                                       10, certify=True)
        assert _norm(projected) <= float(certificate) <= _norm(projected) * 1.001


def _fresh(layer):
    return bool(layer.certificate_cache()[0])


def _bound(layer):
    return float(certified_norms([layer.certified_norm_request()])[0])


@pytest.mark.parametrize("layer_class", [DP_QuickSpectralDense, DP_SpectralDense])
def test_the_bound_pass_serves_the_certificate_only_for_the_kernel_it_certifies(
        layer_class, monkeypatch):
    """After a projection the bound pass returns the projection's certificate without
    certifying anything on the host; after any other write to the kernel the forward pass
    uses (assign, ``set_weights``) it certifies that kernel from scratch, and a projection
    makes the cache fresh again. Writing the free variable of a reparametrised layer leaves
    the forward kernel, and so the cache, as they were."""
    tf.keras.utils.set_random_seed(0)
    layer = layer_class(48, use_bias=False)
    layer.build((None, 64))
    kernel = layer.bounded_kernel()
    assert _fresh(layer)
    cached = float(layer.certificate_cache()[1])
    assert _norm(kernel.numpy()) <= cached <= _norm(kernel.numpy()) * 1.001
    monkeypatch.setattr(operator_norms, "dense_norm_upper", lambda *a: 1 / 0)
    assert _bound(layer) == cached  # no host certificate was computed
    monkeypatch.undo()
    if layer_class is DP_SpectralDense:
        layer.kernel.assign(layer.kernel * 3.0)
        assert _fresh(layer) and _bound(layer) == cached
    kernel.assign(kernel * 2.0)
    assert not _fresh(layer)
    assert _bound(layer) == float(dense_spectral_norm_upper(tf.reshape(kernel, [64, 48])))
    assert 2 * _norm(kernel.numpy() / 2) <= _bound(layer) <= 2.0001 * _norm(kernel.numpy() / 2)
    layer.project()
    assert _fresh(layer)
    weights = layer.get_weights()
    index = [w.name for w in layer.weights].index(kernel.name)
    weights[index] = weights[index] * 0.5
    layer.set_weights(weights)
    assert not _fresh(layer)
    assert _bound(layer) <= 0.5001 * _norm(kernel.numpy() * 2)


def test_the_cache_is_no_weight_and_convolutions_and_elongated_kernels_have_none():
    """Saved weights, checkpoints and configs are those of before; a convolution's certified
    norm (its operator norm) is not its reshaped kernel's, and an elongated kernel's
    projection never certifies: no cache."""
    layer = DP_QuickSpectralDense(48)
    layer.build((None, 64))
    assert [w.name.split("/")[-1] for w in layer.weights] == [
        "kernel:0", "bias:0", "power_iteration_u:0"]
    conv = DP_QuickSpectralConv2D(8, 3)
    conv.build((None, 8, 8, 4))
    assert conv.certificate_cache() is None
    assert conv.certified_norm_request()[0] == "conv"
    head = DP_QuickSpectralDense(10)  # 1024 x 10: Björck in Gram space, nothing to cache
    head.build((None, 1024))
    assert head.certificate_cache() is None
    assert head.certified_norm_request()[0] == "dense"


def _trained_mlp(inputs, optimizer, seed=0, samples=64, batch=32, hidden_maxiter=None,
                 head_maxiter=None, maxiter_spectral=None):
    """``(model, rng)``: ``inputs -> 48 -> GroupSort2 -> 10`` (no biases, inputs of norm about
    0.58 under a bound of 1) after one epoch of `samples` examples in batches of `batch`,
    the dense layers projected with at most `hidden_maxiter` / `head_maxiter` Björck
    iterations a step (None: deel-lip's loop), after `maxiter_spectral` power iterations
    (None: the layers' default)."""
    tf.keras.utils.set_random_seed(seed)
    model = DP_Sequential(
        [DP_BoundedInput(1.0, input_shape=(inputs,)),
         DP_QuickSpectralDense(48, use_bias=False, maxiter_bjorck=hidden_maxiter,
                               maxiter_spectral=maxiter_spectral),
         DP_GroupSort(2), DP_QuickSpectralDense(10, use_bias=False, maxiter_bjorck=head_maxiter,
                                                maxiter_spectral=maxiter_spectral)],
        dp_parameters=DPParameters(1.0, 1e-5),
        dataset_metadata=DatasetMetadata((inputs,), 10, samples, 16, batch, 1.0, "shuffle"))
    model.compile(loss=DP_TauCategoricalCrossentropy(10.0), optimizer=optimizer)
    rng = np.random.default_rng(seed)
    x = rng.uniform(size=(samples, inputs)).astype(np.float32) / np.sqrt(inputs)
    y = tf.one_hot(rng.integers(0, 10, samples), 10)
    model.fit(x, y, batch_size=batch, epochs=1, verbose=0)
    return model, rng


def _assert_bounds_hold_with_the_cached_certificate(model, rng, cached):
    """The step's bounds, the hidden layer's cached certificate (`cached`) and all, hold for
    exact per-example gradients on adversarial inputs (random inside, on and beyond the input
    bound, constant images, a hot pixel) and on inputs optimised for the certified layer's
    successor's gradient, whose bound is the one the certificate scales; a certificate at
    1/1.4 of the cached one (a wrong proof) makes that bound fail."""
    hidden, successor = model.layers[1], model.layers[3].kernel
    bounds = gradient_bounds(model)
    loss = model.dp_loss
    x_adv = adversarial_inputs(rng, model.input_shape[1:], 1.0)
    y_adv = one_hot_labels(rng, len(x_adv), 10)
    assert_within_bounds(per_example_gradient_norms(model, loss, x_adv, y_adv), bounds,
                         "trained, certified by the projection")
    x_max = maximize_gradient_norm(model, loss, x_adv[:2], y_adv[:2], successor, 1.0, steps=30)
    norms = per_example_gradient_norms(model, loss, x_max, y_adv[:2])
    assert_within_bounds(norms, bounds, "gradient ascent")
    hidden._certificate_cache[1].assign(cached / 1.4)
    with pytest.raises(AssertionError):
        assert_within_bounds(norms, gradient_bounds(model), "certificate / 1.4")
    hidden._certificate_cache[1].assign(cached)


def test_a_trained_and_reloaded_model_bounds_its_gradients_with_fresh_certificates(tmp_path):
    """Training steps certify the projected kernels (the cache is fresh after each step and
    the bounds match the from-scratch ones within the certificate's 0.1% here), and the
    step's bounds hold for exact per-example gradients on adversarial inputs; a model
    reloaded from disk starts with stale caches (its build certified the initial kernels)
    and bounds with from-scratch certificates."""
    model, rng = _trained_mlp(64, tf.keras.optimizers.SGD(0.1))
    hidden = model.layers[1]
    assert _fresh(hidden)
    cached = _bound(hidden)
    scratch = float(dense_spectral_norm_upper(hidden.kernel))
    assert scratch <= cached <= scratch * 1.001
    _assert_bounds_hold_with_the_cached_certificate(model, rng, cached)
    path = str(tmp_path / "model.keras")
    model.save(path)
    loaded = tf.keras.models.load_model(path)
    hidden = loaded.layers[1]
    assert not _fresh(hidden)
    assert _bound(hidden) == scratch


def test_classic_dp_sgd_projects_without_certifying():
    """Classic DP-SGD's privacy rests on clipping: its projections do not certify (the caches
    go stale at the first step; no host call in its step)."""
    tf.keras.utils.set_random_seed(0)
    model = DP_Sequential(
        [DP_BoundedInput(1.0, input_shape=(64,)), DP_QuickSpectralDense(48, use_bias=False),
         DP_GroupSort(2), DP_QuickSpectralDense(10, use_bias=False)],
        dp_parameters=DPParameters(1.0, 1e-5, mode="clipped", clipping="flat",
                                   l2_norm_clip=1.0),
        dataset_metadata=DatasetMetadata((64,), 10, 64, 16, 32, 1.0, "shuffle"))
    model.compile(loss=DP_TauCategoricalCrossentropy(10.0),
                  optimizer=tf.keras.optimizers.SGD(0.1))
    assert _fresh(model.layers[1])  # built eagerly: certified
    rng = np.random.default_rng(0)
    x = rng.uniform(size=(64, 64)).astype(np.float32) / 8.0
    y = tf.one_hot(rng.integers(0, 10, 64), 10)
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    assert model.dp_steps_taken == 2
    assert not _fresh(model.layers[1])


def _trained_hidden_kernel(maxiter_bjorck):
    """The hidden kernel of a small MLP after 8 Adam steps at the main job's learning rate,
    projected with at most `maxiter_bjorck` Björck iterations a step."""
    model, _ = _trained_mlp(64, tf.keras.optimizers.Adam(1e-3), seed=1, samples=128, batch=16,
                            hidden_maxiter=maxiter_bjorck)
    return model.layers[1]


def test_one_warm_started_bjorck_iteration_a_step_keeps_kernels_orthogonal_and_certified():
    """``maxiter_bjorck=1`` (config ``model.maxiter_bjorck``): each projection starts from the
    kernel the last one left, moved by one optimizer step, so a single iteration (which
    about squares the distance of every singular value to 1) keeps the kernel within 1e-4
    of orthogonal (3e-5 here; 5e-3 at ten times the learning rate), and its certificate
    still bounds the exact norm. It is one iteration: the kernel is measurably less
    orthogonal than deel-lip's converged loop leaves it."""
    one = _trained_hidden_kernel(1)
    converged = _trained_hidden_kernel(None)
    assert one.projection.maxiter_bjorck == 1
    spread = {}
    for name, layer in (("one", one), ("converged", converged)):
        singular_values = np.linalg.svd(np.asarray(layer.kernel, np.float64), compute_uv=False)
        spread[name] = float(np.max(np.abs(singular_values - 1.0)))
        assert _fresh(layer)
        assert singular_values[0] <= _bound(layer) <= singular_values[0] * 1.001
    assert spread["one"] < 1e-4
    assert spread["one"] > 10 * spread["converged"]


def test_the_main_jobs_projection_settings_keep_certified_bounds_that_hold():
    """The main job's projection (``maxiter_bjorck: 1``, ``maxiter_spectral: 2``: the kernel
    divided by a two-iteration power estimate, then one Björck iteration), 8 Adam steps at
    its learning rate: the hidden kernel stays within 1e-4 of orthogonal, its projection's
    certificate is fresh and within 0.1% of the exact norm, and the step's bounds hold for
    exact per-example gradients on adversarial and gradient-ascent inputs (and fail with
    that certificate at 1/1.4)."""
    model, rng = _trained_mlp(64, tf.keras.optimizers.Adam(1e-3), seed=1, samples=128,
                              batch=16, hidden_maxiter=1, head_maxiter=1, maxiter_spectral=2)
    hidden = model.layers[1]
    assert hidden.projection.maxiter_spectral == 2 and hidden.projection.maxiter_bjorck == 1
    singular_values = np.linalg.svd(np.asarray(hidden.kernel, np.float64), compute_uv=False)
    assert np.max(np.abs(singular_values - 1.0)) < 1e-4
    assert _fresh(hidden)
    cached = _bound(hidden)
    assert singular_values[0] <= cached <= singular_values[0] * 1.001
    _assert_bounds_hold_with_the_cached_certificate(model, rng, cached)


def test_one_iteration_a_step_certifies_elongated_kernels_and_spares_their_gram_matrix(
        monkeypatch):
    """``maxiter_bjorck=1`` on the paper's CNN's 3136 x 512 dense kernel (elongated and large:
    the bound pass would compute its chunked Gram matrix): the layer builds with deel-lip's
    full loop (a cold start: no certificate, the bound pass certifies from scratch), then each
    projection runs one certifying iteration, and while the kernel is the one certified the
    bound pass neither forms the chunked Gram matrix nor certifies on the host; any other write
    brings both back. The projection's certificate is tighter than the chunked one here."""
    tf.keras.utils.set_random_seed(0)
    layer = DP_QuickSpectralDense(512, use_bias=False, maxiter_bjorck=1)
    layer.build((None, 3136))
    assert not _fresh(layer)
    scratch = _bound(layer)
    assert _norm(layer.kernel.numpy()) <= scratch
    layer.project()
    assert _fresh(layer)
    cached = float(layer.certificate_cache()[1])
    norm = _norm(layer.kernel.numpy())
    assert norm <= cached <= norm * 1.0025
    assert cached < float(certified_norms([without_projection_certificate(
        layer.certified_norm_request())])[0])
    monkeypatch.setattr(operator_norms, "_chunked_gram", lambda *a: 1 / 0)
    monkeypatch.setattr(operator_norms, "chunked_dense_norm_upper", lambda *a, **k: 1 / 0)
    assert _bound(layer) == cached
    monkeypatch.undo()
    layer.kernel.assign(layer.kernel * 1.5)
    assert not _fresh(layer)
    assert 1.5 * norm <= _bound(layer) <= 1.5 * norm * 1.005
    assert layer.certified_norm_request()[0] == "cached-dense"
    default = DP_QuickSpectralDense(512, use_bias=False)
    default.build((None, 3136))
    assert default.certificate_cache() is None
    small = DP_QuickSpectralDense(10, use_bias=False, maxiter_bjorck=1)  # 1024 x 10: the
    small.build((None, 1024))  # bound pass's float64 certificate is cheaper than a host call
    assert small.certificate_cache() is None


def test_a_model_projected_with_one_iteration_bounds_exact_gradients_with_its_certificates(
        monkeypatch):
    """Training with one Björck iteration a step, on an elongated hidden kernel whose
    from-scratch certificate is the chunked one (its thresholds lowered to this small
    kernel): the step's bounds, the projection's certificate inside, hold for exact
    per-example gradients on adversarial and gradient-ascent inputs, and fail with that
    certificate at 1/1.4."""
    monkeypatch.setattr(operator_norms, "CHUNKED_GRAM_MIN_WORK", 2 ** 12)
    model, rng = _trained_mlp(192, tf.keras.optimizers.SGD(0.1), hidden_maxiter=1,
                              head_maxiter=1)
    hidden = model.layers[1]
    assert hidden.certified_norm_request()[0] == "cached-dense"
    assert operator_norms.chunked_certificate(hidden.kernel.shape)
    assert _fresh(hidden) and _fresh(model.layers[3])
    cached = _bound(hidden)
    norm = _norm(hidden.kernel.numpy())
    assert norm <= cached <= norm * 1.001
    _assert_bounds_hold_with_the_cached_certificate(model, rng, cached)
