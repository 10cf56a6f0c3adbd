"""The UNet transformer containers' way out (rules transformer2d_in / spatiotemporal_in): ``proj_out`` (Linear or
1x1 conv) as one GEMM over the tokens with the container's residual added in its epilogue, channels-last out; a
LoRA-like or hooked ``proj_out`` keeps the stock projection and add, counted."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import ldmopt
from ldmopt.nn import child_check
from tests.tolerances import assert_close

t2d = pytest.importorskip("diffusers.models.transformers.transformer_2d")


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        first = out[0] if isinstance(out, (tuple, list)) and out else out
        self.calls.append((str(func.overloadpacket), tuple(first.shape) if torch.is_tensor(first) else None))
        return out


def _model(linear_projection: bool):
    model = t2d.Transformer2DModel(
        num_attention_heads=2, attention_head_dim=16, in_channels=32, norm_num_groups=8, cross_attention_dim=24,
        use_linear_projection=linear_projection,
    )  # fmt: skip
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    for p in model.parameters():
        if p.dim() == 4:
            p.data = p.data.contiguous(memory_format=torch.channels_last)
    return model.eval()


def _inputs():
    x = torch.randn(2, 32, 5, 3).contiguous(memory_format=torch.channels_last)
    return x, torch.randn(2, 7, 24)


@pytest.mark.parametrize("linear_projection", [True, False], ids=["linear", "conv1x1"])
def test_proj_out_adds_the_residual_in_its_epilogue(linear_projection):
    model = _model(linear_projection)
    x, context = _inputs()
    with torch.no_grad():
        ref = model(x, encoder_hidden_states=context).sample
    report = ldmopt.patch(model)
    assert report.counts().get("transformer2d_in") == 1
    child_check.fallback_reasons.clear()
    ops = _Ops()
    with torch.no_grad(), ldmopt.use_backend("torch"), ops:
        out = model(x, encoder_hidden_states=context).sample
    assert out.is_contiguous(memory_format=torch.channels_last)
    assert_close(out, ref.double(), torch.float32, "patched container")
    # proj_out is the fused GEMM writing the container's output (tokens (2, 15, 32)); no add follows it.
    names = [name for name, _ in ops.calls]
    last_gemm = max(i for i, (name, shape) in enumerate(ops.calls) if name == "ldmopt.linear_fwd" and shape == (30, 32))
    assert not [n for n in names[last_gemm:] if n.startswith("aten.add")], names[last_gemm:]
    assert not child_check.fallback_reasons
    ldmopt.unpatch(model)


def test_wrapped_proj_out_keeps_the_stock_projection():
    model = _model(True)
    x, context = _inputs()
    report = ldmopt.patch(model)
    assert report.counts().get("transformer2d_in") == 1

    class LoraLike(torch.nn.Linear):  # another class: its forward is not plain F.linear
        def forward(self, t):
            return super().forward(t) + 1.0

    wrapped = LoraLike(32, 32)
    wrapped.load_state_dict(model.proj_out.state_dict())
    model.proj_out = wrapped
    child_check.fallback_reasons.clear()
    with torch.no_grad(), ldmopt.use_backend("torch"):
        out = model(x, encoder_hidden_states=context).sample
    ldmopt.unpatch(model)
    with torch.no_grad():
        ref = model(x, encoder_hidden_states=context).sample
    assert_close(out, ref.double(), torch.float32, "wrapped proj_out")
    assert any(r.startswith("Transformer2DModel ran the stock path: proj_out") for r in child_check.fallback_reasons)


def _svd_container():
    from diffusers.models.transformers.transformer_temporal import TransformerSpatioTemporalModel

    model = TransformerSpatioTemporalModel(num_attention_heads=2, attention_head_dim=16, in_channels=32,
                                           cross_attention_dim=24)  # fmt: skip
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * (1.0 if name.endswith("mix_factor") else 0.2))
    return model.eval()


def test_svd_container_blend_is_read_by_proj_out(monkeypatch):
    from diffusers.models.resnet import AlphaBlender

    model = _svd_container()
    frames = 3
    x = torch.randn(2 * frames, 32, 3, 5).contiguous(memory_format=torch.channels_last)
    context = torch.randn(2 * frames, 1, 24)
    indicator = torch.zeros(2, frames)
    indicator[1] = 1.0  # an image-only video
    with torch.no_grad():
        ref = model(x, context, image_only_indicator=indicator).sample
    report = ldmopt.patch(model)
    assert report.counts().get("spatiotemporal_in") == 1
    blends = []
    original = AlphaBlender.forward
    monkeypatch.setattr(AlphaBlender, "forward", lambda self, *a, **k: blends.append(1) or original(self, *a, **k))
    child_check.fallback_reasons.clear()
    leaf = x.clone().requires_grad_()
    with ldmopt.use_backend("torch"):
        out = model(leaf, context, image_only_indicator=indicator).sample
    assert not blends and not child_check.fallback_reasons  # the blend ran inside proj_out's GEMM
    assert out.is_contiguous(memory_format=torch.channels_last)
    assert_close(out, ref.double(), torch.float32, "blended proj_out")
    out.sum().backward()
    assert model.time_mixer.mix_factor.grad is not None and model.time_mixer.mix_factor.grad.abs().item() > 0
    # fp64: equal to diffusers' blend to rounding, gradient of the blend factor included.
    model64 = _svd_container().double()
    model64.load_state_dict(model.state_dict())
    stock64 = _svd_container().double()
    stock64.load_state_dict(model.state_dict())
    ldmopt.unpatch(model)
    ldmopt.patch(model64)
    grads = []
    for m in (model64, stock64):
        m.zero_grad()
        m(x.double(), context.double(), image_only_indicator=indicator.double()).sample.square().sum().backward()
        grads.append(m.time_mixer.mix_factor.grad.clone())
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-9, atol=1e-12)


def test_svd_container_triton_interpreter():
    model = _svd_container()
    x = torch.randn(4, 32, 3, 5).contiguous(memory_format=torch.channels_last)
    context, indicator = torch.randn(4, 1, 24), torch.zeros(2, 2)
    with torch.no_grad():
        ref = model(x, context, image_only_indicator=indicator).sample
        report = ldmopt.patch(model)
        with ldmopt.use_backend("triton", ops=("linear", "gn_conv2d", "gn_conv2d_stats")):
            out = model(x, context, image_only_indicator=indicator).sample
    assert report.backends()["linear"].get("triton", 0) > 0, report.backends()
    assert_close(out, ref.double(), torch.float32, "blended proj_out (triton)")


def test_narrower_proj_out_broadcasts_as_diffusers():
    # A 1x1 proj_out to one channel: diffusers' add broadcasts it over the residual's channels; the epilogue adds
    # like shapes only, so this container keeps the stock projection and add.
    model = t2d.Transformer2DModel(num_attention_heads=2, attention_head_dim=16, in_channels=32, out_channels=1,
                                   norm_num_groups=8, cross_attention_dim=24).eval()  # fmt: skip
    x, context = _inputs()
    with torch.no_grad():
        ref = model(x, encoder_hidden_states=context).sample
        ldmopt.patch(model)
        with ldmopt.use_backend("torch"):
            out = model(x, encoder_hidden_states=context).sample
    assert out.shape == ref.shape == (2, 32, 5, 3)
    assert_close(out, ref.double(), torch.float32, "broadcast proj_out")


def test_hooked_time_mixer_keeps_the_stock_blend_counted():
    model = _svd_container()
    model.time_mixer.register_forward_hook(lambda *a: None)
    x = torch.randn(4, 32, 3, 5).contiguous(memory_format=torch.channels_last)
    context, indicator = torch.randn(4, 1, 24), torch.zeros(2, 2)
    with torch.no_grad():
        ref = model(x, context, image_only_indicator=indicator).sample
        ldmopt.patch(model)
        child_check.fallback_reasons.clear()
        with ldmopt.use_backend("torch"):
            out = model(x, context, image_only_indicator=indicator).sample
    assert_close(out, ref.double(), torch.float32, "hooked time_mixer")
    assert any("time_mixer" in r for r in child_check.fallback_reasons), child_check.fallback_reasons
