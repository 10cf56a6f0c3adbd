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


def test_ops_called_with_their_default_floats_compile_dynamic_in_checkpointed_regions():
    """A float default (eps=1e-5, output_scale=1.0) was one graph input that Dynamo shares between every call; met
    first inside one gradient-checkpointed region and again in the next, torch.compile(dynamic=True) failed
    ('lift_tracked_freevar_to_input should not be called on root SubgraphTracer', pytorch/pytorch#193194): a patched
    SD1.5 UNet trained with gradient checkpointing did, where stock compiles. The defaults are literals now."""
    from torch.utils.checkpoint import checkpoint

    from ldmopt import ops

    torch.manual_seed(0)
    w, b, lw = (torch.randn(8, requires_grad=True) for _ in range(3))
    cw, pw = torch.randn(8, 8, 3, 3, requires_grad=True), torch.randn(6, 8, requires_grad=True)
    emb = torch.randn(2, 16)

    def block(x):
        y = ops.gn_silu_conv2d(ops.group_norm(x, 2, w, b), w, b, 2, 1e-5, cw, None, 1, 1)
        t = ops.layer_norm_rope(ops.rms_norm(y.permute(0, 2, 3, 1).reshape(2, 35, 8), lw), lw, lw)
        t = ops.adaln_modulate(t, *emb.chunk(2, dim=1))
        return torch.cat([x, ops.layer_norm_linear(t, lw, lw, pw).reshape(2, 6, 5, 7)[:, :0]], 1) + y

    def model(x):
        return checkpoint(block, checkpoint(block, x, use_reentrant=False), use_reentrant=False)

    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, dynamic=True, backend="eager")
    x = torch.randn(2, 8, 5, 7, requires_grad=True)
    with ldmopt.use_backend("torch"):
        out = compiled(x)
        grads = torch.autograd.grad(out.square().sum(), (x, w, cw, lw))
        ref = model(x)
        ref_grads = torch.autograd.grad(ref.square().sum(), (x, w, cw, lw))
    torch.testing.assert_close(out, ref)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r)
    torch._dynamo.reset()
