"""The ``cogvideox_qk_norm_rope`` rule: CogVideoX attention (per-head query/key LayerNorm + RoPE of the video tokens
in one row kernel per tensor) against diffusers' CogVideoXAttnProcessor2_0, in fp32 and half precision, forward and
backward."""

import copy

import pytest
import torch

import ldmopt
from tests.patch.helpers import (
    DispatchedOps,
    assert_fused_grads_match_stock,
    assert_same_snapshot,
    output_tensor,
    snapshot,
    with_nontrivial_norms,
)
from tests.tolerances import assert_close, assert_within_torch_error

diffusers = pytest.importorskip("diffusers")
R = torch.randn
TEXT, FRAMES, HEIGHT, WIDTH, HEAD = 7, 2, 6, 8, 16  # latent frames x (6 x 8) / 2x2 patches: 24 video tokens
VIDEO = FRAMES * (HEIGHT // 2) * (WIDTH // 2)


def _model(seed=0, rope=True):
    torch.manual_seed(seed)
    model = diffusers.CogVideoXTransformer3DModel(
        num_attention_heads=2, attention_head_dim=HEAD, in_channels=4, out_channels=4, time_embed_dim=16,
        text_embed_dim=24, num_layers=2, sample_width=WIDTH, sample_height=HEIGHT, sample_frames=5,
        max_text_seq_length=TEXT, use_rotary_positional_embeddings=rope,
    )  # fmt: skip
    return with_nontrivial_norms(model)


def _tables(dtype=torch.float32):
    theta = torch.randn(VIDEO, HEAD // 2, dtype=torch.float64) * 3
    return tuple(t.repeat_interleave(2, -1).to(dtype) for t in (theta.cos(), theta.sin()))


def _inputs(batch=2, rope=True):
    return dict(
        hidden_states=R(batch, FRAMES, 4, HEIGHT, WIDTH), encoder_hidden_states=R(batch, TEXT, 24),
        timestep=torch.tensor([3, 700][:batch]), image_rotary_emb=_tables() if rope else None, return_dict=False,
    )  # fmt: skip


def _attention_args(batch=2):
    return R(batch, VIDEO, 2 * HEAD), R(batch, TEXT, 2 * HEAD), _tables()


@pytest.mark.parametrize("rope", [True, False])
def test_model_matches_stock(rope):
    model, inputs = _model(rope=rope), _inputs(rope=rope)
    with torch.no_grad():
        ref = output_tensor(model(**inputs))
    before = snapshot(model)
    report = ldmopt.patch(model, families=["rms_norm"])
    assert report.counts() == {"cogvideox_qk_norm_rope": 2}, str(report)
    with torch.no_grad(), ldmopt.use_backend("triton"), DispatchedOps() as ops:
        out = output_tensor(model(**inputs))
    assert not report.fallbacks(), report.fallbacks()
    assert report.backends() == {"rms_norm": {"triton": 2 * 2}}, report.backends()  # q and k of two layers
    assert not ops.shapes("aten.native_layer_norm", 4), "the per-head norms ran in torch"
    assert_close(out, ref.double(), torch.float32, f"cogvideox rope={rope}")
    ldmopt.unpatch(model)
    assert_same_snapshot(before, snapshot(model))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_half_attention_within_torch_error(dtype):
    """The fused kernel rounds once; diffusers rounds the norm's output, then the rotation's: both against fp64."""
    attn = _model().transformer_blocks[0].attn1
    video, text, tables = _attention_args()
    with torch.no_grad():
        exact = copy.deepcopy(attn).double()(video.double(), text.double(), image_rotary_emb=tuple(
            t.double() for t in tables))  # fmt: skip
        low = copy.deepcopy(attn).to(dtype)
        stock = low(video.to(dtype), text.to(dtype), image_rotary_emb=tables)
        report = ldmopt.patch(low)
        assert report.counts() == {"cogvideox_qk_norm_rope": 1}
        with ldmopt.use_backend("triton"):
            fused = low(video.to(dtype), text.to(dtype), image_rotary_emb=tables)
    assert not report.fallbacks()
    for got, want, ref, name in zip(fused, stock, exact, ("video", "text")):
        assert got.dtype == want.dtype == dtype
        assert_within_torch_error(got, ref, want, f"cogvideox {name} {dtype}")


def test_gradients_match_stock():
    model = _model().train()
    video, text, tables = _attention_args()
    call = lambda attn, v, t: attn(v, t, image_rotary_emb=tables)
    assert_fused_grads_match_stock(model.transformer_blocks[1].attn1, call, [video, text], rms_norm_calls=2)


def test_patched_attention_compiles_fullgraph():
    torch._dynamo.reset()
    attn = _model().transformer_blocks[0].attn1
    report = ldmopt.patch(attn)
    video, text, tables = _attention_args()
    with torch.no_grad():
        eager = attn(video, text, image_rotary_emb=tables)
        compiled = torch.compile(attn, backend="aot_eager", fullgraph=True)(video, text, image_rotary_emb=tables)
    for got, want in zip(compiled, eager):
        assert_close(got, want.double(), torch.float32, "compiled cogvideox attention")
    assert not report.fallbacks(), report.fallbacks()


def test_other_processors_and_calls_keep_the_stock_forward():
    model = _model()
    fused_qkv = diffusers.models.attention_processor.FusedCogVideoXAttnProcessor2_0()
    model.transformer_blocks[1].attn1.set_processor(fused_qkv)
    report = ldmopt.patch(model)
    assert report.counts().get("cogvideox_qk_norm_rope") == 1, str(report)
    # The rule keys on the stock processor: the fused-projection one is not matched, its module stays as it was.
    assert type(model.transformer_blocks[1].attn1) is diffusers.models.attention_processor.Attention
    attn = model.transformer_blocks[0].attn1
    video, text, tables = _attention_args()
    mask = torch.zeros(2, TEXT + VIDEO)  # additive: the processor repeats it per head
    with torch.no_grad():
        ldmopt.unpatch(model)
        stock = attn(video, text, image_rotary_emb=tables, attention_mask=mask)
        report = ldmopt.patch(model)
        masked = attn(video, text, image_rotary_emb=tables, attention_mask=mask)
        with pytest.raises(RuntimeError):  # diffusers' own error, from the stock path
            attn(video, text, image_rotary_emb=tuple(t[1:] for t in tables))  # tables for one token fewer
    for got, want in zip(masked, stock):
        assert_close(got, want.double(), torch.float32, "masked call")
    reasons = " | ".join(report.fallbacks())
    assert "attention_mask" in reasons and "rotary tables of shape" in reasons, reasons


def test_a_subclassed_processor_is_reported_as_left_stock():
    # A processor subclassing diffusers' own may change its forward: the rule leaves it stock and says so (it used to
    # count the module as patched, whose every call then ran the stock forward).
    model = _model()
    processor_class = diffusers.models.attention_processor.CogVideoXAttnProcessor2_0
    custom = type("MyCogVideoXProcessor", (processor_class,), {})
    model.transformer_blocks[1].attn1.set_processor(custom())
    report = ldmopt.patch(model)
    assert report.counts().get("cogvideox_qk_norm_rope") == 1, str(report)
    (skip,) = [s for s in report.skipped if s.rule == "cogvideox_qk_norm_rope"]
    assert skip.name == "transformer_blocks.1.attn1"
    assert skip.reasons == (
        "its processor is MyCogVideoXProcessor, a subclass of diffusers' CogVideoXAttnProcessor2_0 whose forward may "
        "differ",
    )
    assert type(model.transformer_blocks[1].attn1.processor) is custom
    ldmopt.unpatch(model)


def test_norm_weights_of_another_dtype_run_stock():
    """fp32 norms on fp16 tokens: the stock LayerNorm decides what that gives; the fused path does not guess."""
    attn = _model().transformer_blocks[0].attn1.half()
    attn.norm_q.float()
    video, text, tables = _attention_args()
    video, text = video.half(), text.half()
    with torch.no_grad():
        stock = attn(video, text, image_rotary_emb=tables)
        report = ldmopt.patch(attn)
        out = attn(video, text, image_rotary_emb=tables)
    for got, want in zip(out, stock):
        assert got.dtype == want.dtype and torch.equal(got, want)
    assert any("another dtype" in r for r in report.fallbacks()), report.fallbacks()


@pytest.mark.parametrize("kind", ["cross-attention", "no-affine"])
def test_bare_attention_variants_match_stock(kind):
    """A cross-attention (k not rotated, as the processor leaves it) and norms without affine parameters
    (CogView3-Plus's), on diffusers' Attention with the CogVideoX processor."""
    from diffusers.models.attention_processor import Attention, CogVideoXAttnProcessor2_0

    torch.manual_seed(1)
    attn = Attention(
        query_dim=2 * HEAD, dim_head=HEAD, heads=2, qk_norm="layer_norm", eps=1e-6, bias=True, out_bias=True,
        elementwise_affine=kind != "no-affine", cross_attention_dim=2 * HEAD if kind == "cross-attention" else None,
        processor=CogVideoXAttnProcessor2_0(),
    ).eval()  # fmt: skip
    with_nontrivial_norms(attn)
    assert attn.is_cross_attention == (kind == "cross-attention")
    video, text, tables = _attention_args()
    with torch.no_grad():
        stock = attn(video, text, image_rotary_emb=tables)
        report = ldmopt.patch(attn)
        with ldmopt.use_backend("triton"):
            fused = attn(video, text, image_rotary_emb=tables)
    assert report.counts() == {"cogvideox_qk_norm_rope": 1} and not report.fallbacks(), str(report)
    for got, want in zip(fused, stock):
        assert_close(got, want.double(), torch.float32, kind)
