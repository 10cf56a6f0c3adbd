"""The ``flux_qk_norm_rope`` rule: Flux attention (per-head query/key RMSNorm of both streams + RoPE in one row kernel
per tensor) against diffusers' FluxAttnProcessor, in fp32 and half precision, forward and backward."""

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
TEXT, HEIGHT, WIDTH = 5, 3, 7  # odd token counts


def _flux(seed=0):
    torch.manual_seed(seed)
    model = diffusers.FluxTransformer2DModel(
        patch_size=1, in_channels=8, num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=3,
        joint_attention_dim=24, pooled_projection_dim=12, axes_dims_rope=(4, 6, 6),
    )  # fmt: skip
    return with_nontrivial_norms(model)


def _inputs(batch=2):
    ids = torch.stack(torch.meshgrid(torch.arange(HEIGHT), torch.arange(WIDTH), indexing="ij"), -1).reshape(-1, 2)
    img_ids = torch.cat([torch.zeros(len(ids), 1), ids.float()], dim=1)
    return dict(
        hidden_states=R(batch, HEIGHT * WIDTH, 8), encoder_hidden_states=R(batch, TEXT, 24),
        pooled_projections=R(batch, 12), timestep=torch.tensor([0.3, 0.7][:batch]), img_ids=img_ids,
        txt_ids=torch.zeros(TEXT, 3), return_dict=False,
    )  # fmt: skip


def _attention_args(model, batch=2):
    """(hidden [B, S, C], text [B, T, C], rotary tables [T + S, D]) as the double-stream block's attention sees them."""
    inputs = _inputs(batch)
    tables = model.pos_embed(torch.cat([inputs["txt_ids"], inputs["img_ids"]], dim=0))
    dim = model.config.num_attention_heads * model.config.attention_head_dim
    return R(batch, HEIGHT * WIDTH, dim), R(batch, TEXT, dim), tables


@pytest.mark.parametrize("fused_projections", [False, True])
def test_flux_model_matches_stock(fused_projections):
    model = _flux()
    if fused_projections:
        model.fuse_qkv_projections()
    inputs = _inputs()
    with torch.no_grad():
        ref = output_tensor(model(**inputs))
    before = snapshot(model)
    report = ldmopt.patch(model)
    assert report.counts().get("flux_qk_norm_rope") == 2, str(report)  # the double and the single block
    with torch.no_grad(), ldmopt.use_backend("triton"):
        out = output_tensor(model(**inputs))
    assert not report.fallbacks(), report.fallbacks()
    assert_close(out, ref.double(), torch.float32, f"flux fused_projections={fused_projections}")
    ldmopt.unpatch(model)
    assert type(model.transformer_blocks[0].attn).__name__ == "FluxAttention"
    assert_same_snapshot(before, snapshot(model))


def _as_tuple(out):
    return out if isinstance(out, tuple) else (out,)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("stream", ["double", "single"])
def test_half_attention_within_torch_error(dtype, stream):
    """The fused kernel rounds once; diffusers rounds the norm's output, then the rotation's: both against fp64."""
    model = _flux()
    hidden, text, tables = _attention_args(model)
    if stream == "double":
        attn, args = model.transformer_blocks[0].attn, (hidden, text)
    else:  # the single-stream blocks attend over [text, image] with no text projections
        attn, args = model.single_transformer_blocks[0].attn, (torch.cat([text, hidden], dim=1), None)
    cast = lambda d: tuple(a.to(d) if a is not None else None for a in args)
    with torch.no_grad():
        exact = _as_tuple(copy.deepcopy(attn).double()(*cast(torch.float64), None, tuple(t.double() for t in tables)))
        low = copy.deepcopy(attn).to(dtype)
        stock = _as_tuple(low(*cast(dtype), None, tables))
        report = ldmopt.patch(low)
        assert report.counts() == {"flux_qk_norm_rope": 1}
        with ldmopt.use_backend("triton"):
            fused = _as_tuple(low(*cast(dtype), None, tables))
    # Double stream: q and k each one joint kernel over [text | image]; single stream: q and k in place.
    op = "rms_norm_joint" if stream == "double" else "rms_norm"
    assert not report.fallbacks() and report.backends() == {op: {"triton": 2}}, report.backends()
    assert len(fused) == len(stock) == len(exact) == (2 if stream == "double" else 1)
    for got, want, ref, name in zip(fused, stock, exact, ("image", "text")):
        assert got.dtype == want.dtype == dtype
        assert_within_torch_error(got, ref, want, f"flux {stream} {name} {dtype}")


def test_gradients_match_stock():
    model = _flux().train()
    hidden, text, tables = _attention_args(model)
    call = lambda attn, h, t: attn(h, t, None, tables)
    assert_fused_grads_match_stock(
        model.transformer_blocks[0].attn, call, [hidden, text], rms_norm_calls=2, op="rms_norm_joint"
    )


def test_double_stream_concatenates_only_the_values():
    """The joint kernel writes [text | image] q and k itself: of the stock processor's three concatenations of the
    streams (q, k, v), only the values' remains."""
    from tests.patch.helpers import DispatchedOps

    model = _flux()
    attn = model.transformer_blocks[0].attn
    hidden, text, tables = _attention_args(model)
    joint = (2, TEXT + HEIGHT * WIDTH, 3, 16)
    with torch.no_grad(), DispatchedOps() as stock_ops:
        ref = attn(hidden, text, None, tables)
    ldmopt.patch(model)
    with torch.no_grad(), ldmopt.use_backend("triton"), DispatchedOps() as fused_ops:
        out = attn(hidden, text, None, tables)
    assert stock_ops.shapes("aten.cat").count(joint) == 3
    assert fused_ops.shapes("aten.cat").count(joint) == 1, fused_ops.shapes("aten.cat")
    for got, want in zip(out, ref):
        assert_close(got, want.double(), torch.float32, "joint q/k")


def test_norms_of_different_eps_run_per_stream():
    """norm_added_q and norm_q with different epsilons cannot share one kernel's statistics: one call per stream,
    then the concatenation, still matching diffusers."""
    model = _flux()
    attn = model.transformer_blocks[0].attn
    attn.norm_added_q.eps, attn.norm_k.eps = 1e-2, None  # None: torch's default, the dtype's machine epsilon
    hidden, text, tables = _attention_args(model)
    with torch.no_grad():
        ref = attn(hidden, text, None, tables)
    report = ldmopt.patch(model)
    with torch.no_grad(), ldmopt.use_backend("triton"):
        out = attn(hidden, text, None, tables)
    assert report.backends() == {"rms_norm": {"triton": 4}}, report.backends()
    for got, want in zip(out, ref):
        assert_close(got, want.double(), torch.float32, "per-stream eps")


def test_other_processors_and_calls_keep_the_stock_forward():
    class MyProcessor(diffusers.models.transformers.transformer_flux.FluxAttnProcessor):
        pass

    model = _flux()
    model.single_transformer_blocks[0].attn.set_processor(MyProcessor())
    report = ldmopt.patch(model)
    assert report.counts().get("flux_qk_norm_rope") == 1, str(report)
    assert any("MyProcessor" in why for s in report.skipped for why in s.reasons), str(report)

    attn = model.transformer_blocks[0].attn
    hidden, text, (cos, sin) = _attention_args(model)
    with torch.no_grad():
        ldmopt.unpatch(model)
        stock = [attn(hidden, text, None, (cos, sin)), attn(hidden, text, None, None)]
        report = ldmopt.patch(model)
        no_rope = attn(hidden, text, None, None)
        with pytest.raises(RuntimeError, match="must match the size"):  # diffusers' own error, from the stock path
            attn(hidden[:, :-1], text, None, (cos, sin))  # tables for one token more than given
    assert_close(no_rope[0], stock[1][0].double(), torch.float32, "no rotary")
    reasons = " | ".join(report.fallbacks())
    assert "without image_rotary_emb" in reasons and "rotary tables of shape" in reasons, reasons


def test_no_text_tokens_run_stock():
    """An empty text stream (a prompt of zero tokens): the stock forward, which returns an empty text output."""
    model = _flux()
    attn = model.transformer_blocks[0].attn
    hidden, text, (cos, sin) = _attention_args(model)
    text, cos, sin = text[:, :0], cos[TEXT:], sin[TEXT:]
    with torch.no_grad():
        ref = attn(hidden, text, None, (cos, sin))
        report = ldmopt.patch(model)
        out = attn(hidden, text, None, (cos, sin))
    assert out[1].shape == ref[1].shape == text.shape
    assert_close(out[0], ref[0].double(), torch.float32, "image stream")
    assert "not non-empty [B, S, C]" in " | ".join(report.fallbacks()), report.fallbacks()


def test_hooked_norm_runs_stock():
    model = _flux()
    attn = model.transformer_blocks[0].attn
    hidden, text, tables = _attention_args(model)
    with torch.no_grad():
        ref = attn(hidden, text, None, tables)
    report = ldmopt.patch(model)
    calls = []
    attn.norm_added_k.register_forward_hook(lambda mod, args, out: calls.append(1))
    with torch.no_grad():
        out = attn(hidden, text, None, tables)
    assert calls == [1]
    for got, want in zip(out, ref):
        assert_close(got, want.double(), torch.float32, "hooked norm_added_k")
    assert any("norm_added_k" in r for r in report.fallbacks()), report.fallbacks()


def test_patched_attention_compiles_fullgraph():
    torch._dynamo.reset()
    model = _flux()
    attn = model.transformer_blocks[0].attn
    report = ldmopt.patch(model)
    hidden, text, tables = _attention_args(model)
    with torch.no_grad():
        eager = attn(hidden, text, None, tables)
        compiled = torch.compile(attn, backend="aot_eager", fullgraph=True)(hidden, text, None, tables)
    for got, want in zip(compiled, eager):
        assert_close(got, want.double(), torch.float32, "compiled flux attention")
    assert not report.fallbacks(), report.fallbacks()


def test_tables_on_another_device_and_ip_adapter_inputs():
    """apply_rotary_emb moves the tables to the tokens' device (ids left on the CPU); FluxAttention.forward drops
    IP-Adapter inputs quietly for a stock processor: both keep the fused path, as both work on the stock one."""
    model = _flux()
    attn = model.transformer_blocks[0].attn.to("meta")
    hidden, text, tables = _attention_args(model)
    hidden, text = hidden.to("meta"), text.to("meta")
    ip = dict(ip_hidden_states=[R(2, 4, 48)])
    with torch.no_grad():
        stock = attn(hidden, text, None, tables, **ip)
        report = ldmopt.patch(attn)
        fused = attn(hidden, text, None, tables, **ip)
    assert [t.shape for t in fused] == [t.shape for t in stock] and fused[0].device.type == "meta"
    assert not report.fallbacks(), report.fallbacks()


def test_under_autocast_matches_stock():
    """fp32 model under bf16 autocast: the projections hand bf16 q/k to the fused norms, whose fp32 weights the
    kernel reads as they are; stock's norm runs on the same bf16 inputs. (The other families' GEMMs are left out:
    the Triton interpreter computes bf16 tl.dot wrongly on the CPU.)"""
    model = _flux()
    inputs = _inputs()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        ref = output_tensor(model(**inputs))
    report = ldmopt.patch(model, families=["rms_norm"])
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16), ldmopt.use_backend("triton"):
        out = output_tensor(model(**inputs))
    assert out.dtype == ref.dtype == torch.bfloat16
    assert report.counts() == {"flux_qk_norm_rope": 2} and not report.fallbacks()
    assert_close(out, ref.double(), torch.bfloat16, "flux under autocast")
