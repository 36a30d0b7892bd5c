"""Helpers of the certificate tests: exact norms and orthogonal kernels to check certificates
against, and choosing how lipdp certifies a convolution (`lipdp.gram_certificates`)."""

import numpy as np

from lipdp import gram_certificates



def exact_norm(w):
    """``||W||_2`` of the float32 kernel `w` (an array, cast to float32 first: the kernel that
    is certified), by a float64 SVD; 0 for an empty one."""
    w = np.asarray(w, np.float32).astype(np.float64)
    return float(np.linalg.svd(w, compute_uv=False)[0]) if w.size else 0.0


def exact_conv_norm(kernel, grid):
    """The operator norm of the circular convolution by the float32 ``(kh, kw, C_in, C_out)``
    `kernel` on the `grid` torus: the largest singular value of its transform over the whole
    spectrum (numpy's float64 FFT, both halves)."""
    k_hat = np.fft.fft2(np.asarray(kernel, np.float32).astype(np.float64), s=grid, axes=(0, 1))
    return float(np.max(np.linalg.svd(k_hat, compute_uv=False)))


def orthogonal_kernel(rows, cols, rng):
    """A float32 rows x cols matrix with orthonormal columns (rows) from `rng`."""
    q, _ = np.linalg.qr(rng.normal(size=(max(rows, cols), min(rows, cols))))
    return (q if rows >= cols else q.T).astype(np.float32)


#: The two ways `conv_norm_upper` computes a convolution's frequency Gram matrices.
CONV_GRAM_WAYS = ("_grams_by_tap_pairs", "_grams_by_transform")


def force_conv_gram_way(monkeypatch, way):
    """Make every `conv_norm_upper` compute its Gram matrices by `way` (one of
    `CONV_GRAM_WAYS`), whatever its cost model picks; returns the list to which each such
    computation appends `way` (to check that the forced way ran)."""
    chosen, used = getattr(gram_certificates, way), []
    for name in CONV_GRAM_WAYS:
        monkeypatch.setattr(gram_certificates, name,
                            lambda *args: used.append(way) or chosen(*args))
    return used
