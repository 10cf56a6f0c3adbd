"""The ``flux_single_gated`` rule: Flux's single-stream block runs ``residual + gate * proj_out(cat([attn, mlp]))`` as
one GEMM that reads the attention output and the MLP activation in place (no concatenation written) with the gated
residual in its epilogue. Against diffusers' own block in fp64, fp32 and fp16, forward and backward."""

import copy

import pytest
import torch
from torch import nn

import ldmopt
from ldmopt.nn.child_check import fallback_reasons
from tests.patch.helpers import DispatchedOps, assert_fused_grads_match_stock, assert_same_snapshot, snapshot
from tests.tolerances import assert_within_torch_error

diffusers = pytest.importorskip("diffusers")
from diffusers.models.transformers.transformer_flux import FluxPosEmbed, FluxSingleTransformerBlock  # noqa: E402

DIM, MLP_RATIO = 48, 2.5  # attention width 48 and MLP width 120 (neither a multiple of the 32-wide K tile)
TEXT, IMAGE = 5, 11


def _block() -> FluxSingleTransformerBlock:
    block = FluxSingleTransformerBlock(DIM, num_attention_heads=2, attention_head_dim=24, mlp_ratio=MLP_RATIO).eval()
    with torch.no_grad():
        for name, p in block.named_parameters():
            if "norm_" in name and name.endswith("weight"):
                p.copy_(1 + 0.5 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5 if p.dim() == 2 else 0.3 * torch.randn_like(p))
    return block


def _inputs(batch=2):
    return [torch.randn(batch, IMAGE, DIM), torch.randn(batch, TEXT, DIM), torch.randn(batch, DIM)]


def _rotary(dtype=torch.float32):
    """Flux's rotary tables (cos, sin) [TEXT + IMAGE, 24] for text ids at 0 and image ids on a 1 x IMAGE grid."""
    ids = torch.zeros(TEXT + IMAGE, 3)
    ids[TEXT:, 2] = torch.arange(IMAGE)
    return tuple(t.to(dtype) for t in FluxPosEmbed(theta=10000, axes_dim=[4, 10, 10])(ids))


def _call(block, hidden, context, temb, rotary=None):
    return block(hidden, context, temb, image_rotary_emb=rotary if rotary is not None else _rotary())


class _ConcatRecorder(torch.utils._python_dispatch.TorchDispatchMode):
    """The widths of every channel concatenation (aten.cat along the last axis)."""

    def __init__(self):
        super().__init__()
        self.widths = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.__name__.startswith("cat") and (args[1] if len(args) > 1 else 0) in (-1, out.dim() - 1):
            self.widths.append(out.shape[-1])
        return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_block_matches_stock_without_the_concatenation(dtype):
    block, inputs = _block(), _inputs()
    with torch.no_grad():
        exact = _call(copy.deepcopy(block).double(), *(t.double() for t in inputs), _rotary(torch.float64))
        low = copy.deepcopy(block).to(dtype)
        low_inputs = [t.to(dtype) for t in inputs]
        with _ConcatRecorder() as theirs:
            stock = _call(low, *low_inputs)
        before = snapshot(low)
        report = ldmopt.patch(low)
        assert report.counts()["flux_single_gated"] == 1, str(report)
        with _ConcatRecorder() as ours, ldmopt.use_backend("triton"):
            fused = _call(low, *low_inputs)
    width = DIM + int(DIM * MLP_RATIO)
    assert width in theirs.widths and width not in ours.widths, (theirs.widths, ours.widths)
    assert not report.fallbacks(), report.fallbacks()
    for name, f, e, s in zip(("context", "image"), fused, exact, stock):
        assert f.dtype == dtype
        assert_within_torch_error(f, e, s, f"flux single block {name} {dtype}")
    ldmopt.unpatch(low)
    assert_same_snapshot(before, snapshot(low))


def test_gradients_match_stock():
    block = _block().train()
    assert_fused_grads_match_stock(block, _call, _inputs(), 2, op="linear")


class _Wrapped(nn.Linear):
    """Stands for a LoRA/quantized projection installed after patching: not a plain nn.Linear."""


def test_wrapped_proj_out_runs_stock_on_the_concatenation():
    block, inputs = _block(), _inputs()
    with torch.no_grad():
        exact = _call(copy.deepcopy(block).double(), *(t.double() for t in inputs), _rotary(torch.float64))
        stock = _call(block, *inputs)
    ldmopt.patch(block)
    wrapped = _Wrapped(block.proj_out.in_features, block.proj_out.out_features)
    wrapped.load_state_dict(block.proj_out.state_dict())
    block.proj_out = wrapped
    fallback_reasons.clear()
    with torch.no_grad(), ldmopt.use_backend("triton"):
        fused = _call(block, *inputs)
    assert any("proj_out" in r for r in fallback_reasons), list(fallback_reasons)
    for f, e, s in zip(fused, exact, stock):
        assert_within_torch_error(f, e, s, "wrapped proj_out")


def test_block_reads_the_previous_blocks_halves_in_place():
    """FluxTransformer2DModel hands each single block the previous one's output split into [:, :text] and
    [:, text:] views: patched, the block reads that tensor in place instead of concatenating the views again (no
    grad asked), and gives the stock result."""
    block = _block()
    hidden, context, temb = _inputs()
    with torch.no_grad():
        text, image = _call(block, hidden, context, temb)  # the halves of one tensor, as the model passes them
        ref = _call(block, image, text, temb)
        ldmopt.patch(block)
        with ldmopt.use_backend("triton"), DispatchedOps() as ops:
            out = _call(block, image, text, temb)
    assert ops.shapes("aten.cat").count((2, TEXT + IMAGE, DIM)) == 0, ops.shapes("aten.cat")
    for got, want in zip(out, ref):
        assert_within_torch_error(got, want.double(), want, "halves read in place")
    with ldmopt.use_backend("triton"), DispatchedOps() as ops:  # with a gradient asked: the concatenation
        out = _call(block, image.requires_grad_(), text, temb)
    assert ops.shapes("aten.cat").count((2, TEXT + IMAGE, DIM)) == 1


def test_adjacent_halves_only_for_the_halves_of_one_tensor():
    from ldmopt.patch.rules_blocks import adjacent_halves

    joint = torch.randn(2, 7, 6)
    first, second = joint[:, :3], joint[:, 3:]
    view = adjacent_halves(first, second)
    assert view is not None and view.data_ptr() == joint.data_ptr() and torch.equal(view, joint)
    assert adjacent_halves(second, first) is None  # the wrong order
    assert adjacent_halves(first, joint[:, 4:]) is None  # a gap
    assert adjacent_halves(first, second.clone()) is None  # another tensor
    assert adjacent_halves(joint[:, :3, :5], joint[:, 3:, :5]) is not None  # strided columns: still one tensor
    assert adjacent_halves(joint[:1, :3], joint[1:, 3:]) is None  # other samples
    assert adjacent_halves(first, second.half()) is None
    assert adjacent_halves(joint.requires_grad_()[:, :3], joint[:, 3:]) is None  # autograd: concatenate
    with torch.no_grad():
        assert adjacent_halves(joint[:, :3], joint[:, 3:]) is not None

        class Sub(torch.Tensor):  # a subclass (DTensor, a quantized wrapper): no storage to compare, concatenate
            pass

        plain = torch.randn(2, 7, 6)
        assert adjacent_halves(plain[:, :3].as_subclass(Sub), plain[:, 3:].as_subclass(Sub)) is None


def _assert_clipped_like_stock(fused, stock, name):
    """fp16 outputs where the stock block clipped its stream to +-65504: the same saturated values there (the fused
    epilogue clamps before its rounding), close elsewhere, no inf."""
    clipped = stock.abs() == 65504
    assert clipped.any(), f"{name}: the case must saturate"
    assert torch.isfinite(fused).all() and torch.equal(fused[clipped], stock[clipped]), name
    scale = stock.abs().max().item()
    err = (fused[~clipped].double() - stock[~clipped].double()).abs().max().item()
    assert err <= 2e-3 * scale, f"{name}: {err:.3g} of {scale:.3g}"


def test_fp16_clip_in_the_epilogue():
    """diffusers clips the fp16 stream after proj_out's gated residual; patched, the epilogue clamps before it rounds:
    no clamp pass, the same saturated values."""
    block = _block().half()
    hidden, context, temb = (t.half() for t in _inputs())
    hidden[:, :3] = 6.55e4  # the residual at the top of fp16's range: gate * proj_out pushes some past it
    context[0, 1] = -6.55e4
    with torch.no_grad():
        stock = _call(block, hidden, context, temb, _rotary(torch.float16))
        ldmopt.patch(block)
        with ldmopt.use_backend("triton"), DispatchedOps() as ops:
            fused = _call(block, hidden, context, temb, _rotary(torch.float16))
    assert not ops.shapes("aten.clamp"), ops.shapes("aten.clamp")
    for name, f, s in zip(("context", "image"), fused, stock):
        _assert_clipped_like_stock(f, s, f"single block {name}")
