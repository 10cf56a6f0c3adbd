"""The ``hunyuan_video_qk_norm_rope`` rule: HunyuanVideo attention (diffusers' per-head RMSNorms, the rotation of the
video tokens) against HunyuanVideoAttnProcessor2_0, dual- and single-stream, fp32 and half, forward and backward."""

import copy

import pytest
import torch

import ldmopt
from tests.patch.helpers import (
    assert_fused_grads_match_stock,
    assert_same_snapshot,
    output_tensor,
    snapshot,
    with_nontrivial_norms,
)
from tests.tolerances import assert_close, assert_within_torch_error

diffusers = pytest.importorskip("diffusers")
R = torch.randn
TEXT = 7
#: rms_norm kernels per attention call: video q, k and text q, k (dual); q and k over all tokens (single)
# (op, calls): the dual-stream blocks' q and k each in one kernel over [video | text], the single-stream blocks' too
KERNELS = {"dual": ("rms_norm_joint", 2), "single": ("rms_norm", 2)}


def _hunyuan(seed=0):
    torch.manual_seed(seed)
    model = diffusers.HunyuanVideoTransformer3DModel(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=16, num_layers=1,
        num_single_layers=1, num_refiner_layers=1, text_embed_dim=24, pooled_projection_dim=12,
        rope_axes_dim=(4, 6, 6),
    )  # fmt: skip
    return with_nontrivial_norms(model)


def _inputs(batch=2):
    mask = torch.ones(batch, TEXT)
    mask[-1, TEXT - 2 :] = 0  # a shorter prompt: padding masked out
    return dict(
        hidden_states=R(batch, 4, 3, 6, 10), timestep=torch.tensor([300, 700][:batch]),
        encoder_hidden_states=R(batch, TEXT, 24), encoder_attention_mask=mask, pooled_projections=R(batch, 12),
        guidance=torch.full((batch,), 3.5), return_dict=False,
    )  # fmt: skip


def _attention_args(model, batch=2):
    """(video [B, S, C], text [B, T, C], rotary tables [S, D]): 3 frames x 3 x 5 patches."""
    tables = model.rope(R(batch, 4, 3, 6, 10))
    dim = model.config.num_attention_heads * model.config.attention_head_dim
    return R(batch, 45, dim), R(batch, TEXT, dim), tables


def _stream(model, stream):
    return (model.transformer_blocks if stream == "dual" else model.single_transformer_blocks)[0].attn


def test_hunyuan_model_matches_stock():
    model = _hunyuan()
    inputs = _inputs()
    with torch.no_grad():
        ref = output_tensor(model(**inputs))
    before = snapshot(model)
    report = ldmopt.patch(model)
    # The token refiner's attention has diffusers' plain processor: not this rule's.
    assert report.counts().get("hunyuan_video_qk_norm_rope") == 2, str(report)
    assert not report.skipped, str(report)
    with torch.no_grad(), ldmopt.use_backend("triton"):
        out = output_tensor(model(**inputs))
    assert not report.fallbacks(), report.fallbacks()
    assert_close(out, ref.double(), torch.float32, "hunyuan video")
    ldmopt.unpatch(model)
    assert_same_snapshot(before, snapshot(model))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("stream", ["dual", "single"])
def test_half_attention_within_torch_error(dtype, stream):
    model = _hunyuan()
    attn = _stream(model, stream)
    video, text, tables = _attention_args(model)
    with torch.no_grad():
        exact = copy.deepcopy(attn).double()(
            video.double(), text.double(), image_rotary_emb=tuple(t.double() for t in tables)
        )
        low = copy.deepcopy(attn).to(dtype)
        stock = low(video.to(dtype), text.to(dtype), image_rotary_emb=tables)
        report = ldmopt.patch(low)
        assert report.counts() == {"hunyuan_video_qk_norm_rope": 1}
        with ldmopt.use_backend("triton"):
            fused = low(video.to(dtype), text.to(dtype), image_rotary_emb=tables)
    op, calls = KERNELS[stream]
    assert not report.fallbacks() and report.backends() == {op: {"triton": calls}}, report.backends()
    for got, want, ref, name in zip(fused, stock, exact, ("video", "text")):
        assert got.dtype == want.dtype == dtype
        assert_within_torch_error(got, ref, want, f"hunyuan {stream} {name} {dtype}")


@pytest.mark.parametrize("stream", ["dual", "single"])
def test_gradients_match_stock(stream):
    model = _hunyuan().train()
    video, text, tables = _attention_args(model)
    call = lambda attn, v, t: attn(v, t, image_rotary_emb=tables)
    op, calls = KERNELS[stream]
    assert_fused_grads_match_stock(_stream(model, stream), call, [video, text], rms_norm_calls=calls, op=op)


def test_other_processors_and_calls_keep_the_stock_forward():
    from diffusers.models.transformers.transformer_hunyuan_video import HunyuanVideoAttnProcessor2_0

    class MyProcessor(HunyuanVideoAttnProcessor2_0):
        pass

    model = _hunyuan()
    model.single_transformer_blocks[0].attn.set_processor(MyProcessor())
    report = ldmopt.patch(model)
    assert report.counts().get("hunyuan_video_qk_norm_rope") == 1, str(report)
    attn = model.transformer_blocks[0].attn
    video, text, tables = _attention_args(model)
    with torch.no_grad():
        fused = attn(video, text, image_rotary_emb=tables)
        no_rope = attn(video, text)
        attn.set_processor(MyProcessor())
        swapped = attn(video, text, image_rotary_emb=tables)
        stock_no_rope = attn(video, text)
    for got, want in zip((*fused, *no_rope), (*swapped, *stock_no_rope)):
        assert_close(got, want.double(), torch.float32, "stock paths")
    reasons = " | ".join(report.fallbacks())
    assert "MyProcessor" in reasons and "without image_rotary_emb" in reasons, reasons


def test_patched_attention_compiles_fullgraph():
    torch._dynamo.reset()
    model = _hunyuan()
    report = ldmopt.patch(model)
    video, text, tables = _attention_args(model)
    attn = model.single_transformer_blocks[0].attn
    fn = lambda v, t: attn(v, t, image_rotary_emb=tables)
    with torch.no_grad():
        eager = fn(video, text)
        compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)(video, text)
    for got, want in zip(compiled, eager):
        assert_close(got, want.double(), torch.float32, "compiled hunyuan attention")
    assert not report.fallbacks(), report.fallbacks()


def test_under_autocast_matches_stock():
    """fp32 model under bf16 autocast: diffusers' RMSNorm with its fp32 weight returns fp32 q/k from bf16
    projections; the fused norms must too (the norm family only: the interpreter's bf16 tl.dot is wrong on CPU)."""
    model = _hunyuan()
    stock_model = copy.deepcopy(model)
    inputs = _inputs()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        ref = output_tensor(model(**inputs))
    report = ldmopt.patch(model, families=["rms_norm"])
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16), ldmopt.use_backend("triton"):
        out = output_tensor(model(**inputs))
    assert out.dtype == ref.dtype and not report.fallbacks(), report.fallbacks()
    assert_close(out, ref.double(), torch.bfloat16, "hunyuan under autocast")
    video, text, tables = _attention_args(model)
    for stream in ("dual", "single"):  # the dtypes the stock processor returns under autocast
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16), ldmopt.use_backend("triton"):
            fused = _stream(model, stream)(video, text, image_rotary_emb=tables)
            stock = _stream(stock_model, stream)(video, text, image_rotary_emb=tables)
        assert [t.dtype for t in fused] == [t.dtype for t in stock], stream
        assert type(_stream(model, stream)) is not type(_stream(stock_model, stream))  # fused vs stock indeed


def test_empty_text_and_tensor_parallel_heads():
    """An empty text stream runs stock (which accepts one); with heads sharded (local head count, global inner_dim)
    the head size is the norms' width and the fusion stays."""
    model = _hunyuan()
    attn = model.transformer_blocks[0].attn
    video, text, tables = _attention_args(model)
    with torch.no_grad():
        stock_empty = attn(video, text[:, :0], image_rotary_emb=tables)
        report = ldmopt.patch(model)
        empty = attn(video, text[:, :0], image_rotary_emb=tables)
    assert [t.shape for t in empty] == [t.shape for t in stock_empty]
    assert any("not non-empty" in r for r in report.fallbacks()), report.fallbacks()
    ldmopt.unpatch(model)
    with torch.no_grad():  # keep head 0 only: what one rank of two holds
        for proj in (attn.to_q, attn.to_k, attn.to_v, attn.add_q_proj, attn.add_k_proj, attn.add_v_proj):
            proj.weight.data, proj.bias.data = proj.weight.data[:16], proj.bias.data[:16]
        for proj in (attn.to_out[0], attn.to_add_out):
            proj.weight.data = proj.weight.data[:, :16]
        attn.heads = 1
        stock = attn(video, text, image_rotary_emb=tables)
        report = ldmopt.patch(attn)
        assert report.counts() == {"hunyuan_video_qk_norm_rope": 1}, str(report)
        with ldmopt.use_backend("triton"):
            fused = attn(video, text, image_rotary_emb=tables)
    assert not report.fallbacks(), report.fallbacks()
    for got, want in zip(fused, stock):
        assert_close(got, want.double(), torch.float32, "one rank's heads")
