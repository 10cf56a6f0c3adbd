"""The host side of a fused op's call: the launch arithmetic matches Triton's, and no call goes through Triton's
constexpr functions on the host (each unwraps its arguments first: about 2 us a call, ten a call of the fused conv
before they were replaced)."""

from __future__ import annotations

import os

import pytest
import torch
import triton
from ldmopt.kernels._common import cdiv, next_power_of_2
from triton.runtime import jit

from benchmarks import bench_host_overhead, profile_host
from ldmopt._env import getenv


def test_launch_arithmetic_matches_triton():
    for a in [0, 1, 2, 3, 7, 8, 9, 40, 63, 64, 65, 1000, 4095, 4096, 4097, 2**31 - 1, 2**31, 2**40 + 3]:
        assert next_power_of_2(a) == triton.next_power_of_2(max(1, a)), a
        for b in [1, 2, 3, 16, 40, 128, 1024]:
            assert cdiv(a, b) == triton.cdiv(a, b), (a, b)
    assert next_power_of_2(-5) == 1 and next_power_of_2(0) == 1


@pytest.mark.parametrize("case", sorted(bench_host_overhead.CASES))
def test_op_calls_no_triton_constexpr_function_on_the_host(case, monkeypatch):
    monkeypatch.setattr(bench_host_overhead, "DEVICE", "cpu")
    tensors = bench_host_overhead._tensors(torch.float32)
    fused = bench_host_overhead.CASES[case][0]
    with torch.no_grad(), profile_host.stubbed_launches() as launches:
        fused(tensors)  # first call: autotuning and caches
        host_calls = []
        stock = jit.ConstexprFunction.__call__

        def counted(self, *args, **kwargs):
            host_calls.append(getattr(self, "__name__", repr(self)))
            return stock(self, *args, **kwargs)

        monkeypatch.setattr(jit.ConstexprFunction, "__call__", counted)
        launches.clear()
        fused(tensors)
    assert launches, f"{case}: no Triton kernel was launched (the case ran another backend)"
    assert not host_calls, f"{case}: host calls of Triton constexpr functions: {host_calls}"


def test_getenv_sees_every_change_os_environ_sees(monkeypatch):
    name = "LDMOPT_TEST_GETENV_VARIABLE"
    monkeypatch.delenv(name, raising=False)
    assert getenv(name) is None and getenv(name, "dflt") == "dflt"
    for value in ("1", "torch", "", "  Triton ", "é-ünïcode", "1"):
        monkeypatch.setenv(name, value)
        assert getenv(name, "dflt") == os.environ.get(name) == value
    os.environ[name] = "direct"
    assert getenv(name) == "direct"
    del os.environ[name]
    assert getenv(name, "gone") == "gone"


@pytest.mark.parametrize("case", sorted(bench_host_overhead.CASES))
def test_op_calls_read_their_variables_without_os_environ(case, monkeypatch):
    # os.environ.get encodes the key on each read (~1.6 us here); the hot path reads through ldmopt._env.getenv.
    monkeypatch.setattr(bench_host_overhead, "DEVICE", "cpu")
    tensors = bench_host_overhead._tensors(torch.float32)
    fused = bench_host_overhead.CASES[case][0]
    with torch.no_grad(), profile_host.stubbed_launches():
        fused(tensors)  # first call: autotuning and caches
        read = []
        stock = type(os.environ).__getitem__

        def counted(self, key):
            read.append(key)
            return stock(self, key)

        monkeypatch.setattr(type(os.environ), "__getitem__", counted)
        fused(tensors)
        monkeypatch.undo()
    ours = [key for key in read if key.startswith("LDMOPT_") or key == "TRITON_INTERPRET"]
    assert not ours, f"{case} read {ours} through os.environ"
