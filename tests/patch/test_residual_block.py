"""The ``residual_block`` rule: UNet transformer blocks (BasicTransformerBlock, "layer_norm") with the attention and
feed-forward residual adds in the output projections' GEMM epilogues, against diffusers' own block (its default
processor), forward and backward, and every per-call fall-back."""

import copy

import pytest
import torch
from torch import nn

import ldmopt
from ldmopt.nn.child_check import fallback_reasons
from tests.patch.helpers import assert_fused_grads_match_stock, assert_same_snapshot, snapshot
from tests.tolerances import assert_close, assert_within_torch_error

diffusers = pytest.importorskip("diffusers")
from diffusers.models.attention import BasicTransformerBlock  # noqa: E402
from diffusers.models.attention_processor import AttnProcessor, FusedAttnProcessor2_0  # noqa: E402

R = torch.randn
DIM, CONTEXT_DIM, TOKENS, CONTEXT_TOKENS = 40, 24, 37, 7


def _block(**overrides) -> BasicTransformerBlock:
    """A block with odd sizes (40 channels, 2 heads of 20) and every weight drawn: LayerNorm affine around 1 / 0,
    projections at their fan-in scale, biases non-zero."""
    kwargs = dict(
        dim=DIM, num_attention_heads=2, attention_head_dim=20, cross_attention_dim=CONTEXT_DIM,
        activation_fn="geglu", norm_type="layer_norm",
    )  # fmt: skip
    block = BasicTransformerBlock(**{**kwargs, **overrides}).eval()
    with torch.no_grad():
        for name, p in block.named_parameters():
            if name.startswith("norm") and name.endswith("weight"):
                p.copy_(1 + 0.5 * torch.randn_like(p))
            elif p.dim() == 2:
                p.copy_(torch.randn_like(p) / p.shape[1] ** 0.5)
            else:
                p.copy_(0.3 * torch.randn_like(p))
    return block


def _inputs(batch=4):  # 148 rows: more than to_q, to_k and to_v have outputs (120), so they run as one GEMM
    return R(batch, TOKENS, DIM), R(batch, CONTEXT_TOKENS, CONTEXT_DIM)


def _call(block, hidden, context, **kwargs):
    return block(hidden, encoder_hidden_states=context, **kwargs)


def _exact(block, hidden, context, **kwargs):
    """The stock block in fp64: the reference both the stock fp32 and the fused results are measured against."""
    double = lambda t: t.double() if isinstance(t, torch.Tensor) else t
    kwargs = {k: double(v) for k, v in kwargs.items()}
    with torch.no_grad():
        return _call(copy.deepcopy(block).double(), double(hidden), double(context), **kwargs)


def _stock_and_fused(stock_block, block, hidden, context, hook_calls=(), **kwargs):
    """(the fp64 reference, the stock fp32 output, the patched output under Triton) of one call, with
    ``fallback_reasons`` counting the patched call only. ``hook_calls``: lists of hook calls to empty once the fp64
    copy has run (its deep copy carries the hooks)."""
    exact = _exact(stock_block, hidden, context, **kwargs)
    for calls in hook_calls:
        calls.clear()
    fallback_reasons.clear()
    with torch.no_grad():
        ref = _call(stock_block, hidden, context, **kwargs)
        with ldmopt.use_backend("triton"):
            out = _call(block, hidden, context, **kwargs)
    return exact, ref, out


def _residual_gemms(report) -> dict[str, int]:
    """Runs per backend of the fused residual GEMMs: linear, and linear_stats (those that also sum their output's
    LayerNorm statistics for the norm after them)."""
    runs: dict[str, int] = {}
    for table in ("linear", "linear_stats"):
        for backend, count in report.backends().get(table, {}).items():
            runs[backend] = runs.get(backend, 0) + count
    return runs


def _patched_matches_stock(block, hidden, context, sites, normed=None, **kwargs):
    exact = _exact(block, hidden, context, **kwargs)
    with torch.no_grad():
        ref = _call(block, hidden, context, **kwargs)
    before = snapshot(block)
    report = ldmopt.patch(block)
    assert report.counts() == {"geglu": 1, "residual_block": 1}, str(report)
    with torch.no_grad(), ldmopt.use_backend("triton"):
        out = _call(block, hidden, context, **kwargs)
    assert not report.fallbacks(), report.fallbacks()
    # One linear GEMM per fused residual add (the GEGLU projection is its own op); the attentions' output projections
    # also sum their rows' statistics for the norm after them (linear_stats).
    backends = report.backends()
    assert backends["linear"] == {"triton": 1} and backends["linear_stats"] == {"triton": sites - 1}, backends
    if normed is not None:  # GEMMs that read a norm in their loads, and the norms' statistics passes: norm1's only
        assert backends["layer_norm_linear"] == {"triton": normed}, backends
        assert backends["layer_norm_stats"] == {"triton": 1}, backends
    assert_within_torch_error(out, exact, ref, "residual block")
    ldmopt.unpatch(block)
    assert_same_snapshot(before, snapshot(block))
    return out


@pytest.mark.parametrize(
    "variant,overrides,sites,normed",
    [
        ("self+cross", {}, 3, 3),  # q, k, v of norm1 (one GEMM over the three); q of norm2; the GEGLU of norm3
        ("no attn2", dict(cross_attention_dim=None), 2, 2),
        ("double self-attention", dict(cross_attention_dim=None, double_self_attention=True), 3, 3),
        ("only cross-attention", dict(only_cross_attention=True), 3, 3),
        ("no norm affine", dict(norm_elementwise_affine=False), 3, 3),
    ],
)
def test_block_matches_stock(variant, overrides, sites, normed):
    block = _block(**overrides)
    hidden, context = _inputs()
    if overrides.get("cross_attention_dim", CONTEXT_DIM) is None and not overrides.get("double_self_attention"):
        context = None
    if overrides.get("double_self_attention"):
        context = None  # attn2 attends to the block's own tokens
    _patched_matches_stock(block, hidden, context, sites, normed)


def test_masks_match_stock():
    # diffusers' mask preparation (prepare_attention_mask, per-head view), an additive bias per key.
    block = _block()
    hidden, context = _inputs()
    mask = torch.where(torch.rand(4, 1, TOKENS) < 0.2, -1e4, 0.0)
    context_mask = torch.where(torch.rand(4, 1, CONTEXT_TOKENS) < 0.3, -1e4, 0.0)
    _patched_matches_stock(block, hidden, context, 3, attention_mask=mask, encoder_attention_mask=context_mask)


def test_fused_qkv_projections_match_stock():
    block = _block()
    for attn in (block.attn1, block.attn2):
        attn.fuse_projections()
        attn.set_processor(FusedAttnProcessor2_0())
    hidden, context = _inputs()
    _patched_matches_stock(block, hidden, context, 3, normed=3)  # to_qkv, attn2's to_q, the GEGLU


def test_self_attention_projections_are_one_gemm_with_or_without_biases():
    # to_q, to_k and to_v read norm1 as one GEMM over their stacked weights (and biases), forward and backward; a
    # mixed set (one projection without a bias) runs them one by one.
    block = _block(attention_bias=True)
    hidden, context = _inputs()
    _patched_matches_stock(block, hidden, context, 3, normed=3)
    assert_fused_grads_match_stock(_block(attention_bias=True), _call, [hidden, context], 2, op="linear_stats")
    mixed = _block(attention_bias=True)
    mixed.attn1.to_k.bias = None
    _patched_matches_stock(mixed, hidden, context, 3, normed=5)
    # Inference on fewer rows (37) than the three have outputs (120): stacking the weights would cost more than the
    # two reads of x it saves, so they run one by one.
    one, context_one = _inputs(batch=1)
    _patched_matches_stock(_block(attention_bias=True), one, context_one, 3, normed=5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_low_precision_within_torch_error(dtype):
    """The fused GEMM rounds once; diffusers rounds the projection, then the sum: both against fp64."""
    block = _block()
    hidden, context = _inputs()
    with torch.no_grad():
        exact = copy.deepcopy(block).double()(hidden.double(), encoder_hidden_states=context.double())
        low = copy.deepcopy(block).to(dtype)
        stock = low(hidden.to(dtype), encoder_hidden_states=context.to(dtype))
        report = ldmopt.patch(low)
        with ldmopt.use_backend("triton"):
            fused = low(hidden.to(dtype), encoder_hidden_states=context.to(dtype))
    assert not report.fallbacks() and _residual_gemms(report) == {"triton": 3}, report.backends()
    assert fused.dtype == stock.dtype == dtype
    assert_within_torch_error(fused, exact, stock, f"residual block {dtype}")


def test_gradients_match_stock():
    block = _block().train()
    hidden, context = _inputs(batch=2)
    # the attentions' output projections hand their statistics on (linear_stats); the feed-forward's is plain linear
    assert_fused_grads_match_stock(block, _call, [hidden, context], 2, op="linear_stats")


def test_under_autocast_matches_stock():
    # fp32 weights under bf16 autocast: the GEMM runs on bf16 operands, the residual stays fp32 (the sum is fp32).
    block = _block()
    hidden, context = _inputs()
    exact = _exact(block, hidden, context)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        ref = _call(block, hidden, context)
        report = ldmopt.patch(block)
        with ldmopt.use_backend("torch"):
            out = _call(block, hidden, context)
    assert not report.fallbacks(), report.fallbacks()
    assert out.dtype == ref.dtype == torch.float32
    # Stock rounds each projection to bf16 before the fp32 add; the epilogue adds in fp32 first.
    assert_within_torch_error(out, exact, ref, "residual block under autocast")


def test_compiles_fullgraph():
    torch._dynamo.reset()
    block = _block()
    hidden, context = _inputs()
    report = ldmopt.patch(block)
    with torch.no_grad():
        eager = _call(block, hidden, context)
        compiled = torch.compile(block, backend="aot_eager", fullgraph=True)(hidden, encoder_hidden_states=context)
    assert_close(compiled, eager.double(), torch.float32, "compiled residual block")
    assert not report.fallbacks(), report.fallbacks()


class _Wrapped(nn.Linear):
    """Stands for a LoRA/quantized projection installed after patching: not a plain nn.Linear."""


def _wrap_to_out(block):
    old = block.attn1.to_out[0]
    new = _Wrapped(old.in_features, old.out_features)
    new.load_state_dict(old.state_dict())
    block.attn1.to_out[0] = new


def _change(block, change, calls):
    if change == "processor":
        block.attn1.set_processor(AttnProcessor())
    elif change == "hook":
        block.attn2.register_forward_hook(lambda *a: calls.append(1))
    elif change == "wrapped to_out":
        _wrap_to_out(block)


@pytest.mark.parametrize(
    "change,expected,fused_adds",
    [
        ("processor", "attn1 runs AttnProcessor", 2),
        ("hook", "attn2 has hooks", 2),
        ("wrapped to_out", "attn1.to_out.0", 2),
        ("ip-adapter kwargs", "attention kwargs", 1),  # both attentions fall back; the feed-forward stays fused
    ],
)
def test_per_call_fallbacks_match_stock(change, expected, fused_adds):
    """Changed after patching: what the mirrored processor does not serve runs diffusers' attention and the stock
    add, the reason counted; the other residual adds stay fused."""
    block = _block()
    hidden, context = _inputs()
    stock_block = copy.deepcopy(block)
    kwargs = {}
    if change == "ip-adapter kwargs":  # dropped quietly by Attention.forward for the default processor
        kwargs = dict(cross_attention_kwargs={"ip_adapter_masks": None})
    report = ldmopt.patch(block)
    stock_calls, calls = [], []
    _change(stock_block, change, stock_calls)
    _change(block, change, calls)
    exact, ref, out = _stock_and_fused(stock_block, block, hidden, context, (stock_calls,), **kwargs)
    reasons = list(fallback_reasons)
    assert any(expected in r for r in reasons), reasons
    assert calls == stock_calls  # a hooked attention still ran as a module
    assert_within_torch_error(out, exact, ref, change)
    assert _residual_gemms(report) == {"triton": fused_adds}, report.backends()


@pytest.mark.parametrize("attn", ["attn1", "attn2"])
@pytest.mark.parametrize(
    "attr,value,expected",
    [
        ("rescale_output_factor", 2.0, "rescale_output_factor is 2.0"),
        ("residual_connection", True, "residual_connection is set"),
    ],
)
def test_epilogue_changed_after_patching_runs_stock(attn, attr, value, expected):
    """A rescale factor other than 1 or the attention's own residual add, set after patching: what follows to_out[0]
    is not the identity, so that attention's add runs stock (the reason counted); the other two stay fused."""
    block = _block()
    hidden, context = _inputs()
    stock_block = copy.deepcopy(block)
    report = ldmopt.patch(block)
    for b in (block, stock_block):
        setattr(getattr(b, attn), attr, value)
    exact, ref, out = _stock_and_fused(stock_block, block, hidden, context)
    assert_within_torch_error(out, exact, ref, f"{attn}.{attr}={value}")
    assert any(f"{attn}.{expected}" in r for r in fallback_reasons), dict(fallback_reasons)
    assert _residual_gemms(report) == {"triton": 2}, report.backends()


@pytest.mark.parametrize("change", ["final_dropout", "hooked ff"])
def test_feed_forward_kept_stock_attention_still_fused(change):
    block = _block(final_dropout=change == "final_dropout")
    hidden, context = _inputs()
    stock_block = copy.deepcopy(block)
    report = ldmopt.patch(block)
    assert report.counts()["residual_block"] == 1
    calls, stock_calls = [], []
    if change == "hooked ff":  # e.g. diffusers' layer-skip guidance, added after patching
        block.ff.register_forward_hook(lambda *a: calls.append(1))
        stock_block.ff.register_forward_hook(lambda *a: stock_calls.append(1))
    exact, ref, out = _stock_and_fused(stock_block, block, hidden, context, (stock_calls,))
    assert calls == stock_calls == ([1] if change == "hooked ff" else [])
    assert any(r.startswith("FeedForward ran the stock path") for r in fallback_reasons), dict(fallback_reasons)
    assert _residual_gemms(report) == {"triton": 2}, report.backends()  # both attentions' epilogues
    assert_within_torch_error(out, exact, ref, change)


def test_chunked_feed_forward_and_gligen_run_stock():
    block = _block()
    block.set_chunk_feed_forward(1, dim=0)
    hidden, context = _inputs()
    with torch.no_grad():
        ref = _call(block, hidden, context)
        report = ldmopt.patch(block)
        out = _call(block, hidden, context)
    assert report.counts()["residual_block"] == 1 and "linear" not in report.backends()
    torch.testing.assert_close(out, ref)
    gated = _block(attention_type="gated")
    report = ldmopt.patch(gated)
    skipped = [s for s in report.skipped if s.rule == "residual_block"]
    assert skipped and "GLIGEN" in skipped[0].reasons[0]


def test_unet_blocks_patched_and_state_dict_unchanged():
    from tests.patch import models

    unet = models.sd15_unet().eval()
    keys = list(unet.state_dict())
    report = ldmopt.patch(unet)
    blocks = [m for m in unet.modules() if isinstance(m, BasicTransformerBlock)]
    assert report.counts()["residual_block"] == len(blocks) > 0
    assert list(unet.state_dict()) == keys
    assert "residual" in ldmopt.patch.FAMILIES


def test_any_cross_attention_kwargs_key_is_passed_on():
    # Keys that are also helper parameter names must reach the attention (which drops what it does not take).
    block = _block()
    hidden, context = _inputs()
    kwargs = dict(cross_attention_kwargs={"name": 1, "where": 2, "residual": 3, "kwargs": 4})
    with torch.no_grad():
        ref = _call(block, hidden, context, **kwargs)
        ldmopt.patch(block)
        with ldmopt.use_backend("torch"):
            out = _call(block, hidden, context, **kwargs)
    assert_close(out, ref.double(), torch.float32, "kwargs")


def test_hook_on_output_dropout_runs():
    block = _block()
    hidden, context = _inputs()
    stock_block = copy.deepcopy(block)
    ldmopt.patch(block)
    for b in (block, stock_block):  # a hook that changes the output: skipping it would show
        b.attn1.to_out[1].register_forward_hook(lambda module, args, out: 0.5 * out)
    exact, ref, out = _stock_and_fused(stock_block, block, hidden, context)
    assert any("attn1.to_out.1 has hooks" in r for r in fallback_reasons), dict(fallback_reasons)
    assert_within_torch_error(out, exact, ref, "hooked dropout")


def test_a_dropout_subclass_after_patching_runs():
    """Monte-Carlo dropout: to_out.1's class changed after patching to one that samples in eval mode too; the block
    must run it (p=1 makes it visible: the attention's output drops to zero)."""

    class AlwaysDropout(torch.nn.Dropout):
        def forward(self, x):
            return torch.nn.functional.dropout(x, self.p, training=True)

    block = _block()
    hidden, context = _inputs()
    stock_block = copy.deepcopy(block)
    ldmopt.patch(block)
    for b in (block, stock_block):
        b.attn1.to_out[1].p = 1.0
        b.attn1.to_out[1].__class__ = AlwaysDropout
    fallback_reasons.clear()
    with torch.no_grad(), ldmopt.use_backend("torch"):
        ref = _call(stock_block, hidden, context)
        out = _call(block, hidden, context)
    assert any("attn1.to_out is not [Linear, inactive Dropout]" in r for r in fallback_reasons), dict(fallback_reasons)
    assert_close(out, ref.double(), torch.float32, "MC dropout")


def test_profiler_observers_keep_every_epilogue():
    # The profiler's scope hooks sit on every module, to_out.0 and ff.net.2 included: they are observers, so a
    # profiled block still runs (and measures) all three fused epilogues.
    from ldmopt.profiler.scopes import ModuleScopes

    block = _block()
    hidden, context = _inputs()
    report = ldmopt.patch(block)
    fallback_reasons.clear()
    with torch.no_grad(), ModuleScopes(block), ldmopt.use_backend("torch"):
        _call(block, hidden, context)
    assert not fallback_reasons, dict(fallback_reasons)
    assert _residual_gemms(report) == {"torch": 3}, report.backends()


def test_norms_are_read_in_the_gemms_loads_not_called(monkeypatch):
    # The three LayerNorms never run as modules: their outputs are formed in the GEMMs' loads.
    calls = []
    stock_forward = nn.LayerNorm.forward
    monkeypatch.setattr(nn.LayerNorm, "forward", lambda self, x: calls.append(1) or stock_forward(self, x))
    block = _block()
    hidden, context = _inputs()
    ldmopt.patch(block)
    with torch.no_grad(), ldmopt.use_backend("torch"):
        _call(block, hidden, context)
    assert calls == []


@pytest.mark.parametrize(
    "change,expected,normed",
    [
        ("hooked norm3", "norm3 has hooks", 2),  # the hook changes the output: skipping it would show
        # A LoRA on one projection: it reads the norm's output, written once, which to_v then reads too.
        ("wrapped to_k", "to_k is a", 3),
        ("norm subclass", "norm2 is _Norm, not nn.LayerNorm", 2),
    ],
)
def test_norm_fallbacks_match_stock(change, expected, normed):
    block = _block()
    hidden, context = _inputs()
    report = ldmopt.patch(block)
    stock_block = copy.deepcopy(block)
    ldmopt.unpatch(stock_block)
    for b in (block, stock_block):
        if change == "hooked norm3":
            b.norm3.register_forward_hook(lambda module, args, out: 0.5 * out)
        elif change == "wrapped to_k":
            old = b.attn1.to_k
            b.attn1.to_k = _Wrapped(old.in_features, old.out_features, bias=False)
            b.attn1.to_k.load_state_dict(old.state_dict())
        else:
            old = b.norm2
            b.norm2 = _Norm(DIM)
            b.norm2.load_state_dict(old.state_dict())
    exact, ref, out = _stock_and_fused(stock_block, block, hidden, context)
    assert any(expected in r for r in fallback_reasons), dict(fallback_reasons)
    assert report.backends()["layer_norm_linear"] == {"triton": normed}, report.backends()
    assert_within_torch_error(out, exact, ref, change)


class _Norm(nn.LayerNorm):
    """A LayerNorm subclass (another forward could hide behind it): read as a module, never in the loads."""


@pytest.mark.parametrize("hooked", [False, True])
def test_positional_embeddings_added_in_the_loads(hooked):
    # Sinusoidal positions on norm1/norm2's output (diffusers' pos_embed) are added in the projections' loads too;
    # a hooked pos_embed keeps those two norms and the module call (norm3 is read in the loads either way).
    block = _block(positional_embeddings="sinusoidal", num_positional_embeddings=TOKENS + 3)
    calls, stock_calls = [], []
    stock_block = copy.deepcopy(block)
    if hooked:
        block.pos_embed.register_forward_hook(lambda *a: calls.append(1))
        stock_block.pos_embed.register_forward_hook(lambda *a: stock_calls.append(1))
    hidden, context = _inputs()
    exact = _exact(stock_block, hidden, context)
    stock_calls.clear()
    with torch.no_grad():
        ref = _call(stock_block, hidden, context)
        report = ldmopt.patch(block)
        with ldmopt.use_backend("triton"):
            out = _call(block, hidden, context)
    assert calls == stock_calls == ([1, 1] if hooked else [])
    assert report.backends()["layer_norm_linear"] == {"triton": 1 if hooked else 3}, report.backends()
    assert_within_torch_error(out, exact, ref, f"positional embeddings, hooked={hooked}")


@pytest.mark.parametrize("change", ["none", "hooked norm", "residual connection"])
def test_single_key_cross_attention_skips_its_norm(monkeypatch, change):
    # SVD's spatial attn2 runs ldmopt's single-key shortcut, which reads only the queries' shape: norm2 is not
    # computed, and its parameters still get the stock path's zero gradients. A hooked norm2 runs; so does one whose
    # output the attention adds back (residual_connection: the shortcut reads the queries' values then).
    from ldmopt.nn.temporal_attention import SingleKeyAttnProcessor

    hooked_norm = change == "hooked norm"
    block = _block()
    block.attn2.residual_connection = change == "residual connection"
    hidden, context = R(3, TOKENS, DIM), R(3, 1, CONTEXT_DIM)
    stock_block = copy.deepcopy(block)
    hook_calls, stock_hook_calls = [], []
    if hooked_norm:
        block.norm2.register_forward_hook(lambda *a: hook_calls.append(1))
        stock_block.norm2.register_forward_hook(lambda *a: stock_hook_calls.append(1))
    exact = _exact(stock_block, hidden, context)
    stock_hook_calls.clear()
    with torch.no_grad():
        ref = _call(stock_block, hidden, context)
    ldmopt.patch(block)
    block.attn2.set_processor(SingleKeyAttnProcessor())
    calls = []
    stock_forward = nn.LayerNorm.forward
    monkeypatch.setattr(nn.LayerNorm, "forward", lambda self, x: calls.append(1) or stock_forward(self, x))
    with torch.no_grad(), ldmopt.use_backend("triton"):
        out = _call(block, hidden, context)
    assert calls == ([] if change == "none" else [1]) and hook_calls == stock_hook_calls
    assert_within_torch_error(out, exact, ref, f"single-key attention, {change}")
    block.train()
    with ldmopt.use_backend("torch"):
        _call(block, hidden.requires_grad_(), context).sum().backward()
    stock_block.train()
    stock_hidden = hidden.detach().requires_grad_()
    _call(stock_block, stock_hidden, context).sum().backward()
    assert block.norm2.weight.grad is not None
    for name, p in block.named_parameters():
        torch.testing.assert_close(p.grad, stock_block.get_parameter(name).grad, atol=1e-4, rtol=1e-4, msg=name)
    torch.testing.assert_close(hidden.grad, stock_hidden.grad, atol=1e-4, rtol=1e-4)


def _saved_shapes(block, hidden, context):
    """Shapes of the tensors the patched block saves for backward (an observer hook, as saved_activations counts)."""
    from ldmopt.nn.child_check import observer

    shapes = []

    def pack(t):
        shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(observer(pack), observer(lambda t: t)):
        out = _call(block, hidden, context)
    return out, shapes


def test_joint_projection_keeps_the_parameters_not_their_stacked_copy_for_backward():
    block = _block().train()
    hidden, context = _inputs()
    ldmopt.patch(block, training=True)
    with ldmopt.use_backend("triton"):
        out, shapes = _saved_shapes(block, hidden, context)
        assert (3 * DIM, DIM) not in shapes  # the stacked to_q/to_k/to_v weight is not kept
        out.sum().backward()
    assert block.attn1.to_k.weight.grad is not None
    # Changed in place before the backward that needs it: refused, as autograd refuses for a saved tensor.
    with ldmopt.use_backend("triton"):
        out = _call(block, hidden, context)
        with torch.no_grad():
            block.attn1.to_v.weight.mul_(1.0)
        with pytest.raises(RuntimeError, match="modified in place"):
            out.sum().backward()


def test_joint_projection_under_activation_offloading():
    # Saved-tensor hooks of the user's (here offloading to the CPU) stay in charge: the stacked weight is then kept.
    block = _block().train()
    hidden, context = _inputs()
    stock, exact = copy.deepcopy(block), copy.deepcopy(block).double()
    ldmopt.patch(block, training=True)
    weights = torch.randn(hidden.shape)
    with ldmopt.use_backend("triton"), torch.autograd.graph.save_on_cpu():
        (_call(block, hidden, context) * weights).sum().backward()
    (_call(stock, hidden, context) * weights).sum().backward()
    (_call(exact, hidden.double(), context.double()) * weights.double()).sum().backward()
    # Each gradient sums over rows in another order than stock's: measured against the fp64 stock block, within
    # the error stock's own fp32 backward makes.
    for (name, p), q, e in zip(stock.named_parameters(), block.parameters(), exact.parameters()):
        assert_within_torch_error(q.grad, e.grad, p.grad, f"grad {name}")
