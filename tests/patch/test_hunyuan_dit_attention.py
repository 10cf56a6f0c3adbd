"""The ``hunyuan_dit_qk_norm_rope`` rule: HunyuanDiT attention (per-head query/key LayerNorm + RoPE in one row kernel
per tensor) against diffusers' HunyuanAttnProcessor2_0, self- and cross-attention, fp32 and half precision, forward
and backward."""

import copy

import pytest
import torch

import ldmopt
from tests.patch.helpers import assert_fused_grads_match_stock, assert_same_snapshot, snapshot, with_nontrivial_norms
from tests.tolerances import assert_close, assert_within_torch_error

diffusers = pytest.importorskip("diffusers")
from diffusers.models.attention_processor import Attention, HunyuanAttnProcessor2_0  # noqa: E402

HEAD, TOKENS, CONTEXT = 8, 16, 5  # 8 x 8 latents in 2 x 2 patches


def _model(seed=0):
    torch.manual_seed(seed)
    model = diffusers.HunyuanDiT2DModel(
        num_attention_heads=2, attention_head_dim=HEAD, in_channels=4, patch_size=2, sample_size=8, hidden_size=16,
        num_layers=4, cross_attention_dim=24, cross_attention_dim_t5=32, pooled_projection_dim=12, text_len=CONTEXT,
        text_len_t5=6,
    )  # fmt: skip
    return with_nontrivial_norms(model)


def _tables(dtype=torch.float32):
    theta = torch.randn(TOKENS, HEAD // 2, dtype=torch.float64) * 3
    return tuple(t.repeat_interleave(2, -1).to(dtype) for t in (theta.cos(), theta.sin()))


def _inputs(batch=2):
    return dict(
        hidden_states=torch.randn(batch, 4, 8, 8), timestep=torch.tensor([3.0, 500.0][:batch]),
        encoder_hidden_states=torch.randn(batch, CONTEXT, 24), text_embedding_mask=torch.ones(batch, CONTEXT),
        encoder_hidden_states_t5=torch.randn(batch, 6, 32), text_embedding_mask_t5=torch.ones(batch, 6),
        image_meta_size=torch.randn(batch, 6), style=torch.zeros(batch, dtype=torch.long), image_rotary_emb=_tables(),
        return_dict=False,
    )  # fmt: skip


def _attention(kind, seed=1):
    torch.manual_seed(seed)
    attn = Attention(
        query_dim=2 * HEAD, cross_attention_dim=24 if kind == "cross" else None, dim_head=HEAD, heads=2,
        qk_norm="layer_norm", eps=1e-6, bias=True, processor=HunyuanAttnProcessor2_0(),
    ).eval()  # fmt: skip
    return with_nontrivial_norms(attn)


def _attention_args(kind, batch=2):
    context = torch.randn(batch, CONTEXT, 24) if kind == "cross" else None
    return torch.randn(batch, TOKENS, 2 * HEAD), context, _tables()


def test_model_matches_stock():
    model, inputs = _model(), _inputs()
    with torch.no_grad():
        ref = model(**inputs)[0]
    before = snapshot(model)
    report = ldmopt.patch(model, families=["rms_norm"])
    assert report.counts() == {"hunyuan_dit_qk_norm_rope": 2 * 4}, str(report)  # attn1 and attn2 of 4 blocks
    with torch.no_grad(), ldmopt.use_backend("triton"):
        out = model(**inputs)[0]
    assert not report.fallbacks() and report.backends() == {"rms_norm": {"triton": 2 * 8}}, report.backends()
    assert_close(out, ref.double(), torch.float32, "hunyuan-dit")
    ldmopt.unpatch(model)
    assert_same_snapshot(before, snapshot(model))


@pytest.mark.parametrize("kind", ["self", "cross"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_half_attention_within_torch_error(kind, dtype):
    """The fused kernel rounds once; diffusers rounds the norm's output, then the rotation's: both against fp64. The
    cross-attention rotates its queries only."""
    attn = _attention(kind)
    hidden, context, tables = _attention_args(kind)
    cast = lambda t, d: t.to(d) if t is not None else None
    with torch.no_grad():
        exact = copy.deepcopy(attn).double()(
            hidden.double(), cast(context, torch.float64), image_rotary_emb=tuple(t.double() for t in tables)
        )
        low = copy.deepcopy(attn).to(dtype)
        stock = low(hidden.to(dtype), cast(context, dtype), image_rotary_emb=tables)
        report = ldmopt.patch(low)
        with ldmopt.use_backend("triton"):
            fused = low(hidden.to(dtype), cast(context, dtype), image_rotary_emb=tables)
    assert report.counts() == {"hunyuan_dit_qk_norm_rope": 1} and not report.fallbacks(), str(report)
    assert fused.dtype == stock.dtype == dtype
    assert_within_torch_error(fused, exact, stock, f"hunyuan-dit {kind} {dtype}")


@pytest.mark.parametrize("kind", ["self", "cross"])
def test_gradients_match_stock(kind):
    attn = _attention(kind).train()
    hidden, context, tables = _attention_args(kind)
    inputs = [hidden] if context is None else [hidden, context]
    call = lambda a, h, c=None: a(h, c, image_rotary_emb=tables)
    assert_fused_grads_match_stock(attn, call, inputs, rms_norm_calls=2)


def test_patched_attention_compiles_fullgraph():
    torch._dynamo.reset()
    attn = _attention("self")
    report = ldmopt.patch(attn)
    hidden, _, tables = _attention_args("self")
    with torch.no_grad():
        eager = attn(hidden, image_rotary_emb=tables)
        compiled = torch.compile(attn, backend="aot_eager", fullgraph=True)(hidden, image_rotary_emb=tables)
    assert_close(compiled, eager.double(), torch.float32, "compiled hunyuan-dit attention")
    assert not report.fallbacks(), report.fallbacks()


def test_masked_4d_and_mismatched_calls_run_stock():
    attn = _attention("self")
    hidden, _, tables = _attention_args("self")
    mask = torch.zeros(2, TOKENS)
    image = hidden.unflatten(1, (4, 4)).movedim(-1, 1).contiguous()  # 4-D [B, C, H, W]: the processor flattens it
    context = torch.randn(1, CONTEXT, 2 * HEAD)  # one sample of context for two of queries: stock re-batches it
    calls = [dict(hidden_states=hidden, attention_mask=mask), dict(hidden_states=image),
             dict(hidden_states=hidden, encoder_hidden_states=context, image_rotary_emb=None)]  # fmt: skip
    with torch.no_grad():
        stock = [attn(**{"image_rotary_emb": tables, **kw}) for kw in calls]
        report = ldmopt.patch(attn)
        fused = [attn(**{"image_rotary_emb": tables, **kw}) for kw in calls]
    for got, want in zip(fused, stock):
        assert torch.equal(got, want)
    reasons = " | ".join(report.fallbacks())
    assert "attention_mask" in reasons and "not non-empty [B, S, C]" in reasons, reasons
    assert "the queries' batch" in reasons, reasons


def test_norm_only_without_tables_matches_stock():
    """Without rotary tables (HunyuanDiT always passes them, other users may not) only the norms run fused."""
    attn = _attention("self")
    hidden, _, _ = _attention_args("self")
    with torch.no_grad():
        stock = attn(hidden)
        report = ldmopt.patch(attn)
        with ldmopt.use_backend("triton"):
            fused = attn(hidden)
    assert not report.fallbacks() and report.backends() == {"rms_norm": {"triton": 2}}, report.backends()
    assert_close(fused, stock.double(), torch.float32, "norms only")
