"""Augmentation multiplicity: k views per sampled example, their gradients averaged.

The sensitivity claim: an example contributes the average of its k views' gradients, each
of which obeys the per-example bound, so adding or removing the example moves the
averaged gradient by at most bound / D. Checked against exact gradients: with k identical
views the example's contribution equals its single-view gradient (the 1/k is exact), and
with k random views it stays within the sensitivity. Broken on purpose (the step's k set
to 1, views summed instead of averaged), both checks fail (4x the single-view gradient).
"""

import os

import numpy as np
import pytest
import tensorflow as tf

import lipdp
from lipdp.augmentation import random_shift
from lipdp.layers import DP_BoundedInput, DP_Flatten, DP_GroupSort, DP_QuickSpectralDense
from lipdp.per_example import per_example_gradients
from tests._soundness import maximize_gradient_norm
from tests.test_data import make_mnist_dir, write_idx

X0 = 6.0
K = 4


@pytest.fixture
def fashion_dir(tmp_path):
    make_mnist_dir(str(tmp_path / "fashion_mnist"), n_train=48, n_test=16)
    return str(tmp_path)


def _load(data_dir, **kwargs):
    options = dict(bound_clip_value=X0, data_dir=data_dir, download=False, seed=0,
                   augmentation="shift_flip", augmentation_multiplicity=K)
    options.update(kwargs)
    return lipdp.data.load_dataset("fashion_mnist", 8, **options)


def _model(metadata, mode="clipless"):
    parameters = (lipdp.DPParameters(1.0, 1e-5) if mode == "clipless" else
                  lipdp.DPParameters(1.0, 1e-5, mode="clipped", l2_norm_clip=1.0))
    model = lipdp.DP_Sequential(
        [DP_BoundedInput(X0, input_shape=(28, 28, 1)), DP_Flatten(), DP_QuickSpectralDense(16),
         DP_GroupSort(2), DP_QuickSpectralDense(10)],
        dp_parameters=parameters, dataset_metadata=metadata)
    model.compile(optimizer="sgd", loss=lipdp.losses.DP_TauCategoricalCrossentropy(4.0))
    return model


@pytest.mark.parametrize("seeded", [False, True])
def test_each_example_gets_k_bounded_views_of_itself(fashion_dir, seeded):
    """Every row holds k views of one example, each another draw of the augmentation, also in
    a program that set TensorFlow's global seed (there a user's augmentation, mapped image by
    image, drew the same k views when it was called once per view)."""
    if seeded:
        tf.keras.utils.set_random_seed(0)
    else:
        tf.random.set_seed(None)
    offset = lambda images: images + tf.random.uniform([tf.shape(images)[0], 1, 1, 1], 0, 1e-3)
    ds, _, metadata = _load(fashion_dir, augmentation=offset, bound_clip_value=1e3,
                            sampling="shuffle")
    assert metadata.augmentation_multiplicity == K
    raw = lipdp.data.load_arrays("fashion_mnist", data_dir=fashion_dir, download=False)
    originals = raw.x_train.reshape(len(raw.x_train), -1).astype(np.float32) / 255.0
    for x, y in ds.take(2):
        assert x.shape[1:] == (K, 28, 28, 1)
        for views, label in zip(x.numpy(), y.numpy()):
            flat = views.reshape(K, -1)
            sources = [int(np.argmin(np.abs(originals - v).max(axis=1))) for v in flat]
            assert len(set(sources)) == 1  # all k views of a row come from one example
            assert np.abs(originals[sources[0]] - flat).max() < 1e-3 + 1e-6
            assert raw.y_train[sources[0]] == np.argmax(label)
            drawn = len({float(v[0]) for v in flat})  # the views' offsets
            assert drawn == K if seeded else drawn > 1  # seeded: deterministic, all differ
    shifted, _, _ = _load(fashion_dir)
    for x, _ in shifted.take(2):
        norms = np.linalg.norm(x.numpy().reshape(-1, 28 * 28), axis=1)
        assert norms.max() <= X0 * (1 + 1e-6)  # the bound applies to every view


def _example_contribution(model, views, label):
    """What one example with these views adds to the noise-free averaged gradient."""
    x, y = model._flatten_views(tf.constant(views[None]), tf.constant(label[None]))
    gradients, _, _ = model._averaged_gradients(x, y)
    return [g.numpy() for g in gradients]


def _adversarial_example(seed=0):
    image = np.random.RandomState(seed).rand(28, 28, 1).astype(np.float32)
    return image * (X0 / np.linalg.norm(image)), np.eye(10, dtype=np.float32)[3]


@pytest.mark.parametrize("views_are", ["identical", "shifted", "constant", "ascended"])
def test_one_example_moves_the_gradient_by_at_most_its_sensitivity(fashion_dir, views_are):
    """Views of an image on the bound: identical, shifted, constant images (+-) and the
    inputs gradient ascent finds for the first kernel's gradient norm."""
    _, _, metadata = _load(fashion_dir)
    model = _model(metadata)
    image, label = _adversarial_example()
    if views_are == "identical":
        views = np.stack([image] * K)
    elif views_are == "shifted":
        tf.random.set_seed(1)
        views = random_shift(2)(tf.constant(np.stack([image] * K))).numpy()
    elif views_are == "constant":
        constant = np.full((28, 28, 1), X0 / 28, np.float32)
        views = np.stack([constant, -constant, constant, -constant])
    else:
        starts = np.stack([image, -image, np.roll(image, 3), np.full_like(image, X0 / 28)])
        views = maximize_gradient_norm(model, model.dp_loss, starts, np.stack([label] * K),
                                       model.trainable_variables[0], X0, steps=30)
    contribution = _example_contribution(model, views, label)
    sensitivities = [float(s) for s in model.sensitivities()]
    for g, delta in zip(contribution, sensitivities):
        assert np.linalg.norm(g) <= delta * (1 + 1e-4)
    if views_are == "identical":  # the average of k equal gradients is that gradient
        single, _, _ = per_example_gradients(model, model.dp_loss.call, image[None],
                                             label[None])
        for g, s in zip(contribution, single):
            np.testing.assert_allclose(g, s.numpy()[0] / metadata.batch_size, rtol=1e-5, atol=1e-8)
        # The example is near the bound: summing the views (k = 1 here) would exceed it.
        assert max(np.linalg.norm(g) / d for g, d in zip(contribution, sensitivities)) > 1 / K


def test_fit_on_k_views_records_the_mechanism_of_one_view(fashion_dir):
    ds, ds_test, metadata = _load(fashion_dir)
    model = _model(metadata)
    model.fit(ds, epochs=2, verbose=0, validation_data=ds_test,
              callbacks=[lipdp.BoundMonitor(ds, sample_size=8)])
    plain_ds, _, plain_metadata = _load(fashion_dir, augmentation=None,
                                        augmentation_multiplicity=1)
    plain = _model(plain_metadata)
    plain.fit(plain_ds, epochs=2, verbose=0)
    assert model.dp_steps_taken == plain.dp_steps_taken == 2 * metadata.steps_per_epoch
    assert model.privacy_ledger.segments[0].mechanism == plain.privacy_ledger.segments[0].mechanism
    assert lipdp.accounting.epsilon_spent(model) == lipdp.accounting.epsilon_spent(plain)


def test_a_pipeline_that_disagrees_with_the_metadata_is_refused(fashion_dir):
    single_view, _, _ = _load(fashion_dir, augmentation=None, augmentation_multiplicity=1)
    _, _, metadata = _load(fashion_dir)
    model = _model(metadata)
    with pytest.raises(ValueError, match=r"inputs of shape \(batch, 4\)"):
        model.fit(single_view, epochs=1, verbose=0)


def test_clipped_mode_refuses_multiplicity(fashion_dir):
    _, _, metadata = _load(fashion_dir)
    with pytest.raises(ValueError, match="clipless mode only"):
        _model(metadata, mode="clipped")


def test_load_dataset_refuses_what_it_cannot_augment(fashion_dir):
    with pytest.raises(ValueError, match="needs an `augmentation`"):
        _load(fashion_dir, augmentation=None)
    with pytest.raises(ValueError, match="Unknown augmentation"):
        _load(fashion_dir, augmentation="rotate")
    with pytest.raises(ValueError, match="needs images"):
        lipdp.data.load_dataset("digits", 64, bound_clip_value=8.0, augmentation="shift")
    with pytest.raises(ValueError, match="one or the other"):
        _load(fashion_dir, feature_map=lambda x: x)


def _mixup(images):
    """Each image blended with another of the batch (a random pairing)."""
    partners = tf.gather(images, tf.random.shuffle(tf.range(tf.shape(images)[0])))
    return 0.7 * images + 0.3 * partners


@pytest.mark.parametrize("augmentation,mixes", [
    (_mixup, True),
    (lambda images: images - tf.reduce_mean(images, axis=0), True),  # the batch's mean image
    (lambda images: tf.cond(tf.random.uniform(()) < 0.25, lambda: _mixup(images),
                            lambda: images), True),  # a mixup on a quarter of the batches
    ("shift_flip", False),
    (tf.keras.layers.RandomFlip("horizontal"), False),
    (lambda images: tf.image.random_brightness(images, 0.1), False)])
def test_an_augmentation_mixing_the_images_of_a_batch_is_refused(fashion_dir, augmentation,
                                                                 mixes):
    """An augmentation must transform each image on its own (the module docstring): a mixup or
    a batch statistic lets one record move other records' views. They used to be accepted
    silently; `load_dataset` now refuses them (a NaN image in a probe batch must not reach
    the other views in 32 tries), with and without multiplicity. A mixup applied to a
    quarter of the batches passed the first version's 3 tries."""
    tf.keras.utils.set_random_seed(1)
    for multiplicity in (1, K):
        options = dict(augmentation=augmentation, augmentation_multiplicity=multiplicity)
        if mixes:
            with pytest.raises(ValueError, match="does not transform each image on its own"):
                _load(fashion_dir, **options)
        else:
            _load(fashion_dir, **options)


class _CarriesTheLastImage:
    """An augmentation adding a tenth of the last image of its previous call, kept in a
    tf.Variable (NaN-free, so the NaN probe does not see it): called image by image, each
    view carries the image before it."""

    def __init__(self):
        self.last = tf.Variable(tf.zeros([1, 28, 28, 1]))

    def __call__(self, images):
        views = images + 0.1 * self.last
        self.last.assign(tf.where(tf.math.is_finite(images[-1:]), images[-1:], 0.0))
        return views


class _QueuesTheLastImage(_CarriesTheLastImage):
    """The same state, kept in a queue (a review, 2026-12-07)."""

    def __init__(self):
        self.queue = tf.queue.FIFOQueue(2, tf.float32, shapes=[[1, 28, 28, 1]])
        self.queue.enqueue(tf.zeros([1, 28, 28, 1]))

    def __call__(self, images):
        views = images + 0.1 * self.queue.dequeue()
        self.queue.enqueue(tf.where(tf.math.is_finite(images[-1:]), images[-1:], 0.0))
        return views


class _SkipsByTheImage:
    """Noise from a generator advanced by a count of draws computed from the image: the next
    call's noise depends on this call's image (a review, 2026-12-07)."""

    def __init__(self):
        self.generator = tf.random.Generator.from_seed(0)

    def __call__(self, images):
        views = images + self.generator.normal(tf.shape(images))
        count = tf.cast(tf.reduce_sum(tf.where(tf.math.is_finite(images), images, 0.0)), tf.int64)
        with tf.control_dependencies([views]):
            self.generator.skip(count)
        return tf.identity(views)


class _DrawsOnBrightPixels(_SkipsByTheImage):
    """Noise drawn for the bright pixels only: the count of draws, and so the next call's
    noise, depends on the image (a review, 2026-12-07)."""

    def __call__(self, images):
        bright = tf.where(images > 0.5)
        noise = self.generator.normal(tf.shape(bright)[:1])
        return tf.tensor_scatter_nd_add(images, bright, 0.1 * noise)


@pytest.mark.parametrize("stateful,op", [(_CarriesTheLastImage, "AssignVariableOp"),
                                         (_QueuesTheLastImage, "QueueDequeueV2"),
                                         (_SkipsByTheImage, "of a count computed from the data"),
                                         (_DrawsOnBrightPixels,
                                          "of a count computed from the data")])
def test_an_augmentation_holding_state_is_refused(fashion_dir, stateful, op):
    """The state an augmentation keeps from one call to the next, in a tf.Variable, a queue
    or a random generator skipped by a count of the data: each carries one image into the
    next call's view (shown), and each is refused by the op that holds it."""
    ones, zeros = np.ones([1, 28, 28, 1], np.float32), np.zeros([1, 28, 28, 1], np.float32)
    second = np.full([1, 28, 28, 1], 0.75, np.float32)
    after = {}
    for first in (ones, zeros):  # the same second image, after another first one
        carrier = stateful()
        carrier(first)
        after[float(first.max())] = carrier(second).numpy()
    assert np.abs(after[1.0] - after[0.0]).max() > 0.05
    with pytest.raises(ValueError, match=f"`augmentation` holds stateful operations .*{op}"):
        _load(fashion_dir, augmentation=stateful())


@pytest.mark.parametrize("option", ["augmentation", "feature_map"])
def test_an_augmentation_or_feature_map_writing_state_is_refused(fashion_dir, option):
    """`each_image_alone` keeps an augmentation of yours from seeing other images of a batch,
    but not from keeping state across its calls: the last image kept in a tf.Variable carried
    one record into the next one's view, and passed every check. `load_dataset` refuses a
    function whose graph writes a variable or a table, a feature_map alike (this one's state
    was also seen by its probe); the state is shown to carry a record."""
    state = _CarriesTheLastImage()
    first, second = np.ones([1, 28, 28, 1], np.float32), np.zeros([1, 28, 28, 1], np.float32)
    state(first)
    assert float(tf.reduce_max(tf.abs(state(second)))) > 0  # the first image moved the second
    with pytest.raises(ValueError, match=rf"`{option}` holds stateful operations "
                                         r"\(AssignVariableOp\) that can carry"):
        _load(fashion_dir, **{option: _CarriesTheLastImage()}, **(
            {"augmentation": None, "augmentation_multiplicity": 1}
            if option == "feature_map" else {}))


def test_an_augmentation_mixing_only_large_batches_is_refused(fashion_dir):
    """A mixup of batches above 16 images passed the probe batch of 16 (an audit): the
    augmentation is also probed at the batch size (up to 1024)."""
    def mix_large(images):
        return tf.cond(tf.shape(images)[0] > 16, lambda: _mixup(images), lambda: images)

    with pytest.raises(ValueError, match="does not transform each image on its own"):
        lipdp.data.load_dataset("fashion_mnist", 32, bound_clip_value=X0, data_dir=fashion_dir,
                                download=False, augmentation=mix_large)


def _invert_if_one_is_bright(images):
    """Inverts every image of a batch that holds an image of mean above 0.9: a NaN image never
    triggers it (a comparison with NaN is false), so the NaN probe passes it."""
    bright = tf.reduce_any(tf.reduce_mean(images, axis=[1, 2, 3]) > 0.9)
    return tf.where(bright, 1.0 - images, images)


@pytest.mark.parametrize("multiplicity", [1, K])
def test_a_mixing_the_probe_misses_cannot_reach_another_image(tmp_path, multiplicity):
    """The audit's augmentation (2026-12-07) passed the probe and moved the averaged gradient
    by 4.1x the sensitivity when the bright record was added: `load_dataset` now calls it on
    each image alone, so the bright image inverts itself only. Without `each_image_alone`
    every view of the batch was inverted."""
    folder = str(tmp_path / "fashion_mnist")
    x_train, *_ = make_mnist_dir(folder, n_train=48, n_test=16, ids=True)
    x_train[7] = 250  # the bright record
    write_idx(os.path.join(folder, "train-images-idx3-ubyte.gz"), x_train, True)
    ds, _, _ = lipdp.data.load_dataset(
        "fashion_mnist", 48, bound_clip_value=1e3, data_dir=str(tmp_path), download=False,
        seed=0, sampling="shuffle", augmentation=_invert_if_one_is_bright,
        augmentation_multiplicity=multiplicity)
    x, _ = next(iter(ds))
    views = x.numpy().reshape((48, multiplicity, 28, 28))
    bright = np.all(np.isclose(views, 1.0 - 250 / 255, atol=1e-6), axis=(1, 2, 3))
    assert bright.sum() == 1  # the bright record, inverted, in every view
    assert np.all(views[~bright][:, :, 1:, :] == 0.0)  # the id images, not inverted (1.0)


def test_only_lipdp_s_own_augmentations_run_on_the_whole_batch():
    from lipdp.augmentation import each_image_alone, random_shift_flip

    own = random_shift_flip()
    assert each_image_alone(own) is own and each_image_alone(random_shift()) is not None
    mimic = lambda images: images  # noqa: E731  (a flag copied from a string is not lipdp's)
    mimic.lipdp_per_image = "lipdp_per_image"
    assert each_image_alone(mimic) is not mimic
    images = tf.constant(np.random.default_rng(0).uniform(size=(5, 4, 4, 1)), tf.float32)
    np.testing.assert_array_equal(each_image_alone(_invert_if_one_is_bright)(images),
                                  images.numpy())


def test_metadata_round_trip_keeps_the_multiplicity(fashion_dir):
    _, _, metadata = _load(fashion_dir)
    again = lipdp.DatasetMetadata.from_config(metadata.get_config())
    assert again == metadata and again.augmentation_multiplicity == K
