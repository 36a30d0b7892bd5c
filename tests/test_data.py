"""Tests of lipdp.data: file formats, lookup order, bounding, sampling pipelines.

No test downloads anything: image datasets are tiny IDX / pickle files written in
temporary directories (or the Debian-installed Fashion-MNIST when present),
tabular ones are scikit-learn's bundled files. Every test that could reach
`download` passes ``download=False``.

Tolerances: norms are computed in float32, whose unit roundoff is 6e-8; summing
784 squares and taking a square root gives a relative error far below 1e-5,
which is the tolerance used for "norm <= X0" and "norm == X0".
"""

import gzip
import math
import os
import pickle
import struct
import warnings

import numpy as np
import pytest
import tensorflow as tf

from lipdp import data
from lipdp.metadata import DatasetMetadata, Sampling

RTOL = 1e-5
FASHION_DEBIAN = "/usr/share/datasets/fashion-mnist"


# ----------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------


def write_idx(path, array, gz=True, magic=None):
    array = np.ascontiguousarray(array, dtype=np.uint8)
    if magic is None:
        magic = 0x0800 + array.ndim
    header = struct.pack(">I", magic) + struct.pack(">" + "I" * array.ndim, *array.shape)
    payload = header + array.tobytes()
    opener = gzip.open if gz else open
    with opener(path, "wb") as f:
        f.write(payload)


def make_mnist_dir(directory, n_train=50, n_test=20, gz=True, seed=0, ids=False):
    """Writes the four IDX files; returns the arrays written.

    With ``ids=True`` image i carries its index in pixel (0, 0) (and 255 in
    pixel (0, 1) so that no image is zero), to identify examples in batches.
    """
    os.makedirs(directory, exist_ok=True)
    rng = np.random.RandomState(seed)
    x_train = rng.randint(0, 256, size=(n_train, 28, 28)).astype(np.uint8)
    x_test = rng.randint(0, 256, size=(n_test, 28, 28)).astype(np.uint8)
    if ids:
        assert n_train <= 256
        x_train[:] = 0
        x_train[:, 0, 0] = np.arange(n_train)
        x_train[:, 0, 1] = 255
    x_train[0] = 0  # an all-zero example (bounding must keep it 0, without NaN)
    y_train = rng.randint(0, 10, size=n_train).astype(np.uint8)
    y_test = rng.randint(0, 10, size=n_test).astype(np.uint8)
    ext = ".gz" if gz else ""
    write_idx(os.path.join(directory, "train-images-idx3-ubyte" + ext), x_train, gz)
    write_idx(os.path.join(directory, "train-labels-idx1-ubyte" + ext), y_train, gz)
    write_idx(os.path.join(directory, "t10k-images-idx3-ubyte" + ext), x_test, gz)
    write_idx(os.path.join(directory, "t10k-labels-idx1-ubyte" + ext), y_test, gz)
    return x_train, y_train, x_test, y_test


@pytest.fixture
def isolated(tmp_path, monkeypatch):
    """No dataset reachable by accident: empty env dir, Keras home and Debian root."""
    monkeypatch.delenv(data.DATA_DIR_ENV, raising=False)
    monkeypatch.setenv("KERAS_HOME", str(tmp_path / "keras_home"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setattr(data, "DEBIAN_DATASETS_DIR", str(tmp_path / "debian"))
    return tmp_path


@pytest.fixture
def idx_dir(isolated):
    d = isolated / "mnist_files"
    arrays = make_mnist_dir(str(d))
    return d, arrays


def batches(ds):
    return [(x.numpy(), y.numpy()) for x, y in ds]


def norms(x):
    return np.linalg.norm(x.reshape(len(x), -1).astype(np.float64), axis=1)


def ids_of(x):
    """Recovers the identity written by make_mnist_dir(ids=True) (bounding is the identity)."""
    return np.rint(x[:, 0, 0, 0] * 255).astype(int)


# ----------------------------------------------------------------------------
# bounding functions
# ----------------------------------------------------------------------------


def test_bound_clip_value_single_example():
    f = data.bound_clip_value(2.0)
    x = tf.constant(np.full((4, 4, 1), 3.0, np.float32))  # ||x|| = 12
    y = f(x).numpy()
    assert y.shape == (4, 4, 1)
    np.testing.assert_allclose(np.linalg.norm(y), 2.0, rtol=RTOL)
    np.testing.assert_allclose(y / np.linalg.norm(y), x.numpy() / 12.0, rtol=RTOL)
    small = tf.constant([0.3, -0.4])  # norm 0.5 < 2: unchanged
    np.testing.assert_array_equal(f(small).numpy(), small.numpy())
    zero = f(tf.zeros((3, 3))).numpy()
    assert np.all(zero == 0) and np.all(np.isfinite(zero))


def test_bound_normalize_single_example():
    f = data.bound_normalize(1.5)
    for x in (np.array([0.3, -0.4], np.float32), np.full((5, 5, 3), 7.0, np.float32)):
        np.testing.assert_allclose(np.linalg.norm(f(tf.constant(x)).numpy()), 1.5, rtol=RTOL)
    zero = f(tf.zeros((2, 2, 1))).numpy()
    assert np.all(zero == 0) and np.all(np.isfinite(zero))


def test_bounds_in_tf_data_map_and_batches():
    x = np.random.RandomState(0).normal(size=(10, 6, 6, 1)).astype(np.float32) * 3
    ds = tf.data.Dataset.from_tensor_slices(x).map(data.bound_clip_value(1.0))
    out = np.stack(list(ds.as_numpy_iterator()))
    assert np.all(norms(out) <= 1.0 * (1 + RTOL))
    batched = data.bound_normalize(1.0).apply_batch(tf.constant(x)).numpy()
    np.testing.assert_allclose(norms(batched), 1.0, rtol=RTOL)


@pytest.mark.parametrize("scale", [1e-30, 1.1e-19, 1.0, 1e20, 1e37])
def test_bounds_hold_for_tiny_and_huge_inputs(scale):
    """The squares of float32 entries below about 1e-19 underflow: the norm taken as
    ``sqrt(sum x^2)`` came out too small, normalized images of about 1.1e-19 reached 3.9 X0
    and clipped ones 412 X0 under X0 = 1e-21 (an audit, 2026-12-07); above about 1e19 they
    overflow, and clipped images came out 0. Every bound lands its outputs in the ball
    (float64 norms), on the sphere where its mode says so, in a map and in batches."""
    x = np.random.RandomState(3).uniform(0.0, 1.0, size=(6, 28, 28, 1)).astype(np.float32)
    x = x * np.float32(scale)
    for bound in (data.bound_clip_value(2.0), data.bound_clip_value(1e-21),
                  data.bound_normalize(1.0)):
        batched = norms(bound.apply_batch(tf.constant(x)).numpy().astype(np.float64))
        alone = norms(np.stack([bound(tf.constant(image)).numpy() for image in x])
                      .astype(np.float64))
        for out in (batched, alone):
            assert np.all(out <= bound.max_norm * (1 + RTOL)), (bound, out / bound.max_norm)
            if bound.mode == "normalize" or np.linalg.norm(x[0].astype(np.float64)) > \
                    bound.max_norm:
                np.testing.assert_allclose(out, bound.max_norm, rtol=RTOL)


def test_bounds_of_non_finite_or_subnormal_examples():
    """An example holding a NaN or an infinity comes out NaN (fit refuses it), one of
    subnormal entries (read as 0 by TensorFlow's kernels) comes out 0; the others of the
    batch are bounded as alone."""
    x = np.array([[np.nan, 1.0], [np.inf, 0.0], [1e-40, -1e-41], [3.0, 4.0]], np.float32)
    for bound in (data.bound_clip_value(2.0), data.bound_normalize(2.0)):
        out = bound.apply_batch(tf.constant(x)).numpy()
        assert np.isnan(out[:2]).all() and (out[2] == 0).all()
        np.testing.assert_allclose(out[3], [1.2, 1.6], rtol=RTOL)


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), True, "1"])
def test_bound_validation(bad):
    with pytest.raises(ValueError, match="max_norm"):
        data.bound_clip_value(bad)
    with pytest.raises(ValueError, match="max_norm"):
        data.bound_normalize(bad)


# ----------------------------------------------------------------------------
# IDX files and lookup
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("gz", [True, False])
def test_read_idx_round_trip(tmp_path, gz):
    a = np.random.RandomState(1).randint(0, 256, size=(7, 5, 3)).astype(np.uint8)
    p = str(tmp_path / "a-idx3-ubyte")
    write_idx(p, a, gz=gz)
    np.testing.assert_array_equal(data.read_idx(p, expected_ndim=3), a)


def test_idx_round_trip_load_dataset(idx_dir):
    d, (x_train, y_train, x_test, y_test) = idx_dir
    x0 = 3.0
    ds_train, ds_test, md = data.load_dataset(
        "mnist", 10, bound_clip_value=x0, data_dir=str(d), download=False, seed=0)
    assert md == DatasetMetadata((28, 28, 1), 10, 50, 20, 10, x0, Sampling.POISSON)
    spec = ((None, 28, 28, 1), (None, 10))
    assert tuple(tuple(s.shape.as_list()) for s in ds_test.element_spec) == spec
    assert tuple(tuple(s.shape.as_list()) for s in ds_train.element_spec) == spec
    assert all(s.dtype == tf.float32 for s in ds_train.element_spec)

    test = batches(ds_test)
    assert [len(x) for x, _ in test] == [10, 10]  # unshuffled, batches of batch_size
    xt = np.concatenate([x for x, _ in test])
    yt = np.concatenate([y for _, y in test])
    # One-hot labels, in file order.
    np.testing.assert_array_equal(yt, np.eye(10, dtype=np.float32)[y_test])
    # Scaling to [0, 1] then clipping: equals the closed form x/255 * min(1, X0/||x/255||).
    raw = x_test.astype(np.float64)[..., None] / 255.0
    expected = raw * np.minimum(1.0, x0 / norms(raw))[:, None, None, None]
    np.testing.assert_allclose(xt, expected, rtol=RTOL, atol=1e-7)
    assert np.all(norms(xt) <= x0 * (1 + RTOL))
    for x, y in batches(ds_train):
        assert np.all(norms(x) <= x0 * (1 + RTOL))
        assert np.all(x >= 0) and np.all(y.sum(axis=1) == 1)


def test_bound_normalize_pipeline(idx_dir):
    d, _ = idx_dir
    with pytest.warns(data.ShuffleSamplingWarning):
        ds_train, ds_test, md = data.load_dataset(
            "mnist", 50, bound_normalize=0.5, sampling="shuffle", data_dir=str(d),
            download=False, seed=0)
    assert md.max_norm == 0.5
    (x, _), = batches(ds_train)  # one batch holding all 50 examples
    n = norms(x)
    zero = n == 0
    assert zero.sum() == 1  # example 0 was written all-zero: stays 0, no NaN
    assert np.all(np.isfinite(x))
    np.testing.assert_allclose(n[~zero], 0.5, rtol=RTOL)


def test_bound_arguments_required_and_exclusive(idx_dir):
    d, _ = idx_dir
    with pytest.raises(ValueError, match="bounded"):
        data.load_dataset("mnist", 10, data_dir=str(d), download=False)
    with pytest.raises(ValueError, match="not both"):
        data.load_dataset("mnist", 10, bound_clip_value=1.0, bound_normalize=1.0,
                          data_dir=str(d), download=False)
    with pytest.raises(ValueError, match="bound_clip_value"):
        data.load_dataset("mnist", 10, bound_clip_value=-1.0, data_dir=str(d), download=False)


def test_argument_validation(idx_dir):
    d, _ = idx_dir
    kw = dict(bound_clip_value=1.0, data_dir=str(d), download=False)
    with pytest.raises(ValueError, match="Unknown dataset"):
        data.load_dataset("imagenet", 10, **kw)
    with pytest.raises(ValueError, match="sampling"):
        data.load_dataset("mnist", 10, sampling="uniform", **kw)
    with pytest.raises(ValueError, match="batch_size"):
        data.load_dataset("mnist", 0, **kw)
    with pytest.raises(ValueError, match="batch_size"):
        data.load_dataset("mnist", 51, **kw)  # more than N = 50
    with pytest.raises(ValueError, match="nb_samples_train"):
        data.load_dataset("mnist", 10, nb_samples_train=51, **kw)
    with pytest.raises(ValueError, match="drop_remainder"):
        data.load_dataset("mnist", 10, drop_remainder=True, **kw)


def test_nb_samples_train(idx_dir):
    d, (x_train, y_train, _, _) = idx_dir
    with pytest.warns(data.ShuffleSamplingWarning):
        ds_train, _, md = data.load_dataset(
            "mnist", 5, bound_clip_value=100.0, sampling="shuffle", data_dir=str(d),
            download=False, nb_samples_train=12, seed=0)
    assert md.nb_samples_train == 12 and md.steps_per_epoch == 3
    assert md.sampling_rate == 5 / 12
    got = np.concatenate([x for x, _ in batches(ds_train)])
    # The first 12 examples exactly (X0 = 100 > 28 = max norm: clipping is the identity).
    assert len(got) == 12
    expected = x_train[:12].astype(np.float32)[..., None] / 255.0
    order = np.lexsort(got.reshape(12, -1).T)
    order_e = np.lexsort(expected.reshape(12, -1).T)
    np.testing.assert_allclose(got[order], expected[order_e], rtol=RTOL)


def test_lookup_data_dir_beats_env(isolated, monkeypatch):
    env_root = isolated / "env"
    make_mnist_dir(str(env_root / "mnist"), n_train=30, n_test=7, seed=1)
    arg_dir = isolated / "arg"
    make_mnist_dir(str(arg_dir), n_train=40, n_test=9, seed=2, gz=False)
    monkeypatch.setenv(data.DATA_DIR_ENV, str(env_root))

    raw = data.load_arrays("mnist", data_dir=str(arg_dir), download=False)
    assert len(raw.y_train) == 40 and str(arg_dir) in raw.source
    raw = data.load_arrays("mnist", download=False)
    assert len(raw.y_train) == 30 and str(env_root / "mnist") in raw.source
    assert data.DATA_DIR_ENV in raw.source
    # A data_dir without the files is refused: it fell through to the next location, and
    # the CLI trained on another dataset than the one named (an audit, 2026-12-07).
    empty = isolated / "empty"
    empty.mkdir()
    for given in (empty, isolated / "missing"):
        with pytest.raises(FileNotFoundError, match=r"(?s)not found in data_dir=.*(no dataset "
                                                    r"files|does not exist).*the only place"):
            data.load_arrays("mnist", data_dir=str(given), download=False)
    with pytest.raises(ValueError, match="bundled with scikit-learn: data_dir"):
        data.load_arrays("digits", data_dir=str(arg_dir))  # it was ignored (a review)
    monkeypatch.setenv("HOME", str(isolated))  # "~" expanded (a review)
    assert len(data.load_arrays("mnist", data_dir="~/arg", download=False).y_train) == 40


def test_lookup_debian_then_keras_cache(isolated):
    # Keras cache for fashion_mnist: ~/.keras/datasets/fashion-mnist/*.gz
    make_mnist_dir(str(isolated / "keras_home" / "datasets" / "fashion-mnist"), n_train=11,
                   n_test=3)
    raw = data.load_arrays("fashion_mnist", download=False)
    assert len(raw.y_train) == 11 and "Keras cache" in raw.source
    make_mnist_dir(str(isolated / "debian" / "fashion-mnist"), n_train=13, n_test=3)
    raw = data.load_arrays("fashion_mnist", download=False)
    assert len(raw.y_train) == 13 and "Debian" in raw.source


def test_keras_mnist_npz(isolated):
    rng = np.random.RandomState(0)
    d = isolated / "keras_home" / "datasets"
    d.mkdir(parents=True)
    np.savez(d / "mnist.npz",
             x_train=rng.randint(0, 256, (8, 28, 28)).astype(np.uint8),
             y_train=rng.randint(0, 10, 8).astype(np.uint8),
             x_test=rng.randint(0, 256, (4, 28, 28)).astype(np.uint8),
             y_test=rng.randint(0, 10, 4).astype(np.uint8))
    raw = data.load_arrays("mnist", download=False)
    assert raw.x_train.shape == (8, 28, 28, 1) and raw.y_test.shape == (4,)


def test_missing_everywhere_lists_locations(isolated, monkeypatch):
    env_root = isolated / "env"
    env_root.mkdir()
    monkeypatch.setenv(data.DATA_DIR_ENV, str(env_root))
    with pytest.raises(FileNotFoundError) as info:
        data.load_dataset("fashion_mnist", 10, bound_clip_value=1.0, download=False)
    msg = str(info.value)
    # A data_dir given is the only place looked in (a review, 2026-12-07), named as such.
    arg = isolated / "nowhere"
    with pytest.raises(FileNotFoundError, match="A data_dir given is the only place looked in"):
        data.load_dataset("fashion_mnist", 10, bound_clip_value=1.0, data_dir=str(arg),
                          download=False)
    for place in (str(env_root / "fashion_mnist"),
                  str(isolated / "debian" / "fashion-mnist"),
                  str(isolated / "keras_home" / "datasets" / "fashion-mnist"),
                  "download=False", "apt-get install dataset-fashion-mnist",
                  "train-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz",
                  data.DATA_DIR_ENV):
        assert place in msg, place


def test_missing_cifar10_message(isolated):
    with pytest.raises(FileNotFoundError, match="data_batch_1") as info:
        data.load_arrays("cifar10", download=False)
    assert str(isolated / "keras_home" / "datasets" / "cifar-10-batches-py") in str(info.value)
    assert "LIPDP_DATA_DIR is not set" in str(info.value)


def test_incomplete_directory_is_reported(isolated):
    d = isolated / "partial"
    make_mnist_dir(str(d))
    os.remove(d / "t10k-labels-idx1-ubyte.gz")
    with pytest.raises(FileNotFoundError, match="missing t10k-labels-idx1-ubyte"):
        data.load_arrays("mnist", data_dir=str(d), download=False)


def test_two_files_for_one_part_are_refused(isolated):
    """The .gz was read and an edited plain file beside it ignored, silently (an audit,
    2026-12-07); a symlink to the same file is one file."""
    d = isolated / "both"
    _, y_train, _, _ = make_mnist_dir(str(d))
    write_idx(str(d / "train-labels-idx1-ubyte"), (y_train + 1) % 10, False)
    with pytest.raises(data.DatasetFormatError, match=r"holds 2 different files for "
                                                      r"train-labels: train-labels-idx1-ubyte.gz, "
                                                      r"train-labels-idx1-ubyte\. Keep one"):
        data.load_arrays("mnist", data_dir=str(d), download=False)
    write_idx(str(d / "train-labels-idx1-ubyte"), y_train, False)  # gunzip -k: one file
    assert list(data.load_arrays("mnist", data_dir=str(d), download=False).y_train) == \
        list(y_train)
    os.remove(d / "train-labels-idx1-ubyte")
    os.symlink(d / "train-labels-idx1-ubyte.gz", d / "train-labels.idx1-ubyte.gz")
    assert list(data.load_arrays("mnist", data_dir=str(d), download=False).y_train) == \
        list(y_train)


def test_an_input_bound_beyond_float32_is_refused():
    """Normalized to X0 = 1e39, every input was inf or NaN (an audit, 2026-12-07)."""
    with pytest.raises(ValueError, match="within float32's range"):
        data.load_dataset("digits", 64, bound_normalize=1e39)
    with pytest.raises(ValueError, match="within float32's range"):
        data.bound_normalize(3.5e38)


def test_corrupt_magic(idx_dir):
    d, (x_train, *_) = idx_dir
    write_idx(str(d / "train-images-idx3-ubyte.gz"), x_train, magic=0x12345678)
    with pytest.raises(data.DatasetFormatError, match="magic number 0x12345678") as info:
        data.load_arrays("mnist", data_dir=str(d), download=False)
    assert "train-images-idx3-ubyte.gz" in str(info.value)
    # Labels file where images are expected: magic 0x801 declares 1 dimension.
    write_idx(str(d / "train-images-idx3-ubyte.gz"), np.zeros(5, np.uint8))
    with pytest.raises(data.DatasetFormatError, match="0x00000803"):
        data.load_arrays("mnist", data_dir=str(d), download=False)


def test_corrupt_size_and_gzip(idx_dir):
    d, (x_train, *_) = idx_dir
    p = d / "train-images-idx3-ubyte.gz"
    with gzip.open(p, "rb") as f:
        payload = f.read()
    with gzip.open(p, "wb") as f:
        f.write(payload[:-100])  # truncated data
    with pytest.raises(data.DatasetFormatError, match="truncated or corrupt"):
        data.load_arrays("mnist", data_dir=str(d), download=False)
    p.write_bytes(b"\x1f\x8b" + b"garbage" * 10)
    with pytest.raises(data.DatasetFormatError, match="gzip"):
        data.load_arrays("mnist", data_dir=str(d), download=False)


def test_mismatched_counts(idx_dir):
    d, _ = idx_dir
    write_idx(str(d / "train-labels-idx1-ubyte.gz"), np.zeros(49, np.uint8))
    with pytest.raises(data.DatasetFormatError, match="50 train images but 49"):
        data.load_arrays("mnist", data_dir=str(d), download=False)


def test_labels_not_one_an_image_are_refused(tmp_path):
    """Labels of shape (20, 2) for 40 images were flattened and paired with the images at
    random (an audit, 2026-12-07); (n, 1) labels are one an image and pass."""
    x = np.zeros((40, 28, 28), np.uint8)
    y = np.arange(40, dtype=np.int64) % 10
    for labels, refused in [(y.reshape(20, 2), True), (y.reshape(40, 1), False)]:
        np.savez(tmp_path / "fashion_mnist.npz", x_train=x, y_train=labels, x_test=x, y_test=y)
        if refused:
            with pytest.raises(data.DatasetFormatError, match=r"train labels have shape \(20, 2\)"):
                data.load_arrays("fashion_mnist", data_dir=str(tmp_path), download=False)
        else:
            raw = data.load_arrays("fashion_mnist", data_dir=str(tmp_path), download=False)
            np.testing.assert_array_equal(raw.y_train, y)


def test_cifar10_pickle_batches(isolated, monkeypatch):
    root = isolated / "env"
    d = root / "cifar-10-batches-py"
    d.mkdir(parents=True)
    rng = np.random.RandomState(0)
    written = {}
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        x = rng.randint(0, 256, (3, 3072)).astype(np.uint8)
        labels = [int(v) for v in rng.randint(0, 10, 3)]
        written[name] = (x, labels)
        with open(d / name, "wb") as f:  # protocol 2, as the official python-2 files
            pickle.dump({b"data": x, b"labels": labels, b"batch_label": b"b"}, f, protocol=2)
    monkeypatch.setenv(data.DATA_DIR_ENV, str(root))
    raw = data.load_arrays("cifar10", download=False)
    assert raw.x_train.shape == (15, 32, 32, 3) and raw.x_test.shape == (3, 32, 32, 3)
    x1, l1 = written["data_batch_1"]
    # Rows are [R plane | G plane | B plane], each 32x32 row-major.
    np.testing.assert_array_equal(raw.x_train[0, :, :, 1], x1[0, 1024:2048].reshape(32, 32))
    np.testing.assert_array_equal(raw.y_train[:3], l1)
    ds_train, ds_test, md = data.load_dataset("cifar10", 3, bound_clip_value=1.0,
                                              download=False, seed=0)
    assert md.input_shape == (32, 32, 3) and md.nb_samples_train == 15
    assert ds_test.element_spec[0].shape.as_list() == [None, 32, 32, 3]


def test_cifar10_refuses_code_in_pickle(isolated):
    d = isolated / "cifar"
    d.mkdir()

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        with open(d / name, "wb") as f:
            pickle.dump({b"data": Evil(), b"labels": []}, f)
    with pytest.raises(data.DatasetFormatError, match="not allowed"):
        data.load_arrays("cifar10", data_dir=str(d), download=False)


# ----------------------------------------------------------------------------
# Poisson sampling
# ----------------------------------------------------------------------------


@pytest.fixture
def ids_dir(isolated):
    d = isolated / "ids"
    make_mnist_dir(str(d), n_train=100, n_test=10, ids=True)
    return d


def _poisson(d, batch_size, seed=0, n=None):
    # X0 = 100 > sqrt(784) >= ||x||: clipping is the identity, ids stay readable.
    return data.load_dataset("mnist", batch_size, bound_clip_value=100.0, data_dir=str(d),
                             download=False, seed=seed, nb_samples_train=n)


def test_poisson_statistics(ids_dir):
    ds_train, _, md = _poisson(ids_dir, 10)
    n, q, steps = 100, 0.1, md.steps_per_epoch
    assert steps == 10 and ds_train.cardinality().numpy() == steps
    epochs = 200
    counts = np.zeros(n)
    sizes, epoch_sets = [], []
    for _ in range(epochs):  # each `for` re-iterates the dataset, as Keras fit does
        ep = []
        for x, y in ds_train:
            ids = ids_of(x.numpy())
            assert len(np.unique(ids)) == len(ids)  # no example twice in one batch
            assert x.shape[0] == y.shape[0]
            counts[ids] += 1
            sizes.append(len(ids))
            ep.append(frozenset(ids))
        assert len(ep) == steps  # exactly steps_per_epoch batches, every epoch
        epoch_sets.append(ep)
    sizes = np.array(sizes)
    T = epochs * steps  # 2000 draws
    # Total inclusions ~ Binomial(T*N, q): sd of the mean batch size is
    # sqrt(N q (1-q) / T) = 0.067; allow 6 sd.
    assert abs(sizes.mean() - q * n) < 6 * math.sqrt(n * q * (1 - q) / T)
    # Batch size variance N q (1-q) = 9 (a fixed-size sampler would give 0). The
    # sample variance of T draws has sd ~ var * sqrt(2/T) (plus a small kurtosis
    # term) = 0.3; allow [7, 11].
    assert 7.0 < sizes.var() < 11.0
    # Per example: count ~ Binomial(T, q), mean 200, sd 13.4; 6 sd = 80 for each of 100
    # examples (union bound: failure probability < 1e-6).
    assert np.all(np.abs(counts - T * q) < 6 * math.sqrt(T * q * (1 - q)))
    # Epochs differ (fresh randomness on every iteration).
    assert epoch_sets[0] != epoch_sets[1]
    assert len({tuple(ep) for ep in epoch_sets}) == epochs


def test_poisson_seed_reproducible(ids_dir):
    def first_epochs(seed):
        ds, _, _ = _poisson(ids_dir, 10, seed=seed)
        return [[tuple(ids_of(x.numpy())) for x, _ in ds] for _ in range(2)]

    a, b = first_epochs(3), first_epochs(3)
    assert a == b and a[0] != a[1]
    assert first_epochs(4) != a


def test_poisson_empty_batches(ids_dir):
    ds_train, _, md = _poisson(ids_dir, 1, n=50)  # q = 1/50
    assert md.steps_per_epoch == 50 and md.sampling_rate == 0.02
    # P(empty) = 0.98^50 = 0.36 per step; P(no empty batch in 50 steps) = 2e-10.
    empties = [(x, y) for x, y in ds_train if x.shape[0] == 0]
    assert empties
    x, y = empties[0]
    assert x.shape == (0, 28, 28, 1) and y.shape == (0, 10)
    assert x.dtype == tf.float32 and y.dtype == tf.float32


@pytest.mark.parametrize("sampling", ["poisson", "shuffle"])
def test_pipelines_run_without_the_autotuner(ids_dir, sampling):
    """tf.data's autotuning model is off in both pipelines, and in a user's map of them:
    with it on, dropping an iterator (each epoch of a fit) waited for the autotuner's
    sleep, up to 1.3 s between two epochs and 60 s in the suite (docs/speed.md)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # shuffle sampling's and the known seed's warnings
        ds_train, ds_test, _ = data.load_dataset(
            "mnist", 10, bound_clip_value=100.0, data_dir=str(ids_dir), download=False,
            seed=0, sampling=sampling)
    mapped = ds_train.map(lambda x, y: (2.0 * x, y))
    for ds in (ds_train, ds_test, mapped):
        assert ds.options().autotune.enabled is False
    assert ds_train.lipdp_sampler.sampling.value == sampling
    assert [len(y) for _, y in ds_test] == [10]


def test_poisson_batches_in_keras_fit(ids_dir):
    """Keras fit re-iterates the dataset every epoch: the batches are drawn anew."""
    ds_train, _, md = _poisson(ids_dir, 10)
    seen = []

    class Recorder(tf.keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = tf.keras.layers.Dense(10)

        def train_step(self, batch):
            x, _ = batch
            ids = tf.cast(tf.round(x[:, 0, 0, 0] * 255), tf.int64)
            # order-independent fingerprint of the batch
            return {"fp": tf.reduce_sum(tf.one_hot(ids, 100) * tf.range(1.0, 101.0) ** 2),
                    "n": tf.shape(x)[0]}

    class Cb(tf.keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            seen.append((float(logs["fp"]), int(logs["n"])))

    model = Recorder()
    model.compile()
    model.fit(ds_train, epochs=2, verbose=0, callbacks=[Cb()])
    assert len(seen) == 2 * md.steps_per_epoch
    assert seen[:10] != seen[10:]


# ----------------------------------------------------------------------------
# shuffling
# ----------------------------------------------------------------------------


def test_shuffle_warns_and_batches(ids_dir):
    with pytest.warns(data.ShuffleSamplingWarning, match="Poisson"):
        ds_train, _, md = data.load_dataset(
            "mnist", 16, bound_clip_value=100.0, sampling="shuffle", data_dir=str(ids_dir),
            download=False, seed=0, nb_samples_train=50)
    assert md.sampling is Sampling.SHUFFLE and md.steps_per_epoch == 4
    epochs = []
    for _ in range(2):
        bs = batches(ds_train)
        assert [len(x) for x, _ in bs] == [16, 16, 16, 2]  # partial last batch kept
        ids = np.concatenate([ids_of(x) for x, _ in bs])
        assert sorted(ids) == list(range(50))  # a permutation
        epochs.append(ids)
    assert not np.array_equal(epochs[0], epochs[1])  # reshuffled each epoch
    # A second pipeline of the seed shuffles on: tf.data's shuffle(seed=...) restarted its
    # permutations in each pipeline, so a run continued on one trained on the first run's
    # epochs again (an audit, 2026-12-07). The pass that starts at step t is (seed, t)'s.
    with pytest.warns(data.ShuffleSamplingWarning):
        again, _, _ = data.load_dataset(
            "mnist", 16, bound_clip_value=100.0, sampling="shuffle", data_dir=str(ids_dir),
            download=False, seed=0, nb_samples_train=50)
    third = np.concatenate([ids_of(x) for x, _ in batches(again)])
    assert sorted(third) == list(range(50))
    assert not any(np.array_equal(third, ids) for ids in epochs)
    assert again.lipdp_sampler.next_step.numpy() == 3 * md.steps_per_epoch
    assert ds_train.lipdp_sampler.last_pass_start() == md.steps_per_epoch
    assert again.lipdp_sampler.last_pass_start() == 2 * md.steps_per_epoch


def test_shuffle_drop_remainder(ids_dir):
    with pytest.warns(data.ShuffleSamplingWarning):
        ds_train, _, md = data.load_dataset(
            "mnist", 16, bound_clip_value=100.0, sampling="shuffle", drop_remainder=True,
            data_dir=str(ids_dir), download=False, seed=0, nb_samples_train=50)
    assert [len(x) for x, _ in batches(ds_train)] == [16, 16, 16]
    assert md.nb_samples_train == 50  # honest: the set still has 50 examples


def test_poisson_does_not_warn(ids_dir, recwarn):
    _poisson(ids_dir, 10)
    assert not [w for w in recwarn if issubclass(w.category, data.ShuffleSamplingWarning)]


# ----------------------------------------------------------------------------
# scikit-learn datasets
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("name,n_features,n_classes,n_total", [
    ("digits", 64, 10, 1797), ("breast_cancer", 30, 2, 569)])
def test_sklearn_datasets(name, n_features, n_classes, n_total):
    pytest.importorskip("sklearn")
    ds_train, ds_test, md = data.load_dataset(name, 32, bound_clip_value=1e3, seed=0)
    assert md.input_shape == (n_features,) and md.nb_classes == n_classes
    assert md.nb_samples_train + md.nb_samples_test == n_total
    assert abs(md.nb_samples_test / n_total - 0.2) < 0.01
    a, b = data.load_arrays(name), data.load_arrays(name)
    np.testing.assert_array_equal(a.x_train, b.x_train)  # deterministic split
    np.testing.assert_array_equal(a.y_test, b.y_test)
    # Stratified: class proportions agree between train and test within 1 example.
    for c in range(n_classes):
        n_c = np.sum(a.y_train == c) + np.sum(a.y_test == c)
        assert abs(np.sum(a.y_test == c) - 0.2 * n_c) <= 1
    x, y = next(iter(ds_test))
    assert x.shape[1:] == (n_features,) and y.shape[1:] == (n_classes,)
    np.testing.assert_array_equal(y.numpy().sum(axis=1), 1)
    if name == "digits":
        assert a.x_train.min() == 0 and a.x_train.max() == 1
    else:  # documented ranges: every value in [0, 1] up to the 3-digit rounding of DESCR
        assert a.x_train.min() > -0.05 and a.x_train.max() < 1.05


def test_breast_cancer_constants_match_public_description():
    sklearn_datasets = pytest.importorskip("sklearn.datasets")
    descr = sklearn_datasets.load_breast_cancer().DESCR
    rows = [line.split() for line in descr.splitlines() if line.count(":") == 1
            and line.strip().endswith(tuple("0123456789")) and "(" in line]
    table = np.array([[float(v) for v in r[-2:]] for r in rows])
    np.testing.assert_array_equal(table, data._BREAST_CANCER_RANGES)


@pytest.mark.parametrize("name", ["digits", "breast_cancer"])
def test_sklearn_preprocessing_is_per_example(name, monkeypatch):
    """Changing one training example's features changes no other preprocessed value:
    no statistic of the (private) training set enters the preprocessing."""
    sklearn_datasets = pytest.importorskip("sklearn.datasets")
    loader_name = f"load_{name}"
    original = getattr(sklearn_datasets, loader_name)
    before = data.load_arrays(name)
    x_raw, y_raw = original(return_X_y=True)
    train_idx, _ = data._stratified_split(y_raw, 0.2, data._SKLEARN_SPLIT_SEED)
    victim = train_idx[0]  # the first training example
    x_mod = x_raw.copy()
    x_mod[victim] = x_mod[victim] * 7.0 + 100.0

    monkeypatch.setattr(sklearn_datasets, loader_name,
                        lambda return_X_y=False: (x_mod, y_raw))
    after = data.load_arrays(name)
    assert not np.array_equal(before.x_train[0], after.x_train[0])
    np.testing.assert_array_equal(before.x_train[1:], after.x_train[1:])
    np.testing.assert_array_equal(before.x_test, after.x_test)
    np.testing.assert_array_equal(before.y_train, after.y_train)


# ----------------------------------------------------------------------------
# command line
# ----------------------------------------------------------------------------


def test_main(idx_dir, capsys):
    d, _ = idx_dir
    assert data.main(["mnist", "--data-dir", str(d), "--no-download"]) == 0
    assert str(d) in capsys.readouterr().out
    assert data.main(["fashion_mnist", "--no-download"]) == 1
    err = capsys.readouterr().err
    assert "not found" in err and "apt-get install dataset-fashion-mnist" in err


# ----------------------------------------------------------------------------
# real Fashion-MNIST (Debian package dataset-fashion-mnist)
# ----------------------------------------------------------------------------


@pytest.mark.skipif(not os.path.isdir(FASHION_DEBIAN),
                    reason=f"Fashion-MNIST not installed in {FASHION_DEBIAN}")
def test_real_fashion_mnist():
    raw = data.load_arrays("fashion_mnist", data_dir=FASHION_DEBIAN, download=False)
    assert raw.x_train.shape == (60000, 28, 28, 1) and raw.x_test.shape == (10000, 28, 28, 1)
    assert raw.x_train.max() == 255 and raw.x_train.min() == 0
    assert np.bincount(raw.y_train).tolist() == [6000] * 10
    # X0 = 28 = sqrt(784) >= ||x|| for x in [0, 1]^784: clipping is the identity.
    _, ds_test, md = data.load_dataset("fashion_mnist", 1000, bound_clip_value=28.0,
                                       data_dir=FASHION_DEBIAN, download=False)
    assert (md.nb_samples_train, md.nb_samples_test) == (60000, 10000)
    lo, hi, n = 1.0, 0.0, 0
    for x, y in ds_test:
        x = x.numpy()
        lo, hi, n = min(lo, x.min()), max(hi, x.max()), n + len(x)
    assert n == 10000 and lo == 0.0 and hi == 1.0


def test_feature_map_is_applied_per_example_and_cached_by_key():
    """load_dataset(feature_map=...) maps every train and test input (then bounds the
    features), and the first training batch once more (`_check_per_example`); with a
    feature_cache_key the features of the last call are reused when the key, the dataset and
    nb_samples_train are the same, and recomputed otherwise."""
    from lipdp import data

    calls = []

    def doubled(x):
        if tf.executing_eagerly():  # not the traces of `_refuse_state`
            calls.append(int(x.shape[0]))
        return 2.0 * tf.reshape(x, (-1, 64))

    def load(key, n=100):
        return data.load_dataset("digits", 50, bound_clip_value=1e6, nb_samples_train=n,
                                 feature_map=doubled, feature_cache_key=key, seed=0)

    _, ds_test, metadata = load(None)
    probes = 100 + 2 * data._PROBE_ROWS  # `_check_per_example`'s three probes
    assert metadata.input_shape == (64,) and sum(calls) == 100 + probes + metadata.nb_samples_test
    raw = data.load_arrays("digits")
    x, _ = next(iter(ds_test))
    np.testing.assert_allclose(x.numpy(), 2.0 * raw.x_test[:len(x)].reshape(-1, 64), rtol=1e-6)
    calls.clear()
    load(("doubled",))
    first = sum(calls)
    load(("doubled",))
    assert sum(calls) == first  # reused
    load(("doubled",), n=80)
    load(("halved",), n=80)
    assert sum(calls) == first + 2 * (
        2 * 80 + 2 * data._PROBE_ROWS + metadata.nb_samples_test)  # recomputed twice
    data._FEATURE_CACHE.clear()


def _standardised(x):
    """Per-feature standardisation by the statistics of the batch: couples its examples."""
    x = tf.reshape(x, (-1, 64))
    return (x - tf.reduce_mean(x, 0)) / (tf.math.reduce_std(x, 0) + 1e-3)


def _min_max_scaled(x):
    """Per-feature min-max scaling by the batch: one record that is a batch's extreme moves
    every other record's features (rarely one of 1000 digits is)."""
    x = tf.reshape(x, (-1, 64))
    low, high = tf.reduce_min(x, 0), tf.reduce_max(x, 0)
    return (x - low) / (high - low + 1e-3)


def _nan_ignoring_max_scaled(x):
    """Division by the batch's largest value of each feature, NaN left aside (numpy)."""
    x = np.asarray(x).reshape(-1, 64)
    return x / (np.nanmax(np.abs(x), axis=0) + 1e-3)


def _refusing_nan(x):
    """Per example, but fails on a NaN input (its probe is then skipped)."""
    return 2.0 * tf.debugging.check_numerics(tf.reshape(x, (-1, 64)), "NaN input")


def test_a_feature_map_mixing_the_examples_or_adapted_on_data_is_refused():
    """Features must be a function of their example alone: a map standardising or min-max
    scaling by the batch's statistics (one record moves every other record's features) and a
    Keras Normalization adapted on the data (statistics of the records, without noise) used
    to be accepted silently; they are refused. The min-max scalings passed the first probe
    (an example replaced by another) alone. The Normalization layer given public statistics,
    and a per-example map failing on NaN, are accepted."""
    raw = data.load_arrays("digits")
    flat = raw.x_train.reshape(-1, 64).astype(np.float32)
    adapted = tf.keras.layers.Normalization()
    adapted.adapt(flat)
    public = tf.keras.layers.Normalization(mean=8.0, variance=36.0)
    mixing = "does not treat each example on its own"
    for feature_map, refused in [(_standardised, mixing), (_min_max_scaled, mixing),
                                 (_nan_ignoring_max_scaled, mixing),
                                 (tf.keras.Sequential([tf.keras.layers.Reshape((64,)), adapted]),
                                  "adapted on data"),
                                 (tf.keras.Sequential([tf.keras.layers.Reshape((64,)), public]),
                                  None),
                                 (_refusing_nan, None)]:
        def load():
            return data.load_dataset("digits", 50, bound_clip_value=1e6, seed=0,
                                     nb_samples_train=200, feature_map=feature_map)
        if refused:
            with pytest.raises(ValueError, match=refused):
                load()
        else:
            _, _, metadata = load()
            assert metadata.input_shape == (64,)


def test_a_feature_map_giving_non_finite_features_is_refused_as_such():
    """A map taking the logarithm of the digits' zero pixels gives -inf features: it was
    refused for "not treating each example on its own" (its probes read the infinities as
    mixing: an audit, 2026-12-07), and one whose features are not finite on some examples
    only was accepted, those examples NaN after the bound. Both are refused for what they
    are, with the count of examples (checked against the raw digits)."""
    def flat(x):
        return tf.reshape(x, (tf.shape(x)[0], -1))

    centre = data.load_arrays("digits").x_train[:1400].reshape(1400, -1)[:, 36]
    for feature_map, count in [(lambda x: tf.math.log(flat(x)), 1400),
                               (lambda x: flat(x) / flat(x)[:, 36:37], int((centre == 0).sum()))]:
        assert 0 < count <= 1400
        with pytest.raises(ValueError, match="feature_map gives features that are not finite "
                                             rf"\(NaN or inf\) to {count} of the 1400"):
            data.load_dataset("digits", 50, bound_clip_value=1e6, seed=0,
                              nb_samples_train=1400, feature_map=feature_map)


def test_feature_cache_maps_changed_files_again_and_rows_match_labels(tmp_path):
    """The cache was keyed by (key, name, data_dir, nb_samples_train): a record replaced in
    the files between two calls in one process kept its old features, paired with the new
    label (found by an audit). The raw data's digest is part of the key; a map that does not
    give one row per example is refused."""
    from lipdp import data

    def flat(x):
        return tf.reshape(x, (tf.shape(x)[0], -1))

    def train_rows(**kwargs):
        ds, _, _ = data.load_dataset("mnist", 30, bound_clip_value=1e6, data_dir=str(tmp_path),
                                     sampling="shuffle", drop_remainder=True, seed=0,
                                     feature_map=flat, feature_cache_key="flat", **kwargs)
        return {tuple(np.rint(r * 255).astype(int)) for r in next(iter(ds))[0].numpy()}

    x_train, *_ = make_mnist_dir(str(tmp_path), n_train=30, n_test=10, seed=1)
    first = train_rows()
    replaced, *_ = make_mnist_dir(str(tmp_path), n_train=30, n_test=10, seed=2)
    second = train_rows()
    assert second == {tuple(r.reshape(-1).astype(int)) for r in replaced}
    assert first == {tuple(r.reshape(-1).astype(int)) for r in x_train} != second
    with pytest.raises(ValueError, match="must map each example to one row"):
        data.load_dataset("mnist", 30, bound_clip_value=1e6, data_dir=str(tmp_path),
                          feature_map=lambda x: flat(x)[:-1])
    data._FEATURE_CACHE.clear()


@pytest.mark.parametrize("sampling", ["poisson", "shuffle"])
def test_a_given_seed_warns_that_epsilon_needs_it_secret(recwarn, sampling):
    """An explicit seed makes every batch public to whoever knows it, and with it which steps
    an example took part in: the subsampling's amplification, which the accountant counts,
    is gone (an audit: epsilon 9.8-13.9 for a run reported at 2.99). It warns, for shuffled
    batches too (they did not warn, while the README said so: an audit, 2026-12-07); the
    default (a secret seed) does not."""
    def known_seed_warnings():
        return [w for w in recwarn if issubclass(w.category, data.KnownSeedWarning)]

    data.load_dataset("digits", 50, bound_clip_value=1.0, seed=3, sampling=sampling)
    assert len(known_seed_warnings()) == 1 and "seed=3" in str(known_seed_warnings()[0].message)
    recwarn.clear()
    data.load_dataset("digits", 50, bound_clip_value=1.0, sampling=sampling)
    assert not known_seed_warnings()


def test_input_bound_names_its_load_dataset_keyword():
    assert data.InputBound("clip", 3.0).load_dataset_keyword() == {"bound_clip_value": 3.0}
    assert data.InputBound("normalize", 2.0).load_dataset_keyword() == {"bound_normalize": 2.0}
