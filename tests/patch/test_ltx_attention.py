"""The ``ltx_qk_norm_rope`` rule: LTX-Video attention (query/key RMSNorm across heads + RoPE in one row kernel each;
the cross-attention's norms alone) against diffusers' LTXVideoAttnProcessor, fp32 and half precision, forward and
backward."""

import copy

import pytest
import torch

import ldmopt
from tests.patch.helpers import assert_fused_grads_match_stock, assert_same_snapshot, snapshot, with_nontrivial_norms
from tests.tolerances import assert_close, assert_within_torch_error

diffusers = pytest.importorskip("diffusers")
from diffusers.models.transformers.transformer_ltx import LTXAttention  # noqa: E402

FRAMES, HEIGHT, WIDTH, TEXT = 2, 3, 5, 6  # 30 video tokens, odd


def _model(seed=0):
    torch.manual_seed(seed)
    model = diffusers.LTXVideoTransformer3DModel(
        in_channels=8, out_channels=8, num_attention_heads=2, attention_head_dim=12, cross_attention_dim=24,
        num_layers=2, caption_channels=16,
    )  # fmt: skip
    return with_nontrivial_norms(model)


def _inputs(batch=2):
    return dict(
        hidden_states=torch.randn(batch, FRAMES * HEIGHT * WIDTH, 8),
        encoder_hidden_states=torch.randn(batch, TEXT, 16),
        timestep=torch.tensor([3, 700][:batch]),
        encoder_attention_mask=torch.tensor([[1] * TEXT, [1] * 4 + [0] * 2])[:batch],
        num_frames=FRAMES, height=HEIGHT, width=WIDTH, return_dict=False,
    )  # fmt: skip


def _attention(seed=1):
    torch.manual_seed(seed)
    return with_nontrivial_norms(LTXAttention(query_dim=24, heads=2, kv_heads=2, dim_head=12).eval())


def _tables(batch, tokens=FRAMES * HEIGHT * WIDTH, width=24):
    theta = torch.randn(batch, tokens, width // 2, dtype=torch.float64) * 3
    return tuple(t.repeat_interleave(2, -1).float() for t in (theta.cos(), theta.sin()))


def test_model_matches_stock():
    model, inputs = _model(), _inputs()
    with torch.no_grad():
        ref = model(**inputs)[0]
    before = snapshot(model)
    report = ldmopt.patch(model, families=["rms_norm"])
    # attn1 and attn2 of two blocks; the blocks' own norm1/norm2 are diffusers RMSNorms (rule rms_norm)
    assert report.counts() == {"ltx_qk_norm_rope": 2 * 2, "rms_norm": 2 * 2}, str(report)
    with torch.no_grad(), ldmopt.use_backend("triton"):
        out = model(**inputs)[0]
    kernels = 2 * 2 * 2 + 2 * 2  # q and k of four attentions, and the blocks' norms
    assert not report.fallbacks() and report.backends() == {"rms_norm": {"triton": kernels}}, report.backends()
    assert_close(out, ref.double(), torch.float32, "ltx")
    ldmopt.unpatch(model)
    assert_same_snapshot(before, snapshot(model))


@pytest.mark.parametrize("table_batch", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_half_attention_within_torch_error(table_batch, dtype):
    """Tables for the batch (one per position) or per sample (one per row of q); the fused kernel rounds once,
    diffusers rounds the norm's output, then the rotation's: both against fp64."""
    attn = _attention()
    hidden, tables = torch.randn(2, FRAMES * HEIGHT * WIDTH, 24), _tables(table_batch)
    with torch.no_grad():
        exact = copy.deepcopy(attn).double()(hidden.double(), image_rotary_emb=tuple(t.double() for t in tables))
        low = copy.deepcopy(attn).to(dtype)
        stock = low(hidden.to(dtype), image_rotary_emb=tables)
        report = ldmopt.patch(low)
        with ldmopt.use_backend("triton"):
            fused = low(hidden.to(dtype), image_rotary_emb=tables)
    assert report.counts() == {"ltx_qk_norm_rope": 1} and not report.fallbacks(), str(report)
    assert fused.dtype == stock.dtype == dtype
    assert_within_torch_error(fused, exact, stock, f"ltx tables[{table_batch}] {dtype}")


def test_gradients_match_stock():
    attn = _attention().train()
    hidden, tables = torch.randn(2, FRAMES * HEIGHT * WIDTH, 24), _tables(2)
    call = lambda a, h: a(h, image_rotary_emb=tables)
    assert_fused_grads_match_stock(attn, call, [hidden], rms_norm_calls=2)


def test_patched_attention_compiles_fullgraph():
    torch._dynamo.reset()
    attn = _attention()
    report = ldmopt.patch(attn)
    hidden, tables = torch.randn(2, FRAMES * HEIGHT * WIDTH, 24), _tables(1)
    with torch.no_grad():
        eager = attn(hidden, image_rotary_emb=tables)
        compiled = torch.compile(attn, backend="aot_eager", fullgraph=True)(hidden, image_rotary_emb=tables)
    assert_close(compiled, eager.double(), torch.float32, "compiled ltx attention")
    assert not report.fallbacks(), report.fallbacks()


def test_other_processors_and_tables_run_stock():
    class MyProcessor(diffusers.models.transformers.transformer_ltx.LTXVideoAttnProcessor):
        pass

    attn, other = _attention(), _attention()
    reference = copy.deepcopy(attn)  # stays stock
    other.set_processor(MyProcessor())
    report = ldmopt.patch(torch.nn.ModuleList([attn, other]))
    assert report.counts() == {"ltx_qk_norm_rope": 1}, str(report)
    assert any("MyProcessor" in why for s in report.skipped for why in s.reasons), str(report)
    hidden = torch.randn(2, FRAMES * HEIGHT * WIDTH, 24)
    wrong = tuple(t[:, 1:] for t in _tables(2))  # one token fewer than the queries
    with torch.no_grad(), pytest.raises(RuntimeError):  # diffusers' own error, from the stock path
        attn(hidden, image_rotary_emb=wrong)
    # Tables with a context (the processor would rotate the context's keys by them) and an empty context: stock.
    calls = [dict(encoder_hidden_states=hidden[:1], image_rotary_emb=_tables(2)),
             dict(encoder_hidden_states=hidden[:, :0], image_rotary_emb=None)]  # fmt: skip
    with torch.no_grad():
        stock = [reference(hidden, **kw) for kw in calls]
        fused = [attn(hidden, **kw) for kw in calls]
    for got, want in zip(fused, stock):
        assert torch.equal(got, want)
    reasons = " | ".join(report.fallbacks())
    assert "rotary tables of shape" in reasons and "with encoder_hidden_states" in reasons, reasons
    assert "not non-empty [B, S, C]" in reasons, reasons
