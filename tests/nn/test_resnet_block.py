"""ldmopt.nn.resnet: the fused ResnetBlock2D forward against diffusers' own ResnetBlock2D (Triton interpreter).

Rule: against diffusers' block run in fp64, the fused block's error is at most 2x the error diffusers itself makes in
the same dtype. Random weights with non-trivial GroupNorm affine; odd channel counts and spatial sizes.
"""

import copy
import types
import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import ldmopt
from ldmopt.nn import resnet
from ldmopt.nn.resnet import FusedResnetBlock2D, can_fuse, fused_resnet_forward
from ldmopt.ops import gn_conv2d_prologue as prologue
from tests.tolerances import assert_within_torch_error

diffusers_resnet = pytest.importorskip("diffusers.models.resnet")
ResnetBlock2D = diffusers_resnet.ResnetBlock2D

VARIANTS = {
    # name: (ResnetBlock2D kwargs, batch, H=W)
    "sd-temb-shortcut": (dict(in_channels=40, out_channels=72, temb_channels=16, groups=8), 3, 9),  # 1x1 shortcut
    "vae-identity": (dict(in_channels=40, temb_channels=None, groups=8, eps=1e-6), 1, 9),  # no temb
    "conv-shortcut-scale": (
        dict(
            in_channels=24,
            temb_channels=16,
            groups=8,
            use_in_shortcut=True,
            conv_shortcut_bias=False,
            output_scale_factor=2.0,
            skip_time_act=True,
        ),
        1,
        7,
    ),
    "up": (dict(in_channels=24, out_channels=16, temb_channels=16, groups=8, up=True), 3, 5),
    "down": (dict(in_channels=24, temb_channels=16, groups=4, down=True), 1, 9),  # identity shortcut, pooled
    "groups-out": (
        dict(in_channels=24, out_channels=16, conv_2d_out_channels=8, temb_channels=16, groups=8, groups_out=4),
        1,
        7,
    ),
}


def _block(kwargs, dtype=torch.float32):
    block = ResnetBlock2D(**kwargs)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.2)
        for norm in (block.norm1, block.norm2):
            norm.weight.normal_(1.0, 0.5)
            norm.bias.normal_(0.0, 0.5)
    return block.to(dtype=dtype).eval()


def _inputs(block, batch, size, dtype):
    x = torch.randn(batch, block.in_channels, size, size, dtype=torch.float64) * 1.5 + 0.3
    x = x.to(dtype).contiguous(memory_format=torch.channels_last)
    temb = None if block.time_emb_proj is None else torch.randn(batch, block.time_emb_proj.in_features, dtype=dtype)
    return x, temb


def _block_copy(block, dtype):
    return copy.deepcopy(block).to(dtype)


def _run_diffusers(block, x, temb, dtype):
    """diffusers' forward of a copy of the block in ``dtype`` (fp64: the reference)."""
    twin = _block_copy(block, dtype)
    return ResnetBlock2D.forward(twin, x.to(dtype), None if temb is None else temb.to(dtype))


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_forward_matches_diffusers(variant, dtype):
    kwargs, batch, size = VARIANTS[variant]
    block = _block(kwargs, dtype)
    x, temb = _inputs(block, batch, size, dtype)
    assert can_fuse(block) == []
    resnet.fallback_reasons.clear()
    with ldmopt.use_backend("triton"), torch.no_grad():
        out = fused_resnet_forward(block, x, temb)
        ref = _run_diffusers(block, x, temb, torch.float64)
        lowp = _run_diffusers(block, x, temb, dtype)
    assert not resnet.fallback_reasons
    assert out.shape == lowp.shape and out.dtype == dtype
    assert out.is_contiguous(memory_format=torch.channels_last)
    assert_within_torch_error(out, ref, lowp, f"{variant} {dtype}")


@pytest.mark.parametrize("when", ["before patch", "after patch"])
def test_each_norm_keeps_its_own_eps(when):
    # norm1 and norm2 with different eps (diffusers builds both from one argument; a checkpoint or the user may
    # change one): each GroupNorm of the fused block normalises with its own.
    block = _block(VARIANTS["sd-temb-shortcut"][0])
    x, temb = _inputs(block, 2, 5, torch.float32)
    if when == "before patch":
        block.norm1.eps = 1e-2
    report = ldmopt.patch(block)
    assert report.counts() == {"resnet": 1}, str(report)
    if when == "after patch":
        block.norm1.eps = 1e-2
    assert block.norm2.eps == 1e-6
    resnet.fallback_reasons.clear()
    with ldmopt.use_backend("triton"), torch.no_grad():
        out = block(x, temb)
        ref = _run_diffusers(block, x, temb, torch.float64)
        lowp = _run_diffusers(block, x, temb, torch.float32)
    assert not resnet.fallback_reasons, dict(resnet.fallback_reasons)
    assert_within_torch_error(out, ref, lowp, f"norm1.eps=1e-2 set {when}")
    ldmopt.unpatch(block)


@pytest.mark.parametrize(
    "variant,dtype",
    [("sd-temb-shortcut", torch.float32), ("sd-temb-shortcut", torch.float16), ("up", torch.float32),
     ("down", torch.float32), ("conv-shortcut-scale", torch.float32)],
)  # fmt: skip
def test_backward_matches_diffusers(variant, dtype):
    kwargs, batch, size = VARIANTS[variant]
    block = _block(kwargs, dtype).train()  # dropout p=0: training takes the fused path
    x, temb = _inputs(block, batch, size, dtype)
    dy = None
    grads = {}
    for name, cast in (("ours", dtype), ("ref", torch.float64), ("lowp", dtype)):
        b = block if name == "ours" else _block_copy(block, cast)
        xi = x.detach().to(cast).requires_grad_()
        ti = None if temb is None else temb.detach().to(cast).requires_grad_()
        with ldmopt.use_backend("triton"):
            out = fused_resnet_forward(b, xi, ti) if name == "ours" else ResnetBlock2D.forward(b, xi, ti)
        if dy is None:
            dy = torch.randn_like(out)
        out.backward(dy.to(cast))
        named = dict(b.named_parameters())
        grads[name] = {"x": xi.grad, "temb": None if ti is None else ti.grad}
        grads[name].update({k: p.grad for k, p in named.items()})
    for key, ours in grads["ours"].items():
        if ours is None:
            assert grads["ref"][key] is None, key
            continue
        assert ours.dtype == dtype, key
        assert_within_torch_error(ours, grads["ref"][key], grads["lowp"][key], f"grad {key} {variant} {dtype}")


def _saved_activation_bytes(block, fn):
    """Bytes of distinct non-parameter tensors autograd keeps for backward while ``fn`` runs."""
    params = {p.data_ptr() for p in block.parameters()}
    saved = {}

    def pack(t):
        if t.data_ptr() not in params:
            saved[t.data_ptr()] = max(saved.get(t.data_ptr(), 0), t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(saved.values())


@pytest.mark.parametrize("variant", ["sd-temb-shortcut", "up"])
def test_backward_keeps_no_more_activations_than_diffusers(variant):
    kwargs, batch, size = VARIANTS[variant]
    block = _block(kwargs).train()
    x, temb = _inputs(block, batch, size, torch.float32)
    x.requires_grad_()
    with ldmopt.use_backend("triton"):
        fused = _saved_activation_bytes(block, lambda: fused_resnet_forward(block, x, temb))
    stock = _saved_activation_bytes(block, lambda: ResnetBlock2D.forward(block, x, temb))
    h_bytes = batch * block.out_channels * (2 * size if block.up else size) ** 2 * 4
    assert fused <= x.numel() * 4 + h_bytes + 4096, (fused, stock)  # x and h (+ statistics, temb)
    assert fused < stock / 2, (fused, stock)


class _Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("placement", ["loader", "staged"])
def test_eval_forward_dispatches_no_group_norm_or_convolution(triton_launches, placement, monkeypatch):
    monkeypatch.setenv(prologue.ENV, placement)
    block = _block(VARIANTS["sd-temb-shortcut"][0])
    x, temb = _inputs(block, 2, 5, torch.float32)
    ldmopt.ops.backend_counts.clear()
    with _Recorder() as rec, torch.no_grad():
        fused_resnet_forward(block, x, temb)
    aten = [op for op in rec.ops if op.startswith("aten.")]
    bad = [op for op in aten if "group_norm" in op or "conv" in op]
    assert not bad, f"aten ops the fused block must not dispatch: {bad}"
    assert rec.ops.count("ldmopt.gn_conv2d") == 2 and rec.ops.count("ldmopt.gn_conv2d_stats") == 1
    assert ldmopt.ops.backend_counts[("gn_conv2d", "triton")] == 2
    # norm1 statistics (2), conv1, conv2; staged: each conv after its own normalisation pass
    staged = ["_group_norm_fwd_apply_kernel"] if placement == "staged" else []
    conv = [*staged, "_gn_conv2d_fwd_kernel"]
    assert triton_launches == ["_group_norm_fwd_partial_kernel", "_group_norm_fwd_finalize_kernel", *conv, *conv]
    # With norm1 statistics from the producer (e.g. the previous block's out_stats): two (staged: four) launches.
    stats = torch.ops.ldmopt.gn_conv2d_stats(x, block.norm1.num_groups, block.norm1.eps)
    triton_launches.clear()
    with torch.no_grad():
        fused_resnet_forward(block, x, temb, stats=stats)
    assert triton_launches == conv * 2


def test_chained_blocks_hand_statistics_over():
    first = _block(VARIANTS["sd-temb-shortcut"][0])
    second = _block(dict(in_channels=72, temb_channels=16, groups=8))
    x, temb = _inputs(first, 1, 5, torch.float32)
    with ldmopt.use_backend("triton"), torch.no_grad():
        h, stats = fused_resnet_forward(first, x, temb, out_stats=(8, second.norm1.eps))
        chained = fused_resnet_forward(second, h, temb, stats=stats)
        alone = fused_resnet_forward(second, h, temb)
    torch.testing.assert_close(chained, alone, rtol=1e-5, atol=1e-5)


def test_nchw_input_is_converted_and_fused():
    block = _block(VARIANTS["vae-identity"][0])
    x = torch.randn(1, 40, 5, 5)
    resnet.fallback_reasons.clear()
    resnet.layout_conversions.clear()
    with torch.no_grad(), ldmopt.use_backend("triton"):
        out = fused_resnet_forward(block, x, None)
    expect = ResnetBlock2D.forward(block.double(), x.double(), None)
    assert out.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(out.double(), expect, rtol=1e-4, atol=1e-4)
    assert sum(resnet.layout_conversions.values()) == 1 and not resnet.fallback_reasons


def test_unfusable_block_falls_back_to_diffusers_with_reason():
    block = _block(VARIANTS["vae-identity"][0])
    x = torch.randn(1, 40, 5, 5).to(memory_format=torch.channels_last)
    block.nonlinearity = torch.nn.GELU()
    resnet.fallback_reasons.clear()
    with torch.no_grad():
        out = fused_resnet_forward(block, x, None)
        expect = ResnetBlock2D.forward(block, x, None)
    torch.testing.assert_close(out, expect, rtol=0, atol=0)
    assert any("nonlinearity GELU" in r for r in resnet.fallback_reasons)
    # A patcher-style class swap (ldmopt.patch.rule.fused_class) falls back to diffusers' forward, not to itself.
    swapped = {"forward": lambda self, x, t=None: fused_resnet_forward(self, x, t), "_ldmopt_base": ResnetBlock2D}
    block.__class__ = type("ResnetBlock2D", (ResnetBlock2D,), swapped)
    assert can_fuse(block) != []
    with torch.no_grad():
        torch.testing.assert_close(block(x, None), expect, rtol=0, atol=0)


def test_embeddings_of_a_larger_batch_run_diffusers_broadcast():
    # diffusers' add broadcasts an input of batch 1 over time embeddings of batch 3; the fused convs keep the input's
    # batch, so that call runs diffusers' forward (the reverse, one embedding for a batch, stays fused)
    block = _block(dict(in_channels=40, out_channels=24, temb_channels=16, groups=8))
    fused = FusedResnetBlock2D(copy.deepcopy(block))
    x = torch.randn(1, 40, 6, 5).to(memory_format=torch.channels_last)
    temb = torch.randn(3, 16)
    resnet.fallback_reasons.clear()
    with torch.no_grad():
        out, expect = fused(x, temb), block(x, temb)
    assert out.shape == (3, 24, 6, 5)
    torch.testing.assert_close(out, expect, rtol=0, atol=0)
    assert list(resnet.fallback_reasons) == ["temb of batch 3 for an input of batch 1"]
    resnet.fallback_reasons.clear()
    x3 = torch.randn(3, 40, 6, 5).to(memory_format=torch.channels_last)
    with torch.no_grad():
        out = fused(x3, temb[:1])
        ref, lowp = (_run_diffusers(block, x3, temb[:1], dtype) for dtype in (torch.float64, torch.float32))
    assert_within_torch_error(out, ref, lowp, "one embedding for a batch of 3")
    assert not resnet.fallback_reasons


def test_torch_func_transforms_run_the_stock_forward():
    """vmap cannot query the layouts the fused path reads: under a torch.func transform the module runs diffusers'
    forward (with the reason counted), as a patched block does, and vmap and jacfwd equal the stock block's."""
    block = _block(dict(in_channels=8, out_channels=12, temb_channels=16, groups=4))
    fused = FusedResnetBlock2D(copy.deepcopy(block))
    x, temb = _inputs(block, 3, 5, torch.float32)
    resnet.fallback_reasons.clear()
    mapped = torch.func.vmap(lambda a, t: fused(a[None], t[None])[0])(x, temb)
    expected = torch.func.vmap(lambda a, t: block(a[None], t[None])[0])(x, temb)
    torch.testing.assert_close(mapped, expected, rtol=0, atol=0)
    jac = torch.func.jacfwd(lambda a: fused(a, temb[:1]))(x[:1, :, :2, :2].contiguous())
    assert jac.shape == (1, 12, 2, 2, 1, 8, 2, 2)
    assert set(resnet.fallback_reasons) == {"under a torch.func transform (vmap, grad, jvp ...)"}


def test_dropout_in_training_falls_back():
    block = _block(dict(in_channels=8, temb_channels=None, groups=4, dropout=0.1)).train()
    resnet.fallback_reasons.clear()
    fused_resnet_forward(block, torch.randn(1, 8, 3, 3).contiguous(memory_format=torch.channels_last), None)
    assert list(resnet.fallback_reasons) == ["dropout p=0.1 in training mode"]


def test_monte_carlo_dropout_at_eval_falls_back():
    """Dropout active while the block is in eval mode (Monte-Carlo dropout: model.eval(), then the Dropout layers
    .train(), or a Dropout subclass that samples in eval mode): diffusers' forward, as nn.Dropout reads its own flag."""

    class AlwaysDropout(torch.nn.Dropout):
        def forward(self, x):
            return torch.nn.functional.dropout(x, self.p, training=True)

    block = _block(dict(in_channels=8, temb_channels=None, groups=4, dropout=1.0))  # p=1: the conv2 input is zero
    x = torch.randn(1, 8, 3, 3).contiguous(memory_format=torch.channels_last)
    expected = block.conv2.bias[None, :, None, None] + x  # conv2 of zeros, plus the residual
    resnet.fallback_reasons.clear()
    block.dropout.train()
    torch.testing.assert_close(fused_resnet_forward(block, x, None), expected.expand_as(x))
    block.dropout = AlwaysDropout(1.0).eval()
    torch.testing.assert_close(fused_resnet_forward(block, x, None), expected.expand_as(x))
    expected_reasons = ["dropout p=1.0 in training mode", "dropout of class AlwaysDropout, not nn.Dropout"]
    assert list(resnet.fallback_reasons) == expected_reasons


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(time_embedding_norm="scale_shift"), "time_embedding_norm='scale_shift'"),
        (dict(non_linearity="mish"), "nonlinearity Mish"),
        (dict(up=True, kernel="fir"), "not nearest 2x"),
        (dict(down=True, kernel="fir"), "not a 2x2 average pool"),
    ],
)
def test_can_fuse_reasons(kwargs, match):
    block = ResnetBlock2D(in_channels=8, temb_channels=4, groups=4, **kwargs)
    reasons = can_fuse(block)
    assert any(match in r for r in reasons), reasons
    # Reasons are grouped by their text in the report: no per-object memory address in them.
    assert reasons == can_fuse(ResnetBlock2D(in_channels=8, temb_channels=4, groups=4, **kwargs))


def test_can_fuse_accepts_sde_vp_and_rejects_wrapped_conv():
    assert can_fuse(ResnetBlock2D(in_channels=8, temb_channels=4, groups=4, up=True, kernel="sde_vp")) == []
    assert can_fuse(ResnetBlock2D(in_channels=8, temb_channels=4, groups=4, down=True, kernel="sde_vp")) == []
    block = ResnetBlock2D(in_channels=8, temb_channels=4, groups=4)
    block.conv1 = torch.nn.Sequential(block.conv1)  # e.g. a LoRA wrapper
    assert any("conv1 is a torch.nn.modules.container.Sequential" in r for r in can_fuse(block))
    assert "not a diffusers ResnetBlock2D" in can_fuse(torch.nn.Linear(2, 2))[0]

    class Custom(ResnetBlock2D):
        def forward(self, x, temb=None):
            return x

    assert can_fuse(Custom(in_channels=8, temb_channels=4, groups=4)) == [
        "test_can_fuse_accepts_sde_vp_and_rejects_wrapped_conv.<locals>.Custom overrides ResnetBlock2D.forward"
    ]


def test_module_does_not_adopt_a_forward_installed_on_the_block():
    """A forward set on the block instance (a hook wrapper, or fused_resnet_forward bound to it) stays the block's:
    the module runs its own fused forward, not the wrapper."""
    block = _block(VARIANTS["conv-shortcut-scale"][0])
    calls = []

    def wrapper(*args, **kwargs):
        calls.append(1)
        return type(block).forward(block, *args, **kwargs)

    block.forward = wrapper
    fused = FusedResnetBlock2D(block)
    assert "forward" not in vars(fused)
    x, temb = _inputs(block, 1, 5, torch.float32)
    with ldmopt.use_backend("torch"), torch.no_grad():
        fused(x, temb)
    assert not calls


def test_module_and_bound_forward_share_parameters():
    block = _block(VARIANTS["conv-shortcut-scale"][0])
    fused = FusedResnetBlock2D(block)
    assert list(fused.state_dict()) == list(block.state_dict())
    assert all(a is b for a, b in zip(fused.parameters(), block.parameters()))
    fused.load_state_dict(block.state_dict())
    x, temb = _inputs(block, 1, 5, torch.float32)
    with ldmopt.use_backend("triton"), torch.no_grad():
        out = fused(x, temb)
        block.forward = types.MethodType(fused_resnet_forward, block)
        bound = block(x, temb)
        del block.forward
        stock = block(x, temb)
    torch.testing.assert_close(out, bound, rtol=0, atol=0)
    torch.testing.assert_close(out, stock, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_torch_compile_fullgraph(backend):
    torch._dynamo.reset()
    block = _block(dict(in_channels=8, out_channels=12, temb_channels=4, groups=4)).train()
    x, temb = _inputs(block, 2, 3, torch.float32)
    x.requires_grad_()
    compiled = torch.compile(lambda x, t: fused_resnet_forward(block, x, t), backend=backend, fullgraph=True)
    out = compiled(x, temb)
    out.sum().backward()
    grad = x.grad.clone()
    x.grad = None
    eager = fused_resnet_forward(block, x, temb)
    eager.sum().backward()
    torch.testing.assert_close(out, eager, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad, x.grad, rtol=1e-5, atol=1e-5)


def test_module_refuses_what_is_not_a_resnet_block_and_warns_when_it_can_never_fuse():
    with pytest.raises(TypeError, match="block must be a diffusers ResnetBlock2D, got Linear"):
        FusedResnetBlock2D(torch.nn.Linear(4, 4))
    from diffusers.models.resnet import ResnetBlock2D

    never = ResnetBlock2D(in_channels=8, out_channels=8, temb_channels=4, groups=2, time_embedding_norm="scale_shift")
    with pytest.warns(UserWarning, match="runs diffusers' forward: time_embedding_norm='scale_shift'"):
        FusedResnetBlock2D(never)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        FusedResnetBlock2D(_block(VARIANTS["conv-shortcut-scale"][0]))  # a fusable block: silent


@pytest.mark.parametrize("variant", ["vae-identity", "down", "sd-temb-shortcut"])
@pytest.mark.parametrize("with_stats", [False, True])
def test_autocast_keeps_the_identity_residual_in_its_own_dtype(variant, with_stats):
    """Under autocast diffusers adds the identity residual in fp32 (fp32 + bf16 -> fp32): so does the fused block,
    instead of rounding the residual stream to bf16 in the epilogue. A large residual makes the difference plain."""
    kwargs, batch, size = VARIANTS[variant]
    block = _block(kwargs)
    x, temb = _inputs(block, batch, size, torch.float32)
    x = x * 20
    with torch.no_grad():
        exact = _run_diffusers(block, x, temb, torch.float64)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            stock = ResnetBlock2D.forward(block, x, temb)
            with ldmopt.use_backend("torch"):
                out = fused_resnet_forward(block, x, temb, out_stats=(4, 1e-5) if with_stats else None)
    out, stats = out if with_stats else (out, None)
    assert out.dtype == stock.dtype
    stock_error = (stock.double() - exact).abs().max().item()
    assert (out.double() - exact).abs().max().item() <= 2 * stock_error + 1e-6
    if with_stats:  # the next GroupNorm's statistics describe the output that is returned
        groups = out.double().reshape(batch, 4, -1)
        assert torch.allclose(stats[0].double().reshape(batch, 4), groups.mean(-1), atol=1e-4)
