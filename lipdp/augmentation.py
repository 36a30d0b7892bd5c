"""Data augmentation with multiplicity (De et al., 2022): k views of each sampled example.

With augmentation multiplicity k, the training pipeline gives every sampled example
k augmented views, and the private step uses the *average* of the k views' gradients
as that example's gradient. Each view is an input like any other (the model clips it
to the input bound), so each view's gradient obeys the per-example bound, and so does
their average: the sensitivity, the noise and the accountant are unchanged, while the
example's gradient is a less noisy estimate of its expected gradient under
augmentation. Adding or removing one example adds or removes its k views together,
because a view is a function of its own example only.

An augmentation here is a function of a batch of images ``(B, H, W, C)`` (floats,
before the input bound) that transforms every image independently of the others; its
randomness needs no secrecy (the privacy analysis holds for any fixed choice of views).
`lipdp.data.load_dataset` calls one of yours on each image alone, as a batch of one
(`each_image_alone`), so that no augmentation can make a view depend on another record;
lipdp's own (`random_shift`, `random_shift_flip`) transform each image alone by
construction and run on the whole batch.
"""

from __future__ import annotations

from typing import Callable

import tensorflow as tf

__all__ = ["AUGMENTATIONS", "each_image_alone", "random_shift", "random_shift_flip",
           "stack_views"]

#: Marks lipdp's own augmentations, whose every output image depends on its own input
#: image alone (`each_image_alone` calls them on the batch). Module-private: not a flag a
#: user's function could carry by accident.
_PER_IMAGE = object()


def random_shift(max_shift: int = 2) -> Callable[[tf.Tensor], tf.Tensor]:
    """Translates each image by independent integer offsets in [-max_shift, max_shift]
    (rows and columns), filling with zeros."""
    if not isinstance(max_shift, int) or max_shift < 0:
        raise ValueError(f"`max_shift` must be a non-negative integer. Received: {max_shift!r}")

    def shift(images: tf.Tensor) -> tf.Tensor:
        batch = tf.shape(images)[0]
        offsets = tf.cast(tf.random.uniform([batch, 2], -max_shift, max_shift + 1, tf.int32),
                          tf.float32)
        ones, zeros = tf.ones([batch, 1]), tf.zeros([batch, 1])
        # Output pixel (r, c) reads input pixel (r + dy, c + dx): one transform per image.
        transforms = tf.concat([ones, zeros, offsets[:, :1], zeros, ones, offsets[:, 1:],
                                zeros, zeros], axis=1)
        shifted = tf.raw_ops.ImageProjectiveTransformV3(
            images=images, transforms=transforms, output_shape=tf.shape(images)[1:3],
            fill_value=0.0, interpolation="NEAREST", fill_mode="CONSTANT")
        return tf.ensure_shape(shifted, images.shape)

    shift.lipdp_per_image = _PER_IMAGE
    return shift


def random_shift_flip(max_shift: int = 2) -> Callable[[tf.Tensor], tf.Tensor]:
    """`random_shift`, then a left-right flip of each image with probability 1/2."""
    shift = random_shift(max_shift)

    def shift_flip(images: tf.Tensor) -> tf.Tensor:
        shifted = shift(images)
        flip = tf.random.uniform([tf.shape(images)[0], 1, 1, 1]) < 0.5
        return tf.where(flip, tf.reverse(shifted, axis=[2]), shifted)

    shift_flip.lipdp_per_image = _PER_IMAGE
    return shift_flip


def each_image_alone(augmentation: Callable[[tf.Tensor], tf.Tensor]
                     ) -> Callable[[tf.Tensor], tf.Tensor]:
    """`augmentation` applied to each image of a batch on its own, as a batch of one
    (`tf.map_fn`): whatever it computes from its input, an image's view is a function of that
    image alone, which the sensitivity of a step assumes (the module docstring), unless the
    augmentation keeps state across calls (a `tf.Variable` it writes: the calls run one
    image after the other, so such state can carry one image into the next one's view, a
    review, 2026-12-07; an augmentation must not write state). `load_dataset`'s probe
    refuses augmentations it sees mixing images, but a mixing that a NaN image does not
    trigger passed it: an augmentation inverting every image of a batch holding one bright
    image moved the averaged gradient by 4.1x the sensitivity (clipless) and 6.5x (clipped)
    when that record was added (an audit, 2026-12-07). lipdp's own augmentations are
    returned as they are (one batched call: 7 ms for 1000 images of 28 x 28 against 35 ms
    image by image)."""
    if getattr(augmentation, "lipdp_per_image", None) is _PER_IMAGE:
        return augmentation

    def alone(images: tf.Tensor) -> tf.Tensor:
        return tf.map_fn(lambda image: augmentation(image[None])[0], images,
                         fn_output_signature=images.dtype)

    return alone


#: The augmentations a config names (``dataset.augmentation``).
AUGMENTATIONS = {"shift": random_shift, "shift_flip": random_shift_flip}


def stack_views(images: tf.Tensor, augmentation: Callable, multiplicity: int) -> tf.Tensor:
    """``(B, *shape) -> (B, multiplicity, *shape)``: `multiplicity` independent views of each
    image, those of example b in row b.

    One call of `augmentation` on the images repeated (example b's copies in rows ``k b`` to
    ``k b + k - 1``), so each view is another draw of the augmentation's randomness. Called
    once per view, a user's augmentation (mapped image by image, `each_image_alone`) drew
    the same k views in a program that set TensorFlow's global seed: each call's loop body
    is a graph of its own, whose random op the global seed seeds the same."""
    views = augmentation(tf.repeat(images, multiplicity, axis=0))
    stacked = tf.reshape(views, tf.concat([[-1, multiplicity], tf.shape(views)[1:]], axis=0))
    stacked.set_shape(tf.TensorShape([images.shape[0], multiplicity]).concatenate(
        views.shape[1:]))
    return stacked
