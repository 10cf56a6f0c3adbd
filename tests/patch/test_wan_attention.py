"""The ``wan_qk_norm_rope`` rule: Wan and SkyReels-V2 self-attention (query/key RMSNorm across heads + RoPE in one
row kernel each) against diffusers' own processor, in fp32 and half precision, forward and backward."""

import copy

import pytest
import torch

import ldmopt
from tests.patch.helpers import assert_fused_grads_match_stock, assert_same_snapshot, output_tensor, snapshot
from tests.patch.test_wan import _skyreels, _wan, _wan_inputs
from tests.tolerances import assert_close, assert_within_torch_error

diffusers = pytest.importorskip("diffusers")
R = torch.randn


def _with_qk_affine(model):
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".norm_q." in name or ".norm_k." in name:
                p.copy_(1 + 0.5 * torch.randn_like(p))  # non-trivial RMSNorm weights
    return model


def _attention_args(model, batch=2):
    """(hidden [B, 45, 40], rotary) as the blocks see them: 3 frames x 3 x 5 patches."""
    return R(batch, 45, 40) * 2, model.rope(R(batch, 4, 3, 6, 10))


@pytest.mark.parametrize("fused_projections", [False, True])
def test_wan_model_matches_stock(fused_projections):
    model = _with_qk_affine(_wan())
    if fused_projections:
        model.fuse_qkv_projections()
    inputs = _wan_inputs()
    with torch.no_grad():
        ref = output_tensor(model(**inputs))
    before = snapshot(model)
    report = ldmopt.patch(model)
    assert report.counts().get("wan_qk_norm_rope") == 2, str(report)  # attn1 of both blocks; attn2 is not touched
    with torch.no_grad(), ldmopt.use_backend("triton"):
        out = output_tensor(model(**inputs))
    assert not report.fallbacks(), report.fallbacks()
    assert_close(out, ref.double(), torch.float32, f"wan fused_projections={fused_projections}")
    ldmopt.unpatch(model)
    assert type(model.blocks[0].attn1).__name__ == "WanAttention"
    assert_same_snapshot(before, snapshot(model))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_half_attention_within_torch_error(dtype):
    """The fused kernel rounds once; diffusers rounds the norm's output, then the rotation's: both against fp64."""
    model = _with_qk_affine(_wan())
    attn = model.blocks[0].attn1
    hidden, rotary = _attention_args(model)
    exact_attn = copy.deepcopy(attn).double()
    with torch.no_grad():
        exact = exact_attn(hidden.double(), None, None, tuple(t.double() for t in rotary))
        low = copy.deepcopy(attn).to(dtype)
        stock = low(hidden.to(dtype), None, None, rotary)
        report = ldmopt.patch(low)
        assert report.counts() == {"wan_qk_norm_rope": 1}
        with ldmopt.use_backend("triton"):
            fused = low(hidden.to(dtype), None, None, rotary)
    assert not report.fallbacks() and report.backends()["rms_norm"]["triton"] == 2
    assert fused.dtype == stock.dtype == dtype
    assert_within_torch_error(fused, exact, stock, f"wan attention {dtype}")


def test_gradients_match_stock():
    model = _with_qk_affine(_wan()).train()
    hidden, rotary = _attention_args(model)
    call = lambda attn, h: attn(h, None, None, rotary)
    assert_fused_grads_match_stock(model.blocks[0].attn1, call, [hidden], rms_norm_calls=2)


def test_skyreels_and_per_sample_rotary_match_stock():
    model = _with_qk_affine(_skyreels())
    attn = model.blocks[1].attn1
    if type(attn).__name__ != "SkyReelsV2Attention":
        pytest.skip(f"this diffusers' SkyReels-V2 blocks hold {type(attn).__name__}, not SkyReelsV2Attention (0.36+)")
    hidden, rotary = _attention_args(model)
    # [B, S, 1, D]: one table per sample, the second sample's positions shifted (a row must read its own sample's)
    per_sample = tuple(torch.cat([t, t.roll(7, dims=1)]) for t in rotary)
    with torch.no_grad():
        refs = [attn(hidden, None, None, r) for r in (rotary, per_sample)]
    report = ldmopt.patch(model)
    assert report.counts().get("wan_qk_norm_rope") == 2, str(report)
    with torch.no_grad(), ldmopt.use_backend("triton"):
        for r, ref in zip((rotary, per_sample), refs):
            assert_close(attn(hidden, None, None, r), ref.double(), torch.float32, f"skyreels {r[0].shape[0]}")
    assert not report.fallbacks(), report.fallbacks()


def test_other_processors_and_calls_keep_the_stock_forward():
    class MyProcessor(diffusers.models.transformers.transformer_wan.WanAttnProcessor):
        pass

    model = _with_qk_affine(_wan())
    model.blocks[0].attn1.set_processor(MyProcessor())
    report = ldmopt.patch(model)
    assert report.counts().get("wan_qk_norm_rope") == 1, str(report)
    assert any("MyProcessor" in why for s in report.skipped for why in s.reasons), str(report)

    attn = model.blocks[1].attn1
    hidden, (cos, sin) = _attention_args(model)
    with torch.no_grad():
        ldmopt.unpatch(model)
        stock_outs = [attn(hidden, None, None, (cos, sin)), attn(hidden, None, None, None)]
        report = ldmopt.patch(model)
        attn.set_processor(MyProcessor())  # after patch: counted per call
        swapped = attn(hidden, None, None, (cos, sin))
        attn.set_processor(diffusers.models.transformers.transformer_wan.WanAttnProcessor())
        no_rope = attn(hidden, None, None, None)
    assert_close(swapped, stock_outs[0].double(), torch.float32, "user processor")
    assert_close(no_rope, stock_outs[1].double(), torch.float32, "no rotary_emb")
    reasons = " | ".join(report.fallbacks())
    assert "MyProcessor" in reasons and "without rotary_emb" in reasons, reasons


def test_angles_that_need_grad_and_hooked_norms_run_stock():
    model = _with_qk_affine(_wan())
    attn = model.blocks[0].attn1
    hidden, (cos, sin) = _attention_args(model)
    with torch.no_grad():
        ref = attn(hidden, None, None, (cos, sin))
    report = ldmopt.patch(model)
    trainable = (cos.clone().requires_grad_(), sin)
    out = attn(hidden, None, None, trainable)
    assert_close(out, ref.double(), torch.float32, "angles with grad")
    out.sum().backward()
    assert trainable[0].grad is not None  # stock's autograd reached the angles
    calls = []
    attn.norm_k.register_forward_hook(lambda mod, args, out: calls.append(1))
    with torch.no_grad():
        assert_close(attn(hidden, None, None, (cos, sin)), ref.double(), torch.float32, "hooked norm_k")
    assert calls == [1]
    reasons = " | ".join(report.fallbacks())
    assert "require grad" in reasons and "norm_k" in reasons, reasons


def test_patched_attention_compiles_fullgraph():
    torch._dynamo.reset()
    model = _with_qk_affine(_wan())
    attn = model.blocks[0].attn1
    report = ldmopt.patch(model)
    hidden, rotary = _attention_args(model)
    with torch.no_grad():
        eager = attn(hidden, None, None, rotary)
        compiled = torch.compile(attn, backend="aot_eager", fullgraph=True)(hidden, None, None, rotary)
    assert_close(compiled, eager.double(), torch.float32, "compiled wan attention")
    assert not report.fallbacks(), report.fallbacks()


def test_cos_and_sin_of_different_batch_run_stock():
    """diffusers broadcasts a per-sample cos against a shared sin; the fused forward takes equal shapes only."""
    model = _with_qk_affine(_wan())
    attn = model.blocks[0].attn1
    hidden, (cos, sin) = _attention_args(model)
    mixed = (cos.expand(2, *cos.shape[1:]), sin)
    with torch.no_grad():
        ref = attn(hidden, None, None, mixed)
        report = ldmopt.patch(model)
        out = attn(hidden, None, None, mixed)
    assert_close(out, ref.double(), torch.float32, "mixed tables")
    assert any("rotary cos and sin of shapes" in r for r in report.fallbacks()), report.fallbacks()


def test_under_autocast_matches_stock():
    """fp32 model under bf16 autocast (the Triton interpreter's bf16 tl.dot is wrong on the CPU: only the norms)."""
    model = _with_qk_affine(_wan())
    inputs = _wan_inputs()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        ref = output_tensor(model(**inputs))
    report = ldmopt.patch(model, families=["rms_norm"])
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16), ldmopt.use_backend("triton"):
        out = output_tensor(model(**inputs))
    assert out.dtype == ref.dtype
    assert report.counts() == {"wan_qk_norm_rope": 2} and not report.fallbacks()
    assert_close(out, ref.double(), torch.bfloat16, "wan under autocast")
