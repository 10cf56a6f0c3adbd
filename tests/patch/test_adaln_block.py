"""The ``adaln_block`` rule's attention epilogues: in DiT ("ada_norm_zero") and PixArt/Latte ("ada_norm_single")
blocks, the self-attention's gated residual ``h + gate * attn1(...)`` and the cross-attention's ``h + attn2(...)`` run
in the output projections' GEMM epilogues. Against diffusers' own block (its default processor) in fp64, fp32 and
fp16, forward and backward, with masks and per-call fall-backs."""

import copy

import pytest
import torch

import ldmopt
from ldmopt.nn.child_check import fallback_reasons
from tests.patch.helpers import assert_fused_grads_match_stock, assert_same_snapshot, snapshot
from tests.tolerances import assert_close, assert_within_torch_error

diffusers = pytest.importorskip("diffusers")
from diffusers.models.attention import BasicTransformerBlock  # noqa: E402
from diffusers.models.attention_processor import AttnProcessor  # noqa: E402

DIM, CONTEXT_DIM, TOKENS, CONTEXT_TOKENS, BATCH = 40, 24, 37, 7, 3
# Linear GEMMs per block call: the GELU projection, one per attention epilogue, the feed-forward output's.
SITES = {"dit": 3, "pixart": 4, "latte": 3, "dit-cross": 4}


def _block(kind: str) -> BasicTransformerBlock:
    """Odd sizes (40 channels, 2 heads of 20), every weight drawn (the adaLN tables and the zero-initialised
    projections too), so that a wrong gate or a dropped add shows."""
    kwargs = dict(
        dim=DIM, num_attention_heads=2, attention_head_dim=20, activation_fn="gelu-approximate",
        norm_elementwise_affine=False,
    )  # fmt: skip
    if kind.startswith("dit"):
        kwargs.update(norm_type="ada_norm_zero", num_embeds_ada_norm=1000)
        if kind == "dit-cross":  # a DiT-style block with cross-attention: its plain norm2 feeds attn2's to_q
            kwargs.update(cross_attention_dim=CONTEXT_DIM)
    else:
        kwargs.update(norm_type="ada_norm_single", norm_eps=1e-6)
        if kind == "pixart":
            kwargs.update(cross_attention_dim=CONTEXT_DIM)
    block = BasicTransformerBlock(**kwargs).eval()
    if kind.startswith("dit"):  # no random class-label drop in training mode: stock and fused runs see the same labels
        block.norm1.emb.class_embedder.dropout_prob = 0.0
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5 if p.dim() == 2 else 0.3 * torch.randn_like(p))
    return block


def _inputs(kind: str, batch: int = BATCH) -> dict:
    kw = dict(hidden_states=torch.randn(batch, TOKENS, DIM))
    if kind.startswith("dit"):
        kw.update(timestep=torch.randint(0, 1000, (batch,)), class_labels=torch.randint(0, 1000, (batch,)))
    else:  # the model's t_embedder output: six modulation vectors per sample
        kw.update(timestep=0.5 * torch.randn(batch, 6 * DIM))
    if kind in ("pixart", "dit-cross"):
        kw.update(encoder_hidden_states=torch.randn(batch, CONTEXT_TOKENS, CONTEXT_DIM))
    return kw


def _exact(block, kw):
    double = {k: v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in kw.items()}
    with torch.no_grad():
        return copy.deepcopy(block).double()(**double)


def _patched_matches_stock(kind, block, kw, sites, normed=None):
    exact = _exact(block, kw)
    with torch.no_grad():
        ref = block(**kw)
    before = snapshot(block)
    report = ldmopt.patch(block)
    assert report.counts()["adaln_block"] == 1, str(report)
    fallback_reasons.clear()
    with torch.no_grad(), ldmopt.use_backend("triton"):
        out = block(**kw)
    assert not report.fallbacks(), report.fallbacks()
    assert report.backends()["linear"] == {"triton": sites}, report.backends()
    assert report.backends().get("layer_norm_linear") == normed, report.backends()
    assert_within_torch_error(out, exact, ref, f"{kind} block")
    ldmopt.unpatch(block)
    assert_same_snapshot(before, snapshot(block))


@pytest.mark.parametrize("kind", ["dit", "pixart", "latte"])
def test_block_matches_stock(kind):
    _patched_matches_stock(kind, _block(kind), _inputs(kind), SITES[kind])


def test_dit_cross_attention_reads_norm2_in_to_q_loads():
    # norm2 has no affine here and 40 channels: the K tail of the normalised tiles is masked without a weight.
    _patched_matches_stock("dit-cross", _block("dit-cross"), _inputs("dit-cross"), 4, normed={"triton": 1})


def test_dit_one_timestep_for_the_batch_broadcasts():
    # Stock broadcasts a (1,) timestep and class label over the batch (its modulation vectors are (1, C)).
    kw = _inputs("dit")
    kw.update(timestep=kw["timestep"][:1], class_labels=kw["class_labels"][:1])
    _patched_matches_stock("dit", _block("dit"), kw, SITES["dit"])


def test_pixart_text_mask_matches_stock():
    # PixArt passes the text padding as an additive bias per key (diffusers' mask preparation, per-head view).
    kw = _inputs("pixart")
    kw["encoder_attention_mask"] = torch.where(torch.rand(BATCH, 1, CONTEXT_TOKENS) < 0.3, -1e4, 0.0)
    _patched_matches_stock("pixart", _block("pixart"), kw, SITES["pixart"])


@pytest.mark.parametrize("kind", ["dit", "pixart"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_low_precision_within_torch_error(kind, dtype):
    """The fused GEMM rounds once; diffusers rounds the projection, the gated product and the sum."""
    block, kw = _block(kind), _inputs(kind)
    exact = _exact(block, kw)
    low = copy.deepcopy(block).to(dtype)
    kw_low = {k: v.to(dtype) if v.is_floating_point() else v for k, v in kw.items()}
    with torch.no_grad():
        stock = low(**kw_low)
        report = ldmopt.patch(low)
        with ldmopt.use_backend("triton"):
            fused = low(**kw_low)
    assert not report.fallbacks() and report.backends()["linear"] == {"triton": SITES[kind]}, report.backends()
    assert fused.dtype == stock.dtype == dtype
    assert_within_torch_error(fused, exact, stock, f"{kind} block {dtype}")


@pytest.mark.parametrize("kind", ["dit", "pixart"])
def test_gradients_match_stock(kind):
    block = _block(kind).train()
    kw = _inputs(kind, batch=2)
    names = [k for k, v in kw.items() if v.is_floating_point()]

    def call(module, *tensors):
        return module(**{**kw, **dict(zip(names, tensors))})

    assert_fused_grads_match_stock(block, call, [kw[k] for k in names], SITES[kind], op="linear")


@pytest.mark.parametrize("dynamic", [None, True], ids=["default", "dynamic"])
def test_compiles_fullgraph(dynamic):
    # dynamic=True passes the norms' eps as symbolic floats: the ops' eps checks must not break the trace.
    torch._dynamo.reset()
    block, kw = _block("pixart"), _inputs("pixart")
    report = ldmopt.patch(block)
    with torch.no_grad():
        eager = block(**kw)
        compiled = torch.compile(block, backend="aot_eager", fullgraph=True, dynamic=dynamic)(**kw)
    assert_close(compiled, eager.double(), torch.float32, "compiled adaLN block")
    assert not report.fallbacks(), report.fallbacks()


@pytest.mark.parametrize("family", ["flux", "sd3"])
def test_patched_transformer_compiles_with_dynamic_shapes(family):
    from tests.patch import models
    from tests.patch.helpers import assert_outputs_close, output_tensor

    torch._dynamo.reset()
    model = models.BUILDERS[family]().eval()
    kw = models.inputs(family, model)
    ldmopt.patch(model)
    with torch.no_grad(), ldmopt.use_backend("torch"):
        eager = output_tensor(model(**kw))
        compiled = output_tensor(torch.compile(model, backend="aot_eager", fullgraph=True, dynamic=True)(**kw))
    assert_outputs_close(compiled, eager, name=f"{family} compiled with dynamic=True")


@pytest.mark.parametrize(
    "change,expected,fused",
    [
        ("processor", "attn1 runs AttnProcessor", 3),  # attn2 and the feed-forward stay fused
        ("hook", "attn2 has hooks", 3),
        ("ip-adapter kwargs", "attention kwargs", 2),  # both attentions fall back
    ],
)
def test_per_call_fallbacks_match_stock(change, expected, fused):
    """Changed after patching: the attention runs as diffusers calls it, then the stock gate and add, the reason
    counted; the other epilogues stay fused."""
    block, kw = _block("pixart"), _inputs("pixart")
    stock_block = copy.deepcopy(block)
    if change == "ip-adapter kwargs":  # dropped quietly by Attention.forward for the default processor
        kw["cross_attention_kwargs"] = {"ip_adapter_masks": None}
    report = ldmopt.patch(block)
    calls, stock_calls = [], []
    for b, log in ((block, calls), (stock_block, stock_calls)):
        if change == "processor":
            b.attn1.set_processor(AttnProcessor())
        elif change == "hook":
            b.attn2.register_forward_hook(lambda *a, log=log: log.append(1))
    exact = _exact(stock_block, kw)
    fallback_reasons.clear()
    stock_calls.clear()  # the fp64 copy's hook ran too
    with torch.no_grad():
        ref = stock_block(**kw)
        with ldmopt.use_backend("triton"):
            out = block(**kw)
    assert any(expected in r for r in fallback_reasons), list(fallback_reasons)
    assert calls == stock_calls  # a hooked attention still ran as a module
    assert_within_torch_error(out, exact, ref, change)
    assert report.backends()["linear"] == {"triton": fused}, report.backends()


# ------------------------------------------------------------------------------------------------ SD3 / Flux joint


def _joint_block(kind: str):
    from diffusers.models.attention import JointTransformerBlock
    from diffusers.models.transformers.transformer_flux import FluxTransformerBlock

    if kind == "sd3":
        block = JointTransformerBlock(dim=DIM, num_attention_heads=2, attention_head_dim=20)
    else:
        block = FluxTransformerBlock(dim=DIM, num_attention_heads=2, attention_head_dim=20)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5 if p.dim() == 2 else 0.3 * torch.randn_like(p))
    return block.eval()


def _joint_inputs():
    return [torch.randn(BATCH, TOKENS, DIM), torch.randn(BATCH, CONTEXT_TOKENS, DIM), torch.randn(BATCH, DIM)]


@pytest.mark.parametrize("kind", ["sd3", "flux"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_joint_block_gated_update_in_the_row_kernel(kind, dtype):
    """SD3/Flux joint blocks: ``h + gate * attn`` runs inside the adaLN row kernel (no product written), both
    streams, against diffusers' block in fp64 and in the same dtype."""
    block, inputs = _joint_block(kind), _joint_inputs()

    def run(module, tensors):
        hidden, context, temb = tensors
        if kind == "sd3":
            return module(hidden_states=hidden, encoder_hidden_states=context, temb=temb)
        from diffusers.models.transformers.transformer_flux import FluxPosEmbed

        ids = torch.zeros(CONTEXT_TOKENS + TOKENS, 3)
        ids[CONTEXT_TOKENS:, 2] = torch.arange(TOKENS)
        rotary = tuple(t.to(hidden.dtype) for t in FluxPosEmbed(theta=10000, axes_dim=[4, 8, 8])(ids))
        out = module(hidden_states=hidden, encoder_hidden_states=context, temb=temb, image_rotary_emb=rotary)
        return out[::-1]  # (context, image) as SD3's

    with torch.no_grad():
        exact = run(copy.deepcopy(block).double(), [t.double() for t in inputs])
        low = copy.deepcopy(block).to(dtype)
        low_inputs = [t.to(dtype) for t in inputs]
        stock = run(low, low_inputs)
        report = ldmopt.patch(low)
        assert report.counts()["joint_block"] == 1, str(report)
        with ldmopt.use_backend("triton"):
            fused = run(low, low_inputs)
    assert not report.fallbacks(), report.fallbacks()
    # norm1 and norm1_context (adaln_zero) and the two streams' residual + norm2 (joint_block)
    assert report.backends()["adaln_modulate"] == {"triton": 4}, report.backends()
    for name, f, e, s in zip(("context", "image"), fused, exact, stock):
        assert f.dtype == dtype
        assert_within_torch_error(f, e, s, f"{kind} joint block {name} {dtype}")


def test_joint_stream_keeps_promotion_of_an_fp32_gate():
    # An fp32 gate on a bf16 stream promotes the stock sum to fp32 (fp32 feed-forward weights then serve it): the
    # fused stream does the same, through the stock product.
    from ldmopt.patch.rules_blocks import _stream

    block = _joint_block("sd3")
    hidden, update = torch.randn(2, 5, DIM, dtype=torch.bfloat16), torch.randn(2, 5, DIM, dtype=torch.bfloat16)
    gate, scale, shift, ff_gate = (torch.randn(2, DIM) for _ in range(4))
    with torch.no_grad(), ldmopt.use_backend("torch"):
        out = _stream(hidden, update, gate, scale, shift, ff_gate, block.norm2, block.ff)
        h = hidden + gate[:, None] * update
        normed = torch.nn.functional.layer_norm(h, (DIM,), eps=block.norm2.eps) * (1 + scale[:, None]) + shift[:, None]
        expect = h + ff_gate[:, None] * block.ff(normed)
    assert out.dtype == expect.dtype == torch.float32
    assert_close(out, expect.double(), torch.float32, "fp32 gate on a bf16 stream")


def test_flux_double_block_fp16_clip_in_the_epilogue():
    """Flux's double block clips its fp16 text stream after ff_context's gated residual: patched, in that GEMM's
    epilogue (no clamp pass), with the same saturated values."""
    from diffusers.models.transformers.transformer_flux import FluxPosEmbed

    from tests.patch.helpers import DispatchedOps
    from tests.patch.test_flux_single_block import _assert_clipped_like_stock

    block = _joint_block("flux").half()
    hidden, context, temb = (t.half() for t in _joint_inputs())
    context[:, :2] = 6.55e4
    ids = torch.zeros(CONTEXT_TOKENS + TOKENS, 3)
    ids[CONTEXT_TOKENS:, 2] = torch.arange(TOKENS)
    rotary = tuple(t.half() for t in FluxPosEmbed(theta=10000, axes_dim=[4, 8, 8])(ids))
    kw = dict(hidden_states=hidden, encoder_hidden_states=context, temb=temb, image_rotary_emb=rotary)
    with torch.no_grad():
        stock = block(**kw)
        ldmopt.patch(block)
        with ldmopt.use_backend("triton"), DispatchedOps() as ops:
            fused = block(**kw)
    assert not ops.shapes("aten.clamp"), ops.shapes("aten.clamp")
    _assert_clipped_like_stock(fused[0], stock[0], "flux double block context")
    err = (fused[1].double() - stock[1].double()).abs().max().item()
    assert err <= 2e-3 * stock[1].abs().max().item(), f"flux double block image: {err:.3g}"


def test_joint_block_skip_reason_names_the_stream_whose_feed_forward_changed():
    """A wrapped (LoRA / quantized) text-stream projection ff_context.net.2 keeps the joint block stock, and the
    reason names that projection and its class, not the image stream's ff.net.2."""

    class Wrapped(torch.nn.Linear):
        pass

    block = _joint_block("sd3")
    old = block.ff_context.net[2]
    block.ff_context.net[2] = Wrapped(old.in_features, old.out_features)
    report = ldmopt.patch(block)
    reasons = [r for s in report.skipped if s.rule == "joint_block" for r in s.reasons]
    named = [r for r in reasons if r.startswith("ff_context.net.2 is a ")]
    assert named and "Wrapped, not a plain nn.Linear" in named[0], reasons
    assert not any(r.startswith("ff.net.2") for r in reasons), reasons
