"""ldmopt.ops.rms_norm and the ``rms_norm`` patch rule: against PyTorch in fp64 and against diffusers' RMSNorm."""

import pytest
import torch

import ldmopt
from ldmopt.ops.rms_norm import rms_norm
from tests.tolerances import assert_close, assert_within_torch_error


def _reference(x, weight=None, bias=None, eps=1e-6):
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight
    return y + bias if bias is not None else y


SHAPES = [(3, 13, 72), (37, 40), (2, 5, 3, 24)]  # odd row counts, C not a power of two, per-head 4-D


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("affine", ["none", "weight", "weight+bias"])
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_forward(shape, dtype, affine, backend):
    x = (torch.randn(shape, dtype=torch.float64) * 2 + 0.3).to(dtype)
    c = shape[-1]
    weight = (1 + 0.5 * torch.randn(c, dtype=torch.float64)).to(dtype) if affine != "none" else None
    bias = (0.3 * torch.randn(c, dtype=torch.float64)).to(dtype) if affine == "weight+bias" else None
    with ldmopt.use_backend(backend):
        y = rms_norm(x, weight, bias, eps=1e-6)
    assert y.dtype == dtype and y.shape == x.shape
    as64 = [t.double() if t is not None else None for t in (x, weight, bias)]
    lowp = _reference(x.float(), *(t.float() if t is not None else None for t in (weight, bias))).to(dtype)
    assert_within_torch_error(y, _reference(*as64), lowp, f"rms_norm {shape} {dtype} {affine}")


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_backward_matches_autograd(shape, backend):
    c = shape[-1]
    leaves = [torch.randn(shape) * 1.5, 1 + 0.5 * torch.randn(c), 0.3 * torch.randn(c)]
    leaves = [t.requires_grad_() for t in leaves]
    with ldmopt.use_backend(backend):
        y = rms_norm(*leaves)
    dy = torch.randn_like(y)
    got = torch.autograd.grad((y * dy).sum(), leaves)
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    expect = torch.autograd.grad((_reference(*ref_leaves) * dy.double()).sum(), ref_leaves)
    for name, g, e in zip(("dx", "dweight", "dbias"), got, expect):
        assert_close(g, e, torch.float32, f"{backend} {name} {shape}")


def test_half_input_fp32_weight_backward_dtypes():
    x = torch.randn(6, 40, dtype=torch.float16, requires_grad=True)
    w = (1 + 0.5 * torch.randn(40)).requires_grad_()
    with ldmopt.use_backend("triton"):
        y = rms_norm(x, w, out_dtype=torch.float32)
    assert y.dtype == torch.float32
    dx, dw = torch.autograd.grad(y.sum(), (x, w))
    assert dx.dtype == torch.float16 and dw.dtype == torch.float32


def test_gradcheck_reference_path():
    leaves = [torch.randn(4, 6, dtype=torch.float64), torch.randn(6, dtype=torch.float64) + 1,
              torch.randn(6, dtype=torch.float64)]  # fmt: skip
    with ldmopt.use_backend("torch"):
        assert torch.autograd.gradcheck(lambda *t: rms_norm(*t), [t.requires_grad_() for t in leaves])


def test_opcheck_and_compile():
    x, w = torch.randn(10, 24), torch.randn(24).requires_grad_()
    torch.library.opcheck(torch.ops.ldmopt.rms_norm_fwd, (x, w, None, 1e-6, torch.float32, True))
    torch.library.opcheck(torch.ops.ldmopt.rms_norm_fwd, (x, None, None, 1e-6, torch.float16, False))
    _, rstd = torch.ops.ldmopt.rms_norm_fwd(x, w.detach(), None, 1e-6, torch.float32, True)
    torch.library.opcheck(torch.ops.ldmopt.rms_norm_bwd, (torch.randn(10, 24), x, rstd, w.detach()))
    torch.library.opcheck(torch.ops.ldmopt.rms_norm_bwd, (torch.randn(10, 24), x, rstd, None))
    torch._dynamo.reset()
    xs = torch.randn(2, 5, 24, requires_grad=True)
    out = torch.compile(lambda a, b: rms_norm(a, b) * 2, backend="aot_eager", fullgraph=True)(xs, w)
    got = torch.autograd.grad(out.sum(), (xs, w))
    expect_out = rms_norm(xs, w) * 2
    expect = torch.autograd.grad(expect_out.sum(), (xs, w))
    assert_close(out, expect_out.detach().double(), torch.float32, "compiled")
    for g, e in zip(got, expect):
        assert_close(g, e.double(), torch.float32, "compiled grads")


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: rms_norm(torch.randn(4, 8), torch.randn(6)), r"weight must have shape \(8,\)"),
        (lambda: rms_norm(torch.randn(4, 8), eps=-1.0), "eps must be a finite non-negative float, got -1.0"),
        (lambda: rms_norm(torch.randn(4, 8), eps=float("nan")), "eps must be a finite non-negative float, got nan"),
        (lambda: rms_norm(torch.randn(4, 8), eps=True), "eps must be a finite non-negative float, got True"),
        (lambda: rms_norm(torch.randn(4, 8), out_dtype=torch.int8), "out_dtype must be None or one of"),
        (lambda: rms_norm(torch.randn(4, 8), out_dtype=torch.float8_e4m3fn), "got torch.float8_e4m3fn"),
        (lambda: rms_norm(torch.randn(4, 0)), "x is empty"),
        (lambda: rms_norm(torch.tensor(1.0)), "at least 1 dim"),
    ],
)
def test_bad_input_messages(call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call()


# ------------------------------------------------------------------------------------------------ with RoPE


def x_rows(shape):
    return torch.Size(shape[:-1]).numel()


def _rope_reference(y, cos, sin):
    """Pairs of each head turned by the angle of the row's position: y [..., P, C] (or [M, C] with per-row angles)."""
    p, half = cos.shape
    pairs = y.reshape(-1, p, y.shape[-1] // (2 * half), half, 2)
    even, odd = pairs[..., 0], pairs[..., 1]
    c, s = cos.view(1, p, 1, half).to(y.dtype), sin.view(1, p, 1, half).to(y.dtype)
    return torch.stack((even * c - odd * s, even * s + odd * c), dim=-1).reshape(y.shape)


def _angles(positions, half, wan_views=False):
    """(cos, sin) [positions, half] fp32; with wan_views, as strided views of Wan's repeated [1, P, 1, 2 * half]."""
    theta = torch.randn(positions, half, dtype=torch.float64) * 3
    if not wan_views:
        return theta.cos().float(), theta.sin().float()
    cos = theta.cos().repeat_interleave(2, -1).float().view(1, positions, 1, 2 * half)
    sin = theta.sin().repeat_interleave(2, -1).float().view(1, positions, 1, 2 * half)
    return cos[..., 0::2].flatten(0, 2), sin[..., 1::2].flatten(0, 2)


ROPE_CASES = [  # (x shape, heads): odd positions, C = 18 not a power of two (pairs masked), angles per row of x
    ((2, 5, 18), 3, "positions"),
    ((3, 7, 40), 2, "positions"),
    ((4, 24), 2, "rows"),
    ((2, 5, 24), 2, "rows"),  # 10 rows of angles for x [2, 5, C]: row b * 5 + s reads its own row, not row s
]


@pytest.mark.parametrize("shape,heads,per", ROPE_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_rope_forward(shape, heads, per, dtype, backend):
    c = shape[-1]
    half = c // heads // 2
    positions = shape[-2] if per == "positions" else x_rows(shape)
    cos, sin = _angles(positions, half, wan_views=per == "positions")
    x = (torch.randn(shape, dtype=torch.float64) * 2 + 0.3).to(dtype)
    weight = (1 + 0.5 * torch.randn(c, dtype=torch.float64)).to(dtype)
    with ldmopt.use_backend(backend):
        y = rms_norm(x, weight, eps=1e-6, rope=(cos, sin), rope_layout="pairs")
    assert y.dtype == dtype and y.shape == x.shape
    exact = _rope_reference(_reference(x.double(), weight.double()), cos.double(), sin.double())
    lowp = _rope_reference(_reference(x.float(), weight.float()).to(dtype), cos, sin).to(dtype)  # as diffusers
    assert_within_torch_error(y, exact, lowp, f"rms_norm+rope {shape} {dtype}")


@pytest.mark.parametrize("shape,heads,per", ROPE_CASES)
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_rope_backward_matches_autograd(shape, heads, per, backend):
    c = shape[-1]
    half = c // heads // 2
    cos, sin = _angles(shape[-2] if per == "positions" else x_rows(shape), half)
    x, w = (torch.randn(shape) * 1.5).requires_grad_(), (1 + 0.5 * torch.randn(c)).requires_grad_()
    with ldmopt.use_backend(backend):
        y = rms_norm(x, w, rope=(cos, sin), rope_layout="pairs")
    dy = torch.randn_like(y)
    got = torch.autograd.grad((y * dy).sum(), (x, w))
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ref = _rope_reference(_reference(x64, w64), cos.double(), sin.double())
    expect = torch.autograd.grad((ref * dy.double()).sum(), (x64, w64))
    for name, g, e in zip(("dx", "dweight"), got, expect):
        assert_close(g, e, torch.float32, f"{backend} rope {name} {shape}")


def test_rope_gradcheck_reference_path_and_opcheck():
    cos, sin = (t.double() for t in _angles(3, 2))
    leaves = [torch.randn(2, 3, 8, dtype=torch.float64), torch.randn(8, dtype=torch.float64) + 1]
    with ldmopt.use_backend("torch"):
        fn = lambda *t: rms_norm(*t, rope=(cos, sin), rope_layout="pairs")
        assert torch.autograd.gradcheck(fn, [t.requires_grad_() for t in leaves])
    x, w = torch.randn(6, 8), torch.randn(8)
    cos, sin = _angles(3, 2, wan_views=True)
    torch.library.opcheck(torch.ops.ldmopt.rms_norm_fwd, (x, w, None, 1e-6, torch.float32, True, cos, sin))
    _, rstd = torch.ops.ldmopt.rms_norm_fwd(x, w, None, 1e-6, torch.float32, True, cos, sin)
    torch.library.opcheck(torch.ops.ldmopt.rms_norm_bwd, (torch.randn(6, 8), x, rstd, w, cos, sin))


def test_rope_compiles_fullgraph():
    torch._dynamo.reset()
    cos, sin = _angles(5, 3)
    xs, w = torch.randn(2, 5, 12, requires_grad=True), (1 + torch.randn(12)).requires_grad_()
    pairs = dict(rope=(cos, sin), rope_layout="pairs")
    fn = torch.compile(lambda a, b: rms_norm(a, b, **pairs) * 2, backend="aot_eager", fullgraph=True)
    out = fn(xs, w)
    got = torch.autograd.grad(out.sum(), (xs, w))
    expect_out = rms_norm(xs, w, **pairs) * 2
    expect = torch.autograd.grad(expect_out.sum(), (xs, w))
    assert_close(out, expect_out.detach().double(), torch.float32, "compiled rope")
    for g, e in zip(got, expect):
        assert_close(g, e.double(), torch.float32, "compiled rope grads")


def _flux_reference(x, weight, cos, sin):
    """Flux's per-head norm and rotation: x [B, S, H, D] normalised per head, then diffusers' apply_rotary_emb (tables
    [S, D], one value per element, sequence on dim 1)."""
    from diffusers.models.embeddings import apply_rotary_emb

    return apply_rotary_emb(_reference(x, weight), (cos, sin), sequence_dim=1)


@pytest.mark.parametrize("shape", [(2, 7, 3, 6), (1, 5, 2, 16)])  # (B, S, H, D): odd S, D not a power of two
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_rope_elements_per_head_matches_diffusers_rotation(shape, dtype, backend):
    pytest.importorskip("diffusers")
    _, s, _, d = shape
    cos, sin = torch.randn(s, d), torch.randn(s, d)  # not repeated per pair: each element reads its own value
    x = (torch.randn(shape, dtype=torch.float64) * 2).to(dtype)
    weight = (1 + 0.5 * torch.randn(d, dtype=torch.float64)).to(dtype)
    with ldmopt.use_backend(backend):
        y = rms_norm(x, weight, eps=1e-6, rope=(cos, sin), rope_layout="elements", rope_dim=-3)
    exact = _flux_reference(x.double(), weight.double(), cos.double(), sin.double())
    from diffusers.models.embeddings import apply_rotary_emb

    lowp = apply_rotary_emb(_reference(x.float(), weight.float()).to(dtype), (cos, sin), sequence_dim=1)  # as Flux
    assert_within_torch_error(y, exact, lowp, f"rms_norm+rope elements {shape} {dtype}")
    x64, w64 = x.double().requires_grad_(), weight.double().requires_grad_()
    xs, ws = x.float().requires_grad_(), weight.float().requires_grad_()
    with ldmopt.use_backend(backend):
        y32 = rms_norm(xs, ws, eps=1e-6, rope=(cos, sin), rope_layout="elements", rope_dim=-3)
    dy = torch.randn_like(y32)
    got = torch.autograd.grad((y32 * dy).sum(), (xs, ws))
    expect = torch.autograd.grad(
        (_flux_reference(x64, w64, cos.double(), sin.double()) * dy.double()).sum(), (x64, w64)
    )
    for name, g, e in zip(("dx", "dweight"), got, expect):
        assert_close(g, e, torch.float32, f"{backend} elements {name} {shape}")


@pytest.mark.parametrize(
    "rope,bias,match",
    [
        ((torch.ones(5, 2),), None, r"rope must be a \(cos, sin\) pair"),
        ((torch.ones(5, 2), torch.ones(5, 3)), None, "cos and sin must have the same shape"),
        ((torch.ones(5, 3), torch.ones(5, 3)), None, "heads of 6\\) do not divide x's last dim 8"),
        ((torch.ones(4, 2), torch.ones(4, 2)), None, "tables for 4 positions do not match x of shape"),
        ((torch.ones(5, 2, requires_grad=True), torch.ones(5, 2)), None, "rope cos requires grad"),
        ((torch.ones(5, 2), torch.ones(5, 2)), torch.ones(8), "bias with rope is not supported"),
        ((torch.ones(5, 2, dtype=torch.int32), torch.ones(5, 2)), None, "rope cos has dtype torch.int32"),
    ],
)
def test_rope_bad_input_messages(rope, bias, match):
    with pytest.raises((ValueError, TypeError), match=match):
        rms_norm(torch.randn(2, 5, 8), None, bias, rope=rope, rope_layout="pairs")


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(rope_layout="halves"), "rope_layout must be one of"),
        (dict(rope_layout=None), r"rope_layout must be one of .* with rope \(pairs: tables \[P, D/2\]"),
        (dict(rope_dim=-1), "rope_dim must be a dim of x before the last"),
        (dict(rope_dim=-4), "rope_dim must be a dim of x before the last"),
    ],
)
def test_rope_mapping_bad_input_messages(kwargs, match):
    with pytest.raises(ValueError, match=match):
        rms_norm(
            torch.randn(2, 5, 8), None, rope=(torch.ones(5, 2), torch.ones(5, 2)), **{"rope_layout": "pairs", **kwargs}
        )


# ------------------------------------------------------------------------------------------------ the patch rule


@pytest.mark.parametrize(
    "input_dtype,weight_dtype,affine",
    [
        (torch.float32, torch.float32, True),
        (torch.float16, torch.float16, True),  # stock rounds to fp16 before the weight; the kernel once
        (torch.float16, torch.float32, True),  # an fp32 weight makes the stock output fp32
        (torch.float16, None, False),
    ],
)
def test_patched_diffusers_rms_norm_matches_stock(input_dtype, weight_dtype, affine):
    from diffusers.models.normalization import RMSNorm

    norm = RMSNorm(40, eps=1e-6, elementwise_affine=affine)
    if affine:
        with torch.no_grad():
            norm.weight.copy_(1 + 0.5 * torch.randn(40))
        norm.to(weight_dtype)
    x = (torch.randn(3, 7, 40) * 2).to(input_dtype)
    stock = norm(x)
    exact = RMSNorm(40, eps=1e-6, elementwise_affine=affine).double()
    if affine:
        exact.weight.data = norm.weight.data.double()
    expect = exact(x.double())
    report = ldmopt.patch(norm)
    assert report.counts() == {"rms_norm": 1}, str(report)
    with ldmopt.use_backend("triton"):
        fused = norm(x)
    assert fused.dtype == stock.dtype
    assert_within_torch_error(fused, expect, stock, f"patched RMSNorm {input_dtype} {weight_dtype}")
    ldmopt.unpatch(norm)
    assert type(norm) is RMSNorm


def test_patched_sd3_with_rms_qk_norm_matches_stock():
    from diffusers import SD3Transformer2DModel

    from tests.patch.helpers import assert_same_snapshot, output_tensor, snapshot

    torch.manual_seed(0)
    model = SD3Transformer2DModel(
        sample_size=8, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=8, num_attention_heads=2,
        joint_attention_dim=32, caption_projection_dim=16, pooled_projection_dim=16, out_channels=4,
        pos_embed_max_size=16, qk_norm="rms_norm",
    ).eval()  # fmt: skip
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm_" in name:
                p.copy_(1 + 0.5 * torch.randn_like(p))
            elif not p.any():
                p.normal_(std=0.1)
    inputs = dict(hidden_states=torch.randn(2, 4, 8, 8), encoder_hidden_states=torch.randn(2, 5, 32),
                  pooled_projections=torch.randn(2, 16), timestep=torch.tensor([10, 500]))  # fmt: skip
    with torch.no_grad():
        ref = output_tensor(model(**inputs))
    before = snapshot(model)
    report = ldmopt.patch(model)
    assert report.counts().get("rms_norm", 0) >= 8, str(report)  # q/k (+ added q/k) norms of both blocks
    with torch.no_grad(), ldmopt.use_backend("triton"):
        out = output_tensor(model(**inputs))
    assert_close(out, ref.double(), torch.float32, "sd3 rms qk-norm")
    ldmopt.unpatch(model)
    assert_same_snapshot(before, snapshot(model))


def test_patched_rms_norm_keeps_stock_behaviour_at_the_edges():
    from diffusers.models.normalization import RMSNorm

    norm = RMSNorm(16, eps=1e-6, elementwise_affine=True, bias=True)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.5 * torch.randn(16))
        norm.bias.copy_(0.1 * torch.randn(16))
    norm.weight.data = norm.weight.data.half()  # a half weight with an fp32 bias: stock's output is fp32
    x = torch.randn(2, 5, 16, dtype=torch.float16)
    stock = norm(x)
    empty = norm(torch.randn(0, 7, 16, dtype=torch.float16))
    nchw = torch.randn(2, 16, 3, 5)  # DC-AE normalises channels through movedim: rows strided in memory
    stock_nchw = norm(nchw.movedim(1, -1)).movedim(-1, 1)
    ldmopt.patch(norm)
    with ldmopt.use_backend("triton"):
        fused = norm(x)
        assert fused.dtype == stock.dtype == torch.float32
        torch.testing.assert_close(fused, stock, atol=2e-3, rtol=2e-3)
        out = norm(torch.randn(0, 7, 16, dtype=torch.float16))
        assert out.shape == empty.shape and out.dtype == empty.dtype  # empty in, empty out, as stock
        patched_nchw = norm(nchw.movedim(1, -1)).movedim(-1, 1)
    assert patched_nchw.stride() == stock_nchw.stride()  # the layout the next conv sees is stock's
    torch.testing.assert_close(patched_nchw, stock_nchw)


def test_strided_columns():
    """Rows whose columns are apart in memory (the op takes any strides; the kernel's column offsets are 64-bit, as
    a channel stride of a huge NCHW tensor times C can pass 2^31, which this small case cannot allocate)."""
    base = torch.randn(3, 8)  # rows of 3, columns 8 apart: x.t() has stride (1, 8)
    x = base.t()
    with ldmopt.use_backend("triton"):
        y = rms_norm(x, None, None, eps=1e-6)
    torch.testing.assert_close(y, _reference(x.double()).float(), atol=1e-5, rtol=1e-5)


def test_rope_per_row_tables_only_without_heads_between():
    """Tables with as many rows as x has rows are read one per row only at rope_dim=-2: with heads between the
    positions and the channels that reading would give the heads of one token different angles."""
    x, tables = torch.randn(1, 4, 3, 8), (torch.ones(12, 4), torch.ones(12, 4))
    with pytest.raises(ValueError, match=r"tables for 12 positions do not match x of shape \(1, 4, 3, 8\)"):
        rms_norm(x, rope=tables, rope_layout="pairs", rope_dim=-3)
    assert rms_norm(x.flatten(1, 2), rope=tables, rope_layout="pairs").shape == (1, 12, 8)
