"""``ldmopt::layer_norm_apply`` (internal: the A operand the LayerNorm-in-loads GEMMs' backward recomputes) and that
backward as a whole: the Triton interpreter against F.layer_norm in fp64 (odd widths, strided rows, positions per
frame, no affine), the reference backend's refusals, opcheck, and the GEMM backward running one pass for h and one
for the LayerNorm's input gradients instead of an eager composition."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import ldmopt
from ldmopt.ops import backend_counts
from ldmopt.ops.layer_norm_apply import APPLY, layer_norm_apply
from ldmopt.ops.layer_norm_linear import layer_norm_linear, layer_norm_stats
from tests.tolerances import assert_within_torch_error

EPS = 1e-5


def _case(m, c, dtype, *, affine=True, positions=0):
    x = (torch.randn(m, c, dtype=torch.float64) * 1.7 + 0.4).to(dtype)
    w = (torch.randn(c, dtype=torch.float64) * 0.5 + 1.0).to(dtype) if affine else None
    b = (torch.randn(c, dtype=torch.float64) * 0.5).to(dtype) if affine else None
    table = torch.randn(positions, c, dtype=torch.float64).to(dtype) if positions else None
    return x, w, b, table


def _expect(x, w, b, table, position_rows, dtype):
    def run(cd):
        h = F.layer_norm(x.to(cd), (x.shape[1],), None if w is None else w.to(cd), None if b is None else b.to(cd), EPS)
        if table is not None:
            index = torch.arange(x.shape[0]) // position_rows % table.shape[0]
            h = h + table.to(cd)[index]
        return h

    return run(torch.float64), run(torch.float32).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize(("affine", "positions"), [(True, 0), (False, 0), (True, 3)])
def test_matches_layer_norm(backend, dtype, affine, positions):
    x, w, b, table = _case(37, 72, dtype, affine=affine, positions=positions)
    stats = layer_norm_stats(x, EPS)
    with ldmopt.use_backend(backend):
        h = layer_norm_apply(x, stats, w, b, table, 5, dtype)
    ref, lowp = _expect(x, w, b, table, 5, dtype)
    assert h.dtype == dtype and h.shape == x.shape and h.is_contiguous()
    assert_within_torch_error(h, ref, lowp, f"layer_norm_apply {backend} {dtype} affine={affine} P={positions}")


def test_strided_rows_and_another_output_dtype():
    base, w, b, _ = _case(19, 96, torch.float32)
    x = base[:, 10:50]  # rows 96 apart, 40 wide
    stats = layer_norm_stats(x, EPS)
    with ldmopt.use_backend("triton"):
        h = layer_norm_apply(x, stats, w[:40], b[:40], None, 1, torch.float16)
    ref, lowp = _expect(x, w[:40], b[:40], None, 1, torch.float16)
    assert_within_torch_error(h, ref, lowp, "strided rows to fp16")


def test_refusals_name_their_reason_and_fall_back():
    x, w, b, _ = _case(6, 24, torch.float64)
    stats = layer_norm_stats(x, EPS)  # fp64 statistics for fp64 rows
    before = backend_counts[("layer_norm_apply", "torch")]
    h = layer_norm_apply(x, stats, w, b, None, 1, torch.float64)
    assert backend_counts[("layer_norm_apply", "torch")] == before + 1
    torch.testing.assert_close(h, F.layer_norm(x, (24,), w, b, EPS))
    (triton,) = [backend for backend in APPLY.backends if backend.name == "triton"]
    reasons = triton.refuse(x, stats, w, b, None, 1, torch.float64)
    assert any("float64" in reason for reason in reasons), reasons
    with ldmopt.use_backend("triton"), pytest.raises(ldmopt.BackendUnavailableError, match="float64"):
        layer_norm_apply(x, stats, w, b, None, 1, torch.float64)
    with pytest.raises(ValueError, match=r"stats \[2, M\]"):
        layer_norm_apply(x, stats[:, :3], w, b, None, 1, torch.float64)


def test_opcheck():
    x, w, b, table = _case(10, 24, torch.float32, positions=2)
    stats = layer_norm_stats(x, EPS)
    torch.library.opcheck(torch.ops.ldmopt.layer_norm_apply.default, (x, stats, w, b, table, 5, torch.float16))


class _OpLog(TorchDispatchMode):
    """Names of the operators run, and of those writing a tensor of ``size`` elements (a pass over the rows)."""

    def __init__(self, size: int):
        super().__init__()
        self.size = size
        self.names, self.row_passes = [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.names.append(func._schema.name)
        first = out[0] if isinstance(out, (tuple, list)) else out
        if isinstance(first, torch.Tensor) and first.numel() == self.size and not func.is_view:
            self.row_passes.append(func._schema.name)
        return out


@pytest.mark.parametrize("act", [None, "geglu"])
def test_gemm_backward_runs_the_norm_in_two_passes(act):
    """The LayerNorm-in-loads GEMM's backward: dH and dW GEMMs, one pass recomputing h, one pass for the norm's input
    and affine gradients; no eager elementwise chain over the [M, K] rows (that took ~20 fp32 passes)."""
    m, k, n = 30, 40, 24
    x = torch.randn(m, k, requires_grad=True)
    nw = (torch.randn(k) * 0.3 + 1).requires_grad_()
    nb = torch.randn(k, requires_grad=True)
    w = torch.randn(2 * n if act == "geglu" else n, k, requires_grad=True)
    with ldmopt.use_backend("triton"):
        y = layer_norm_linear(x, nw, nb, w, None, eps=EPS, activation=act)
        dy = torch.randn_like(y)
        log = _OpLog(m * k)
        with log:
            y.backward(dy)
    # h recomputed, dH = dz W, the norm's input gradient: nothing else writes a [M, K] tensor
    assert sorted(log.row_passes) == ["aten::mm", "ldmopt::adaln_modulate_bwd", "ldmopt::layer_norm_apply"], log.names
    ref = [t.detach().double().requires_grad_() for t in (x, nw, nb, w)]
    h = F.layer_norm(ref[0], (k,), ref[1], ref[2], EPS) @ ref[3].t()
    if act == "geglu":
        value, gate = h.chunk(2, dim=-1)
        h = value * F.gelu(gate)
    # values: against autograd of the fp64 composition with the same upstream gradient
    dy = torch.randn(m, n, dtype=torch.float64)
    for t in (x, nw, nb, w):
        t.grad = None
    with ldmopt.use_backend("triton"):
        layer_norm_linear(x, nw, nb, w, None, eps=EPS, activation=act).backward(dy.float())
    expect = torch.autograd.grad(h, ref, dy)
    for name, got, want in zip(("dx", "dnorm_weight", "dnorm_bias", "dweight"), (x, nw, nb, w), expect):
        torch.testing.assert_close(got.grad.double(), want, rtol=2e-4, atol=2e-4, msg=name)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_gemm_backward_keeps_tiny_norm_weights_exact(backend):
    # The norm's weight is multiplied as it is: passing w - 1 to adaLN's "1 + scale" would round a weight of 1e-6 to
    # a few ulp of 1 in fp32 (dx 3% off).
    m, k, n = 12, 40, 8
    x = torch.randn(m, k, requires_grad=True)
    nw = (torch.rand(k) * 1e-6 + 1e-7).requires_grad_()
    nb = torch.randn(k, requires_grad=True)
    w = torch.randn(n, k, requires_grad=True)
    dy = torch.randn(m, n)
    with ldmopt.use_backend(backend):
        layer_norm_linear(x, nw, nb, w, None, eps=EPS).backward(dy)
    ref = [t.detach().double().requires_grad_() for t in (x, nw, nb, w)]
    (F.layer_norm(ref[0], (k,), ref[1], ref[2], EPS) @ ref[3].t()).backward(dy.double())
    for name, got, want in zip(("dx", "dnorm_weight"), (x, nw), ref):
        err = ((got.grad.double() - want.grad).abs().max() / want.grad.abs().max()).item()
        assert err < 1e-5, f"{name} {backend}: relative error {err:.2e}"


def test_adaln_backward_opcheck_with_the_weight_as_scale():
    x, w, _, _ = _case(10, 24, torch.float32)
    stats = layer_norm_stats(x, EPS)
    args = (torch.randn(10, 24), x, stats[0].contiguous(), stats[1].contiguous(), w[None], None, None, None, True)
    torch.library.opcheck(torch.ops.ldmopt.adaln_modulate_bwd.default, args)


def test_torch_compile_fullgraph():
    x, w, b, table = _case(23, 40, torch.float32, positions=3)
    stats = layer_norm_stats(x, EPS)
    compiled = torch.compile(lambda *a: layer_norm_apply(*a, 5, torch.float16), fullgraph=True, backend="aot_eager")
    with ldmopt.use_backend("triton"):
        h = compiled(x, stats, w, b, table)
    ref, lowp = _expect(x, w, b, table, 5, torch.float16)
    assert_within_torch_error(h, ref, lowp, "compiled")
