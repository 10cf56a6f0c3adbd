"""The analytic model's ``GEMM epilogue (residual)`` and ``(gated residual)`` fusions: which residual adds of
transformer blocks it projects as fused (those the ``residual_block`` and ``adaln_block`` rules and the token-order
temporal forwards fuse), and which not."""

import torch

from ldmopt.profiler import analyze
from ldmopt.profiler.fusions import ADALN, RESIDUAL, plan_fusions, single_key_paths


def _blocks(model, name):
    return [m for m in model.modules() if type(m).__name__ == name]


def _claimed_adds(a):
    _saved, rule, removed, _stats = plan_fusions(a.records, single_key_paths(a.attention))
    adds = [r for r in a.records if r.base == "add" and rule.get(r.index) == RESIDUAL]
    assert all(r.index in removed for r in adds)
    return adds


def test_unet_blocks_three_residuals_each():
    from ldmopt.configs import build_model

    model = build_model("sd15", tiny=True, device="meta", dtype=torch.float16)
    a = analyze(model, gpu="H200", placement="triton")
    blocks = len(_blocks(model, "BasicTransformerBlock"))
    stat = a.fusions[RESIDUAL]
    # attn1, attn2 and the feed-forward; each attention's "/ rescale_output_factor" goes too.
    assert stat.count == 3 * blocks > 0
    assert stat.ops_removed == 3 * blocks + 2 * blocks
    assert all(r.owner.endswith(".BasicTransformerBlock") for r in _claimed_adds(a))
    elementwise = a.categories["elementwise"]
    assert elementwise.patched_bytes < elementwise.bytes


def test_svd_single_key_attention_keeps_its_add():
    # SVD's attn2 (one image-embedding key, spatial and temporal) runs the single-key shortcut: a broadcast add stays.
    from ldmopt.configs import build_model

    model = build_model("svd", tiny=True, device="meta", dtype=torch.float16)
    a = analyze(model, gpu="H200", frames=2)
    spatial = len(_blocks(model, "BasicTransformerBlock"))
    temporal = len(_blocks(model, "TemporalBasicTransformerBlock"))
    containers = len(_blocks(model, "TransformerSpatioTemporalModel"))
    # Spatial: attn1 + ff. Temporal: ff_in (is_res), attn1 + ff. Each container's proj_out + its input.
    assert a.fusions[RESIDUAL].count == 2 * spatial + 3 * temporal + containers
    for add in _claimed_adds(a):
        sources = [a.records[p] for p in add.producers if p >= 0]
        assert sources and not any(".attn2" in r.path for r in sources), add


def test_adaln_blocks_attention_epilogues():
    # PixArt (adaln_block): attn1's gated residual and attn2's add in the output projections' epilogues, each
    # attention's "/ rescale_output_factor" removed with them; the feed-forward's gated residual likewise.
    from ldmopt.configs import build_model
    from ldmopt.profiler.fusions import GATED_RESIDUAL

    model = build_model("pixart-alpha", tiny=True, device="meta", dtype=torch.float16)
    a = analyze(model, gpu="H200")
    blocks = len(_blocks(model, "BasicTransformerBlock"))
    assert a.fusions[RESIDUAL].count == blocks > 0  # attn2
    assert a.fusions[GATED_RESIDUAL].count == 2 * blocks  # attn1, ff
    assert a.fusions[ADALN].count > 0
    _saved, _rule, removed, _stats = plan_fusions(a.records, single_key_paths(a.attention))
    rescales = [r for r in a.records if r.base == "div" and r.owner.endswith(".Attention")]
    assert len(rescales) == 2 * blocks and all(r.index in removed for r in rescales)


def test_flux_single_block_concatenation_is_read_by_proj_out():
    # flux_single_gated: proj_out reads [attn | mlp] in place; the block's first concatenation (text and image
    # streams, read by the norm and kept as the residual) is a view of the previous single block's output, except in
    # the first single block, fed by the double blocks' two streams.
    from ldmopt.configs import build_model
    from ldmopt.profiler.fusions import CONCAT_GEMM, HALVES_IN_PLACE

    model = build_model("flux", tiny=True, device="meta", dtype=torch.bfloat16)
    a = analyze(model, gpu="H200", dtype="bf16")
    singles = len(_blocks(model, "FluxSingleTransformerBlock"))
    stat = a.fusions[CONCAT_GEMM]
    assert stat.count == stat.ops_removed == singles > 1
    assert a.fusions[HALVES_IN_PLACE].count == singles - 1
    _saved, rule, removed, _stats = plan_fusions(a.records, single_key_paths(a.attention))
    cats = [r for r in a.records if r.base == "cat" and r.owner.endswith(".FluxSingleTransformerBlock")]
    fused = [r for r in cats if r.index in removed and rule[r.index] == CONCAT_GEMM]
    assert len(cats) == 2 * singles and len(fused) == singles
    assert all(a.records[r.consumers[0]].path.endswith(".proj_out") for r in fused)
    joint = [r for r in cats if r.index in removed and rule[r.index] == HALVES_IN_PLACE]
    assert [r.path for r in joint] == [f"single_transformer_blocks.{i}" for i in range(1, singles)]
    assert all(len(set(r.producers)) == 1 for r in joint)


def test_flux_qk_stream_concatenation_and_fp16_clips():
    # The double blocks' [text | image] q and k are written by the joint norm kernel (the values' concatenation
    # stays); every fp16 clip follows a gated-residual epilogue that clamps (single blocks' proj_out, double blocks'
    # ff_context).
    from ldmopt.configs import build_model
    from ldmopt.profiler.fusions import CLIP_EPILOGUE, QK_CONCAT

    model = build_model("flux", tiny=True, device="meta", dtype=torch.float16)
    a = analyze(model, gpu="H200")
    doubles = len(_blocks(model, "FluxTransformerBlock"))
    singles = len(_blocks(model, "FluxSingleTransformerBlock"))
    _saved, rule, removed, _stats = plan_fusions(a.records, single_key_paths(a.attention))
    assert all(i in removed for i, name in rule.items() if name in (QK_CONCAT, CLIP_EPILOGUE))
    attn_cats = [r for r in a.records if r.base == "cat" and r.owner.endswith(".FluxAttention")]
    assert len(attn_cats) == 3 * doubles > 0
    assert [rule.get(r.index) for r in attn_cats] == [QK_CONCAT, QK_CONCAT, None] * doubles
    clamps = [r for r in a.records if r.base == "clamp"]
    assert len(clamps) == doubles + singles and all(rule[r.index] == CLIP_EPILOGUE for r in clamps)
    assert a.fusions[CLIP_EPILOGUE].ops_removed == len(clamps)


def _claimed_norms(a):
    from ldmopt.profiler.fusions import LN_GEMM, LN_STATS

    _saved, rule, removed, stats = plan_fusions(a.records, single_key_paths(a.attention))
    norms = [r for r in a.records if r.base == "native_layer_norm" and rule.get(r.index) == LN_GEMM]
    # The statistics pass stays unless the GEMM epilogue that wrote the norm's input summed them (LN_STATS).
    assert sum(r.index in removed for r in norms) == stats[LN_STATS].count
    return norms


def test_unet_block_norms_are_read_in_the_gemm_loads():
    from ldmopt.configs import build_model
    from ldmopt.profiler.fusions import LN_GEMM, LN_STATS, QKV_GEMM

    model = build_model("sd15", tiny=True, device="meta", dtype=torch.float16)
    a = analyze(model, gpu="H200", placement="triton")
    blocks = len(_blocks(model, "BasicTransformerBlock"))
    norms = _claimed_norms(a)
    assert sorted({r.path.rsplit(".", 1)[1] for r in norms}) == ["norm1", "norm2", "norm3"]
    assert len(norms) == a.fusions[LN_GEMM].count == 3 * blocks > 0
    # The norms' output writes (x's size); norm2's and norm3's statistics come from the residual GEMMs' epilogues
    # (one block per transformer here: norm1 keeps its pass); to_q/to_k/to_v read x once, one GEMM.
    assert a.fusions[LN_GEMM].bytes_saved == sum(r.in_bytes[0] for r in norms)
    assert a.fusions[LN_STATS].count == a.fusions[LN_STATS].ops_removed == 2 * blocks
    assert a.fusions[QKV_GEMM].count == blocks


def test_blocks_in_a_row_take_norm1_statistics_from_the_previous_block():
    from ldmopt.configs import build_model
    from ldmopt.profiler.fusions import LN_STATS

    model = build_model("sdxl", device="meta", dtype=torch.float16)
    a = analyze(model, gpu="H200")
    blocks = len(_blocks(model, "BasicTransformerBlock"))
    containers = sum(1 for m in model.modules() if type(m).__name__ == "Transformer2DModel")
    assert (blocks, containers) == (70, 11)
    assert a.fusions[LN_STATS].count == 2 * blocks + (blocks - containers)  # norm2, norm3; norm1 after a block


def test_positional_and_single_key_norms():
    # AnimateDiff's motion-module norm1/norm2 get sinusoidal positions added: the add goes with the norm's write.
    # SVD's norm2 feeds a single-key attention whose query path ldmopt skips: not read by a GEMM in the patched run.
    from ldmopt.configs import build_model
    from ldmopt.profiler.fusions import LN_GEMM

    model = build_model("animatediff", tiny=True, device="meta", dtype=torch.float16)
    a = analyze(model, gpu="H200", frames=2)
    motion = [r for r in _claimed_norms(a) if ".motion_modules." in r.path]
    assert motion and {r.path.rsplit(".", 1)[1] for r in motion} == {"norm1", "norm2", "norm3"}
    _saved, rule, removed, _stats = plan_fusions(a.records, single_key_paths(a.attention))
    adds = [r for r in a.records if r.owner.endswith(".SinusoidalPositionalEmbedding") and r.base == "add"]
    assert adds and all(r.index in removed and rule[r.index] == LN_GEMM for r in adds)
    model = build_model("svd", tiny=True, device="meta", dtype=torch.float16)
    a = analyze(model, gpu="H200", frames=2)
    names = {r.path.rsplit(".", 1)[1] for r in _claimed_norms(a)}
    assert names == {"norm_in", "norm1", "norm3"}, names


def test_svd_single_key_attention_shortcut():
    # SVD's attn2 (one key) runs as to_out(to_v(context)) broadcast: the query path, the attention and the full-size
    # to_out go, to_v stays; norm2 (read only by the skipped to_q) goes in the spatial and the temporal blocks.
    from ldmopt.configs import build_model
    from ldmopt.profiler.fusions import SINGLE_KEY

    model = build_model("svd", tiny=True, device="meta", dtype=torch.float16)
    a = analyze(model, gpu="H200", frames=2)
    single = single_key_paths(a.attention)
    _saved, rule, removed, _stats = plan_fusions(a.records, single)
    blocks = len(_blocks(model, "BasicTransformerBlock")) + len(_blocks(model, "TemporalBasicTransformerBlock"))
    assert len(single) == blocks > 0
    assert a.fusions[SINGLE_KEY].count == len(single)
    for path in single:
        inside = {r.path.removeprefix(path): r.index in removed for r in a.records if r.path.startswith(path)}
        assert inside[".to_q"] and inside[".to_out.0"] and inside[""] and not inside[".to_v"], inside
    norms = [r for r in a.records if r.path.endswith(".norm2") and r.base == "native_layer_norm"]
    assert len(norms) == blocks and all(r.index in removed and rule[r.index] == SINGLE_KEY for r in norms)
