"""diffusers features a user switches on around a patched model: attention slicing, FreeU, ControlNet / T2I-Adapter
residuals, IP-Adapter processors, group offloading, VAE tiling and slicing, the step caches (PyramidAttentionBroadcast,
FasterCache, TaylorSeer), ``set_attention_backend`` and regional compilation. Each is switched on the same way on a
stock copy and on the patched model (before or after ``ldmopt.patch``, where both orders are possible); the two must
agree, the feature must visibly act (it changes the output, its processor/hook/backend runs, the cache hits), and
``ldmopt.unpatch`` must give back the model as it was, with the feature still on where it was on before patching.

Tiny random-weight models from ``models``, fp32, on the reference backend: which path each module takes is under test
here, not the kernels (the interpreter would make the file take minutes)."""

from __future__ import annotations

import contextlib
import copy
import functools

import pytest
import torch

import ldmopt
from tests.patch import models
from tests.patch.helpers import (
    assert_outputs_close,
    assert_same_snapshot,
    output_tensor,
    snapshot,
    with_nontrivial_norms,
)


def _run(model, kwargs: dict, **extra) -> torch.Tensor:
    with torch.no_grad(), ldmopt.use_backend("torch"):
        return output_tensor(model(**kwargs, **extra))


def _assert_differs(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    """The feature acts: its output is not the one without it (far beyond the patched-vs-stock tolerance)."""
    err = (a.double() - b.double()).abs().max().item()
    assert err > 1e-3 * b.abs().max().item(), f"{what}: no effect on the output (max difference {err:.2e})"


def _count_calls(monkeypatch, owner, name) -> list:
    """Replaces ``owner.name`` (a function on a class, or ``owner[name]`` in a dict) by a wrapper that records each
    call's positional arguments (``self`` first for a method); restored when the test ends."""
    calls = []
    original = owner[name] if isinstance(owner, dict) else getattr(owner, name)

    @functools.wraps(original)  # Attention.forward reads the processor's signature
    def counted(*args, **kwargs):
        calls.append(args)
        return original(*args, **kwargs)

    if isinstance(owner, dict):
        monkeypatch.setitem(owner, name, counted)
    else:
        monkeypatch.setattr(owner, name, counted)
    return calls


def _remove_diffusers_hooks(model) -> None:
    for module in model.modules():
        registry = module.__dict__.get("_diffusers_hook")
        for name in list(getattr(registry, "_hook_order", ())):
            registry.remove_hook(name, recurse=False)


def _fallbacks(report, needle: str) -> int:
    return sum(n for reason, n in report.fallbacks().items() if needle in reason)


# --- attention slicing, FreeU (UNets) ----------------------------------------------------------------------------


@pytest.mark.parametrize("order", ["before", "after"])
def test_attention_slicing(order, monkeypatch):
    from diffusers.models.attention_processor import SlicedAttnProcessor

    stock = models.sd15_unet().eval()
    kwargs = models.inputs("sd15", stock)
    patched = copy.deepcopy(stock)
    stock.set_attention_slice(1)
    if order == "before":
        patched.set_attention_slice(1)
    before = snapshot(patched)
    report = ldmopt.patch(patched)
    if order == "after":
        patched.set_attention_slice(1)
    calls = _count_calls(monkeypatch, SlicedAttnProcessor, "__call__")
    expected = _run(stock, kwargs)
    stock_calls = len(calls)
    out = _run(patched, kwargs)
    assert stock_calls == 8 and len(calls) == 2 * stock_calls  # every attention of both models ran sliced
    assert _fallbacks(report, "runs SlicedAttnProcessor") == 8, report.fallbacks()
    assert_outputs_close(out, expected, name=f"attention slicing {order} patch")
    ldmopt.unpatch(patched)
    after = snapshot(patched)
    if order == "before":
        assert_same_snapshot(before, after)
    else:  # slicing chosen while patched stays chosen
        assert_same_snapshot({**before, "processors": after["processors"]}, after)
        assert {type(p) for p in patched.attn_processors.values()} == {SlicedAttnProcessor}
    assert torch.equal(_run(patched, kwargs), expected)


@pytest.mark.parametrize("order", ["before", "after"])
def test_freeu_on_sdxl_up_blocks(order):
    stock = models.sdxl_unet().eval()
    kwargs = models.inputs("sdxl", stock)
    patched = copy.deepcopy(stock)
    before = snapshot(patched)
    plain = _run(stock, kwargs)
    freeu = dict(s1=0.9, s2=0.2, b1=1.2, b2=1.4)
    stock.enable_freeu(**freeu)
    if order == "before":
        patched.enable_freeu(**freeu)
    ldmopt.patch(patched)
    if order == "after":
        patched.enable_freeu(**freeu)
    expected = _run(stock, kwargs)
    _assert_differs(expected, plain, "FreeU")
    assert_outputs_close(_run(patched, kwargs), expected, name=f"FreeU {order} patch")
    patched.disable_freeu()
    assert_outputs_close(_run(patched, kwargs), plain, name="FreeU disabled")
    ldmopt.unpatch(patched)
    assert_same_snapshot(before, snapshot(patched))
    assert torch.equal(_run(patched, kwargs), plain)


# --- ControlNet, T2I-Adapter -------------------------------------------------------------------------------------


def _controlnet(unet):
    from diffusers import ControlNetModel

    # from_unet copies the UNet's encoder; its zero-initialised convolutions are drawn small so residuals count.
    return with_nontrivial_norms(ControlNetModel.from_unet(unet, conditioning_embedding_out_channels=(8, 8)))


def test_controlnet_residuals_into_patched_unet_and_patched_controlnet():
    stock = models.sd15_unet().eval()
    kwargs = models.inputs("sd15", stock)
    controlnet = _controlnet(stock)
    cond = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        down, mid = controlnet(**kwargs, controlnet_cond=cond, return_dict=False)
    residuals = dict(down_block_additional_residuals=down, mid_block_additional_residual=mid)
    patched = copy.deepcopy(stock)
    ldmopt.patch(patched)
    expected = _run(stock, kwargs, **residuals)
    _assert_differs(expected, _run(stock, kwargs), "ControlNet residuals")
    assert_outputs_close(_run(patched, kwargs, **residuals), expected, name="ControlNet residuals")

    patched_controlnet = copy.deepcopy(controlnet)
    report = ldmopt.patch(patched_controlnet)
    assert report.total > 0, report
    with torch.no_grad(), ldmopt.use_backend("torch"):
        fused_down, fused_mid = patched_controlnet(**kwargs, controlnet_cond=cond, return_dict=False)
    assert sum(n for op in report.backends().values() for n in op.values()) > 0, report.backends()
    for i, (got, want) in enumerate(zip((*fused_down, fused_mid), (*down, mid), strict=True)):
        assert_outputs_close(got, want, name=f"patched ControlNet residual {i}")


def test_t2i_adapter_intrablock_residuals():
    from diffusers import T2IAdapter

    stock = models.sd15_unet().eval()
    kwargs = models.inputs("sd15", stock)
    adapter = T2IAdapter(in_channels=3, channels=[32, 64], num_res_blocks=1, downscale_factor=2).eval()
    with torch.no_grad():
        features = adapter(torch.randn(2, 3, 16, 16))
    assert [tuple(f.shape) for f in features] == [(2, 32, 8, 8), (2, 64, 4, 4)]
    patched = copy.deepcopy(stock)
    before = snapshot(patched)
    ldmopt.patch(patched)

    def with_adapter(model):  # the UNet pops the list it is given
        return _run(model, kwargs, down_intrablock_additional_residuals=list(features))

    expected = with_adapter(stock)
    _assert_differs(expected, _run(stock, kwargs), "T2I-Adapter residuals")
    assert_outputs_close(with_adapter(patched), expected, name="T2I-Adapter residuals")
    ldmopt.unpatch(patched)
    assert_same_snapshot(before, snapshot(patched))


# --- IP-Adapter --------------------------------------------------------------------------------------------------


def _install_ip_adapter(unet, seed: int) -> None:
    """What ``load_ip_adapter`` sets up, with random weights: IP-Adapter processors on the cross-attentions and an
    image projection feeding them."""
    from diffusers.models.attention_processor import AttnProcessor2_0, IPAdapterAttnProcessor2_0
    from diffusers.models.embeddings import ImageProjection, MultiIPAdapterImageProjection

    generator = torch.Generator().manual_seed(seed)
    processors = {}
    for name in unet.attn_processors:
        if name.endswith("attn2.processor"):
            hidden = unet.get_submodule(name.removesuffix(".processor")).to_q.out_features
            processors[name] = IPAdapterAttnProcessor2_0(hidden, cross_attention_dim=32, num_tokens=(4,), scale=0.7)
        else:
            processors[name] = AttnProcessor2_0()
    unet.set_attn_processor(dict(processors))  # it pops what it sets
    unet.encoder_hid_proj = MultiIPAdapterImageProjection([ImageProjection(16, 32, num_image_text_embeds=4)])
    unet.config.encoder_hid_dim_type = "ip_image_proj"  # as diffusers' _load_ip_adapter_weights does
    with torch.no_grad():
        for p in (
            *unet.encoder_hid_proj.parameters(),
            *(q for pr in processors.values() if isinstance(pr, torch.nn.Module) for q in pr.parameters()),
        ):
            p.copy_(0.2 * torch.randn(p.shape, generator=generator))


@pytest.mark.parametrize("order", ["before", "after"])
def test_ip_adapter_processors(order):
    base = models.sd15_unet().eval()
    kwargs = models.inputs("sd15", base)
    image = dict(added_cond_kwargs={"image_embeds": [torch.randn(2, 1, 16)]})
    plain = _run(base, kwargs)
    stock, patched = copy.deepcopy(base), copy.deepcopy(base)
    _install_ip_adapter(stock, seed=5)
    if order == "before":
        _install_ip_adapter(patched, seed=5)
    before = snapshot(patched)
    report = ldmopt.patch(patched)
    if order == "after":
        _install_ip_adapter(patched, seed=5)
    expected = _run(stock, kwargs, **image)
    _assert_differs(expected, plain, "IP-Adapter")
    assert_outputs_close(_run(patched, kwargs, **image), expected, name=f"IP-Adapter {order} patch")
    # The cross-attentions keep the user's processor, said so; the rest of the blocks stays fused.
    assert _fallbacks(report, "attn2 runs IPAdapterAttnProcessor2_0") == 4, report.fallbacks()
    assert report.backends()["linear"]["torch"] > 0, report.backends()
    ldmopt.unpatch(patched)
    if order == "before":
        assert_same_snapshot(before, snapshot(patched))
    assert torch.equal(_run(patched, kwargs, **image), expected)


# --- group offloading --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("order", ["before", "after"])
@pytest.mark.parametrize("offload_type", ["block_level", "leaf_level"])
def test_group_offloading_in_memory(offload_type, order, monkeypatch):
    from diffusers.hooks import group_offloading

    stock = models.sd15_unet().eval()
    kwargs = models.inputs("sd15", stock)
    patched = copy.deepcopy(stock)
    plain = _run(stock, kwargs)

    def offload(model):
        extra = dict(num_blocks_per_group=1) if offload_type == "block_level" else {}
        model.enable_group_offload(torch.device("cpu"), torch.device("cpu"), offload_type, **extra)

    offload(stock)
    if order == "before":
        offload(patched)
    before = snapshot(patched)  # with the hooks' wrapped forwards where they came first
    report = ldmopt.patch(patched)
    if order == "after":
        offload(patched)
    onloads = _count_calls(monkeypatch, group_offloading.ModuleGroup, "onload_")
    expected = _run(stock, kwargs)
    stock_onloads = len(onloads)
    out = _run(patched, kwargs)
    assert stock_onloads > 0 and len(onloads) > stock_onloads  # the patched model's groups were onloaded too
    assert_outputs_close(out, expected, name=f"{offload_type} offloading {order} patch")
    assert_outputs_close(_run(patched, kwargs), expected, name="second call")
    if offload_type == "block_level":  # the hooks sit on whole blocks, whose insides run fused
        assert not report.fallbacks() and report.backends()["gn_conv2d"]["torch"] > 0, report
    else:  # every layer is hooked: what would bypass one runs diffusers' forward (or stays stock), said so
        assert _fallbacks(report, "has hooks") > 0, report
    if order == "after":  # diffusers' hooks wrap ldmopt's modules: unpatch waits until they are gone
        with pytest.raises(ldmopt.patch.PatchError, match="unpatch would drop what was attached"):
            ldmopt.unpatch(patched)
        _remove_diffusers_hooks(patched)
        ldmopt.unpatch(patched)
        assert torch.equal(_run(patched, kwargs), plain)
    else:
        ldmopt.unpatch(patched)
        assert_same_snapshot(before, snapshot(patched))
        assert torch.equal(_run(patched, kwargs), expected)
    assert not ldmopt.is_patched(patched)


# --- VAE tiling and slicing ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("order", ["before", "after"])
@pytest.mark.parametrize("feature", ["tiling", "slicing"])
def test_vae_tiling_and_slicing(feature, order, monkeypatch):
    from diffusers import AutoencoderKL

    stock = models.vae().eval()
    patched = copy.deepcopy(stock)
    before = snapshot(patched)
    x = torch.randn(2, 3, 32, 32)  # twice the tile size: four overlapping tiles

    def switch_on(vae):
        if feature == "tiling":
            vae.enable_tiling()
            vae.tile_sample_min_size, vae.tile_latent_min_size = 16, 8
        else:
            vae.enable_slicing()

    def encode_decode(vae):
        with torch.no_grad(), ldmopt.use_backend("torch"):
            z = vae.encode(x).latent_dist.mean
            return z, vae.decode(z).sample

    plain = encode_decode(stock)
    switch_on(stock)
    if order == "before":
        switch_on(patched)
    report = ldmopt.patch(patched)
    if order == "after":
        switch_on(patched)
    decoded = _count_calls(monkeypatch, AutoencoderKL, "_decode")
    z_stock, expected = encode_decode(stock)
    z, out = encode_decode(patched)
    if feature == "tiling":
        _assert_differs(expected, plain[1], "VAE tiling")  # tiles are blended where they overlap
    else:  # one decode per sample, in both models
        assert [args[1].shape[0] for args in decoded] == [1, 1, 1, 1], [args[1].shape for args in decoded]
    assert report.backends()["gn_conv2d"]["torch"] > 0, report.backends()
    assert_outputs_close(z, z_stock, name=f"VAE {feature} {order} patch, latents")
    assert_outputs_close(out, expected, name=f"VAE {feature} {order} patch, decoded")
    ldmopt.unpatch(patched)
    assert_same_snapshot(before, snapshot(patched))
    assert torch.equal(encode_decode(patched)[1], expected)


# --- step caches ---------------------------------------------------------------------------------------------------

#: (family, cache): the transformer families whose blocks ldmopt fuses (adaLN blocks, Flux's attention and
#: single-stream blocks, Latte's temporal blocks), each with the caches diffusers applies to it.
CACHES = [
    ("dit", "pyramid_attention_broadcast"),
    ("pixart", "pyramid_attention_broadcast"),
    ("pixart", "faster_cache"),
    ("latte", "pyramid_attention_broadcast"),
    ("latte", "faster_cache"),
    ("flux", "pyramid_attention_broadcast"),
    ("flux", "faster_cache"),
    ("flux", "taylorseer"),
]
TIMESTEPS = (900, 700, 500, 300)


def _cache_config(family: str, cache: str, clock: dict):
    import diffusers.hooks
    from diffusers.hooks import FasterCacheConfig, PyramidAttentionBroadcastConfig

    now = lambda: clock["t"]
    if cache == "pyramid_attention_broadcast":  # every other step reuses each attention's output
        return PyramidAttentionBroadcastConfig(
            spatial_attention_block_skip_range=2, spatial_attention_timestep_skip_range=(0, 1000),
            temporal_attention_block_skip_range=2, temporal_attention_timestep_skip_range=(0, 1000),
            cross_attention_block_skip_range=2, cross_attention_timestep_skip_range=(0, 1000),
            current_timestep_callback=now,
        )  # fmt: skip
    if cache == "faster_cache":
        return FasterCacheConfig(
            spatial_attention_block_skip_range=2, spatial_attention_timestep_skip_range=(-1, 800),
            temporal_attention_block_skip_range=2, temporal_attention_timestep_skip_range=(-1, 1001),
            unconditional_batch_skip_range=2, unconditional_batch_timestep_skip_range=(-1, 1001),
            attention_weight_callback=lambda _: 0.5, current_timestep_callback=now,
            is_guidance_distilled=family == "flux", tensor_format="BCFHW" if family == "latte" else "BCHW",
        )  # fmt: skip
    taylorseer = getattr(diffusers.hooks, "TaylorSeerCacheConfig", None)
    if taylorseer is None:
        pytest.skip(f"diffusers {diffusers.__version__} has no TaylorSeer cache (TaylorSeerCacheConfig)")
    return taylorseer(cache_interval=2, disable_cache_before_step=1, taylor_factors_dtype=torch.float32)


def _enable_cache(model, config) -> None:
    from diffusers.hooks import apply_faster_cache, apply_pyramid_attention_broadcast

    if hasattr(model, "enable_cache"):  # CacheMixin (Flux, Latte)
        model.enable_cache(config)
    elif type(config).__name__ == "FasterCacheConfig":
        apply_faster_cache(model, config)
    else:
        apply_pyramid_attention_broadcast(model, config)


def _denoise(model, steps: list[dict], clock: dict) -> list[torch.Tensor]:
    """One call per step, the step's timestep visible to the cache's callback, in a cache context where the model
    has one (TaylorSeer needs it)."""
    outs = []
    for t, kwargs in zip(TIMESTEPS, steps):
        clock["t"] = t
        context = model.cache_context("cond") if hasattr(model, "cache_context") else contextlib.nullcontext()
        with context:
            outs.append(_run(model, kwargs).clone())
    return outs


@pytest.mark.parametrize("order", ["before", "after"])
@pytest.mark.parametrize(("family", "cache"), CACHES)
def test_step_caches_hit_and_match_stock(family, cache, order):
    base = getattr(models, family)().eval()
    first = models.inputs(family, base)
    key = "sample" if "sample" in first else "hidden_states"
    scale = 1000 if family == "flux" else 1  # Flux takes the timestep / 1000
    steps = [
        {
            **first,
            key: first[key] + 0.05 * torch.randn_like(first[key]),
            "timestep": torch.full_like(first["timestep"], t / scale),
        }
        for t in TIMESTEPS
    ]
    clock = {"t": 0}
    plain = _denoise(base, steps, clock)
    stock, patched = copy.deepcopy(base), copy.deepcopy(base)
    _enable_cache(stock, _cache_config(family, cache, clock))
    if order == "before":
        _enable_cache(patched, _cache_config(family, cache, clock))
    report = ldmopt.patch(patched)
    assert report.total > 0, report
    if order == "after":
        _enable_cache(patched, _cache_config(family, cache, clock))
    expected = _denoise(stock, steps, clock)
    actual = _denoise(patched, steps, clock)
    # The cache hits: some step's output is not the uncached one (a patched model that missed would give that).
    hits = [i for i, (e, p) in enumerate(zip(expected, plain)) if (e - p).abs().max() > 1e-3 * p.abs().max()]
    assert hits, f"{cache} never changed {family}'s output"
    for i, (got, want) in enumerate(zip(actual, expected)):
        assert_outputs_close(got, want, name=f"{family} {cache} {order} patch, step {i}")
    for model in (patched, stock):
        if hasattr(model, "disable_cache"):
            model.disable_cache()
        else:
            _remove_diffusers_hooks(model)
    ldmopt.unpatch(patched)
    assert torch.equal(_denoise(patched, steps[-1:], clock)[0], plain[-1])


# --- attention backend, regional compilation -----------------------------------------------------------------------


@pytest.mark.parametrize("order", ["before", "after"])
def test_flux_attention_backend(order, monkeypatch):
    from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry

    base = models.flux().eval()
    kwargs = models.inputs("flux", base)
    plain = _run(base, kwargs)
    stock, patched = copy.deepcopy(base), copy.deepcopy(base)
    before = snapshot(patched)
    math = AttentionBackendName._NATIVE_MATH
    # set_attention_backend also makes its backend the process-wide default (reset_attention_backend leaves it).
    default = _AttentionBackendRegistry._active_backend
    monkeypatch.setattr(_AttentionBackendRegistry, "_active_backend", default)
    calls = _count_calls(monkeypatch, _AttentionBackendRegistry._backends, math)
    stock.set_attention_backend(math.value)
    if order == "before":
        patched.set_attention_backend(math.value)
    report = ldmopt.patch(patched)
    if order == "after":
        patched.set_attention_backend(math.value)
    # each model's processors carry the backend now (diffusers 0.35 has no set_active_backend: set the attribute)
    monkeypatch.setattr(_AttentionBackendRegistry, "_active_backend", default)
    expected = _run(stock, kwargs)
    stock_calls = len(calls)
    actual = _run(patched, kwargs)
    assert stock_calls == 2 and len(calls) == 2 * stock_calls  # both attentions of both models ran the math backend
    assert_outputs_close(actual, expected, name=f"Flux on _native_math, set {order} patch")
    assert report.backends()["rms_norm_joint"]["torch"] > 0 and not report.fallbacks(), report
    patched.reset_attention_backend()
    ldmopt.unpatch(patched)
    assert_same_snapshot(before, snapshot(patched))
    assert torch.equal(_run(patched, kwargs), plain)


def test_compile_repeated_blocks_on_patched_sd15():
    stock = models.sd15_unet().eval()
    kwargs = models.inputs("sd15", stock)
    patched = copy.deepcopy(stock)
    report = ldmopt.patch(patched)
    expected = _run(stock, kwargs)

    def ops_per_call():
        counts = lambda: {op: sum(n.values()) for op, n in report.backends().items()}
        start = counts()
        out = _run(patched, kwargs)
        return out, {op: n - start.get(op, 0) for op, n in counts().items()}

    ops_per_call()  # the first call learns which statistics each resnet hands over (ldmopt.nn.stats_handover)
    _, eager_ops = ops_per_call()
    graphs = []

    def eager(graph, example_inputs):  # torch.compile's "eager" backend, counting what it is given
        graphs.append(graph)
        return graph.forward

    patched.compile_repeated_blocks(backend=eager, fullgraph=True)
    try:
        out, compiled_ops = ops_per_call()
        blocks = [m for m in patched.modules() if type(m).__name__ == "BasicTransformerBlock"]
        assert len(blocks) == 4 and all(b._compiled_call_impl is not None for b in blocks)
        assert graphs, "nothing was compiled"
        # The compiled blocks run the same fused ops as eager (report.backends() counts inside compiled code too),
        # but for norm1's statistics: eager blocks take them from proj_in's epilogue (stats_handover), a compiled block
        # takes no hand-over and runs a statistics pass (one per block).
        stats_passes = (compiled_ops.pop("layer_norm_stats", 0), eager_ops.pop("layer_norm_stats", 0))
        assert stats_passes == (len(blocks), 0), stats_passes
        assert compiled_ops == eager_ops and compiled_ops["layer_norm_linear"] > 0, (compiled_ops, eager_ops)
        assert_outputs_close(out, expected, name="compiled repeated blocks")
        compiled = len(graphs)
        ldmopt.unpatch(patched)
        assert torch.equal(_run(patched, kwargs), expected)
        assert len(graphs) > compiled  # the blocks stay compiled: recompiled over diffusers' forward
    finally:
        torch._dynamo.reset()  # the compiled blocks' code would count toward later tests' recompile limits


def test_a_hook_registry_emptied_before_patch_does_not_keep_a_block_stock():
    # Enabling a diffusers hook and removing it again (a cache turned on, then off) leaves an empty HookRegistry on
    # the module: nothing wraps its forward any more, so the block is patched.
    from diffusers.hooks import HookRegistry, ModelHook

    vae = models.vae().eval()
    block = vae.decoder.mid_block.resnets[0]
    registry = HookRegistry.check_if_exists_or_initialize(block)
    registry.register_hook(ModelHook(), "temporary")
    registry.remove_hook("temporary")
    report = ldmopt.patch(vae)
    assert any(r.where == "decoder.mid_block.resnets.0" for r in report.replaced), [
        s.reasons for s in report.skipped if s.where == "decoder.mid_block.resnets.0"
    ]
