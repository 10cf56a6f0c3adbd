"""A forced backend also governs the op's backward when autograd runs it on another thread.

On a GPU the autograd engine runs backward on its device threads, which start with an empty contextvars context and
so do not see the caller's ``use_backend``: the forced choice travels with the autograd node instead. Here a fresh
Python thread plays that role (on the CPU the engine runs backward on the calling thread). In these tests the
interpreter makes Triton the automatic choice, so a backward that lost the forced "torch" would run on Triton.
"""

import threading

import pytest
import torch

import ldmopt
from ldmopt.ops import _dispatch, adaln_modulate, geglu, gn_silu_conv2d, group_norm, linear, temporal_attention
from ldmopt.ops._dispatch import Backend, BackendTable, backend_counts, forced_backend


def _grad_on_fresh_thread(y, inputs, dy):
    result = {}

    def run():
        try:
            result["grads"] = torch.autograd.grad(y, inputs, dy)
        except BaseException as exc:  # re-raised on the test's thread
            result["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    if "error" in result:
        raise result["error"]
    return result["grads"]


def _leaves(*shapes):
    return [(torch.randn(shape, dtype=torch.float64) * 0.5 + 0.1).float().requires_grad_() for shape in shapes]


def _gn_input(channels_last=False):
    x = _leaves((2, 12, 5, 7))[0].detach()
    return (x.to(memory_format=torch.channels_last) if channels_last else x).requires_grad_()


#: op -> (the backward op whose backend is counted, the forward, its inputs)
CASES = {
    "group_norm": ("group_norm_backward", lambda x, w, b: group_norm(x, 3, w, b, 1e-5, "silu"), lambda: [
        _gn_input(), *_leaves(12, 12)]),
    "geglu": ("geglu_backward", geglu, lambda: _leaves((3, 5, 8), (2 * 6, 8), (2 * 6,))),
    "linear": ("linear_backward", lambda x, w, b: linear(x, w, b, activation="gelu"), lambda: _leaves(
        (7, 8), (6, 8), (6,))),
    "adaln_modulate": ("adaln_modulate_backward", adaln_modulate, lambda: _leaves((2, 5, 12), (2, 12), (2, 12))),
    "temporal_attention": ("temporal_attention_backward", temporal_attention, lambda: _leaves(*[(1, 5, 3, 2, 8)] * 3)),
    # The conv's backward is aten's; its GroupNorm part runs through group_norm_backward.
    "gn_silu_conv2d": ("group_norm_backward", lambda x, gw, gb, w: gn_silu_conv2d(x, gw, gb, 3, 1e-5, w), lambda: [
        _gn_input(channels_last=True), *_leaves(12, 12, (6, 12, 3, 3))]),
}  # fmt: skip


@pytest.mark.parametrize("op", list(CASES))
def test_forced_backend_reaches_backward_on_another_thread(op):
    backward_op, fn, make_inputs = CASES[op]
    inputs = make_inputs()
    with ldmopt.use_backend("torch"):
        y = fn(*inputs)
    before = backend_counts.copy()
    grads = _grad_on_fresh_thread(y, inputs, torch.randn_like(y))
    ran = {name: backend_counts[(backward_op, name)] - before[(backward_op, name)] for name in ("torch", "triton")}
    assert ran == {"torch": 1, "triton": 0}, f"{backward_op} after a forward under use_backend('torch'): {ran}"
    assert all(g is not None and torch.isfinite(g).all() for g in grads)


def test_nothing_forced_leaves_the_choice_to_the_backward():
    # Forward in automatic mode, backward under a forced backend on the same thread: the backward's context decides
    # (on a GPU's autograd threads that context is empty, and only LDMOPT_BACKEND forces such a backward).
    x, w, b = _leaves((2, 12, 5, 7), 12, 12)
    y = group_norm(x, 3, w, b, 1e-5)
    before = backend_counts[("group_norm_backward", "torch")]
    with ldmopt.use_backend("torch"):
        torch.autograd.grad(y, [x, w, b], torch.randn_like(y))
    assert backend_counts[("group_norm_backward", "torch")] == before + 1


def test_a_forward_backend_the_backward_lacks_is_chosen_automatically():
    # Temporal attention has a cuda forward but no cuda backward: a forward forced onto cuda must still train.
    table = BackendTable("toy_backward", [Backend("triton", lambda: "triton"), Backend("torch", lambda: "torch")])
    with ldmopt.use_backend("cuda"):
        forward_context = _dispatch._forced.get()
    token = _dispatch._forced.set(_dispatch._inherited(forward_context, None))
    try:
        assert table() == "triton"
    finally:
        _dispatch._forced.reset(token)
    with ldmopt.use_backend("cuda"), pytest.raises(ldmopt.BackendUnavailableError, match="has only"):
        table()  # forced by the caller, not inherited: still an error


def test_forward_forcing_other_ops_keeps_the_backward_context():
    x, w, b = _leaves((2, 12, 5, 7), 12, 12)
    with ldmopt.use_backend("triton", ops=["linear"]):  # says nothing about group_norm
        y = group_norm(x, 3, w, b, 1e-5)
    before = backend_counts[("group_norm_backward", "torch")]
    with ldmopt.use_backend("torch"):
        torch.autograd.grad(y, [x, w, b], torch.randn_like(y))
    assert backend_counts[("group_norm_backward", "torch")] == before + 1


def test_naming_an_op_forces_its_backward_and_nesting_merges():
    with ldmopt.use_backend("torch"), ldmopt.use_backend("triton", ops=["linear"]):
        assert forced_backend("linear") == forced_backend("linear_backward") == "triton"
        assert forced_backend("group_norm") == "torch"
        with ldmopt.use_backend("auto", ops=["group_norm"]):
            assert forced_backend("group_norm") is None and forced_backend("geglu") == "torch"
    x, w, b = _leaves((2, 12, 5, 7), 12, 12)
    with ldmopt.use_backend("torch", ops=["group_norm"]):
        y = group_norm(x, 3, w, b, 1e-5)
    before = backend_counts.copy()
    _grad_on_fresh_thread(y, [x, w, b], torch.randn_like(y))
    assert backend_counts[("group_norm_backward", "torch")] == before[("group_norm_backward", "torch")] + 1


def test_ops_are_named_by_their_public_or_table_names_and_typos_raise():
    # ldmopt.ops.gn_silu_conv2d runs the gn_conv2d and gn_conv2d_stats tables: its own name used to force nothing.
    with ldmopt.use_backend("triton", ops=["gn_silu_conv2d"]):
        assert forced_backend("gn_conv2d") == forced_backend("gn_conv2d_stats") == "triton"
        assert forced_backend("linear") is None
    with ldmopt.use_backend("torch", ops="layer_norm_rope"):  # one name as a plain string
        assert forced_backend("rms_norm") == "torch"
    with ldmopt.use_backend("torch", ops=["gn_conv2d", "linear_backward"]):
        assert forced_backend("gn_conv2d") == forced_backend("linear_backward") == "torch"
    typo = pytest.raises(ValueError, match=r"'groupnorm', not an ldmopt op.*'group_norm'")
    with typo, ldmopt.use_backend("triton", ops=["groupnorm"]):
        pass


def test_naming_a_public_op_forces_every_table_it_runs():
    # gn_silu_conv2d's backward runs group_norm_backward, layer_norm_linear runs layer_norm_stats and linear_backward,
    # temporal_attention(out=...) its own table: naming the op used to leave those to the enclosing context.
    from tests.ops.op_cases import op_cases

    public = {"rms_norm_rope": "rms_norm"}
    for case, fn, inputs in op_cases():
        leaves = [t.detach().float().requires_grad_() for t in inputs]
        before = backend_counts.copy()
        with ldmopt.use_backend("torch"):
            fn(leaves).sum().backward()
        ran = {op for (op, _), n in backend_counts.items() if n > before.get((op, _), 0)}
        with ldmopt.use_backend("triton", ops=[public.get(case, case)]):
            assert {op: forced_backend(op) for op in ran} == dict.fromkeys(ran, "triton"), case
    with ldmopt.use_backend("triton", ops=["temporal_attention"]):
        assert forced_backend("temporal_attention_out") == "triton"
    with ldmopt.use_backend("triton", ops=["layer_norm_linear"]):
        assert forced_backend("geglu_backward") == "triton"  # its GEGLU activation
