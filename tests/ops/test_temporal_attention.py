"""ldmopt.ops.temporal_attention: Triton kernels (interpreter) and the reference backend against fp64 SDPA.

Layouts: "diffusers" is the processor's (B*N, F, C) activation viewed as (B*N, F, 1, H, D); "bfnc" is the
permute-free (B, F, N, C) order viewed as (B, F, N, H, D); "packed" slices q, k, v out of a fused to_qkv output
(B*N, F, 3C) viewed as (B*N, F, 3, H, D).
"""

import pytest
import torch
import torch.nn.functional as F

import ldmopt
from ldmopt.ops.temporal_attention import MAX_FRAMES, temporal_attention
from tests.tolerances import assert_close, assert_within_torch_error

# (batch, F, N, heads, head_dim, layout): every F in {1, 7, 14, 16, 25, 64}, head_dim in {40, 64, 72, 80, 160},
# heads 1..8 and batches 1..37 appear at least once, each layout with at least two of them.
CASES = [
    (37, 1, 1, 1, 40, "diffusers"),  # a single frame: softmax over one key; batch 37
    (2, 7, 3, 3, 72, "bfnc"),  # 7 frames pad to 16 rows; Latte head_dim 72 in chunks of 16
    (1, 14, 5, 5, 64, "packed"),  # SVD: 14 frames, 5 heads of 64, fused QKV
    (3, 16, 2, 8, 40, "bfnc"),  # AnimateDiff level 1: 8 heads of 40, 48 sequences = 12 programs of 4
    (1, 25, 2, 2, 80, "diffusers"),  # SVD-XT frames: 25 pad to 32, one sequence per program
    (1, 64, 1, 1, 160, "packed"),  # longest sequence with the widest real head
    (5, 16, 1, 4, 160, "diffusers"),  # AnimateDiff level 3 head_dim 160 in chunks of 32
    (2, 14, 3, 6, 80, "packed"),  # 36 sequences: the last program is partly masked
]
DTYPES = [torch.float32, torch.float16]


def _make(batch, f, n, h, d, layout, dtype, requires_grad=False):
    c = h * d
    if layout == "diffusers":
        xs = [torch.randn(batch * n, f, c, dtype=torch.float64) for _ in range(3)]
        qkv = [x.to(dtype).view(batch * n, f, 1, h, d) for x in xs]
    elif layout == "bfnc":
        xs = [torch.randn(batch, f, n, c, dtype=torch.float64) for _ in range(3)]
        qkv = [x.to(dtype).view(batch, f, n, h, d) for x in xs]
    else:
        packed = torch.randn(batch * n, f, 3 * c, dtype=torch.float64).to(dtype).view(batch * n, f, 3, h, d)
        qkv = [packed[:, :, i : i + 1] for i in range(3)]
    # Scores of O(3) so the softmax is neither uniform nor one-hot.
    qkv[0] = qkv[0] * 1.5
    if requires_grad:
        return [t.detach().clone().requires_grad_() if layout != "packed" else t for t in qkv]
    return qkv


def _sdpa(q, k, v, scale=None):
    """F.scaled_dot_product_attention over dim 1 of (B, F, N, H, D) tensors."""
    to_bnhfd = [t.permute(0, 2, 3, 1, 4) for t in (q, k, v)]
    return F.scaled_dot_product_attention(*to_bnhfd, scale=scale).permute(0, 3, 1, 2, 4)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("dtype", DTYPES)
def test_forward_triton(case, dtype):
    q, k, v = _make(*case, dtype)
    with ldmopt.use_backend("triton"):
        out = temporal_attention(q, k, v)
    assert out.shape == q.shape and out.dtype == dtype
    ref = _sdpa(q.double(), k.double(), v.double())
    lowp = _sdpa(q, k, v)
    assert_within_torch_error(out, ref, lowp, f"out {case} {dtype}")


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("dtype", DTYPES)
def test_backward_triton(case, dtype):
    batch, f, n, h, d, layout = case
    if layout == "packed":
        base = torch.randn(batch * n, f, 3 * h * d, dtype=torch.float64).to(dtype).requires_grad_()
        leaves = [base]
        q, k, v = (base.view(batch * n, f, 3, h, d)[:, :, i : i + 1] for i in range(3))
    else:
        q, k, v = leaves = _make(*case, dtype, requires_grad=True)
    dout = torch.randn(q.shape, dtype=dtype)
    with ldmopt.use_backend("triton"):
        temporal_attention(q, k, v).backward(dout)
    grads = [t.grad for t in leaves]

    def reference(cast):
        ref_leaves = [t.detach().to(cast).requires_grad_() for t in leaves]
        if layout == "packed":
            qkv = [ref_leaves[0].view(batch * n, f, 3, h, d)[:, :, i : i + 1] for i in range(3)]
        else:
            qkv = ref_leaves
        _sdpa(*qkv).backward(dout.to(cast))
        return [t.grad for t in ref_leaves]

    for i, (got, ref, lowp) in enumerate(zip(grads, reference(torch.float64), reference(dtype))):
        assert got.dtype == dtype and got.shape == leaves[i].shape
        assert_within_torch_error(got, ref, lowp, f"grad {i} {case} {dtype}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_large_logits(dtype):
    # Scaled scores up to about 50 (q.k near 400): a peaked but finite softmax, forward and backward, as SDPA's.
    q, k, v = _make(1, 14, 3, 2, 64, "bfnc", torch.float64)
    leaves = [t.to(dtype).requires_grad_() for t in (4 * q, 4 * k, v)]
    dout = torch.randn(leaves[0].shape, dtype=dtype)
    with ldmopt.use_backend("triton"):
        out = temporal_attention(*leaves)
        out.backward(dout)
    results = {}
    for cast in (torch.float64, dtype):
        ref_leaves = [t.detach().to(cast).requires_grad_() for t in leaves]
        ref_out = _sdpa(*ref_leaves)
        ref_out.backward(dout.to(cast))
        results[cast] = (ref_out.detach(), [t.grad for t in ref_leaves])
    (exact, exact_grads), (lowp, lowp_grads) = results[torch.float64], results[dtype]
    assert out.isfinite().all()
    assert_within_torch_error(out, exact, lowp, f"large logits {dtype}")
    for name, got, want, torch_error in zip("qkv", leaves, exact_grads, lowp_grads):
        assert_within_torch_error(got.grad, want, torch_error, f"d{name}, large logits {dtype}")


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_scale_honoured(backend):
    q, k, v = _make(2, 7, 3, 2, 40, "bfnc", torch.float32)
    with ldmopt.use_backend(backend):
        out = temporal_attention(q, k, v, scale=0.37)
    assert_close(out, _sdpa(q.double(), k.double(), v.double(), scale=0.37), torch.float32, f"scale {backend}")


@pytest.mark.parametrize("layout", ["diffusers", "bfnc", "packed"])
def test_reference_backend_matches_fp64(layout):
    q, k, v = _make(2, 14, 3, 2, 72, layout, torch.float32)
    with ldmopt.use_backend("torch"):
        out = temporal_attention(q, k, v)
    assert_close(out, _sdpa(q.double(), k.double(), v.double()), torch.float32, "torch backend")


def test_gradcheck_reference_fp64():
    q, k, v = _make(1, 4, 2, 1, 6, "bfnc", torch.float64, requires_grad=True)
    with ldmopt.use_backend("torch"):
        assert torch.autograd.gradcheck(lambda q, k, v: temporal_attention(q, k, v, scale=0.6), (q, k, v))


def test_output_layout_is_empty_like_q():
    for layout in ("diffusers", "bfnc"):
        q, k, v = _make(2, 7, 3, 2, 40, layout, torch.float32)
        assert temporal_attention(q, k, v).stride() == q.stride()
    q, k, v = _make(2, 7, 3, 2, 40, "packed", torch.float32)
    out = temporal_attention(q, k, v)
    # A slice of packed qkv is not dense: the result is contiguous (B*N, F, 1, H, D), i.e. (B*N, F, C) for to_out.
    assert out.is_contiguous() and out.view(6, 7, 80).data_ptr() == out.data_ptr()


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_out_written_in_caller_layout(backend):
    q, k, v = _make(2, 16, 3, 4, 40, "diffusers", torch.float16)
    # The caller wants (F, B*N, H, D) order in memory, e.g. to feed a frame-major consumer.
    storage = torch.full((16, 6, 4, 40), float("nan"), dtype=torch.float16)
    out = storage.permute(1, 0, 2, 3).unsqueeze(2)
    with ldmopt.use_backend(backend):
        result = temporal_attention(q, k, v, out=out)
    assert result is out
    assert_within_torch_error(out, _sdpa(q.double(), k.double(), v.double()), _sdpa(q, k, v), f"out= {backend}")


def test_out_refuses_autograd():
    q, k, v = _make(1, 7, 2, 2, 40, "bfnc", torch.float32, requires_grad=True)
    with pytest.raises(RuntimeError, match=r"out=.*does not support automatic differentiation"):
        temporal_attention(q, k, v, out=torch.empty(q.shape))


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_autocast_casts_mixed_operands_as_sdpa(backend):
    """fp32 q/k (from a per-head norm) beside an fp16 v under autocast: cast to fp16 as SDPA casts them, not refused."""
    q, k = torch.randn(2, 5, 3, 2, 8), torch.randn(2, 5, 3, 2, 8)
    v = torch.randn(2, 5, 3, 2, 8, dtype=torch.float16)
    with torch.autocast("cpu", dtype=torch.float16), ldmopt.use_backend(backend):
        out = temporal_attention(q, k, v)
        ref = _sdpa(q, k, v)
    assert out.dtype == ref.dtype == torch.float16
    expected = _sdpa(q.half().double(), k.half().double(), v.double())
    assert_within_torch_error(out, expected, ref, "autocast")


def test_grid_limit_is_not_reached():
    from ldmopt.kernels.temporal_attention import launch_grid

    # 262,144 sequences x 8 heads (8x AnimateDiff-SDXL 1024px's 32,768 x 8): one grid axis, no 65,535 cap.
    for f, d in ((16, 40), (16, 80), (16, 160), (64, 64)):
        grid = launch_grid(262_144 * 8, f, d)
        assert len(grid) == 1 and 65_535 < grid[0] <= 2**31 - 1, (f, d, grid)
    with pytest.raises(ValueError, match="over grid axis 0's limit"):
        launch_grid(2**33, 64, 64)


def test_many_sequences_one_program_each_head():
    # More sequences x heads than a y/z grid axis could hold would need a GPU; here every (b, n, h) index of an odd
    # batch lands in exactly one program: poisoned outputs would show as NaN.
    q, k, v = _make(13, 3, 5, 3, 16, "bfnc", torch.float32)
    with ldmopt.use_backend("triton"):
        out = temporal_attention(q, k, v)
    assert_close(out, _sdpa(q.double(), k.double(), v.double()), torch.float32, "195 sequences")


@pytest.mark.parametrize(
    "f, d, limit",
    [(MAX_FRAMES + 1, 16, f"F={MAX_FRAMES + 1} frames"), (4, 264, "head_dim=264")],  # past the kernels' F or head_dim
)
def test_sizes_past_the_kernels_fall_back_to_reference(f, d, limit):
    q, k, v = _make(1, f, 2, 1, d, "bfnc", torch.float32)
    ldmopt.ops.backend_counts.clear()
    out = temporal_attention(q, k, v)
    assert ldmopt.ops.backend_counts[("temporal_attention", "torch")] == 1
    assert_close(out, _sdpa(q.double(), k.double(), v.double()), torch.float32, limit)
    with pytest.raises(ldmopt.BackendUnavailableError, match=limit), ldmopt.use_backend("triton"):
        temporal_attention(q, k, v)


def test_forced_backend_that_cannot_serve_raises_with_reasons():
    q, k, v = _make(1, 7, 2, 2, 16, "bfnc", torch.float64)
    with (
        pytest.raises(ldmopt.BackendUnavailableError, match=r"'triton' was forced.*float64"),
        ldmopt.use_backend("triton"),
    ):
        temporal_attention(q, k, v)
    with pytest.raises(ldmopt.BackendUnavailableError, match="'cuda' was forced"), ldmopt.use_backend("cuda"):
        temporal_attention(q.float(), k.float(), v.float())


def test_automatic_choice_uses_triton_under_interpreter():
    ldmopt.ops.backend_counts.clear()
    q, k, v = _make(1, 7, 2, 2, 40, "bfnc", torch.float32, requires_grad=True)
    temporal_attention(q, k, v).sum().backward()
    assert ldmopt.ops.backend_counts[("temporal_attention", "triton")] == 1
    assert ldmopt.ops.backend_counts[("temporal_attention_backward", "triton")] == 1


_X = torch.randn(2, 7, 3, 2, 8)


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: temporal_attention(_X[0], _X[0], _X[0]), "q must have 5 dims"),
        (lambda: temporal_attention(_X, _X[:, :5], _X), r"k has shape \(2, 5, 3, 2, 8\) but q has"),
        (lambda: temporal_attention(_X, _X, _X.half()), "v has dtype torch.float16 but q has torch.float32"),
        (lambda: temporal_attention(_X.long(), _X, _X), "q has dtype torch.int64"),
        (lambda: temporal_attention(_X[:0], _X[:0], _X[:0]), "q is empty"),
        (lambda: temporal_attention(_X, _X, _X, scale="0.5"), "scale must be a float or None"),
        (lambda: temporal_attention(_X, _X, _X, out=torch.empty(2, 7, 3, 2, 9)), r"out has shape \(2, 7, 3, 2, 9\)"),
        # a stride-0 axis: several outputs in one location, which a kernel writing each once would race on
        (
            lambda: temporal_attention(_X, _X, _X, out=torch.empty(2, 7, 1, 2, 8).expand(_X.shape)),
            r"out \(strides \(112, 16, 0, 8, 1\)\) has elements that share memory",
        ),
    ],
)
def test_bad_input_messages(call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call()


def test_opcheck():
    q, k, v = _make(2, 7, 3, 2, 40, "packed", torch.float32)
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    torch.library.opcheck(torch.ops.ldmopt.temporal_attention_fwd, (qg, kg, vg, 0.3))
    torch.library.opcheck(torch.ops.ldmopt.temporal_attention_fwd, (q, k, v, 0.3))
    dout = torch.randn(q.shape)
    torch.library.opcheck(torch.ops.ldmopt.temporal_attention_bwd, (dout, q, k, v, 0.3))
    out = torch.empty(q.shape).transpose(0, 1).contiguous().transpose(0, 1)
    torch.library.opcheck(torch.ops.ldmopt.temporal_attention_fwd_out, (q, k, v, 0.3, out))


class _TemporalSelfAttention(torch.nn.Module):
    """Fused QKV projection, strided attention over frames, output projection: the processor's path."""

    def __init__(self, c=32, heads=2):
        super().__init__()
        self.heads = heads
        self.to_qkv = torch.nn.Linear(c, 3 * c)
        self.to_out = torch.nn.Linear(c, c)

    def forward(self, x):
        bn, f, c = x.shape
        qkv = self.to_qkv(x).view(bn, f, 3, self.heads, c // self.heads)
        out = temporal_attention(qkv[:, :, 0:1], qkv[:, :, 1:2], qkv[:, :, 2:3])
        return self.to_out(out.view(bn, f, c))


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_torch_compile_fullgraph(backend):
    torch._dynamo.reset()
    module = _TemporalSelfAttention()
    x = torch.randn(6, 7, 32, requires_grad=True)
    compiled = torch.compile(module, backend=backend, fullgraph=True)
    out = compiled(x)
    out.sum().backward()
    grad_compiled = x.grad.clone()
    x.grad = None
    eager = module(x)
    eager.sum().backward()
    assert_close(out, eager.detach().double(), torch.float32, "compiled forward")
    assert_close(grad_compiled, x.grad.double(), torch.float32, "compiled backward")


def test_row_alignment_divides_every_stride():
    from ldmopt.kernels.temporal_attention import row_alignment

    def diffusers(d, heads, dtype, f=16):
        return torch.empty(6, f, heads * d, dtype=dtype).view(6, f, 1, heads, d)

    assert row_alignment(diffusers(40, 8, torch.float16)) == 8  # 16 bytes: AnimateDiff's head dim 40
    assert row_alignment(diffusers(72, 16, torch.bfloat16)) == 8  # Latte
    assert row_alignment(diffusers(40, 8, torch.float32)) == 4
    assert row_alignment(diffusers(20, 3, torch.float16)) == 4  # head stride 20
    assert row_alignment(diffusers(7, 3, torch.float16)) == 1  # no hint at all
    packed = torch.empty(6, 16, 3 * 320, dtype=torch.float16).view(6, 16, 3, 8, 40)
    assert row_alignment(*(packed[:, :, i : i + 1] for i in range(3))) == 8  # q, k, v of a fused to_qkv output
    odd_frames = torch.empty(6, 16, 8 * 40 + 2, dtype=torch.float16)[:, :, : 8 * 40].view(6, 16, 1, 8, 40)
    assert row_alignment(odd_frames) == 2  # frame stride 322: the weakest stride decides
    assert row_alignment(diffusers(40, 8, torch.float16), odd_frames) == 2


def test_aot_specs_compile_what_runs():
    # The AOT gate's hints must hold for real activations, or it checks a variant no launch uses (a head stride of 40
    # once counted as a multiple of 16 there, hiding scalar loads): every argument a spec marks divisible by 16 is,
    # and its ALIGN is what the launcher computes.
    from ldmopt.kernels.temporal_attention import aot_specs, row_alignment

    channels = {40: 320, 64: 320, 72: 1152, 80: 640, 160: 1280}
    dtypes = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
    for spec in aot_specs():
        d = spec["constexprs"]["D"]
        dtype = dtypes[spec["name"].rsplit(",", 1)[1].rstrip("]")]
        view = torch.empty(4, spec["constexprs"]["BLOCK_F"], channels[d], dtype=dtype)
        view = view.view(4, view.shape[1], 1, channels[d] // d, d)
        strides = dict(zip("bfnhd", view.stride(), strict=True))
        for name in spec["divisible_by_16"]:
            if name.startswith("stride_"):
                assert strides[name[-1]] % 16 == 0, f"{spec['name']}: {name}={strides[name[-1]]} is marked %16"
        assert spec["constexprs"]["ALIGN"] == row_alignment(view), spec["name"]


def _mixed_layouts(dtype, bases=None):
    """q, k, v of one (B, F, N, H, D) = (2, 7, 3, 2, 40) shape in three layouts: the permute-free (B, F, N, C), a
    view of diffusers' (B*N, F, C) and a slice of a packed (B*N, F, 3C) qkv; each with its own strides."""
    if bases is None:
        bases = [torch.randn(2, 7, 3, 80), torch.randn(6, 7, 80), torch.randn(6, 7, 240)]
        bases = [(1.5 * b if i == 0 else b).to(dtype).requires_grad_() for i, b in enumerate(bases)]
    q = bases[0].view(2, 7, 3, 2, 40)
    k = bases[1].view(2, 3, 7, 2, 40).transpose(1, 2)
    v = bases[2].view(2, 3, 7, 3, 2, 40)[:, :, :, 2].transpose(1, 2)
    return bases, (q, k, v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_q_k_v_in_three_different_layouts(dtype):
    # Each operand read with its own strides, forward and backward (the test layouts above give k and v one layout).
    bases, (q, k, v) = _mixed_layouts(dtype)
    assert len({t.stride() for t in (q, k, v)}) == 3
    dout = torch.randn(q.shape, dtype=dtype)
    with ldmopt.use_backend("triton"):
        out = temporal_attention(q, k, v)
        out.backward(dout)
    for compute in (torch.float64, torch.float32):
        ref_bases = [b.detach().to(compute).requires_grad_() for b in bases]
        _, ref_qkv = _mixed_layouts(compute, ref_bases)
        ref_out = _sdpa(*ref_qkv)
        ref_out.backward(dout.to(compute))
        if compute == torch.float64:
            exact, exact_grads = ref_out.detach(), [b.grad for b in ref_bases]
        else:
            lowp, lowp_grads = ref_out.detach().to(dtype), [b.grad.to(dtype) for b in ref_bases]
    assert_within_torch_error(out, exact, lowp, f"mixed layouts {dtype}")
    for name, base, want, torch_error in zip("qkv", bases, exact_grads, lowp_grads):
        assert_within_torch_error(base.grad, want, torch_error, f"d{name}, mixed layouts {dtype}")
