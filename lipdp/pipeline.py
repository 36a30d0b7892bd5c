"""The paper library's data pipeline API (lip-dp, ICLR 2024), as thin adapters onto `lipdp.data`.

Scripts written for the paper's library call::

    ds_train, ds_test, dataset_metadata = load_and_prepare_data(
        "mnist", batch_size=1000, drop_remainder=True, bound_fct=bound_clip_value(20.0))

This module keeps those names, arguments and return values and runs them on
`lipdp.data.load_dataset`. What is loaded, bounded and sampled is lipdp's, and
where the paper library was unsound lipdp's behaviour wins, with a one-time
`PaperCompatibilityWarning` saying what changed:

- **Sampling.** The paper library shuffled the training set into fixed batches
  (``drop_remainder=True``) while its accountant assumed Poisson subsampling,
  so its epsilon was not a proof for the pipeline it ran. Here the training
  pipeline is Poisson-sampled: at each of ``ceil(N / batch_size)`` steps every
  example joins the batch independently with probability ``batch_size / N``
  (batches of random size, ``batch_size`` on average), which is exactly what the
  accountant assumes. ``drop_remainder`` has no effect (Poisson batches are
  never dropped).
- **Input bound after the colour transform.** The colour space (``colorspace``)
  is applied first, then the bound: every input reaches the model with L2 norm
  at most ``dataset_metadata.max_norm`` in the colour space it is trained in
  (and `lipdp.layers.DP_BoundedInput` clips again in the forward pass).

Colour spaces ``"RGB"`` (identity), ``"HSV"``, ``"YIQ"``, ``"YUV"`` are
`tf.image.rgb_to_hsv` / `rgb_to_yiq` / `rgb_to_yuv` of images scaled to
``[0, 1]``, a fixed per-pixel function (no statistic of the data), case
insensitive as in the paper library. On single-channel (grayscale) data such as
MNIST they are all the identity: a grey pixel ``v`` is the RGB pixel
``(v, v, v)``, whose hue and saturation (HSV) or chroma (YIQ's I, Q; YUV's U, V)
are 0 and whose value / luma is ``v`` itself (the luma weights sum to 1), so the
image keeps its one channel unchanged (the paper library raised an error there;
lipdp warns once that the colour space has no effect).
"""

from __future__ import annotations

import math
import warnings
from typing import Callable, Optional

import numpy as np
import tensorflow as tf

from lipdp import data
from lipdp.data import InputBound

__all__ = [
    "COLORSPACES",
    "PaperCompatibilityWarning",
    "bound_clip_value",
    "bound_normalize",
    "load_and_prepare_data",
]

#: Colour spaces of the paper library: name -> per-pixel map of RGB images in [0, 1].
COLORSPACES = {
    "RGB": None,
    "HSV": tf.image.rgb_to_hsv,
    "YIQ": tf.image.rgb_to_yiq,
    "YUV": tf.image.rgb_to_yuv,
}


class PaperCompatibilityWarning(UserWarning):
    """Issued once per topic when a script written for the paper's library (lip-dp) gets
    lipdp's sound behaviour instead of the paper library's (`lipdp.pipeline`,
    `lipdp.sensitivity`)."""


_WARNED = set()


def _warn_once(topic: str, message: str, stacklevel: int = 3):
    """Warns `message` the first time `topic` comes up in this process."""
    if topic not in _WARNED:
        _WARNED.add(topic)
        warnings.warn(message, PaperCompatibilityWarning, stacklevel=stacklevel)


_SAMPLING_WARNING = (
    "lipdp.pipeline.load_and_prepare_data: the training batches are Poisson-sampled (each "
    "example in each batch independently with probability batch_size / N; random batch "
    "sizes averaging batch_size), not shuffled into fixed batches as in the paper's library. "
    "The paper library shuffled while its accountant assumed Poisson sampling, so the epsilon "
    "it printed was not a guarantee for its pipeline; lipdp's is. drop_remainder has no effect."
)
_GRAYSCALE_WARNING = (
    "lipdp.pipeline.load_and_prepare_data: colorspace={!r} has no effect on single-channel "
    "images: a grey pixel v is the RGB pixel (v, v, v), whose hue/saturation (HSV) or chroma "
    "(YIQ, YUV) is 0 and whose value/luma is v, so the image is kept as it is."
)


def bound_clip_value(value: float) -> InputBound:
    """The paper library's ``bound_clip_value(value)``: inputs mapped by
    ``x * min(1, value / ||x||)`` (norm at most ``value``), for `load_and_prepare_data`.

    Returns `lipdp.data.bound_clip_value(value)` (an `InputBound`), which
    `load_and_prepare_data` takes as ``bound_fct``; ``dataset_metadata.max_norm``
    is then ``value``.
    """
    return data.bound_clip_value(value)


def bound_normalize() -> InputBound:
    """The paper library's ``bound_normalize()``: every non-zero input mapped onto the unit
    sphere, ``x / ||x||`` (``0`` stays ``0``); ``dataset_metadata.max_norm`` is 1.

    Returns `lipdp.data.bound_normalize(1.0)`, for ``bound_fct`` of `load_and_prepare_data`.
    """
    return data.bound_normalize(1.0)


def _colour_map(colorspace: str) -> Optional[Callable[[tf.Tensor], tf.Tensor]]:
    """The per-pixel map of `colorspace` for a batch of images in [0, 1] (None for RGB).

    The map is the identity on single-channel images (see the module docstring)."""
    name = str(colorspace).upper()
    if name not in COLORSPACES:
        raise ValueError(
            f"Received an invalid value for `colorspace`, expected one of "
            f"{', '.join(COLORSPACES)}. Received: colorspace={colorspace!r}"
        )
    convert = COLORSPACES[name]
    if convert is None:
        return None

    def colour_map(x):
        if x.shape[-1] == 1:
            _warn_once(f"grayscale-{name}", _GRAYSCALE_WARNING.format(colorspace))
            return x
        if x.shape[-1] != 3:
            raise ValueError(f"colorspace={colorspace!r} needs RGB images (3 channels) or "
                             f"grayscale ones (1 channel). Received images of shape "
                             f"{tuple(x.shape[1:])}.")
        return convert(x)

    return colour_map


def _largest_norm(colorspace: str, input_shape) -> float:
    """An upper bound of the norm of any image with pixels in [0, 1] once in `colorspace`:
    what ``bound_fct=None`` clips to, so that no image changes (the paper library declared
    ``H * W * C`` there, the square of the largest RGB norm).

    RGB and HSV pixels lie in ``[0, 1]^C``, as do the single channel of grayscale
    images in any colour space: ``sqrt(H W C)``. YIQ and YUV map an RGB pixel p to
    ``M p``: ``||M||_2 sqrt(H W 3)`` (``||M||_2`` of the public matrix of `tf.image`,
    about 0.857, computed from the map itself)."""
    gain = 1.0
    convert = COLORSPACES[str(colorspace).upper()]
    if convert is not None and convert is not tf.image.rgb_to_hsv and input_shape[-1] == 3:
        gain = float(np.linalg.norm(convert(tf.eye(3, dtype=tf.float64)).numpy(), 2))
    return gain * math.sqrt(float(np.prod(input_shape)))


def _each_example(augmentation_fct, x, y):
    """The paper-style per-example ``augmentation_fct(x, y) -> (x, y)`` applied to each
    example of the batch ``(x, y)``."""
    return tf.map_fn(lambda pair: augmentation_fct(*pair), (x, y),
                     fn_output_signature=(tf.TensorSpec(x.shape[1:], x.dtype),
                                          tf.TensorSpec(y.shape[1:], y.dtype)))


def _augmented(ds, augmentation_fct, bound: InputBound):
    """Applies `augmentation_fct` to every example of every training batch
    (`_each_example`), then the input bound again (an augmentation may leave the ball)."""
    def augment_batch(x, y):
        x, y = _each_example(augmentation_fct, x, y)
        return bound.apply_batch(x), y

    augmented = ds.map(augment_batch, num_parallel_calls=tf.data.AUTOTUNE)
    # The same batches, each example augmented: still the Poisson sampler's.
    augmented.lipdp_sampler = ds.lipdp_sampler
    return augmented


def load_and_prepare_data(
    dataset_name: str = "mnist",
    batch_size: int = 256,
    colorspace: str = "RGB",
    drop_remainder: bool = True,
    augmentation_fct: Optional[Callable] = None,
    bound_fct: Optional[InputBound] = None,
    **load_dataset_kwargs,
):
    """The paper library's ``load_and_prepare_data``, on `lipdp.data.load_dataset`.

    Args:
        dataset_name: ``"mnist"``, ``"fashion_mnist"``, ``"cifar10"`` (or another name
            of `lipdp.data.DATASET_NAMES`); found as `lipdp.data` says (``data_dir``,
            ``$LIPDP_DATA_DIR``, the Keras cache, then a download).
        batch_size: the expected batch size D of the Poisson-sampled training batches
            (the public denominator of every averaged gradient) and the test batch size.
        colorspace: ``"RGB"``, ``"HSV"``, ``"YIQ"`` or ``"YUV"`` (see the module
            docstring; the identity on single-channel images). Applied before the bound.
        drop_remainder: accepted for compatibility; no effect (Poisson sampling never
            drops a batch; see `PaperCompatibilityWarning`).
        augmentation_fct: optional per-example ``(image, one_hot_label) -> (image,
            label)`` applied to the training examples each time a batch is drawn, after
            the colour transform and the bound, followed by the bound again. (The paper
            library augmented before the colour transform: the same for geometric
            augmentations, which commute with a per-pixel colour map.)
        bound_fct: `bound_clip_value(X0)` or `bound_normalize()`. None (the paper
            library's default, no bounding) clips to the largest norm any image in
            ``[0, 1]`` can have in `colorspace` (`_largest_norm`), so that no image
            changes and the declared bound is a true one.
        **load_dataset_kwargs: lipdp's extras passed to `lipdp.data.load_dataset`
            (``data_dir``, ``seed``, ``nb_samples_train``, ``download``).

    Returns:
        ``(ds_train, ds_test, dataset_metadata)``: bounded pipelines of ``(x, one_hot_y)``
        and a `lipdp.DatasetMetadata` (``input_shape``, ``nb_classes``, ``max_norm``,
        ``batch_size``, ``nb_samples_train``, ``steps_per_epoch`` ...).
    """
    if bound_fct is not None and not isinstance(bound_fct, InputBound):
        raise TypeError(
            "`bound_fct` must be lipdp.pipeline.bound_clip_value(X0) or bound_normalize() "
            "(or None): lipdp declares the input bound from it, so it cannot be an arbitrary "
            f"function. Received: bound_fct={bound_fct!r}"
        )
    if augmentation_fct is not None and not callable(augmentation_fct):
        raise TypeError("`augmentation_fct` must be a callable (image, label) -> (image, label). "
                        f"Received: augmentation_fct={augmentation_fct!r}")
    del drop_remainder  # Poisson batches are never dropped (see the warning below).
    _warn_once("sampling", _SAMPLING_WARNING)

    colour_map = _colour_map(colorspace)
    if bound_fct is None:
        shape = data.load_arrays(dataset_name, data_dir=load_dataset_kwargs.get("data_dir"),
                                 download=load_dataset_kwargs.get("download", True)).input_shape
        bound_fct = data.bound_clip_value(_largest_norm(colorspace, shape))
    ds_train, ds_test, metadata = data.load_dataset(
        dataset_name, batch_size, sampling="poisson", feature_map=colour_map,
        **bound_fct.load_dataset_keyword(), **load_dataset_kwargs)
    if augmentation_fct is not None:
        _refuse_state(augmentation_fct, metadata)
        _check_per_example(augmentation_fct, ds_test)
        ds_train = _augmented(ds_train, augmentation_fct, bound_fct)
    return ds_train, ds_test, metadata


def _refuse_state(augmentation_fct, metadata):
    """`lipdp.data`'s refusal of augmentations that keep state from one call to the next,
    on `augmentation_fct` applied example by example (`_each_example`, with one-hot labels):
    `load_and_prepare_data` skipped it, and one returning the previous call's image (kept
    in a tf.Variable) made each training view another record, the first one a test image
    its probe had left there (an audit, 2026-12-07)."""
    def on_images(images):
        labels = tf.zeros([tf.shape(images)[0], metadata.nb_classes], tf.float32)
        return _each_example(augmentation_fct, images, labels)[0]

    data._refuse_state(on_images, metadata.input_shape, "augmentation_fct")


def _check_per_example(augmentation_fct, ds_test):
    """`lipdp.data`'s probe of augmentations that mix the images of a batch, on
    `augmentation_fct` applied example by example as `_augmented` applies it
    (`_each_example`), over a batch of test images (drawing a training batch would use up a
    draw of the Poisson sampler): applied to each example alone, it can mix them only
    through state it keeps (an audit's kept the previous image and averaged it in: 198 of
    199 outputs mixed two records)."""
    images, labels = next(iter(ds_test))
    labels = labels[:16]
    data._check_augmentation_per_example(
        lambda batch: _each_example(augmentation_fct, batch, labels)[0], images.numpy()[:16])
