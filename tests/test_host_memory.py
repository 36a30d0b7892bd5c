"""`lipdp.host_memory`: glibc's M_TOP_PAD raised once per process, and the opt-out."""

import ctypes
import sys

import pytest

from lipdp import host_memory


@pytest.fixture
def fresh(monkeypatch):
    monkeypatch.setattr(host_memory, "_DONE", [])


def test_the_setting_is_applied_once_on_glibc(fresh, monkeypatch):
    if not (sys.platform.startswith("linux")
            and hasattr(ctypes.CDLL(None), "gnu_get_libc_version")):
        pytest.skip("glibc only")
    calls = []
    real = host_memory._set_top_pad
    monkeypatch.setattr(host_memory, "_set_top_pad", lambda: calls.append(1) or real())
    assert host_memory.keep_host_memory() is True
    assert host_memory.keep_host_memory() is True
    assert calls == [1]


def test_opt_out_leaves_glibc_alone(fresh, monkeypatch):
    monkeypatch.setenv("LIPDP_KEEP_HOST_MEMORY", "0")
    monkeypatch.setattr(ctypes, "CDLL", lambda *a: pytest.fail("libc was opened"))
    assert host_memory.keep_host_memory() is False


def test_other_platforms_are_left_alone(fresh, monkeypatch):
    monkeypatch.setattr(sys, "platform", "darwin")
    monkeypatch.setattr(ctypes, "CDLL", lambda *a: pytest.fail("libc was opened"))
    assert host_memory.keep_host_memory() is False


def test_certified_norms_applies_it(fresh):
    import numpy as np
    import tensorflow as tf

    from lipdp.operator_norms import certified_norms

    # 40 x 40: above lipdp.graph_certificates.IN_GRAPH_MAX_SIDE, certified on the host
    certified_norms([("dense", tf.constant(np.eye(40, dtype=np.float32)), None)])
    assert host_memory._DONE  # decided on the first certificate
