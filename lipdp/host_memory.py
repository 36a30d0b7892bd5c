"""Keep the host memory the certificates free, instead of returning it to the OS every step.

The certified norms run in numpy inside the train step (`lipdp.operator_norms`), on one of
TensorFlow's threads. glibc gives such a thread an arena of its own and shrinks that arena's
heap whenever a free leaves more than ``M_TOP_PAD`` (128 KiB by default) on top, so the
megabytes of temporaries a certificate allocates (Fourier transforms and Gram matrices of a
convolution's kernel: about 20 MB on the paper's CNN) are handed back to the kernel and
faulted in again, zero-filled, on the next step. On this 2-core machine the same numpy code
then ran 1.6-1.9x slower in a host call than on the main thread (7.5 against 4.7 ms for the
paper's CNN's two convolutions; 5.7 against 5.6 ms with this module's setting).

`keep_host_memory` raises ``M_TOP_PAD`` (``mallopt``) to `TOP_PAD_BYTES` once per process:
each arena then keeps up to that much free memory on top of its heap (a resident-memory
cost of at most that per arena that grew, and in practice the certificates' working set).
The clipless step of the paper's CNN at batch 1024: 0.983x with the setting (paired, 24
steps toggling it); `benchmarks/run.py --models cnn --configs floor twin clipless
--batch-sizes 1024 --no-isolated` read 1.11x and 1.11x its twin with it, 1.14x and 1.12x
without (alternate runs). It changes no result, only when memory is returned. ``LIPDP_KEEP_HOST_MEMORY=0`` leaves glibc's default; other C
libraries (musl, macOS, Windows) are left alone.
"""

from __future__ import annotations

import ctypes
import os
import sys

#: glibc's ``M_TOP_PAD`` parameter number (``<malloc.h>``).
M_TOP_PAD = -2
#: Free memory each arena keeps on top of its heap once `keep_host_memory` ran.
TOP_PAD_BYTES = 64 << 20

_DONE = []


def keep_host_memory() -> bool:
    """Raise glibc's ``M_TOP_PAD`` to `TOP_PAD_BYTES`, once per process (module docstring).

    Returns whether the setting is in effect: False off glibc, when ``mallopt`` refused,
    or with ``LIPDP_KEEP_HOST_MEMORY=0``.
    """
    if not _DONE:
        _DONE.append(_set_top_pad())
    return _DONE[0]


def _set_top_pad() -> bool:
    if os.environ.get("LIPDP_KEEP_HOST_MEMORY", "1").strip() == "0":
        return False
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None)
        if not hasattr(libc, "gnu_get_libc_version"):  # not glibc (e.g. musl)
            return False
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt(M_TOP_PAD, TOP_PAD_BYTES) == 1
