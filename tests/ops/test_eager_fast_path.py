"""The eager fast path (ops/_dispatch.call): plain eager calls skip the custom-op dispatcher and must compute exactly
what the custom op computes, forward and backward; anything that needs the dispatcher keeps it."""

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils.flop_counter import FlopCounterMode

from ldmopt import ops
from tests.ops.op_cases import op_cases


class _PassThrough(TorchFunctionMode):
    """A mode that changes nothing but, being a mode, sends every call through the custom op."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


CASES = list(op_cases())


def _node_names(grad_fn) -> str:
    """Names of every node of an autograd graph (the op's node may sit under views and casts)."""
    names, todo = [], [grad_fn]
    while todo:
        node = todo.pop()
        if node is not None:
            names.append(type(node).__name__)
            todo.extend(next_node for next_node, _ in node.next_functions)
    return " ".join(names)


def _run(fn, inputs, mode=None):
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    with ops.use_backend("torch"), mode or _nothing():
        y = fn(leaves)
        grad_fn = _node_names(y.grad_fn)
        y.backward(torch.linspace(-1, 1, y.numel(), dtype=y.dtype).reshape(y.shape))
    return y.detach(), [t.grad for t in leaves], grad_fn


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("name,fn,inputs", CASES, ids=[c[0] for c in CASES])
def test_fast_path_equals_custom_op(name, fn, inputs):
    y_fast, grads_fast, fn_fast = _run(fn, inputs)
    y_slow, grads_slow, fn_slow = _run(fn, inputs, _PassThrough())
    assert "_eager" in fn_fast, f"{name}: the plain eager call did not take the fast path ({fn_fast})"
    assert "_eager" not in fn_slow, f"{name}: under a mode the call must keep the custom op ({fn_slow})"
    torch.testing.assert_close(y_fast, y_slow, rtol=0, atol=0)
    for i, (a, b) in enumerate(zip(grads_fast, grads_slow, strict=True)):
        assert (a is None) == (b is None), f"{name}: grad {i}"
        if a is not None:
            torch.testing.assert_close(a, b, rtol=0, atol=0, msg=f"{name}: grad of input {i}")


def test_modes_profiler_and_fake_tensors_keep_the_custom_op():
    x = torch.randn(2, 8, 4, 4)
    with FlopCounterMode(display=False):  # a dispatch mode sees the custom op itself
        y = ops.group_norm(x.requires_grad_(), 2, activation="silu")
    assert "_eager" not in _node_names(y.grad_fn)
    with torch.profiler.profile() as prof:
        ops.group_norm(x.detach(), 2, activation="silu")
    assert any(e.name == "ldmopt::group_norm_fwd" for e in prof.events()), "profiles must name the op"
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        fake = ops.group_norm(torch.empty(2, 8, 4, 4), 2)
    assert fake.shape == (2, 8, 4, 4)
    meta = ops.group_norm(torch.empty(2, 8, 4, 4, device="meta"), 2)
    assert meta.device.type == "meta"


def test_out_variant_bumps_the_version_counter():
    q, k, v = (torch.randn(1, 5, 2, 1, 8) for _ in range(3))
    out = torch.full_like(q, float("nan"))
    before = out._version
    with torch.no_grad():
        ops.temporal_attention(q, k, v, out=out)
    assert out._version > before
    assert torch.isfinite(out).all()


def test_inference_takes_no_autograd_node():
    x = torch.randn(2, 8, 4, 4, requires_grad=True)
    with torch.no_grad():
        y = ops.group_norm(x, 2)
    assert y.grad_fn is None and not y.requires_grad


@pytest.mark.parametrize("name", ["linear", "geglu", "gn_silu_conv2d"])
def test_fast_path_equals_custom_op_under_autocast(name):
    # The implementation runs inside autocast on the fast path as on the custom op's: same casts, same results.
    _, fn, inputs = next(c for c in CASES if c[0] == name)
    inputs = [t.float() for t in inputs]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y_fast, grads_fast, _ = _run(fn, inputs)
        y_slow, grads_slow, _ = _run(fn, inputs, _PassThrough())
    assert y_fast.dtype == y_slow.dtype
    torch.testing.assert_close(y_fast, y_slow, rtol=0, atol=0)
    for a, b in zip(grads_fast, grads_slow, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("name,fn,inputs", CASES, ids=[c[0] for c in CASES])
def test_reference_backend_under_autocast_equals_compiled(name, fn, inputs):
    # The op's operands are cast for autocast before the op; its reference implementation runs with autocast off, as
    # in a compiled graph. Its inner F.conv2d / matmul used to be cast to bf16 again in eager only.
    leaves = [t.detach().float() for t in inputs]
    torch._dynamo.reset()
    with ops.use_backend("torch"), torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        eager = fn(leaves)
        compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)(leaves)
    assert eager.dtype == compiled.dtype
    torch.testing.assert_close(eager, compiled, rtol=0, atol=0)


def test_jit_trace_keeps_the_custom_op():
    x, w, b = torch.randn(2, 8, 4, 4), torch.randn(8), torch.randn(8)
    with ops.use_backend("torch"):
        traced = torch.jit.trace(lambda t: ops.group_norm(t, 2, w, b, activation="silu"), (x,))
    assert "ldmopt::group_norm_fwd" in str(traced.graph), "the trace must record the op, not its reference code"
    torch.testing.assert_close(traced(x), ops.group_norm(x, 2, w, b, activation="silu"))


def test_forward_mode_sees_through_vmap():
    # vmap's batched wrappers have no batching rule for unpack_dual: the check unwraps them, so a vmapped call without
    # tangents still runs inside a dual level, and jvp of a vmapped call gets the stock GroupNorm's tangent.
    import torch.autograd.forward_ad as fwAD

    x, w, b = torch.randn(3, 1, 4, 2, 2), torch.randn(4), torch.randn(4)
    tangent = torch.randn_like(x)
    norm = torch.func.vmap(lambda r: ops.group_norm(r, 2, w, b))
    with ops.use_backend("torch"):
        expected = norm(x)
        with fwAD.dual_level():
            torch.testing.assert_close(norm(x), expected)
        _, got = torch.func.jvp(norm, (x,), (tangent,))
    _, stock = torch.func.jvp(torch.func.vmap(lambda r: torch.nn.functional.group_norm(r, 2, w, b)), (x,), (tangent,))
    torch.testing.assert_close(got, stock, rtol=1e-4, atol=1e-5)
