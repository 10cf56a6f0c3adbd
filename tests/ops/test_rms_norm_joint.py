"""ldmopt.ops.rms_norm on two parts (x=(head, tail), cat_dim): the norm + RoPE of their concatenation, each part with
its own weight, against torch.cat of an independent fp64 reference."""

import pytest
import torch

import ldmopt
from ldmopt.ops.rms_norm import rms_norm
from tests.tolerances import assert_close, assert_compiled_matches_eager, assert_within_torch_error


def _norm(x, weight, eps=1e-6):
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y * weight if weight is not None else y


def _rotate_elements(y, cos, sin, dim):
    """diffusers' "real" rotation with tables [P, D] along ``dim`` of y [..., D]: y * cos + (-y[2i+1], y[2i]) * sin."""
    pairs = y.unflatten(-1, (-1, 2))
    partner = torch.stack((-pairs[..., 1], pairs[..., 0]), -1).flatten(-2)
    view = [1] * y.dim()
    view[dim], view[-1] = cos.shape[0], cos.shape[1]
    return y * cos.view(view).to(y.dtype) + partner * sin.view(view).to(y.dtype)


def _reference(head, tail, w_head, w_tail, cat_dim, tables=None):
    joint = torch.cat([_norm(head, w_head), _norm(tail, w_tail)], cat_dim)
    return _rotate_elements(joint, *tables, cat_dim % joint.dim()) if tables is not None else joint


CASES = [  # (head shape, tail shape, cat_dim): Flux-like [B, S, H, D] with odd counts, D not a power of two; 3-D
    ((2, 3, 3, 24), (2, 5, 3, 24), 1),
    ((1, 4, 2, 40), (1, 7, 2, 40), 1),
    ((3, 2, 36), (3, 5, 36), 1),
    ((3, 1, 20), (3, 4, 20), 1),  # one head row per sample: its statistics' split is a strided view
    ((5, 20), (2, 20), 0),
]


def _inputs(case, dtype, weights="both"):
    head_shape, tail_shape, cat_dim = case
    c = head_shape[-1]
    head = (torch.randn(head_shape, dtype=torch.float64) * 2 + 0.3).to(dtype)
    tail = (torch.randn(tail_shape, dtype=torch.float64) * 1.5 - 0.2).to(dtype)
    w_head = (1 + 0.5 * torch.randn(c, dtype=torch.float64)).to(dtype) if weights in ("both", "head") else None
    w_tail = (1 + 0.5 * torch.randn(c, dtype=torch.float64)).to(dtype) if weights in ("both", "tail") else None
    positions = head_shape[cat_dim] + tail_shape[cat_dim]
    theta = torch.randn(positions, c // 2, dtype=torch.float64) * 3
    tables = tuple(t.repeat_interleave(2, -1).float() for t in (theta.cos(), theta.sin()))
    return head, tail, w_head, w_tail, tables


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rope", [True, False])
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_forward(case, dtype, rope, backend):
    head, tail, w_head, w_tail, tables = _inputs(case, dtype)
    cat_dim = case[2]
    rope_kw = dict(rope=tables, rope_layout="elements") if rope else {}
    with ldmopt.use_backend(backend):
        y = rms_norm((head, tail), (w_head, w_tail), eps=1e-6, cat_dim=cat_dim, **rope_kw)
    assert y.dtype == dtype and y.shape == torch.cat([head, tail], cat_dim).shape
    exact = _reference(*(t.double() for t in (head, tail, w_head, w_tail)), cat_dim,
                       tuple(t.double() for t in tables) if rope else None)  # fmt: skip
    # As the unfused modules: each norm rounded to the dtype, concatenated, rotated in fp32, rounded again.
    normed = torch.cat([_norm(head.float(), w_head.float()).to(dtype), _norm(tail.float(), w_tail.float()).to(dtype)],
                       cat_dim)  # fmt: skip
    lowp = _rotate_elements(normed.float(), *tables, cat_dim % head.dim()).to(dtype) if rope else normed
    assert_within_torch_error(y, exact, lowp, f"joint rms_norm {case} {dtype} rope={rope}")


@pytest.mark.parametrize("case", CASES[:4])
@pytest.mark.parametrize("weights", ["both", "shared", "tail"])
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_backward_matches_autograd(case, weights, backend):
    head, tail, w_head, w_tail, tables = _inputs(case, torch.float32, "tail" if weights == "tail" else "both")
    if weights == "shared":
        w_tail = w_head
    leaves = [t.requires_grad_() for t in (head, tail, w_head, w_tail) if t is not None]
    weight = w_head if weights == "shared" else (w_head, w_tail)
    with ldmopt.use_backend(backend):
        y = rms_norm((head, tail), weight, cat_dim=case[2], rope=tables, rope_layout="elements")
    dy = torch.randn_like(y)
    got = torch.autograd.grad((y * dy).sum(), leaves)
    ref_leaves = {id(t): t.detach().double().requires_grad_() for t in leaves}
    ref_args = [ref_leaves[id(t)] if t is not None else None for t in (head, tail, w_head, w_tail)]
    ref = _reference(*ref_args, case[2], tuple(t.double() for t in tables))
    expect = torch.autograd.grad((ref * dy.double()).sum(), list(ref_leaves.values()))
    for i, (g, e) in enumerate(zip(got, expect)):
        assert_close(g, e, torch.float32, f"{backend} {weights} grad {i} {case}")


def test_half_parts_fp32_weights_backward_dtypes():
    head, tail = (torch.randn(2, n, 3, 16, dtype=torch.float16, requires_grad=True) for n in (3, 4))
    w_head, w_tail = ((1 + 0.5 * torch.randn(16)).requires_grad_() for _ in range(2))
    with ldmopt.use_backend("triton"):
        y = rms_norm((head, tail), (w_head, w_tail), cat_dim=1)
    assert y.dtype == torch.float16 and y.shape == (2, 7, 3, 16)
    grads = torch.autograd.grad(y.float().sum(), (head, tail, w_head, w_tail))
    assert [g.dtype for g in grads] == [torch.float16, torch.float16, torch.float32, torch.float32]


def test_gradcheck_reference_path():
    head, tail = torch.randn(2, 2, 3, 8, dtype=torch.float64), torch.randn(2, 3, 3, 8, dtype=torch.float64)
    w_head, w_tail = torch.randn(8, dtype=torch.float64) + 1, torch.randn(8, dtype=torch.float64) + 1
    cos, sin = torch.randn(5, 8, dtype=torch.float64), torch.randn(5, 8, dtype=torch.float64)

    def fn(a, b, wa, wb):
        return rms_norm((a, b), (wa, wb), cat_dim=1, rope=(cos, sin), rope_layout="elements")

    with ldmopt.use_backend("torch"):
        assert torch.autograd.gradcheck(fn, [t.requires_grad_() for t in (head, tail, w_head, w_tail)])


def test_opcheck_and_compile():
    head, tail, w_head, w_tail = torch.randn(12, 8), torch.randn(18, 8), torch.randn(8) + 1, torch.randn(8) + 1
    cos, sin = torch.randn(5, 8), torch.randn(5, 8)  # 2 + 3 positions of 3 heads, 2 samples
    for args in [
        (head, tail, w_head, w_tail, 1e-6, torch.float32, True, 6, 9, cos, sin, 3, False),
        (head, tail, None, None, 1e-6, torch.float16, False, 6, 9),
        (head.requires_grad_(), tail, w_head.requires_grad_(), w_tail, 1e-6, torch.float32, True, 6, 9),
    ]:
        torch.library.opcheck(torch.ops.ldmopt.rms_norm_joint_fwd, args)
    parts = torch.randn(2, 2, 3, 8, requires_grad=True), torch.randn(2, 3, 3, 8, requires_grad=True)
    rope = dict(rope=(cos, sin), rope_layout="elements")

    def fn(a, b, wa, wb):
        return rms_norm((a, b), (wa, wb), cat_dim=1, **rope) * 2

    assert_compiled_matches_eager(fn, (*parts, w_head, w_tail.requires_grad_()))


def _parts():
    return torch.randn(2, 3, 2, 8), torch.randn(2, 5, 2, 8)


def _joint_op(tail_rows_total, head_rows, tail_rows):
    return lambda: torch.ops.ldmopt.rms_norm_joint_fwd(
        torch.randn(12, 8), torch.randn(tail_rows_total, 8), None, None, 1e-6, torch.float32, False, head_rows,
        tail_rows,
    )  # fmt: skip


def _rope_call(positions, **kwargs):
    tables = (torch.ones(positions, 8), torch.ones(positions, 8))
    return lambda: rms_norm(_parts(), None, cat_dim=1, rope=tables, rope_layout="elements", **kwargs)


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: rms_norm(_parts(), None), "x=\\(head, tail\\) needs cat_dim"),
        (lambda: rms_norm(_parts(), None, torch.ones(8), cat_dim=1), "bias with two parts"),
        (lambda: rms_norm(torch.randn(2, 8), cat_dim=0), "cat_dim=0 is for two parts"),
        (lambda: rms_norm(_parts(), cat_dim=3), "cat_dim must be a dim of x's parts before the last, got 3"),
        # -1 names the last dim too (each row's own), not a dim before it
        (lambda: rms_norm(_parts(), cat_dim=-1), "cat_dim must be a dim of x's parts before the last, got -1"),
        (lambda: rms_norm(_parts(), cat_dim=True), "cat_dim must be a dim of x's parts before the last, got True"),
        (lambda: rms_norm((torch.randn(2, 3, 8), torch.randn(2, 3, 6)), cat_dim=1), "must match except along"),
        (lambda: rms_norm((torch.randn(2, 3, 8), torch.randn(3, 3, 8)), cat_dim=1), "must match except along"),
        (lambda: rms_norm((torch.randn(2, 8),), cat_dim=0), r"x must be a \(head, tail\) pair"),
        (lambda: rms_norm(_parts(), (torch.ones(8), torch.ones(6)), cat_dim=1), r"weight\[1\] must have shape"),
        (_rope_call(8, rope_dim=-2), "rope_dim must be the concatenation's dim"),
        (_rope_call(5), "tables for 5 positions do not match"),
        (_joint_op(9, 6, 3), "hold 2 and 3 samples"),
        (_joint_op(10, 5, 5), "not whole samples"),
        (
            lambda: torch.ops.ldmopt.rms_norm_joint_fwd(
                torch.randn(6, 8), torch.randn(9, 8), torch.ones(8), None, 1e-6, torch.float32, False, 2, 3
            ),
            "both parts' weights or neither",
        ),
    ],
)
def test_bad_input_messages(call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call()


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_pairs_tables_strided_parts_and_a_positive_rope_dim(backend):
    """Tables of one angle per pair (Qwen-Image's layout), parts that are column slices of a fused projection (rows
    not contiguous) and rope_dim given as cat_dim itself, counted from the front."""
    qkv_text, qkv_image = torch.randn(2, 3, 3 * 2 * 8), torch.randn(2, 5, 3 * 2 * 8)
    head, tail = (t[..., 16:32].unflatten(-1, (2, 8)) for t in (qkv_text, qkv_image))  # the k columns, 2 heads
    assert not head.is_contiguous()
    w_head, w_tail = 1 + 0.5 * torch.randn(8), 1 + 0.5 * torch.randn(8)
    theta = torch.randn(8, 4)
    with ldmopt.use_backend(backend):
        y = rms_norm((head, tail), (w_head, w_tail), cat_dim=1, rope=(theta.cos(), theta.sin()), rope_layout="pairs",
                     rope_dim=1)  # fmt: skip
    tables = tuple(t.repeat_interleave(2, -1).double() for t in (theta.cos(), theta.sin()))
    exact = _reference(*(t.double() for t in (head, tail, w_head, w_tail)), 1, tables)
    assert_close(y, exact, torch.float32, f"pairs, strided parts, {backend}")


@pytest.mark.parametrize(
    "head_rows, tail_rows, positions, rope_rows, match",
    [
        (2, 3, 3, 1, "tables of 3 positions: a sample's joint sequence has 5"),  # the backends placed them apart
        (2, 2, 3, 1, "tables of 3 positions: a sample's joint sequence has 4"),
        (1, 2, 2, 2, "rope_rows=2 does not divide"),  # the backward handed the head part no table rows (P = 0)
    ],
)
def test_direct_call_with_tables_of_another_length_is_refused(head_rows, tail_rows, positions, rope_rows, match):
    # Only a direct call can pass these; the public function checks the tables against the joint sequence.
    x_head, x_tail = torch.randn(3 * head_rows, 24), torch.randn(3 * tail_rows, 24)
    cos, sin = torch.rand(positions, 6), torch.rand(positions, 6)
    for backend in ("triton", "torch"):
        with ldmopt.use_backend(backend), pytest.raises(ValueError, match=match):
            torch.ops.ldmopt.rms_norm_joint_fwd(
                x_head, x_tail, None, None, 1e-6, torch.float32, True, head_rows, tail_rows, cos, sin, rope_rows, True
            )


def test_direct_calls_with_half_a_table_pair_are_refused():
    x, cos = torch.randn(3, 24), torch.rand(3, 12)
    with pytest.raises(ValueError, match="cos and sin must both be given"):
        torch.ops.ldmopt.rms_norm_fwd(x, None, None, 1e-6, torch.float32, True, cos, None, 1, True, False)
    with pytest.raises(ValueError, match=r"must share one \[P, W\] shape"):
        torch.ops.ldmopt.rms_norm_fwd(x, None, None, 1e-6, torch.float32, True, cos, cos[:2], 1, True, False)
