"""ldmopt.nn.temporal_layout: SVD temporal blocks and AnimateDiff / UNet3D temporal containers run whole in
(B, F, N, C) order, against diffusers' own forward on tiny random-weight models (Triton interpreter)."""

import copy

import pytest
import torch

import ldmopt
from ldmopt.nn import temporal_layout as L
from ldmopt.nn.temporal_attention import install_processors, uninstall_processors
from ldmopt.nn.temporal_layout import install_temporal_blocks, uninstall_temporal_blocks
from tests.nn.test_temporal_processor import BUILDERS, FRAMES, _container_call, _CopyRecorder
from tests.tolerances import assert_close, assert_within_torch_error

diffusers = pytest.importorskip("diffusers")


@pytest.fixture(scope="module")
def models():
    torch.manual_seed(0)
    return {name: BUILDERS[name]().eval() for name in ("animatediff", "svd", "modelscope")}


# ------------------------------------------------------------------------------------------------ SVD block


@pytest.mark.parametrize("with_processors", [False, True])
def test_svd_block_in_bfnc_order_matches_stock(models, with_processors):
    block, call = _container_call("svd", models["svd"])
    with torch.no_grad():
        expected = call()
        processors = install_processors(block) if with_processors else None
        blocks = install_temporal_blocks(block)
        try:
            got = call()
        finally:
            uninstall_temporal_blocks(blocks)
            if processors is not None:
                uninstall_processors(processors)
    assert list(blocks.report().values()) == [{"kernel": 1}]
    assert "forward" not in vars(block.temporal_transformer_blocks[0])
    assert_close(got, expected.double(), torch.float32, "svd block")


def test_svd_block_epilogues_survive_the_profiler(models):
    # ff_in, attn1 and ff add their residuals in GEMM epilogues, also under the profiler's observer hooks; ff_in's
    # also sums norm1's statistics, so only norm_in and norm3 run a statistics pass.
    from ldmopt.nn.child_check import fallback_reasons
    from ldmopt.profiler.scopes import ModuleScopes

    temporal = copy.deepcopy(models["svd"].down_blocks[0].attentions[0].temporal_transformer_blocks[0])
    x, context = torch.randn(2 * FRAMES, 6, 64), torch.randn(2 * 6, 1, 16)
    report = ldmopt.patch(temporal)
    fallback_reasons.clear()
    with torch.no_grad(), ModuleScopes(temporal), ldmopt.use_backend("torch"):
        temporal(x, num_frames=FRAMES, encoder_hidden_states=context)
    assert not fallback_reasons, dict(fallback_reasons)
    ran = report.backends()
    assert ran["linear"] == {"torch": 2} and ran["linear_stats"] == {"torch": 1}, ran
    assert ran["layer_norm_stats"] == {"torch": 2}, ran


def test_svd_block_issues_no_activation_copy(models):
    temporal = copy.deepcopy(models["svd"].down_blocks[0].attentions[0].temporal_transformer_blocks[0])
    x, context = torch.randn(2 * FRAMES, 6, 64), torch.randn(2 * 6, 1, 16)
    install = install_temporal_blocks(temporal)
    with torch.no_grad():
        with _CopyRecorder() as ours:
            got = temporal(x, num_frames=FRAMES, encoder_hidden_states=context)
        uninstall_temporal_blocks(install)
        with _CopyRecorder() as theirs:
            expected = temporal(x, num_frames=FRAMES, encoder_hidden_states=context)
    assert_close(got, expected.double(), torch.float32, "svd temporal block")
    copies = [(name, n) for name, n in ours.ops if name in _CopyRecorder.COPY_OPS and n >= x.numel()]
    assert not copies, copies
    # diffusers' block permutes the activation to (B*N, F, C) and back: two copies at least.
    assert sum(name in _CopyRecorder.COPY_OPS and n >= x.numel() for name, n in theirs.ops) >= 2, theirs.ops


def test_svd_block_falls_back_with_reason(models):
    temporal = copy.deepcopy(models["svd"].down_blocks[0].attentions[0].temporal_transformer_blocks[0])
    x, context = torch.randn(2 * FRAMES, 6, 64), torch.randn(2 * 6, 1, 16)
    with torch.no_grad():
        temporal.set_chunk_feed_forward(1)
        expected_chunked = temporal(x, num_frames=FRAMES, encoder_hidden_states=context)
        expected_long = temporal(x, num_frames=FRAMES, encoder_hidden_states=context.expand(-1, 3, -1))
        install = install_temporal_blocks(temporal)
        chunked = temporal(x, num_frames=FRAMES, encoder_hidden_states=context)
        temporal.set_chunk_feed_forward(None)
        long = temporal(x, num_frames=FRAMES, encoder_hidden_states=context.expand(-1, 3, -1))
    reasons = {"kernel": 0, "chunked feed-forward": 1, "attn2 context is not one key per (batch, pixel)": 1}
    assert install.report()[""] == reasons
    assert torch.equal(chunked, expected_chunked) and torch.equal(long, expected_long)


# ------------------------------------------------------------------------------------------------ containers


def _container(family, models):
    model = models[family]
    module = model.down_blocks[0].motion_modules[0] if family == "animatediff" else model.transformer_in
    return copy.deepcopy(module)


def _call(container, x, **kwargs):
    out = container(x, num_frames=FRAMES, **kwargs)
    return out if isinstance(out, torch.Tensor) else out.sample


def _input(channels_last, channels=40, height=3, width=5):
    x = torch.randn(2 * FRAMES, channels, height, width)
    return x.contiguous(memory_format=torch.channels_last) if channels_last else x


CONTAINER_FAMILIES = ["animatediff", "modelscope"]


@pytest.mark.parametrize("family", CONTAINER_FAMILIES)
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "channels_last"])
def test_container_in_bfnc_order_matches_stock(models, family, channels_last):
    container = _container(family, models)
    if family == "animatediff":  # the motion module's sinusoidal positions over frames are part of what is checked
        assert container.transformer_blocks[0].pos_embed is not None
    x = _input(channels_last)
    L.layout_conversions.clear()
    with torch.no_grad():
        expected = _call(container, x)
        install = install_temporal_blocks(container)
        try:
            got = _call(container, x)
        finally:
            uninstall_temporal_blocks(install)
    assert install.report() == {"": {"kernel": 1}} and not install.skipped
    assert "forward" not in vars(container)
    assert_close(got, expected.double(), torch.float32, f"{family} container")
    # The result keeps the input's layout; only an NCHW input is copied (once) to channels-last.
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    assert got.is_contiguous(memory_format=fmt)
    assert sum(L.layout_conversions.values()) == (0 if channels_last else 1), L.layout_conversions


@pytest.mark.parametrize("family", CONTAINER_FAMILIES)
def test_container_issues_no_activation_copy(models, family):
    container = _container(family, models)
    x = _input(channels_last=True)
    install = install_temporal_blocks(container)
    with torch.no_grad():
        with _CopyRecorder() as ours:
            got = _call(container, x)
        uninstall_temporal_blocks(install)
        with _CopyRecorder() as theirs:
            expected = _call(container, x)
    assert_close(got, expected.double(), torch.float32, family)
    big = x.numel() // 2  # any copy of (a layout of) the activation, also of its projections
    copies = [(name, n) for name, n in ours.ops if name in _CopyRecorder.COPY_OPS and n >= big]
    assert not copies, copies
    # diffusers permutes to (B*N, F, C) and back (and GroupNorm may copy its input): two copies at least.
    assert sum(name in _CopyRecorder.COPY_OPS and n >= big for name, n in theirs.ops) >= 2, theirs.ops


class _CustomProcessor(diffusers.models.attention_processor.AttnProcessor2_0):
    pass


@pytest.mark.parametrize("family", CONTAINER_FAMILIES)
def test_container_falls_back_with_reason(models, family):
    container = _container(family, models)
    block = container.transformer_blocks[0]
    x = _input(channels_last=True)
    install = install_temporal_blocks(container)
    with torch.no_grad():
        block.set_chunk_feed_forward(1)
        chunked = _call(container, x)
        block.set_chunk_feed_forward(None)
        block.attn2.set_processor(_CustomProcessor())
        custom = _call(container, x)
        uninstall_temporal_blocks(install)
        expected = _call(container, x)
    assert install.report()[""] == {
        "kernel": 0,
        "transformer_blocks.0: chunked feed-forward": 1,
        "transformer_blocks.0: attn2 has custom processor _CustomProcessor": 1,
    }
    assert_close(chunked, expected.double(), torch.float32, "chunked")
    assert torch.equal(custom, expected)


@pytest.mark.parametrize("family", CONTAINER_FAMILIES)
def test_container_under_vmap_and_with_positional_arguments(models, family):
    """torch.func.vmap runs the stock forward (it cannot query the layouts the token-order path reads), with the
    reason counted; TransformerTemporalModel's positional return_dict is honoured."""
    container = _container(family, models)
    x = _input(channels_last=False)
    install = install_temporal_blocks(container)
    with torch.no_grad():
        mapped = torch.func.vmap(lambda a: _call(container, a))(x[None].expand(2, *x.shape))
        assert install.report()[""] == {"kernel": 0, "under a torch.func transform (vmap, grad, jvp ...)": 1}
        uninstall_temporal_blocks(install)
        expected = _call(container, x)
        install = install_temporal_blocks(container)
        if family == "modelscope":  # (hidden, encoder_hidden_states, timestep, class_labels, num_frames, kwargs, rd)
            out = container(x, None, None, None, FRAMES, None, False)
            assert isinstance(out, tuple)
            assert_close(out[0], expected.double(), torch.float32, "positional return_dict")
    assert install.report()[""]["kernel"] == (1 if family == "modelscope" else 0)
    assert_close(mapped[0], expected.double(), torch.float32, "vmap")


def test_container_calls_its_projections_as_diffusers_does(models):
    """AnimateDiffTransformer3D calls proj_in and proj_out by keyword (input=): a pre-hook with kwargs sees the same
    call in token order."""
    container = _container("animatediff", models)
    x = _input(channels_last=False)  # an NCHW input: proj_in and proj_out are called as modules, not in epilogues
    seen = []
    for name in ("proj_in", "proj_out"):
        getattr(container, name).register_forward_pre_hook(
            lambda module, args, kwargs, name=name: seen.append((name, len(args), sorted(kwargs))), with_kwargs=True
        )
    with torch.no_grad():
        expected = _call(container, x)
        install = install_temporal_blocks(container)
        got = _call(container, x)
    assert install.report()[""]["kernel"] == 1
    assert seen[2:] == seen[:2] == [("proj_in", 0, ["input"]), ("proj_out", 0, ["input"])]
    assert_close(got, expected.double(), torch.float32, "hooked projections")


def test_container_static_reasons(models):
    container = _container("animatediff", models)
    block = container.transformer_blocks[0]
    assert L.container_static_reason(container) is None
    block.norm_type = "ada_norm"
    assert (
        L.container_static_reason(container) == "transformer_blocks.0: block norm_type 'ada_norm' (only 'layer_norm')"
    )
    block.norm_type = "layer_norm"
    block.pos_embed = torch.nn.Identity()
    assert "positional embedding Identity" in L.container_static_reason(container)
    install = install_temporal_blocks(container)
    assert not install.blocks and "positional embedding Identity" in install.skipped[""]


def test_container_backward_matches_stock(models):
    container = _container("animatediff", models).train()
    x = _input(channels_last=True).requires_grad_()
    grad_out = torch.randn(x.shape).contiguous(memory_format=torch.channels_last)

    def grads():
        container.zero_grad(set_to_none=True)
        x.grad = None
        (_call(container, x) * grad_out).sum().backward()
        return x.grad.clone(), {n: p.grad.clone() for n, p in container.named_parameters()}

    expected_x, expected_params = grads()
    install = install_temporal_blocks(container)
    try:
        got_x, got_params = grads()
    finally:
        uninstall_temporal_blocks(install)
    assert install.report()[""]["kernel"] == 1
    assert_close(got_x, expected_x.double(), torch.float32, "dx")
    assert got_params.keys() == expected_params.keys()
    for name, grad in got_params.items():
        assert_close(grad, expected_params[name].double(), torch.float32, f"d{name}")


def test_patch_reports_containers_copies_and_fallbacks(models):
    model = copy.deepcopy(models["animatediff"])
    motion = model.down_blocks[0].motion_modules[0]
    x = _input(channels_last=False)
    with torch.no_grad():
        expected = _call(motion, x)
        report = ldmopt.patch(model, families={"temporal_layout", "temporal_attention"})
        assert report.counts() == {"temporal_container": 7}, report.counts()
        assert "(B, F, N, C) order" in repr(motion)
        got = _call(motion, x)
        motion.transformer_blocks[0].set_chunk_feed_forward(1)
        _call(motion, x)
    assert_close(got, expected.double(), torch.float32, "patched motion module")
    assert report.layout_copies() == {"AnimateDiffTransformer3D: NCHW input copied to channels-last": 1}
    assert report.fallbacks() == {
        "AnimateDiffTransformer3D ran diffusers' forward: transformer_blocks.0: chunked feed-forward": 1
    }
    text = str(report)
    assert "channels-last since patch" in text and "chunked feed-forward" in text
    ldmopt.unpatch(model)
    assert type(motion).__name__ == "AnimateDiffTransformer3D" and "ldmopt" not in repr(motion)
    # Without temporal_layout, the attention processors take the temporal modules, as before.
    report = ldmopt.patch(model, families={"temporal_attention"})
    assert report.counts() == {"temporal_attention": 14}
    ldmopt.unpatch(model)


def test_patch_with_processors_installed_first(models):
    """Processors installed by hand count as stock-or-ours: the container still runs in token order."""
    container = _container("modelscope", models)
    x = _input(channels_last=True)
    processors = install_processors(container)
    try:
        with torch.no_grad():
            expected = _call(container, x)
            install = install_temporal_blocks(container)
            got = _call(container, x)
            uninstall_temporal_blocks(install)
    finally:
        uninstall_processors(processors)
    assert install.report() == {"": {"kernel": 1}}
    assert_close(got, expected.double(), torch.float32, "modelscope container")


@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "channels_last"])
def test_patched_svd_transformer_keeps_the_input_layout(models, channels_last):
    """spatiotemporal_in (GroupNorm in proj_in's loads) + svd_temporal_block on SVD's TransformerSpatioTemporalModel:
    same output as diffusers, in the input's layout, with no GroupNorm pass of its own (channels-last input)."""
    transformer = copy.deepcopy(models["svd"].down_blocks[0].attentions[0])
    x = _input(channels_last, channels=64)
    context = torch.randn(2 * FRAMES, 1, 16)
    indicator = torch.zeros(2, FRAMES)

    def run():
        return transformer(x, context, image_only_indicator=indicator, return_dict=False)[0]

    with torch.no_grad():
        expected = run()
        report = ldmopt.patch(transformer)
        assert report.counts() == {
            "geglu": 3, "residual_block": 1, "spatiotemporal_in": 1, "svd_attn2": 1, "svd_temporal_block": 1
        }  # fmt: skip
        with _CopyRecorder() as ours:
            got = run()
    assert_close(got, expected.double(), torch.float32, "svd transformer")
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    assert got.is_contiguous(memory_format=fmt)
    assert not report.layout_copies()
    if channels_last:
        assert not report.fallbacks()
        assert "native_group_norm" not in {name for name, _ in ours.ops}
    else:  # the fused GroupNorm -> proj_in reads channels-last only: an NCHW call takes the reference, with the reason
        assert [r for r in report.fallbacks() if "is not channels-last" in r] == list(report.fallbacks())
    ldmopt.unpatch(transformer)
    assert type(transformer).__name__ == "TransformerSpatioTemporalModel" and "ldmopt" not in repr(transformer)


# ------------------------------------------------------------------------------------------------ Latte


def _latte_cases():
    from ldmopt.configs import build_model, example_inputs

    def zoo():  # Latte's own config: ada_norm_single temporal blocks
        model = build_model("latte", tiny=True, device="cpu", dtype=torch.float32).eval()
        return model, {k: v for k, v in example_inputs(model, batch=2).kwargs.items() if k != "return_dict"}

    def default():  # diffusers' default config: layer_norm temporal blocks with a GEGLU feed-forward
        model = BUILDERS["latte"]().eval()
        kwargs = dict(timestep=torch.tensor([10, 20]), encoder_hidden_states=torch.randn(2, 3, 16))
        return model, dict(hidden_states=torch.randn(2, 4, FRAMES, 4, 4), **kwargs)

    return {"ada_norm_single": zoo, "layer_norm": default}


def test_latte_runs_a_hooked_norm_out():
    """The patched Latte forward modulates norm_out's output itself; with a hook on norm_out (registered before or
    after patching) it calls the module, so the hook runs and its change shows, as on the stock model."""
    torch.manual_seed(0)
    model, kwargs = _latte_cases()["ada_norm_single"]()
    calls = []

    def hook(module, args, out):
        calls.append(1)
        return out * 1.5 + 0.1

    model.norm_out.register_forward_hook(hook)
    with torch.no_grad():
        expected = model(**kwargs, return_dict=False)[0]
        ldmopt.patch(model)
        got = model(**kwargs, return_dict=False)[0]
    assert len(calls) == 2
    assert_close(got, expected.double(), torch.float32, "latte, hooked norm_out")


@pytest.mark.parametrize("variant", ["ada_norm_single", "layer_norm"])
def test_latte_temporal_blocks_in_token_order(variant):
    torch.manual_seed(0)
    model, kwargs = _latte_cases()[variant]()
    layers = len(model.temporal_transformer_blocks)

    def run():
        return model(**kwargs, return_dict=False)[0]

    with torch.no_grad():
        with _CopyRecorder() as theirs:
            expected = run()
        report = ldmopt.patch(model)
        assert report.counts()["latte_temporal"] == 1 and "temporal_attention" not in report.counts()
        with _CopyRecorder() as ours:
            got = run()
        model.temporal_transformer_blocks[0].set_chunk_feed_forward(1)
        chunked = run()
        model.temporal_transformer_blocks[0].set_chunk_feed_forward(None)
    assert_close(got, expected.double(), torch.float32, f"latte {variant}")
    assert_close(chunked, expected.double(), torch.float32, "latte chunked (stock forward)")
    assert report.fallbacks() == {
        "LatteTransformer3DModel ran diffusers' forward: temporal_transformer_blocks.0: chunked feed-forward": 1
    }
    # diffusers permutes the tokens to (B*N, F, C) and back around every temporal block: 2 copies per layer fewer
    # (with B > 1; for one video the permuted tokens are still a view).
    big = kwargs["hidden_states"].numel()

    def copies(rec):
        return sum(name in _CopyRecorder.COPY_OPS and n >= big for name, n in rec.ops)

    assert copies(ours) <= copies(theirs) - 2 * layers, (copies(ours), copies(theirs))
    if variant == "ada_norm_single":
        # Every LayerNorm runs fused into its modulation, the model's output norm_out * (1 + scale) + shift included.
        assert not [name for name, _ in ours.ops if "layer_norm" in name], [name for name, _ in ours.ops]
    ldmopt.unpatch(model)
    assert type(model).__name__ == "LatteTransformer3DModel" and "ldmopt" not in repr(model)
    with torch.no_grad():
        assert torch.equal(run(), expected)


def test_latte_gradients_match_stock():
    torch.manual_seed(0)
    model, kwargs = _latte_cases()["ada_norm_single"]()
    model.train()
    x = kwargs["hidden_states"].requires_grad_()

    def grads():
        model.zero_grad(set_to_none=True)
        x.grad = None
        out = model(**kwargs, return_dict=False)[0]
        (out * torch.linspace(-1, 1, out.numel()).view(out.shape)).sum().backward()
        return x.grad.clone(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    expected_x, expected = grads()
    report = ldmopt.patch(model, training=True)
    assert report.counts()["latte_temporal"] == 1
    got_x, got = grads()
    ldmopt.unpatch(model)
    assert_close(got_x, expected_x.double(), torch.float32, "dx")
    assert got.keys() == expected.keys()
    for name, grad in got.items():
        assert_close(grad, expected[name].double(), torch.float32, f"d{name}")


def test_svd_shortcuts_give_every_parameter_its_gradient(models):
    """The single-key shortcut skips attn2's query path (to_q, to_k, the norm2 feeding it), whose stock gradient is
    exactly zero: patched, those parameters get exact zeros too, not None (DDP without find_unused_parameters and
    AdamW's weight decay rely on it)."""
    transformer = copy.deepcopy(models["svd"].down_blocks[0].attentions[0]).train()
    x = _input(True, channels=64).requires_grad_()
    context = torch.randn(2 * FRAMES, 1, 16)
    indicator = torch.zeros(2, FRAMES)

    def grads():
        transformer.zero_grad(set_to_none=True)
        out = transformer(x, context, image_only_indicator=indicator, return_dict=False)[0]
        (out * torch.linspace(-1, 1, out.numel()).view(out.shape)).sum().backward()
        return {n: p.grad for n, p in transformer.named_parameters()}

    expected = grads()
    report = ldmopt.patch(transformer, training=True)
    assert report.counts()["svd_attn2"] == 1 and report.counts()["svd_temporal_block"] == 1
    got = grads()
    ldmopt.unpatch(transformer)
    missing = [n for n, g in got.items() if g is None and expected[n] is not None]
    assert not missing, missing
    skipped = [n for n in got if ".attn2.to_q." in n or ".attn2.to_k." in n]
    # Ours are exact zeros; the stock SDPA backward leaves rounding noise around zero.
    assert skipped and all(torch.count_nonzero(got[n]) == 0 for n in skipped)
    for name, grad in got.items():
        assert_close(grad, expected[name].double(), torch.float32, f"d{name}")


@pytest.mark.parametrize("family", CONTAINER_FAMILIES)
def test_container_group_norm_runs_in_proj_in_loads(models, family):
    container = _container(family, models)
    x = _input(channels_last=True)
    install = install_temporal_blocks(container)
    try:
        with torch.no_grad(), _CopyRecorder() as ops:
            got = _call(container, x)
        names = [name for name, _ in ops.ops]
        assert "gn_conv2d" in names and not [n for n in names if "group_norm" in n], names
        # A hook on the norm keeps it a module call of its own (the hook sees its output), then proj_in.
        seen = []
        container.norm.register_forward_hook(lambda m, a, out: seen.append(out.shape))
        with torch.no_grad():
            hooked_out = _call(container, x)
        assert seen and torch.allclose(hooked_out, got, rtol=1e-4, atol=1e-5)
    finally:
        uninstall_temporal_blocks(install)
    with torch.no_grad():
        expected = _call(container, x)
    assert_close(got, expected.double(), torch.float32, family)


def test_default_patch_reads_the_container_norm_in_proj_in_loads_and_hands_norm1_its_statistics(
    models, triton_launches
):
    model = copy.deepcopy(models["animatediff"])
    motion = model.down_blocks[0].motion_modules[0]
    x = _input(channels_last=True)
    with torch.no_grad():
        expected = _call(motion, x)
    report = ldmopt.patch(model)
    # temporal_container claims its norm and proj_in: the group_norm rule does not swap the norm for a class the
    # fused path would not read (which made it a GroupNorm pass of its own before proj_in)
    assert type(motion.norm) is torch.nn.GroupNorm and "group_norm" not in report.counts(), report.counts()
    stats_ops = lambda: sum(report.backends().get("layer_norm_stats", {}).values())
    before = stats_ops()
    with torch.no_grad(), ldmopt.use_backend("torch"), _CopyRecorder() as ops:
        got = _call(motion, x)
    names = [name for name, _ in ops.ops]
    assert "gn_conv2d" in names and not [n for n in names if "group_norm" in n], names
    assert stats_ops() == before  # the one block's norm1 read the statistics proj_in's conv returned with its output
    assert_close(got, expected.double(), torch.float32, "patched motion module")
    # 16-bit operands: the conv's epilogue sums them (fp32 ones take a statistics pass after the conv)
    half, x_half = copy.deepcopy(motion).half(), x.half()
    triton_launches.clear()
    with torch.no_grad(), ldmopt.use_backend("triton"):
        got_half = _call(half, x_half)
    assert "_row_stats_kernel" not in triton_launches and "_gn_conv2d_fwd_kernel" in triton_launches, triton_launches
    with torch.no_grad():
        stock_half = _call(copy.deepcopy(models["animatediff"].down_blocks[0].motion_modules[0]).half(), x_half)
    assert_within_torch_error(got_half, expected.double(), stock_half, "fp16 patched motion module")
    ldmopt.unpatch(model)


@pytest.mark.parametrize("hooked", ["proj_in", "norm"])
def test_a_hooked_norm_or_proj_in_costs_only_their_fusion(models, hooked):
    """temporal_container claims the container's norm and proj_in (kept from the group_norm rule) without making them
    a condition of the rule: a hook on one leaves the container fused, and that pair runs as modules per call."""
    model = copy.deepcopy(models["animatediff"])
    motion = model.down_blocks[0].motion_modules[0]
    seen = []
    getattr(motion, hooked).register_forward_hook(lambda m, args, out: seen.append(out.shape))
    x = _input(channels_last=True)
    with torch.no_grad():
        expected = _call(motion, x)
    report = ldmopt.patch(model)
    assert report.counts()["temporal_container"] == 7 and not report.skipped, (report.counts(), report.skipped)
    assert type(motion.norm) is torch.nn.GroupNorm  # claimed, so not swapped, hooked or not
    with torch.no_grad(), ldmopt.use_backend("torch"):
        got = _call(motion, x)
    assert len(seen) == 2  # the hooked module ran in the fused container's call too
    assert_close(got, expected.double(), torch.float32, f"motion module with a hooked {hooked}")
    ldmopt.unpatch(model)


@pytest.mark.parametrize("tokens_3d", [False, True])
def test_token_order_block_adds_frame_positions_in_any_token_shape(tokens_3d):
    # A layer_norm block with sinusoidal positions run in (B, F, N) token order, given as (B, F, N, C) (AnimateDiff's
    # containers) or as (B, F*N, C) (Latte's layer_norm path): row ((b F + f) N + n) takes table row f, as diffusers'
    # block does on its (B*N, F, C) layout.
    from diffusers.models.attention import BasicTransformerBlock

    from ldmopt.nn.temporal_layout import _basic_block_bfnc

    b, f, n, c = 2, 3, 4, 40
    block = BasicTransformerBlock(c, 2, 20, norm_type="layer_norm", positional_embeddings="sinusoidal",
                                  num_positional_embeddings=f * n).eval()  # fmt: skip
    x = torch.randn(b, f, n, c)
    with torch.no_grad():
        stock = block(x.permute(0, 2, 1, 3).reshape(b * n, f, c)).view(b, n, f, c).permute(0, 2, 1, 3)
        exact = copy.deepcopy(block).double()(x.double().permute(0, 2, 1, 3).reshape(b * n, f, c))
        exact = exact.view(b, n, f, c).permute(0, 2, 1, 3)
        with ldmopt.use_backend("triton"):
            out = _basic_block_bfnc(block, x.reshape(b, f * n, c) if tokens_3d else x, (b, f, n))
    assert_within_torch_error(out.reshape(b, f, n, c), exact, stock, f"positions, 3-D tokens={tokens_3d}")
