"""Scripts written for the paper's library (lip-dp, ICLR 2024) run unchanged on lipdp.

The two scripts of the issue, written here with the same import paths, names and
arguments as the paper library's README quick-start and the getting-started code of
the paper's appendix B.2, but 1 epoch and small generated IDX files under the dataset
name they use ("mnist", in ``$LIPDP_DATA_DIR``; nothing is downloaded). Both train,
report epsilon, and their models pass the exact per-example gradient check of
lipdp's own models (`tests._soundness`). Then the compatibility details: colour
spaces and the input bound after them, ``bound_fct=None``, augmentation, the one-time
warnings, and the measured factor between the paper library's noise and lipdp's on
the getting-started CNN (README, "Migrating from the paper's library").
"""

import logging
import math
import os
import pickle
import warnings

import numpy as np
import pytest
import tensorflow as tf

import lipdp.model
import lipdp.pipeline
import lipdp.sensitivity
from lipdp import callbacks, data, metadata
from lipdp.bounds import gradient_bounds
from tests._soundness import (adversarial_inputs, assert_within_bounds, one_hot_labels,
                              per_example_gradient_norms)
from tests.test_data import make_mnist_dir

# Each test that expects a one-time warning asserts it with pytest.warns.
pytestmark = pytest.mark.filterwarnings("ignore::lipdp.pipeline.PaperCompatibilityWarning")


@pytest.fixture
def offline(tmp_path, monkeypatch):
    """Generated datasets under $LIPDP_DATA_DIR, nothing else reachable, no download; the
    one-time warnings reset."""
    root = tmp_path / "datasets"
    monkeypatch.setenv(data.DATA_DIR_ENV, str(root))
    monkeypatch.setenv("KERAS_HOME", str(tmp_path / "keras_home"))
    monkeypatch.setattr(data, "DEBIAN_DATASETS_DIR", str(tmp_path / "debian"))

    def no_network():
        raise OSError("network disabled in tests")

    for name in ("mnist", "cifar10"):
        monkeypatch.setattr(getattr(tf.keras.datasets, name), "load_data", no_network)
    monkeypatch.setattr(lipdp.pipeline, "_WARNED", set())
    return root


@pytest.fixture
def mnist(offline):
    """1000 training images: the getting-started batch of 1000 is one Poisson step (q = 1)."""
    make_mnist_dir(str(offline / "mnist"), n_train=1000, n_test=50)
    return offline


def make_cifar_dir(directory, n=8, seed=0):
    """CIFAR-10 python batches of `n` random images each (5 training batches, 1 test)."""
    os.makedirs(directory, exist_ok=True)
    rng = np.random.RandomState(seed)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        batch = {b"data": rng.randint(0, 256, size=(n, 3072)).astype(np.uint8),
                 b"labels": list(rng.randint(0, 10, size=n))}
        with open(os.path.join(directory, name), "wb") as f:
            pickle.dump(batch, f)


def _check_sound(model, loss, ds_train, bound, rng):
    """lipdp's soundness check: exact per-example gradients (one tape each) of real training
    examples and of adversarial inputs never exceed `gradient_bounds` at the current weights."""
    x_real, y_real = next(iter(ds_train.unbatch().batch(4)))
    x_adv = adversarial_inputs(rng, tuple(model.input_shape[1:]), bound, n=3)
    x = np.concatenate([x_real.numpy(), x_adv])
    y = np.concatenate([y_real.numpy(), one_hot_labels(rng, len(x_adv), 10)])
    assert_within_bounds(per_example_gradient_norms(model, loss, x, y),
                         gradient_bounds(model, loss), "paper script")


def _getting_started_cnn(DP_Sequential, layers, dataset_metadata, input_upper_bound,
                         dp_parameters, **dense_kwargs):
    """The CNN of appendix B.2 and of the README quick-start (with their arguments; lipdp's
    dense layers get biases unless ``use_bias=False`` is in `dense_kwargs`)."""
    return DP_Sequential(
        layers=[
            layers.DP_BoundedInput(
                input_shape=dataset_metadata.input_shape, upper_bound=input_upper_bound
            ),
            layers.DP_QuickSpectralConv2D(
                filters=32, kernel_size=3, kernel_initializer="orthogonal", strides=1,
                use_bias=False,
            ),
            layers.DP_GroupSort(2),
            layers.DP_ScaledL2NormPooling2D(pool_size=2, strides=2),
            layers.DP_QuickSpectralConv2D(
                filters=64, kernel_size=3, kernel_initializer="orthogonal", strides=1,
                use_bias=False,
            ),
            layers.DP_GroupSort(2),
            layers.DP_ScaledL2NormPooling2D(pool_size=2, strides=2),
            layers.DP_Flatten(),
            layers.DP_QuickSpectralDense(512, **dense_kwargs),
            layers.DP_GroupSort(2),
            layers.DP_QuickSpectralDense(dataset_metadata.nb_classes, **dense_kwargs),
        ],
        dp_parameters=dp_parameters,
        dataset_metadata=dataset_metadata,
    )


# --------------------------------------------------------------------------- #
# The two scripts.
# --------------------------------------------------------------------------- #
def test_appendix_b2_getting_started_runs_unchanged(mnist, caplog):
    # The imports of the paper library's scripts (its `deel.lipdp.*`, renamed `lipdp.*`).
    from lipdp import layers, losses
    from lipdp.model import DP_Accountant, DP_Sequential, DPParameters
    from lipdp.pipeline import bound_clip_value, load_and_prepare_data
    from lipdp.sensitivity import get_max_epochs

    dp_parameters = DPParameters(
        noisify_strategy="global",
        noise_multiplier=2.0,
        delta=1e-5,
    )
    epsilon_max = 3.0
    input_upper_bound = 20.0
    with pytest.warns(lipdp.pipeline.PaperCompatibilityWarning, match="Poisson"):
        ds_train, ds_test, dataset_metadata = load_and_prepare_data(
            "mnist",
            batch_size=1000,
            drop_remainder=True,
            bound_fct=bound_clip_value(
                input_upper_bound
            ),
        )
    model = _getting_started_cnn(DP_Sequential, layers, dataset_metadata, input_upper_bound, dp_parameters)
    model.compile(
        loss=losses.DP_TauCategoricalCrossentropy(18.0),
        optimizer=tf.keras.optimizers.SGD(learning_rate=2e-4, momentum=0.9),
        metrics=["accuracy"],
    )
    model.summary(print_fn=lambda *args, **kwargs: None)
    with pytest.warns(lipdp.pipeline.PaperCompatibilityWarning, match="convolutions"):
        num_epochs = get_max_epochs(epsilon_max, model)
    assert num_epochs >= 1
    with caplog.at_level(logging.INFO, logger="lipdp"):
        hist = model.fit(
            ds_train,
            epochs=1,  # the script's `num_epochs` is the budget; one epoch keeps the test fast
            validation_data=ds_test,
            callbacks=[
                DP_Accountant(log_fn="logging"),
            ],
            verbose=0,
        )
    epsilon = hist.history["epsilon"][-1]
    assert 0 < epsilon <= epsilon_max
    assert model.dp_steps_taken == 1 and "epsilon=" in caplog.text
    _check_sound(model, model.dp_loss, ds_train, input_upper_bound, np.random.default_rng(0))


def test_readme_quick_start_runs_unchanged(mnist):
    from lipdp import layers, losses
    from lipdp.model import DPParameters
    from lipdp.model import DP_Accountant, DP_Sequential
    from lipdp.pipeline import bound_clip_value, load_and_prepare_data

    dp_parameters = DPParameters(
        noisify_strategy="local",
        noise_multiplier=4.0,
        delta=1e-5,
    )
    epsilon_max = 10.0
    # The quick-start leaves the data to the reader: the pipeline of the paper library.
    input_upper_bound = 20.0
    ds_train, ds_test, dataset_metadata = load_and_prepare_data(
        "mnist", batch_size=100, bound_fct=bound_clip_value(input_upper_bound),
        nb_samples_train=200)
    model = _getting_started_cnn(DP_Sequential, layers, dataset_metadata, input_upper_bound, dp_parameters)
    model.compile(loss=losses.DP_TauCategoricalCrossentropy(18.0),
                  optimizer=tf.keras.optimizers.Adam(1e-3), metrics=["accuracy"])
    callbacks = [
        DP_Accountant()
    ]
    hist = model.fit(
        ds_train,
        epochs=1,
        validation_data=ds_test,
        callbacks=callbacks,
        verbose=0,
    )
    assert dp_parameters.noisify_strategy.value == "per-layer"  # the paper library's "local"
    assert 0 < hist.history["epsilon"][-1] <= epsilon_max
    _check_sound(model, model.dp_loss, ds_train, input_upper_bound, np.random.default_rng(1))


# --------------------------------------------------------------------------- #
# The compatibility names.
# --------------------------------------------------------------------------- #
def test_every_compatibility_name_is_exported_and_documented():
    for module, names in [(lipdp.model, {"DP_Accountant", "DP_Sequential", "DPParameters"}),
                          (lipdp.pipeline, {"load_and_prepare_data", "bound_clip_value",
                                            "bound_normalize", "COLORSPACES"}),
                          (lipdp.sensitivity, {"get_max_epochs"})]:
        assert names <= set(module.__all__), module.__name__
        for name in module.__all__:
            obj = getattr(module, name)
            assert obj.__doc__ if callable(obj) else module.__doc__, f"{module.__name__}.{name}"
    assert lipdp.model.DP_Accountant is callbacks.DP_Accountant
    assert lipdp.model.DPParameters is metadata.DPParameters


def test_bound_functions_and_their_metadata(mnist):
    from lipdp.pipeline import bound_clip_value, bound_normalize, load_and_prepare_data

    assert bound_clip_value(3.0).max_norm == 3.0 and bound_normalize().max_norm == 1.0
    _, _, metadata = load_and_prepare_data("mnist", 100, bound_fct=bound_normalize())
    assert metadata.max_norm == 1.0
    # None (the paper library's "no bound"): clipped at the largest possible norm, sqrt(784).
    ds, _, metadata = load_and_prepare_data("mnist", 100, nb_samples_train=100)
    assert metadata.max_norm == pytest.approx(28.0)
    with pytest.raises(TypeError, match="bound_fct"):
        load_and_prepare_data("mnist", 100, bound_fct=(lambda x, y: (x, y), 1.0))


@pytest.mark.parametrize("colorspace", ["hsv", "YIQ", "YUV"])
def test_grayscale_colour_spaces_are_the_identity(mnist, colorspace):
    from lipdp.pipeline import bound_clip_value, load_and_prepare_data

    kwargs = dict(bound_fct=bound_clip_value(5.0), nb_samples_train=100, seed=3)
    with pytest.warns(lipdp.pipeline.PaperCompatibilityWarning, match="no effect"):
        _, ds_col, _ = load_and_prepare_data("mnist", 50, colorspace=colorspace, **kwargs)
    _, ds_rgb, _ = load_and_prepare_data("mnist", 50, **kwargs)
    for (a, _), (b, _) in zip(ds_col, ds_rgb):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


@pytest.mark.parametrize("colorspace", ["RGB", "HSV", "YIQ", "YUV"])
def test_colour_spaces_then_the_bound(offline, colorspace):
    """RGB images: the pipeline yields the tf.image colour map of x / 255, then clipped to
    the declared norm; with bound_fct=None nothing is clipped and the bound still holds."""
    from lipdp.pipeline import COLORSPACES, bound_clip_value, load_and_prepare_data

    make_cifar_dir(str(offline / "cifar10"))
    raw = data.load_arrays("cifar10").x_test.astype(np.float32) / 255.0
    expected = raw if COLORSPACES[colorspace] is None else COLORSPACES[colorspace](raw).numpy()
    _, ds_test, metadata = load_and_prepare_data("cifar10", 8, colorspace=colorspace,
                                                 bound_fct=bound_clip_value(10.0))
    x = np.concatenate([x.numpy() for x, _ in ds_test])
    norms = np.linalg.norm(x.reshape(len(x), -1), axis=1)
    assert metadata.max_norm == 10.0 and np.all(norms <= 10.0 * (1 + 1e-6))
    scale = np.minimum(1.0, 10.0 / np.linalg.norm(expected.reshape(len(x), -1), axis=1))
    np.testing.assert_allclose(x, expected * scale[:, None, None, None], rtol=1e-5, atol=1e-6)
    # No bound given: the largest norm any image can reach in that space; no image changes.
    _, ds_test, metadata = load_and_prepare_data("cifar10", 8, colorspace=colorspace)
    x = np.concatenate([x.numpy() for x, _ in ds_test])
    np.testing.assert_allclose(x, expected, rtol=1e-5, atol=1e-6)
    # White and magenta: the images of largest norm in RGB / HSV and in YIQ / YUV.
    for pixel in ([1.0, 1.0, 1.0], [1.0, 0.0, 1.0]):
        image = np.tile(np.array(pixel, np.float32), (32, 32, 1))
        mapped = image if COLORSPACES[colorspace] is None else COLORSPACES[colorspace](image)
        assert np.linalg.norm(mapped) <= metadata.max_norm * (1 + 1e-6)
    assert metadata.max_norm <= math.sqrt(3072) * (1 + 1e-6)


def test_unknown_colour_space_names_the_value(mnist):
    with pytest.raises(ValueError, match="colorspace='LAB'"):
        lipdp.pipeline.load_and_prepare_data("mnist", 10, colorspace="LAB")


def test_augmentation_is_bounded_again(mnist):
    from lipdp.pipeline import bound_clip_value, load_and_prepare_data

    def shift_up(x, y):  # a paper-style per-example augmentation that leaves the ball
        return x * 3.0 + 1.0, y

    ds_train, _, metadata = load_and_prepare_data(
        "mnist", 50, augmentation_fct=shift_up, bound_fct=bound_clip_value(2.0),
        nb_samples_train=100, seed=0)
    x, y = next(iter(ds_train))
    assert x.shape[1:] == (28, 28, 1) and y.shape[1:] == (10,)
    norms = np.linalg.norm(x.numpy().reshape(len(x), -1), axis=1)
    np.testing.assert_allclose(norms, 2.0, rtol=1e-5)  # every shifted image was clipped


def test_a_paper_augmentation_mixing_examples_through_its_state_is_refused(mnist):
    """`augmentation_fct` is applied example by example, but one keeping the previous image
    in a variable averaged it into the next: 198 of 199 outputs mixed two training records,
    and the pipeline kept its Poisson sampler, so fit saw nothing (an audit). Probed as
    `load_dataset` probes its augmentations; a stateless one passes. (State in a graph is
    refused before the probe: `test_a_paper_augmentation_keeping_state_is_refused`; this one
    keeps it in Python, which only the probe sees.)"""
    from lipdp.pipeline import bound_clip_value, load_and_prepare_data

    previous = [np.zeros((28, 28, 1), np.float32)]

    def average_with_the_previous(x):
        mixed, previous[0] = 0.5 * x.numpy() + 0.5 * previous[0], x.numpy()
        return mixed

    def with_the_previous_image(x, y):
        mixed = tf.py_function(average_with_the_previous, [x], tf.float32)
        return tf.ensure_shape(mixed, x.shape), y

    options = dict(bound_fct=bound_clip_value(2.0), nb_samples_train=100, seed=0)
    with pytest.raises(ValueError, match="does not transform each image on its own"):
        load_and_prepare_data("mnist", 50, augmentation_fct=with_the_previous_image, **options)
    load_and_prepare_data("mnist", 50, augmentation_fct=lambda x, y: (1.0 - x, y), **options)


def test_a_paper_augmentation_keeping_state_is_refused(mnist):
    """`load_and_prepare_data` did not run `load_dataset`'s refusal of stateful
    augmentations: one returning the previous call's image (kept in a tf.Variable, its
    probe's NaN replaced) passed, each training view was another record and the first a
    test image its probe had left (an audit, 2026-12-07). The carried image is shown."""
    from lipdp.pipeline import bound_clip_value, load_and_prepare_data

    previous = tf.Variable(tf.zeros((28, 28, 1)))

    def the_previous_image(x, y):
        out = tf.where(tf.math.is_finite(previous), previous, tf.zeros_like(previous))
        with tf.control_dependencies([out]):
            kept = previous.assign(x)
        with tf.control_dependencies([kept]):
            return tf.identity(out), y

    first = tf.ones((28, 28, 1))
    the_previous_image(first, None)
    assert float(tf.reduce_min(the_previous_image(tf.zeros((28, 28, 1)), None)[0])) == 1.0
    with pytest.raises(ValueError, match=r"`augmentation_fct` holds stateful operations "
                                         r"\(AssignVariableOp\).* into the next one's view"):
        load_and_prepare_data("mnist", 50, augmentation_fct=the_previous_image,
                              bound_fct=bound_clip_value(2.0), nb_samples_train=100, seed=0)


def test_warnings_are_one_time(mnist):
    from lipdp.pipeline import PaperCompatibilityWarning, bound_normalize, load_and_prepare_data

    with pytest.warns(PaperCompatibilityWarning):
        load_and_prepare_data("mnist", 100, bound_fct=bound_normalize())
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error", PaperCompatibilityWarning)
        load_and_prepare_data("mnist", 100, bound_fct=bound_normalize())


# --------------------------------------------------------------------------- #
# The measured noise factor (README, "Migrating from the paper's library").
# --------------------------------------------------------------------------- #
def _paper_library_bounds(model, loss_lipschitz):
    """The paper library's per-example gradient bounds, evaluated on the same (bias-free)
    model: every layer propagates the input bound X and the cotangent bound G unchanged
    (taken as 1-Lipschitz, norm preserving), a convolution kernel gets ``c sqrt(kh kw) X G``
    with c deel-lip's RKO factor, a dense kernel ``X G``."""
    x_bound = model.dataset_metadata.max_norm
    bounds = []
    for layer in model.layers:
        for v in layer.trainable_variables:
            if isinstance(layer, tf.keras.layers.Conv2D):
                bounds.append(layer.coef * math.sqrt(np.prod(layer.kernel_size)) * x_bound
                              * loss_lipschitz)
            else:
                bounds.append(x_bound * loss_lipschitz)
    return np.array(bounds)


def test_noise_std_factor_on_the_getting_started_cnn():
    """The global noise std is sigma * sqrt(sum_v Delta_v^2) / D in both libraries (same
    sigma, D and loss constant sqrt(2)), so the factor between the two stds is the ratio
    of the root sums of squared per-example bounds, at the same weights.

    Two numbers: ``raw``, lipdp's std over the paper library's formula on lipdp's own
    variables (lipdp's kernel Psi enters the convolution as c Psi, so its gradient is c
    times the one of the applied kernel); ``sound``, in the paper library's
    parameterisation (noise on the gradient of the applied kernel c Psi, as the paper
    library added it): lipdp's bound of Psi divided by c, the sound bound of the applied
    kernel. ``sound`` is how much more noise a sound calibration adds to the paper
    library's own training. Per variable, the convolution kernels' sound bounds are
    2.3x and 2.9x the paper library's (1/c, tightened by the certified norms), the dense
    kernels' 0.8x (the second convolution's certified norm is below 1 at these weights).

    Run ``pytest tests/test_compat.py -k noise_std -s`` to print the factors."""
    from lipdp import layers
    from lipdp.losses import DP_TauCategoricalCrossentropy
    from lipdp.metadata import DatasetMetadata, DPParameters
    from lipdp.model import DP_Sequential

    metadata = DatasetMetadata((28, 28, 1), 10, 60000, 10000, 1000, max_norm=20.0)
    model = _getting_started_cnn(DP_Sequential, layers, metadata, 20.0, DPParameters(noise_multiplier=2.0),
                                 use_bias=False)  # the paper library's dense layers had none
    loss = DP_TauCategoricalCrossentropy(18.0)
    lipdp_bounds = np.array(list(gradient_bounds(model, loss).values()))
    paper = _paper_library_bounds(model, math.sqrt(2.0))
    coefs = np.array([layer.coef if isinstance(layer, tf.keras.layers.Conv2D) else 1.0
                      for layer in model.layers for _ in layer.trainable_variables])
    assert len(lipdp_bounds) == len(paper) == 4  # 2 convolution and 2 dense kernels
    raw = np.linalg.norm(lipdp_bounds) / np.linalg.norm(paper)
    sound = np.linalg.norm(lipdp_bounds / coefs) / np.linalg.norm(paper)
    print(f"noise std factor on the getting-started CNN: raw {raw:.3f}, sound {sound:.3f}")
    # README figures (deterministic: seeded orthogonal initialisation, tests/conftest.py).
    assert sound == pytest.approx(1.98, abs=0.03) and raw == pytest.approx(0.87, abs=0.03)
    per_variable = lipdp_bounds / coefs / paper
    assert np.all(per_variable[:2] > 2.2) and np.all(per_variable[2:] < 1)


def test_get_max_epochs_says_when_per_layer_biases_change_the_papers_plan(monkeypatch):
    """Under noisify_strategy='local' each trainable variable is one Gaussian mechanism
    (sigma / sqrt(V)): the biases lipdp's layers train unless use_bias=False raised V from 4
    to 6 on the quick-start CNN, 28 planned epochs for the paper library's 46 (an audit).
    The plan is sound; the claim of the paper's plan was not, so it warns."""
    from lipdp.sensitivity import get_max_epochs
    from tests import _models

    monkeypatch.setattr(lipdp.pipeline, "_WARNED", set())
    with pytest.warns(lipdp.pipeline.PaperCompatibilityWarning, match=r"sigma/sqrt\(V\)"):
        get_max_epochs(5.0, _models.cnn(strategy="per-layer"))
    for model in (_models.cnn(strategy="per-layer", bias=False), _models.cnn(strategy="global")):
        monkeypatch.setattr(lipdp.pipeline, "_WARNED", set())
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            get_max_epochs(5.0, model)
        assert not [w for w in caught if "sigma/sqrt(V)" in str(w.message)]


def test_the_papers_positional_dp_parameters_get_a_clear_error():
    """The paper library's DPParameters(noisify_strategy, noise_multiplier, delta), written
    positionally, failed with "noisify_strategy ... Received: noisify_strategy=1e-05" (an
    audit): the message now names both orders."""
    from lipdp.model import DPParameters

    with pytest.raises(TypeError, match="paper library's positional order"):
        DPParameters("per-layer", 2.0, 1e-5)
