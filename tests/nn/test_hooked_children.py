"""Children that ldmopt.nn's fused paths compute themselves (instead of calling their forward) with hooks attached:
forward hooks, forward pre-hooks, or a forward wrapped on the instance (accelerate's offload and diffusers' cache /
layer-skip hooks wrap ``module.forward``). The fused module must then run the stock forward, so that its output and
every hook's call count equal diffusers' own (each hook here changes the output, so a skipped one is visible), and
take the fused path again once the hook is gone. Also: a batch-1 ``temb``, which diffusers' ResnetBlock2D broadcasts
over the batch. Tiny random-weight diffusers modules, Triton interpreter."""

import copy

import pytest
import torch

import ldmopt
from ldmopt.nn import resnet
from ldmopt.nn import temporal_layout as L
from ldmopt.nn.child_check import fallback_reasons as child_fallbacks
from ldmopt.nn.resnet import FusedResnetBlock2D, can_fuse, fused_resnet_forward
from ldmopt.nn.temporal_layout import install_temporal_blocks, uninstall_temporal_blocks
from ldmopt.nn.temporal_resnet import fused_spatiotemporal_forward, spatiotemporal_reasons
from tests.tolerances import assert_close, assert_within_torch_error

diffusers = pytest.importorskip("diffusers")

# The report's words for a hooked child that a fused path computes itself (written out: the test checks them).
BYPASSED = "has hooks (forward, backward or global) or a wrapped forward the fused path would bypass"
FRAMES = 4


def _attach(module: torch.nn.Module, kind: str, calls: list) -> object:
    """A hook of ``kind`` on ``module`` that counts its calls in ``calls`` and changes what the module computes;
    returns what undoes it."""
    if kind == "forward_hook":
        return module.register_forward_hook(lambda m, args, out: calls.append(1) or out * 0.5 + 0.25)
    if kind == "pre_hook":
        return module.register_forward_pre_hook(lambda m, args: calls.append(1) or (args[0] * 0.5 + 0.25, *args[1:]))
    assert kind == "wrapped"  # what accelerate's add_hook_to_module and diffusers' HookRegistry do

    original = module.forward

    def forward(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs) * 0.5 + 0.25

    module.forward = forward

    class _Undo:
        def remove(self):
            del module.forward

    return _Undo()


def _stock_and_hooked(base: torch.nn.Module, target: str, kind: str):
    """Two copies of ``base`` with the same hook on ``target``: (stock copy, its calls, copy for ldmopt, its calls,
    the handle of the latter's hook)."""
    stock, ours = copy.deepcopy(base), copy.deepcopy(base)
    stock_calls, our_calls = [], []
    _attach(stock.get_submodule(target), kind, stock_calls)
    handle = _attach(ours.get_submodule(target), kind, our_calls)
    return stock, stock_calls, ours, our_calls, handle


# ------------------------------------------------------------------------------------------------ temporal containers


def _animatediff():
    from diffusers.models.unets.unet_motion_model import AnimateDiffTransformer3D

    return AnimateDiffTransformer3D(
        num_attention_heads=2, attention_head_dim=8, in_channels=16, norm_num_groups=4, double_self_attention=True,
        positional_embeddings="sinusoidal", num_positional_embeddings=8,
    ).eval()  # fmt: skip


def _modelscope():
    from diffusers.models.transformers.transformer_temporal import TransformerTemporalModel

    return TransformerTemporalModel(
        num_attention_heads=2, attention_head_dim=8, in_channels=16, norm_num_groups=4
    ).eval()


def _container_out(container, x):
    out = container(x, num_frames=FRAMES)
    return out if isinstance(out, torch.Tensor) else out.sample


CONTAINER_CASES = [
    ("animatediff", "transformer_blocks.0", "forward_hook"),
    ("animatediff", "transformer_blocks.0.attn1", "wrapped"),
    ("animatediff", "transformer_blocks.0.attn2", "pre_hook"),
    ("animatediff", "transformer_blocks.0.pos_embed", "forward_hook"),
    ("animatediff", "transformer_blocks.0.pos_embed", "wrapped"),  # accelerate's offload of the pe buffer
    ("modelscope", "transformer_blocks.0.attn1", "forward_hook"),
    ("modelscope", "transformer_blocks.0", "wrapped"),
]


@pytest.mark.parametrize("family,target,kind", CONTAINER_CASES)
def test_container_runs_stock_while_a_bypassed_child_is_hooked(family, target, kind):
    base = _animatediff() if family == "animatediff" else _modelscope()
    stock, stock_calls, ours, our_calls, _ = _stock_and_hooked(base, target, kind)
    x = torch.randn(2 * FRAMES, 16, 3, 3).contiguous(memory_format=torch.channels_last)
    L.fallback_reasons.clear()
    with torch.no_grad():
        expected = _container_out(stock, x)
        install = install_temporal_blocks(ours)
        assert list(install.forwards) == [""], install.skipped  # hooks are checked per call, not at install
        got = _container_out(ours, x)
    assert len(stock_calls) >= 1 and len(our_calls) == len(stock_calls), (len(stock_calls), len(our_calls))
    assert torch.equal(got, expected)
    reason = f"{target} {BYPASSED}"
    assert install.report()[""] == {"kernel": 0, reason: 1}
    assert L.fallback_reasons == {(type(ours).__name__, reason): 1}  # what PatchReport.fallbacks() lists


def test_container_takes_the_token_order_path_again_once_the_hook_is_gone():
    base = _animatediff()
    _, _, ours, our_calls, handle = _stock_and_hooked(base, "transformer_blocks.0.attn1", "forward_hook")
    x = torch.randn(2 * FRAMES, 16, 3, 3).contiguous(memory_format=torch.channels_last)
    install = install_temporal_blocks(ours)
    with torch.no_grad():
        _container_out(ours, x)
        handle.remove()
        got = _container_out(ours, x)
        expected = _container_out(base, x)
    uninstall_temporal_blocks(install)
    assert len(our_calls) == 1
    assert install.report()[""]["kernel"] == 1
    assert_close(got, expected.double(), torch.float32, "container after the hook was removed")


def test_hooked_positions_run_the_module_in_the_token_order_block():
    # _basic_block_bfnc on its own (Latte's layer_norm blocks call it too): a hooked sinusoidal pos_embed is called
    # as a module on diffusers' (B*N, F, C) layout, so its hook runs as often and with the same effect as in stock.
    from diffusers.models.attention import BasicTransformerBlock

    b, f, n, c = 2, 3, 4, 16
    block = BasicTransformerBlock(c, 2, 8, norm_type="layer_norm", double_self_attention=True,
                                  positional_embeddings="sinusoidal", num_positional_embeddings=f).eval()  # fmt: skip
    stock, stock_calls, ours, our_calls, _ = _stock_and_hooked(block, "pos_embed", "forward_hook")
    x = torch.randn(b, f, n, c)
    with torch.no_grad():
        expected = stock(x.permute(0, 2, 1, 3).reshape(b * n, f, c)).view(b, n, f, c).permute(0, 2, 1, 3)
        with ldmopt.use_backend("triton"):
            got = L._basic_block_bfnc(ours, x, (b, f, n))
    assert len(stock_calls) == 2 and len(our_calls) == 2, (len(stock_calls), len(our_calls))
    assert_close(got, expected.double(), torch.float32, "hooked positions")


# ------------------------------------------------------------------------------------------------ SVD block


def _svd_block():
    from diffusers.models.attention import TemporalBasicTransformerBlock

    return TemporalBasicTransformerBlock(16, 16, 2, 8, cross_attention_dim=12).eval()


@pytest.mark.parametrize(
    "target,kind",
    [("attn1", "forward_hook"), ("attn2", "wrapped"), ("attn2", "pre_hook"), ("norm2", "forward_hook"),
     ("attn2.to_q", "forward_hook")],
)  # fmt: skip
def test_svd_block_runs_stock_while_a_bypassed_child_is_hooked(target, kind):
    # norm2 and attn2.to_q feed only attn2's query, which the single-key shortcut skips: their hooks' effect on the
    # output is nil, but the stock forward runs them (an offload or cache hook must see its calls).
    stock, stock_calls, ours, our_calls, _ = _stock_and_hooked(_svd_block(), target, kind)
    b, n = 2, 5
    x, context = torch.randn(b * FRAMES, n, 16), torch.randn(b * n, 1, 12)
    L.fallback_reasons.clear()
    with torch.no_grad():
        expected = stock(x, FRAMES, context)
        install = install_temporal_blocks(ours)
        got = ours(x, FRAMES, context)
    assert len(stock_calls) == 1 and len(our_calls) == 1, (len(stock_calls), len(our_calls))
    assert torch.equal(got, expected)
    reason = f"{target} {BYPASSED}"
    assert install.report()[""] == {"kernel": 0, reason: 1}


def test_svd_block_replaced_attention_runs_stock():
    # A module put in attn1's place (not diffusers' Attention) is called, not read.
    class Half(torch.nn.Module):
        def forward(self, x, encoder_hidden_states=None):
            return x * 0.5

    stock = _svd_block()
    stock.attn1 = Half()
    ours = copy.deepcopy(stock)
    x, context = torch.randn(2 * FRAMES, 5, 16), torch.randn(2 * 5, 1, 12)
    with torch.no_grad():
        expected = stock(x, FRAMES, context)
        install = install_temporal_blocks(ours)
    assert install.skipped == {"": "attn1 is a Half, not diffusers' Attention"}
    ours = copy.deepcopy(stock)
    ours.attn1 = _svd_block().attn1
    install = install_temporal_blocks(ours)
    ours.attn1 = Half()  # replaced after install
    with torch.no_grad():
        got = ours(x, FRAMES, context)
    assert torch.equal(got, expected)
    assert install.report()[""] == {"kernel": 0, "attn1 is a Half, not diffusers' Attention": 1}


# ------------------------------------------------------------------------------------------------ ResnetBlock2D


def _resnet(**kwargs):
    from diffusers.models.resnet import ResnetBlock2D

    block = ResnetBlock2D(in_channels=16, temb_channels=8, groups=4, **kwargs)
    with torch.no_grad():
        for norm in (block.norm1, block.norm2):
            norm.weight.normal_(1.0, 0.5)
            norm.bias.normal_(0.0, 0.5)
    return block.eval()


RESNET_CASES = [
    ({}, "nonlinearity", "forward_hook"),
    ({}, "nonlinearity", "wrapped"),
    ({}, "dropout", "forward_hook"),
    ({"down": True}, "downsample", "pre_hook"),
    ({"down": True}, "downsample.conv", "forward_hook"),  # the AvgPool2d the fused loader computes
    ({"up": True}, "upsample", "wrapped"),
]


@pytest.mark.parametrize("bound", [False, True], ids=["module", "bound_forward"])
@pytest.mark.parametrize("kwargs,target,kind", RESNET_CASES)
def test_resnet_runs_stock_while_a_bypassed_child_is_hooked(kwargs, target, kind, bound):
    stock, stock_calls, ours, our_calls, handle = _stock_and_hooked(_resnet(**kwargs), target, kind)
    fused = fused_resnet_forward.__get__(ours) if bound else FusedResnetBlock2D(ours)
    x = torch.randn(2, 16, 4, 4).contiguous(memory_format=torch.channels_last)
    temb = torch.randn(2, 8)
    resnet.fallback_reasons.clear()
    with torch.no_grad():
        expected = stock(x, temb)
        got = fused(x, temb)
    assert len(stock_calls) >= 1 and len(our_calls) == len(stock_calls), (len(stock_calls), len(our_calls))
    assert torch.equal(got, expected)
    name = target.split(".")[0]
    reason = f"{name} (or a module in it) {BYPASSED}"
    assert can_fuse(ours) == [reason] and resnet.fallback_reasons == {reason: 1}
    handle.remove()
    assert can_fuse(ours) == []


# ----------------------------------------------------------------------------------------------- SpatioTemporalResBlock


def _spatiotemporal():
    block = diffusers.models.resnet.SpatioTemporalResBlock(32, 32, temb_channels=8, merge_factor=0.3)
    with torch.no_grad():
        for name, p in block.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.normal_(1.0, 0.4)
    return block.eval()


@pytest.mark.parametrize(
    "target,kind", [("temporal_res_block.nonlinearity", "forward_hook"), ("temporal_res_block.dropout", "wrapped")]
)
def test_spatiotemporal_runs_stock_while_a_bypassed_child_is_hooked(target, kind):
    stock, stock_calls, ours, our_calls, handle = _stock_and_hooked(_spatiotemporal(), target, kind)
    b, f = 2, 3
    x = torch.randn(b * f, 32, 3, 3).contiguous(memory_format=torch.channels_last)
    temb, indicator = torch.randn(b * f, 8), torch.zeros(b, f)
    child_fallbacks.clear()
    with torch.no_grad():
        expected = stock(x, temb, indicator)
        got = fused_spatiotemporal_forward(ours, x, temb, indicator)
    assert len(stock_calls) >= 1 and len(our_calls) == len(stock_calls), (len(stock_calls), len(our_calls))
    assert torch.equal(got, expected)
    reason = f"{target} (or a module in it) {BYPASSED}"
    assert spatiotemporal_reasons(ours) == [reason]
    assert child_fallbacks == {f"SpatioTemporalResBlock ran the stock path: {reason}": 1}
    handle.remove()
    assert spatiotemporal_reasons(ours) == []


# ------------------------------------------------------------------------------------------------ batch-1 temb


@pytest.mark.parametrize("kwargs", [{}, {"out_channels": 24}, {"up": True}, {"down": True}, {"skip_time_act": True}])
def test_resnet_broadcasts_a_batch_1_temb_as_diffusers(kwargs):
    block = _resnet(**kwargs)
    x = torch.randn(3, 16, 5, 5).contiguous(memory_format=torch.channels_last)
    temb = torch.randn(1, 8)
    resnet.fallback_reasons.clear()
    with torch.no_grad():
        lowp = block(x, temb)
        exact = copy.deepcopy(block).double()(x.double(), temb.double())
        with ldmopt.use_backend("triton"):
            got = FusedResnetBlock2D(block)(x, temb)
    assert not resnet.fallback_reasons, dict(resnet.fallback_reasons)
    assert got.shape == lowp.shape == (3, block.out_channels, *lowp.shape[2:])
    assert_within_torch_error(got, exact, lowp, f"batch-1 temb {kwargs}")


def test_resnet_batch_1_temb_gradient_matches_diffusers():
    block = _resnet().train()  # dropout p=0: training takes the fused path
    x = torch.randn(3, 16, 4, 4).contiguous(memory_format=torch.channels_last)
    temb = torch.randn(1, 8)
    grads = {}
    copies = {"ours": block, "exact": copy.deepcopy(block).double(), "lowp": copy.deepcopy(block)}
    for name, dtype in (("ours", torch.float32), ("exact", torch.float64), ("lowp", torch.float32)):
        b = copies[name]
        xi, ti = x.detach().to(dtype, copy=True).requires_grad_(), temb.detach().to(dtype, copy=True).requires_grad_()
        with ldmopt.use_backend("triton"):
            out = fused_resnet_forward(b, xi, ti) if name == "ours" else b(xi, ti)
        out.backward(torch.linspace(-1, 1, out.numel(), dtype=dtype).view(out.shape))
        grads[name] = (ti.grad, b.time_emb_proj.weight.grad, xi.grad)
    for i, what in enumerate(("temb", "time_emb_proj.weight", "x")):
        assert grads["ours"][i].shape == grads["exact"][i].shape, what
        assert_within_torch_error(grads["ours"][i], grads["exact"][i], grads["lowp"][i], f"grad {what}")


def test_reason_counters_stay_bounded_and_the_report_formats_the_overflow_key(monkeypatch):
    # Reasons can name shapes: a server seeing ever-new shapes must not grow the counters without bound.
    from collections import Counter

    from ldmopt.nn import child_check, temporal_layout
    from ldmopt.ops import _dispatch, gn_conv2d
    from ldmopt.patch.report import PatchReport

    for module in (child_check, temporal_layout, _dispatch):
        monkeypatch.setattr(module, "fallback_reasons", Counter())
    monkeypatch.setattr(gn_conv2d, "fallback_reasons", _dispatch.fallback_reasons)  # one record, two names
    monkeypatch.setattr(_dispatch, "MAX_REASONS", 3)
    for i in range(5):
        child_check.tally(child_check.fallback_reasons, f"layer ran the stock path: shape ({i}, 8)")
        child_check.tally(temporal_layout.fallback_reasons, ("TransformerTemporalModel", f"F={i}"))
        _dispatch.count_bounded(_dispatch.fallback_reasons, ("gn_conv2d", "triton", f"shape {i}"))
    for counter in (child_check.fallback_reasons, temporal_layout.fallback_reasons, _dispatch.fallback_reasons):
        assert len(counter) == 4 and counter[_dispatch.OTHER_REASONS] == 2, counter
    fell_back = PatchReport().fallbacks()
    assert sum(n for reason, n in fell_back.items() if _dispatch.OTHER_REASONS in reason) == 6, fell_back
