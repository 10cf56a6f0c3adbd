"""The forced backend inside torch.compile. From torch 2.14 dynamo reads the use_backend ContextVar and guards on
it: a later call under another backend retraces. Before (the GPU image's torch 2.11), reading it is a graph break,
so the value in effect while tracing is baked into the graph instead, with no graph break."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounter

import ldmopt
from ldmopt.ops import _dispatch


def _compiled_branch():
    """A fullgraph function whose Python branches on the forced backend, and the list of graphs dynamo made."""
    graphs = []

    def count(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def branch(x):
        return x + (1 if _dispatch.forced_backend("gn_conv2d") == "torch" else 3)

    torch._dynamo.reset()
    return torch.compile(branch, fullgraph=True, backend=count), graphs


def test_before_torch_2_14_the_backend_forced_while_tracing_is_baked_in(monkeypatch):
    monkeypatch.setattr(_dispatch, "_DYNAMO_CANNOT_READ_CONTEXTVARS", True)
    fn, graphs = _compiled_branch()
    x = torch.randn(3)
    with ldmopt.use_backend("torch"):
        torch.testing.assert_close(fn(x), x + 1)
    torch.testing.assert_close(fn(x), x + 1)  # baked: no retrace outside the context
    with ldmopt.use_backend("triton"):
        torch.testing.assert_close(fn(x), x + 1)
    assert len(graphs) == 1
    torch._dynamo.reset()


@pytest.mark.skipif(_dispatch._DYNAMO_CANNOT_READ_CONTEXTVARS, reason="dynamo before torch 2.14 cannot read it")
def test_from_torch_2_14_the_forced_backend_is_guarded_and_retraced():
    fn, graphs = _compiled_branch()
    x = torch.randn(3)
    with ldmopt.use_backend("torch"):
        torch.testing.assert_close(fn(x), x + 1)
    torch.testing.assert_close(fn(x), x + 3)
    with ldmopt.use_backend("triton"):
        torch.testing.assert_close(fn(x), x + 3)
    with ldmopt.use_backend("torch"):
        torch.testing.assert_close(fn(x), x + 1)
    assert len(graphs) >= 2
    torch._dynamo.reset()


def test_outside_compile_the_live_context_decides():
    with ldmopt.use_backend("torch"):
        assert _dispatch._resolve("group_norm") == ("torch", False)
        assert _dispatch._resolve_at_trace_time("group_norm") == ("torch", False)  # same answer, eagerly
    with ldmopt.use_backend("triton"):
        assert _dispatch._resolve("group_norm") == ("triton", False)


@pytest.mark.parametrize("declared", [True, False])
def test_an_environment_read_compiles_once_and_a_change_retraces(monkeypatch, declared):
    # ldmopt._env.getenv caches encoded names and decoded values; a cache entry first written while Dynamo traced
    # failed that graph's guard on the next call (one recompile of a patched model in a fresh process)
    from ldmopt import _env

    name = f"LDMOPT_TEST_COMPILE_READ_{declared}"
    monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(_env, "_ENCODED_NAMES", dict(_env._ENCODED_NAMES))
    monkeypatch.setattr(_env, "_DECODED_VALUES", {})
    if declared:
        _env.read_per_call(name)
    graphs = CompileCounter()
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: x + (1 if _env.getenv(name) is None else 3), fullgraph=True, backend=graphs)
    x = torch.zeros(2)
    for _ in range(3):
        assert torch.equal(compiled(x), x + 1)
    assert graphs.frame_count == 1
    monkeypatch.setenv(name, "on")
    for _ in range(3):
        assert torch.equal(compiled(x), x + 3)
    assert graphs.frame_count == 2
