"""The ``qwen_qk_norm_rope`` rule: Qwen-Image attention (diffusers' per-head RMSNorms of both streams + the complex
RoPE in one row kernel per tensor) against QwenDoubleStreamAttnProcessor2_0, fp32 and half, forward and backward."""

import copy
import inspect

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
FRAMES, HEIGHT, WIDTH, TEXT = 1, 3, 5, 7  # patches; odd token counts


def _qwen(seed=0):
    torch.manual_seed(seed)
    model = diffusers.QwenImageTransformer2DModel(
        patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=24, axes_dims_rope=(4, 6, 6),
    )  # fmt: skip
    return with_nontrivial_norms(model)


#: diffusers before 0.37 sized the text's rotary tables from per-prompt ``txt_seq_lens`` (and did not mask padding).
TEXT_LENGTHS_API = "txt_seq_lens" in inspect.signature(diffusers.QwenImageTransformer2DModel.forward).parameters


def _inputs(batch=2, padded=True):
    mask = torch.ones(batch, TEXT)
    if padded:
        mask[-1, TEXT - 2 :] = 0  # the last prompt is shorter: its padding is masked out of the joint attention
    inputs = dict(
        hidden_states=R(batch, FRAMES * HEIGHT * WIDTH, 16), encoder_hidden_states=R(batch, TEXT, 24),
        encoder_hidden_states_mask=mask, timestep=torch.tensor([0.3, 0.7][:batch]),
        img_shapes=[[(FRAMES, HEIGHT, WIDTH)]] * batch, return_dict=False,
    )  # fmt: skip
    return {**inputs, "txt_seq_lens": [TEXT] * batch} if TEXT_LENGTHS_API else inputs


def _attention_args(model, batch=2):
    """(image [B, S, C], text [B, T, C], rotary tables) as the blocks' attention sees them."""
    shapes, text, cpu = [[(FRAMES, HEIGHT, WIDTH)]] * batch, TEXT, torch.device("cpu")
    if TEXT_LENGTHS_API:
        tables = model.pos_embed(shapes, [text] * batch, device=cpu)
    else:
        tables = model.pos_embed(shapes, max_txt_seq_len=text, device=cpu)
    dim = model.config.num_attention_heads * model.config.attention_head_dim
    return R(batch, FRAMES * HEIGHT * WIDTH, dim), R(batch, TEXT, dim), tables


@pytest.mark.parametrize("padded", [False, True])
def test_qwen_model_matches_stock(padded):
    model = _qwen()
    inputs = _inputs(padded=padded)
    with torch.no_grad():
        ref = output_tensor(model(**inputs))
    before = snapshot(model)
    report = ldmopt.patch(model)
    assert report.counts().get("qwen_qk_norm_rope") == 2, str(report)
    assert report.counts().get("rms_norm") == 1  # the text input's norm; the attention norms are the rule's
    with torch.no_grad(), ldmopt.use_backend("triton"):
        out = output_tensor(model(**inputs))
    assert not report.fallbacks(), report.fallbacks()
    assert_close(out, ref.double(), torch.float32, f"qwen padded={padded}")
    ldmopt.unpatch(model)
    assert type(model.transformer_blocks[0].attn).__name__ == "Attention"
    assert_same_snapshot(before, snapshot(model))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_half_attention_within_torch_error(dtype):
    """The fused kernel rounds once; diffusers rounds the norm's output, then the rotation's: both against fp64."""
    model = _qwen()
    attn = model.transformer_blocks[0].attn
    image, text, tables = _attention_args(model)
    mask = torch.ones(2, TEXT)
    kwargs = dict(encoder_hidden_states_mask=mask, image_rotary_emb=tables)
    with torch.no_grad():
        wide = dict(encoder_hidden_states_mask=mask, image_rotary_emb=tuple(t.to(torch.complex128) for t in tables))
        exact = copy.deepcopy(attn).double()(image.double(), text.double(), **wide)
        low = copy.deepcopy(attn).to(dtype)
        stock = low(image.to(dtype), text.to(dtype), **kwargs)
        report = ldmopt.patch(low)
        assert report.counts() == {"qwen_qk_norm_rope": 1}
        with ldmopt.use_backend("triton"):
            fused = low(image.to(dtype), text.to(dtype), **kwargs)
    # q and k: one kernel each over [text | image] (the joint tensor its only write)
    assert not report.fallbacks() and report.backends() == {"rms_norm_joint": {"triton": 2}}, report.backends()
    for got, want, ref, name in zip(fused, stock, exact, ("image", "text")):
        assert got.dtype == want.dtype == dtype
        assert_within_torch_error(got, ref, want, f"qwen {name} {dtype}")


def test_norms_of_different_eps_or_dtypes_run_per_stream():
    """Streams whose norms differ in epsilon (q) or output dtype (k: a half-precision weight makes diffusers' RMSNorm
    return its dtype) cannot share one kernel: one call per stream, then the concatenation, as diffusers computes."""
    model = _qwen()
    attn = model.transformer_blocks[0].attn
    attn.norm_added_q.eps = 1e-3
    attn.norm_k.weight.data = attn.norm_k.weight.data.half()
    image, text, tables = _attention_args(model)
    kwargs = dict(encoder_hidden_states_mask=None, image_rotary_emb=tables)
    with torch.no_grad():
        ref = attn(image, text, **kwargs)
        report = ldmopt.patch(model)
        with ldmopt.use_backend("triton"):
            out = attn(image, text, **kwargs)
    assert report.backends() == {"rms_norm": {"triton": 4}}, report.backends()
    for got, want in zip(out, ref):
        assert_close(got, want.double(), torch.float16, "per-stream eps / dtypes")


def test_gradients_match_stock():
    model = _qwen().train()
    image, text, tables = _attention_args(model)
    call = lambda attn, i, t: attn(i, t, encoder_hidden_states_mask=None, image_rotary_emb=tables)
    assert_fused_grads_match_stock(
        model.transformer_blocks[1].attn, call, [image, text], rms_norm_calls=2, op="rms_norm_joint"
    )


def test_other_processors_and_calls_keep_the_stock_forward():
    from diffusers.models.transformers.transformer_qwenimage import QwenDoubleStreamAttnProcessor2_0

    class MyProcessor(QwenDoubleStreamAttnProcessor2_0):
        pass

    model = _qwen()
    model.transformer_blocks[1].attn.set_processor(MyProcessor())
    report = ldmopt.patch(model)
    assert report.counts().get("qwen_qk_norm_rope") == 1, str(report)
    assert report.counts().get("rms_norm") == 1 + 4  # the other block's norms now go to the rms_norm rule
    attn = model.transformer_blocks[0].attn
    image, text, tables = _attention_args(model)
    with torch.no_grad():
        fused = attn(image, text, image_rotary_emb=tables)
        attn.set_processor(MyProcessor())  # after patch: counted per call
        swapped = attn(image, text, image_rotary_emb=tables)
    for got, want in zip(fused, swapped):
        assert_close(got, want.double(), torch.float32, "user processor")
    assert any("MyProcessor" in r for r in report.fallbacks()), report.fallbacks()


def test_patched_attention_compiles_fullgraph():
    torch._dynamo.reset()
    model = _qwen()
    attn = model.transformer_blocks[0].attn
    report = ldmopt.patch(model)
    image, text, tables = _attention_args(model)
    mask = torch.ones(2, TEXT)
    fn = lambda a, b: attn(a, b, encoder_hidden_states_mask=mask, image_rotary_emb=tables)
    with torch.no_grad():
        eager = fn(image, text)
        compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)(image, text)
    for got, want in zip(compiled, eager):
        assert_close(got, want.double(), torch.float32, "compiled qwen attention")
    assert not report.fallbacks(), report.fallbacks()


def test_attention_without_norms_or_text_stream_is_skipped_with_reasons():
    from diffusers.models.attention_processor import Attention
    from diffusers.models.transformers.transformer_qwenimage import QwenDoubleStreamAttnProcessor2_0

    no_norms = Attention(query_dim=32, heads=2, dim_head=16, added_kv_proj_dim=32, context_pre_only=False,
                         bias=True, processor=QwenDoubleStreamAttnProcessor2_0(), qk_norm=None)  # fmt: skip
    report = ldmopt.patch(no_norms)
    assert not report.counts() and report.skipped, str(report)
    assert any("norm_q is NoneType" in why for s in report.skipped for why in s.reasons), str(report)
