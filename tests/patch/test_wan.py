"""The ``wan_block`` rule: Wan 2.1/2.2 and SkyReels-V2 transformer blocks against diffusers' own forward, with the
fp32 modulation table and norms diffusers keeps in fp32 when the model runs in half precision."""

import pytest
import torch

import ldmopt
from tests.patch.helpers import assert_same_snapshot, output_tensor, snapshot
from tests.tolerances import assert_close, assert_within_torch_error

diffusers = pytest.importorskip("diffusers")
R = torch.randn


def _wan(cross_attn_norm=True, seed=0):
    torch.manual_seed(seed)
    model = diffusers.WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=20, in_channels=4, out_channels=4,
        text_dim=24, freq_dim=16, ffn_dim=56, num_layers=2, cross_attn_norm=cross_attn_norm,
        qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=32,
    )  # fmt: skip
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm2.weight"):
                p.copy_(1 + 0.4 * torch.randn_like(p))  # a non-trivial affine LayerNorm (1 + (w - 1) in the kernel)
            elif not p.any() or name.endswith("norm2.bias"):
                p.normal_(std=0.1)
    return model.eval()


def _wan_inputs(batch=2, per_token=False):
    inputs = {"hidden_states": R(batch, 4, 3, 6, 10), "encoder_hidden_states": R(batch, 7, 24)}
    tokens = 3 * 3 * 5  # frames x (6 / 2) x (10 / 2) patches
    # Wan 2.2 TI2V passes one timestep per token (temb [B, T, 6, C]); Wan 2.1 one per sample.
    inputs["timestep"] = torch.randint(0, 1000, (batch, tokens)).float() if per_token else torch.tensor([300.0, 700.0])
    return inputs


def _half_like_diffusers(model):
    """model.half() except what diffusers keeps in fp32 (_keep_in_fp32_modules): the table, norms, time embedder."""
    model.half()
    for name, module in model.named_modules():
        if any(key in name.split(".") for key in model._keep_in_fp32_modules):
            module.float()
    for block in model.blocks:
        block.scale_shift_table.data = block.scale_shift_table.data.float()
    return model


@pytest.mark.parametrize("cross_attn_norm", [True, False])
@pytest.mark.parametrize("per_token", [False, True])
def test_wan_matches_stock_reference_backend(cross_attn_norm, per_token):
    model = _wan(cross_attn_norm)
    inputs = _wan_inputs(per_token=per_token)
    with torch.no_grad():
        ref = output_tensor(model(**inputs))
    before = snapshot(model)
    report = ldmopt.patch(model)
    assert report.counts().get("wan_block") == 2, str(report)
    with torch.no_grad(), ldmopt.use_backend("torch"):
        assert_close(output_tensor(model(**inputs)), ref.double(), torch.float32, f"wan norm2={cross_attn_norm}")
    ldmopt.unpatch(model)
    assert type(model.blocks[0]).__name__ == "WanTransformerBlock"
    assert_same_snapshot(before, snapshot(model))


@pytest.mark.parametrize("per_token", [False, True])
def test_wan_block_half_stream_triton_interpreter(per_token):
    """fp16 stream, fp32 table and norms (as from_pretrained(torch_dtype=...) leaves them), one block: the fused block
    rounds once per result where diffusers rounds after each op; both against the fp32 block."""
    import copy

    model = _wan()
    rotary = model.rope(R(2, 4, 3, 6, 10))
    block32 = model.blocks[0]
    hidden, context = R(2, 45, 40) * 2, R(2, 7, 40)
    temb = R(2, 45, 6, 40) if per_token else R(2, 6, 40)
    with torch.no_grad():
        exact = block32(hidden, context, temb, rotary).double()
        half = _half_like_diffusers(copy.deepcopy(model))
        args = (hidden.half(), context.half(), temb, rotary)
        stock = half.blocks[0](*args)
        ldmopt.patch(half)
        with ldmopt.use_backend("triton"):
            fused = half.blocks[0](*args)
    assert fused.dtype == torch.float16
    assert_within_torch_error(fused, exact, stock, f"wan block fp16 per_token={per_token}")


def test_wan_gradients_match_stock():
    model = _wan()
    inputs = _wan_inputs()
    params = dict(model.named_parameters())
    out = output_tensor(model(**inputs))
    weights = torch.randn_like(out)
    ref = torch.autograd.grad((out * weights).sum(), list(params.values()), allow_unused=True)
    ldmopt.patch(model, training=True)
    with ldmopt.use_backend("triton"):
        out2 = output_tensor(model(**inputs))
    got = torch.autograd.grad((out2 * weights).sum(), list(params.values()), allow_unused=True)
    assert_close(out2, out.detach().double(), torch.float32, "forward")
    checked = 0
    for name, g, e in zip(params, got, ref):
        assert (g is None) == (e is None), name
        if g is not None:
            assert_close(g, e.double(), torch.float32, f"grad {name}")
            checked += ".blocks." in f".{name}" and any(k in name for k in ("norm2", "scale_shift_table", "ffn.net.2"))
    assert checked >= 6  # table, norm2 weight and bias, ffn.net.2 weight and bias of both blocks at least


def test_hooked_norm_runs_the_stock_forward():
    """A forward hook on a norm the fused forward bypasses (e.g. a layer-skip or offload hook) sends the block back to
    diffusers' forward, which calls the hook."""
    model = _wan()
    inputs = _wan_inputs()
    ldmopt.patch(model)
    calls = []
    model.blocks[1].norm3.register_forward_hook(lambda mod, args, out: calls.append(1) or out * 0.5)
    with torch.no_grad(), ldmopt.use_backend("torch"):
        patched = output_tensor(model(**inputs))
    ldmopt.unpatch(model)
    with torch.no_grad():
        stock = output_tensor(model(**inputs))
    assert len(calls) == 2
    assert_close(patched, stock.double(), torch.float32, "hooked norm3")


def test_wan_block_compiles_fullgraph():
    torch._dynamo.reset()
    model = _wan()
    block = model.blocks[0]
    ldmopt.patch(model)
    hidden, context, temb = R(2, 45, 40), R(2, 7, 40), R(2, 6, 40)
    rotary = model.rope(R(2, 4, 3, 6, 10))
    with torch.no_grad():
        eager = block(hidden, context, temb, rotary)
        compiled = torch.compile(block, backend="aot_eager", fullgraph=True)(hidden, context, temb, rotary)
    assert_close(compiled, eager.double(), torch.float32, "compiled wan block")


def _skyreels():
    torch.manual_seed(0)
    model = diffusers.SkyReelsV2Transformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=20, in_channels=4, out_channels=4,
        text_dim=24, freq_dim=16, ffn_dim=56, num_layers=2, cross_attn_norm=True, rope_max_seq_len=32,
    )  # fmt: skip
    with torch.no_grad():
        for p in model.parameters():
            if not p.any():
                p.normal_(std=0.1)
    return model.eval()


def test_skyreels_block_matches_stock_per_sample_and_diffusion_forcing():
    model = _skyreels()
    block = model.blocks[0]
    hidden, context = R(2, 45, 40), R(2, 7, 40)
    rotary = model.rope(R(2, 4, 3, 6, 10))
    temb3, temb4 = R(2, 6, 40), R(2, 6, 45, 40)  # per sample; per token (diffusion forcing: [B, 6, T, C])
    with torch.no_grad():
        refs = [block(hidden, context, t, rotary, None) for t in (temb3, temb4)]
    report = ldmopt.patch(model)
    assert report.counts().get("wan_block") == 2, str(report)
    with torch.no_grad(), ldmopt.use_backend("triton"):
        for t, ref in zip((temb3, temb4), refs):
            assert_close(block(hidden, context, t, rotary, None), ref.double(), torch.float32, f"skyreels {t.dim()}-D")


# ------------------------------------------------------------------------------------------------ after-patch hooks


def test_block_level_caches_and_layer_skip_accept_patched_blocks():
    """diffusers' FirstBlockCache, MagCache and whole-block layer skip look blocks up by exact class in their
    TransformerBlockRegistry: the fused class is registered like its base, and the result equals stock's."""
    from diffusers.hooks import FirstBlockCacheConfig, LayerSkipConfig, apply_first_block_cache, apply_layer_skip

    inputs = _wan_inputs()
    outs = {}
    for patched in (False, True):
        for kind in ("fbc", "skip"):
            model = _wan()
            if patched:
                ldmopt.patch(model)
            if kind == "fbc":
                apply_first_block_cache(model, FirstBlockCacheConfig(threshold=0.05))
                with torch.no_grad(), model.cache_context("cond"), ldmopt.use_backend("torch"):
                    outs[patched, kind] = [output_tensor(model(**inputs)) for _ in range(2)]
            else:
                apply_layer_skip(model, LayerSkipConfig(indices=[1], fqn="blocks", skip_attention=True, skip_ff=True))
                with torch.no_grad(), ldmopt.use_backend("torch"):
                    outs[patched, kind] = [output_tensor(model(**inputs))]
    for kind in ("fbc", "skip"):
        for got, want in zip(outs[True, kind], outs[False, kind]):
            assert_close(got, want.double(), torch.float32, f"{kind} patched vs stock")


def test_fall_back_compiles_fullgraph():
    """A hook added after patch sends the block to diffusers' forward, which torch.compile(fullgraph=True) must trace
    (diffusers marks the block allow_in_graph; the stock method is reached through super())."""
    torch._dynamo.reset()
    model = _wan()
    inputs = _wan_inputs()
    ldmopt.patch(model)
    model.blocks[1].norm3.register_forward_hook(lambda mod, args, out: out * 0.5)
    with torch.no_grad():
        eager = output_tensor(model(**inputs))
        compiled = output_tensor(torch.compile(model, backend="aot_eager", fullgraph=True)(**inputs))
    assert_close(compiled, eager.double(), torch.float32, "compiled fall-back")


def test_backward_and_global_hooks_after_patch_run():
    from torch.nn.modules.module import register_module_forward_hook

    inputs = _wan_inputs()
    results = {}
    for patched in (False, True):
        model = _wan().train()
        if patched:
            ldmopt.patch(model, training=True)
        calls, seen = [], []

        def zero_grads(mod, grad_in, grad_out, calls=calls):
            calls.append(1)
            return tuple(g * 0 if g is not None else None for g in grad_in)

        model.blocks[1].norm1.register_full_backward_hook(zero_grads)
        output_tensor(model(**inputs)).sum().backward()
        handle = register_module_forward_hook(lambda mod, args, out, seen=seen: seen.append(type(mod).__name__))
        try:
            with torch.no_grad():
                model(**inputs)
        finally:
            handle.remove()
        results[patched] = (len(calls), model.blocks[0].scale_shift_table.grad.clone(), seen.count("FP32LayerNorm"))
    assert results[True][0] == results[False][0] == 1
    assert_close(results[True][1], results[False][1].double(), torch.float32, "grad with a zeroing backward hook")
    assert results[True][2] == results[False][2] > 0


def test_profiler_scopes_do_not_send_patched_blocks_to_the_stock_path():
    """ldmopt.profile / analyze hook every module to track scopes; those observers must not count as user hooks."""
    from ldmopt.nn.child_check import fallback_reasons
    from ldmopt.profiler.scopes import ModuleScopes

    model = _wan()
    report = ldmopt.patch(model)
    fallback_reasons.clear()
    with torch.no_grad(), ModuleScopes(model), ldmopt.use_backend("torch"):
        model(**_wan_inputs())
    assert not report.fallbacks() and not fallback_reasons, report.fallbacks()


def test_non_affine_norm2_is_fused_too():
    from diffusers.models.normalization import FP32LayerNorm

    model = _wan()
    for block in model.blocks:
        block.norm2 = FP32LayerNorm(40, 1e-6, elementwise_affine=False)
    inputs = _wan_inputs()
    with torch.no_grad():
        ref = output_tensor(model(**inputs))
    assert ldmopt.patch(model).counts().get("wan_block") == 2
    with torch.no_grad(), ldmopt.use_backend("torch"):
        assert_close(output_tensor(model(**inputs)), ref.double(), torch.float32, "non-affine norm2")


def test_shapes_the_fused_forward_does_not_take_run_stock_and_are_counted():
    model = _wan()
    block = model.blocks[0]
    rotary = model.rope(R(1, 4, 3, 6, 10))
    args = (R(1, 45, 40), R(1, 7, 40), R(2, 6, 40), rotary)  # temb batch 2 for hidden batch 1: stock broadcasts
    with torch.no_grad():
        ref = block(*args)
    report = ldmopt.patch(model)
    with torch.no_grad():
        out = block(*args)
    assert_close(out, ref.double(), torch.float32, "stock fall-back")
    assert any("shapes the fused forward does not take" in r for r in report.fallbacks()), report.fallbacks()
