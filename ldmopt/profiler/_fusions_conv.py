"""Fusion rules of the convolution UNets and their transformer blocks (GroupNorm into conv and GEMM loads, conv and
GEMM epilogues, skip concatenations, upsamplers, alpha blends, temporal permutes): see fusions.py."""

from __future__ import annotations

from . import categories as C
from ._fusion_plan import (
    _COPIES,
    _GEMMS,
    _SILU,
    ALPHA_BLEND,
    BLEND_GEMM,
    CONTAINER_OWNERS,
    CONV_EPILOGUE,
    EPILOGUE_CONV_OWNERS,
    GN_CONV,
    GN_SILU,
    GN_STATS,
    LN_GEMM,
    LN_STATS,
    QKV_GEMM,
    RESIDUAL,
    RESIDUAL_OWNERS,
    SINGLE_KEY,
    SKIP_CONCAT,
    SKIP_CONCAT_OWNERS,
    STATS_CHAIN_OWNERS,
    TEMPORAL_CONV_OWNERS,
    TEMPORAL_PERMUTES,
    UPSAMPLE_CONV,
    _as_pass,
    _enclosing,
    _is_rescale,
    _other_inputs,
    _owner_class,
    _Plan,
    _single_key_attention,
    _sole_consumer,
)
from .recorder import OpRecord

#: Blocks whose GroupNorm (+ SiLU) ldmopt reads in the next conv's or GEMM's loads (rules_gn_conv.py, the temporal
#: resnets and containers); a GroupNorm elsewhere (a VAE's conv_norm_out, a model of the user's) is one fused pass.
GN_PROLOGUE_OWNERS = frozenset({
    "ResnetBlock2D", *CONTAINER_OWNERS, *TEMPORAL_CONV_OWNERS, "TransformerTemporalModel", "AnimateDiffTransformer3D",
})  # fmt: skip


def _group_norm_prologue(plan: _Plan, records: list[OpRecord], gn: OpRecord) -> None:
    if _enclosing(plan, gn, GN_PROLOGUE_OWNERS) is None:
        _group_norm_silu(plan, records, gn)
        return
    chain = [gn]
    nxt = _sole_consumer(records, gn)
    if nxt is not None and nxt.base in _SILU:
        chain.append(nxt)
        nxt = _sole_consumer(records, nxt)
    if nxt is not None and nxt.base in _COPIES:
        chain.append(nxt)
        nxt = _sole_consumer(records, nxt)
    if nxt is None or not (_served_conv(plan, nxt) or nxt.base in _GEMMS) or not plan.free(*(r.index for r in chain)):
        return
    # The statistics pass still reads x once; everything else the chain moved stays in registers ("loader"). Staged
    # ("staged", "cudnn"): one pass reads x again and writes act(group_norm(x)), in x's dtype, for the conv to read.
    x = gn.in_bytes[0]
    staged = plan.conv(nxt, normalize=True, linear=nxt.base in _GEMMS) != "loader"
    savings = {gn.index: gn.bytes - x - (2 * x if staged else 0)}
    savings.update({r.index: r.bytes for r in chain[1:]})
    # A Linear on a strided input runs mm + add(bias); the fused conv adds the bias in its epilogue.
    bias = _sole_consumer(records, nxt)
    if nxt.base == "mm" and bias is not None and bias.base == "add" and bias.path == nxt.path and plan.free(bias.index):
        savings[bias.index] = bias.bytes - sum(_other_inputs(bias, nxt.index))
        chain.append(bias)
    plan.claim(GN_CONV, savings, removed=tuple(r.index for r in chain[1:]), cost=True)


def _group_norm_silu(plan: _Plan, records: list[OpRecord], gn: OpRecord) -> None:
    """A GroupNorm module and the SiLU module after it in one pass, where patch fuses them (rules_group_norm.py): a
    model's ``conv_act(conv_norm_out(x))``, and adjacent children of an nn.Sequential. The SiLU's pass goes."""
    silu = _sole_consumer(records, gn)
    if silu is None or silu.base not in _SILU or _owner_class(gn) != "GroupNorm" or _owner_class(silu) != "SiLU":
        return
    parent, _, name = gn.path.rpartition(".")
    silu_parent, _, silu_name = silu.path.rpartition(".")
    head = name == "conv_norm_out" and silu_name == "conv_act"
    in_sequence = name.isdigit() and silu_name == str(int(name) + 1)
    if parent != silu_parent or not (head or in_sequence) or not plan.free(gn.index, silu.index):
        return
    plan.claim(GN_SILU, {silu.index: silu.bytes}, removed=(silu.index,))


def _layer_norm_gemm_loads(plan: _Plan, records: list[OpRecord], ln: OpRecord, single_key: frozenset[str]) -> None:
    block, _, name = ln.path.rpartition(".")
    norms = LN_GEMM_NORMS.get(plan.block_class.get(block, ""), ())
    if name not in norms or not ln.consumers or not plan.free(ln.index):
        return
    gemms = [records[c] for c in set(ln.consumers)]
    positions = gemms[0] if len(gemms) == 1 and _owner_class(gemms[0]) == "SinusoidalPositionalEmbedding" else None
    if positions is not None:  # norm -> + pe[t] -> GEMMs: the table row is added in the loads too
        if positions.base != "add" or not positions.consumers or not plan.free(positions.index):
            return
        gemms = [records[c] for c in set(positions.consumers)]
    if not all(g.base in _GEMMS and g.category == C.LINEAR for g in gemms):
        return  # something else reads the norm's output: it is written
    if any(_single_key_attention(g, single_key) for g in gemms):
        return  # a single-key attention's skipped query path: the shortcut rule removes the norm
    # The norm's output (x's size) is not written; the statistics (mean, rstd) still are. The positions' add goes.
    # cublas: each GEMM's call writes the norm's output by a pass of its own (x read, the output written).
    saving = ln.in_bytes[0]
    if plan.gemm() == "cublas":
        saving -= 2 * ln.in_bytes[0] * len(gemms)
    if positions is None:
        plan.claim(LN_GEMM, {ln.index: saving}, cost=True)
    else:
        plan.claim(LN_GEMM, {ln.index: saving, positions.index: positions.bytes}, removed=(positions.index,), cost=True)


def _joint_projections(plan: _Plan, records: list[OpRecord], ln: OpRecord) -> None:
    """A LayerNorm LN_GEMM claimed whose readers are one attention's to_q, to_k and to_v: the patched block runs them
    as one GEMM over their stacked weights, reading x once instead of three times; the copy that stacks the weights
    (read and written) comes off the saving, counted as none where it is larger (few rows, wide weights)."""
    if plan.rule.get(ln.index) != LN_GEMM:
        return
    source = ln  # or the positions' add LN_GEMM removed (AnimateDiff's motion modules): the GEMMs read that
    first = records[ln.consumers[0]] if ln.consumers else None
    if first is not None and _owner_class(first) == "SinusoidalPositionalEmbedding" and first.index in plan.removed:
        source = first
    readers = {records[c].path: records[c] for c in set(source.consumers) if records[c].base in _GEMMS}
    attentions = {path.rpartition(".")[0] for path in readers}
    if len(readers) != 3 or len(attentions) != 1:
        return
    attention = attentions.pop()
    gemms = [readers.get(f"{attention}.to_{p}") for p in "qkv"]
    if any(g is None for g in gemms):
        return
    x_bytes = ln.in_bytes[0]
    weight_bytes = sum(sum(_other_inputs(g, source.index)) for g in gemms)  # each GEMM's other input: its weight
    net = 2 * x_bytes - 2 * weight_bytes
    # cublas: two normalisation passes fewer too (x read, the norm's output written: LN_GEMM counted three).
    passes = 4 * x_bytes if plan.placements.gemm() == "cublas" else 0
    plan.stats[QKV_GEMM].count += 1
    if passes and net + passes > 0:  # else three GEMMs run (as nn/layer_norm_input.py's _joining_pays decides)
        plan.add_saving(QKV_GEMM, ln.index, net + passes - max(0, net))
    for g in gemms[1:]:  # not removed: their FLOPs still run, in the one GEMM (two launches fewer, not counted)
        plan.add_saving(QKV_GEMM, g.index, net // 2)


def _layer_norm_statistics_from_epilogue(plan: _Plan, records: list[OpRecord], ln: OpRecord) -> None:
    """A BasicTransformerBlock norm LN_GEMM claimed whose input is a residual sum a GEMM epilogue wrote (RESIDUAL):
    norm2 and norm3 after the attentions' to_out in the same block, and norm1 after the previous block's feed-forward
    in the same container (blocks in a row): that epilogue summed the rows' statistics, so the statistics pass that
    LN_GEMM left counted goes too. The first block's norm1 keeps it."""
    if plan.rule.get(ln.index) != LN_GEMM or not ln.producers or ln.producers[0] < 0:
        return
    block, _, name = ln.path.rpartition(".")
    add = records[ln.producers[0]]
    if plan.block_class.get(block) != "BasicTransformerBlock" or plan.rule.get(add.index) != RESIDUAL:
        return
    parent, _, index = block.rpartition(".")
    previous = f"{parent}.{int(index) - 1}" if index.isdigit() else None
    if add.path != block and not (name == "norm1" and add.path == previous):
        return
    plan.stats[LN_STATS].count += 1
    if plan.placements.gemm() == "cublas":  # the normalisation pass stays: the statistics pass (x read) goes
        plan.add_saving(LN_STATS, ln.index, ln.out_bytes)  # x read + mean and rstd written (out = y + them)
        return
    plan.add_saving(LN_STATS, ln.index, ln.bytes)
    plan.removed.add(ln.index)
    plan.stats[LN_STATS].ops_removed += 1


def _single_key_shortcut(plan: _Plan, records: list[OpRecord], single_key: frozenset[str]) -> None:
    by_attention: dict[str, list[OpRecord]] = {}
    for rec in records:
        path = _single_key_attention(rec, single_key)
        if path is not None:
            by_attention.setdefault(path, []).append(rec)
    for path, inside in by_attention.items():
        gone = [r for r in inside if r.path != f"{path}.to_v" and plan.free(r.index)]
        if not gone:
            continue
        ids = {r.index for r in inside}
        savings = {r.index: r.bytes for r in gone}
        for rec in gone:
            for c in set(rec.consumers) - ids:  # the block's add: a broadcast vector per sample instead of rec
                if records[c].base == "add" and plan.free(c):
                    savings[c] = rec.out_bytes
        norm = _query_norm(plan, records, inside, ids, path)
        if norm is not None:
            savings[norm.index] = norm.bytes
        plan.claim(SINGLE_KEY, savings, removed=tuple(r.index for r in gone) + ((norm.index,) if norm else ()))


def _query_norm(
    plan: _Plan, records: list[OpRecord], inside: list[OpRecord], ids: set[int], path: str
) -> OpRecord | None:
    """The block's norm2 feeding only the skipped query path of the single-key attention at ``path`` (its records
    ``inside``, their indices ``ids``), else None."""
    block = path.rpartition(".")[0]
    if plan.block_class.get(block) not in ("TemporalBasicTransformerBlock", "BasicTransformerBlock"):
        return None
    norm = next((records[p] for r in inside for p in r.producers if p >= 0 and records[p].path == f"{block}.norm2"),
                None)  # fmt: skip
    if norm is None or norm.base != "native_layer_norm" or not set(norm.consumers) <= ids or not plan.free(norm.index):
        return None
    return norm


def _residual_epilogue(plan: _Plan, records: list[OpRecord], gemm: OpRecord, single_key: frozenset[str]) -> None:
    if _single_key_attention(gemm, single_key) is not None:
        return
    chain: list[OpRecord] = []  # the rescale pass, removed here; permute copies another rule already removed
    rec = _sole_consumer(records, gemm)
    while rec is not None and rec.base != "add":
        container_copy = rec.base in _COPIES and _owner_class(rec) in CONTAINER_OWNERS and plan.free(rec.index)
        if not ((_is_rescale(rec) and plan.free(rec.index)) or container_copy) and not (
            rec.base in _COPIES and rec.index in plan.removed
        ):
            return
        chain.append(rec)
        rec = _sole_consumer(records, rec)
    add, source = rec, (chain[-1] if chain else gemm)
    if add is None or len(add.in_bytes) != 2 or not plan.free(add.index):
        return
    if _owner_class(add) not in RESIDUAL_OWNERS:
        return
    residual = _other_inputs(add, source.index)
    if len(residual) != 1 or residual[0] != add.out_bytes or source.out_bytes != add.out_bytes:
        return
    savings = {r.index: r.bytes for r in chain if r.index not in plan.removed}
    savings[add.index] = add.bytes - residual[0]
    removed = tuple(savings)
    # SVD's container proj_out reads the blend in its loads: that GEMM stays Triton's, the add in its epilogue
    blend = any(plan.rule.get(p) == BLEND_GEMM for p in gemm.producers if p >= 0)
    if plan.gemm(blend) == "cublas":  # the add is the epilogue pass: it reads the GEMM's output and writes the sum
        _as_pass(savings, [add.index], gemm.out_bytes + add.out_bytes)
        removed = tuple(i for i in removed if i != add.index)
    plan.claim(RESIDUAL, savings, removed=removed)


def _skip_concat(plan: _Plan, records: list[OpRecord], cat: OpRecord) -> None:
    if _owner_class(cat) not in SKIP_CONCAT_OWNERS or len(cat.in_bytes) != 2 or not cat.consumers:
        return
    # Every reader must be a child (norm1, conv_shortcut) of one of the block's ResnetBlock2D.
    resnets = {records[i].path.rpartition(".")[0] for i in cat.consumers}
    if len(resnets) != 1:
        return
    resnet = resnets.pop()
    if plan.block_class.get(resnet) != "ResnetBlock2D" or not resnet.startswith(f"{cat.path}.resnets."):
        return
    if not plan.free(cat.index):
        return
    saving = cat.bytes
    shortcut = next((records[i] for i in cat.consumers if records[i].path == f"{resnet}.conv_shortcut"), None)
    if shortcut is not None and shortcut.base == "convolution" and plan.conv(shortcut, normalize=False) == "cudnn":
        if shortcut.dtype == "float32":
            return  # cudnn's shortcut reads the concatenation in fp32 (README: up blocks)
        saving -= 2 * shortcut.out_bytes  # two GEMMs into one output: the second reads and writes it again
    plan.claim(SKIP_CONCAT, {cat.index: saving}, removed=(cat.index,))


def _upsample_conv(plan: _Plan, records: list[OpRecord], up: OpRecord) -> None:
    conv = _sole_consumer(records, up)
    if _owner_class(up) != "Upsample2D" or conv is None or conv.base != "convolution" or not plan.free(up.index):
        return
    if conv.path.rpartition(".")[0] != up.path or not conv.in_bytes or conv.producers[0] != up.index:
        return
    source = up.producers[0] if up.producers else -1
    if source >= 0 and records[source].path.startswith(f"{up.path}."):
        return  # a norm of the upsampler's own ran first: ldmopt leaves such an upsampler stock
    if plan.conv(conv, normalize=False) == "cudnn":
        return  # cuDNN's conv reads the upsampled tensor, written as diffusers writes it
    plan.claim(UPSAMPLE_CONV, {up.index: up.bytes}, removed=(up.index,))
    plan.add_saving(UPSAMPLE_CONV, conv.index, conv.in_bytes[0] - up.in_bytes[0])  # reads x, not 4x


def _served_conv(plan: _Plan, rec: OpRecord) -> bool:
    """A convolution ldmopt's fused conv computes: 2-D, or the temporal Conv3d of the blocks it fuses."""
    if rec.base != "convolution":
        return False
    return _owner_class(rec) != "Conv3d" or _enclosing(plan, rec, TEMPORAL_CONV_OWNERS) is not None


def _conv_epilogue(plan: _Plan, records: list[OpRecord], conv: OpRecord) -> None:
    if not _served_conv(plan, conv) or _enclosing(plan, conv, EPILOGUE_CONV_OWNERS) is None:
        return
    add = _sole_consumer(records, conv)
    if add is None or add.base != "add" or len(add.in_bytes) != 2 or not plan.free(add.index):
        return
    other = _other_inputs(add, conv.index)
    if len(other) != 1:
        return
    savings = {add.index: add.bytes - other[0]}
    removed = [add.index]
    scale = _sole_consumer(records, add)
    residual = other[0] >= conv.out_bytes
    if (
        residual
        and scale is not None
        and scale.base in ("div", "mul")
        and len(scale.in_bytes) == 1
        and plan.free(scale.index)
    ):
        savings[scale.index] = scale.bytes
        removed.append(scale.index)
    # A container's 1x1 proj_out reads the tokens where they are: the copy to NCHW before it goes too.
    copy = records[conv.producers[0]] if conv.producers and conv.producers[0] >= 0 else None
    if (
        residual
        and _owner_class(add) in CONTAINER_OWNERS
        and copy is not None
        and copy.base in _COPIES
        and _owner_class(copy) in CONTAINER_OWNERS
        and _sole_consumer(records, copy) is conv
        and plan.free(copy.index)
    ):
        savings[copy.index] = copy.bytes
        removed.append(copy.index)
    if _conv_placement(plan, records, conv) == "cudnn":  # the add is the epilogue pass: reads the conv's output back
        _as_pass(savings, [add.index], conv.out_bytes + add.out_bytes)
        removed.remove(add.index)
    plan.claim(CONV_EPILOGUE, savings, removed=tuple(removed))


def _conv_placement(plan: _Plan, records: list[OpRecord], conv: OpRecord) -> str:
    """The placement of a fused conv: normalising when GN_CONV took its input chain; a container's 1x1 proj_out is a
    Linear read as a 1x1 conv (nn/proj_out.py)."""
    source = conv.producers[0] if conv.producers else -1
    normalize = source >= 0 and plan.rule.get(source) == GN_CONV
    return plan.conv(conv, normalize, linear=not normalize and conv.path.endswith(".proj_out"))


def _statistics_from_epilogue(plan: _Plan, records: list[OpRecord], gn: OpRecord) -> None:
    """A GroupNorm read through a conv's loads whose input the previous fused conv of the same block wrote (directly
    or through its epilogue's time-embedding add): that conv's epilogue produced the statistics, so the statistics
    pass GN_CONV left counted goes too (ResnetBlock2D norm2, the temporal blocks' later norms)."""
    if plan.rule.get(gn.index) != GN_CONV or not gn.producers or gn.producers[0] < 0:
        return
    producer = records[gn.producers[0]]
    if producer.base == "add" and plan.rule.get(producer.index) == CONV_EPILOGUE:  # (cudnn: the pass, kept)
        producer = next((records[p] for p in producer.producers if p >= 0 and records[p].base == "convolution"), None)
    if producer is None or not _served_conv(plan, producer):
        return
    block = _enclosing(plan, gn, STATS_CHAIN_OWNERS)
    if block is None or not producer.path.startswith(block + "."):
        return
    if producer.index == gn.producers[0] and _conv_placement(plan, records, producer) == "cudnn":
        return  # nothing to add: the cudnn placement's statistics-only pass reads the output as this pass does
    plan.stats[GN_STATS].count += 1
    if plan.saved.get(gn.index, 0) < gn.bytes - gn.in_bytes[0]:  # staged: the normalisation pass stays
        plan.add_saving(GN_STATS, gn.index, gn.in_bytes[0])
        return
    plan.add_saving(GN_STATS, gn.index, gn.bytes)
    plan.removed.add(gn.index)
    plan.stats[GN_STATS].ops_removed += 1


def _alpha_blend(plan: _Plan, records: list[OpRecord], add: OpRecord) -> None:
    """SVD's ``alpha * x + (1 - alpha) * (x + conv(...))`` after a temporal resnet whose final add the conv epilogue
    took: the fused conv writes ``x + (1 - alpha) * conv(...)``, so both products and the blend's add go."""
    if _owner_class(add) != "AlphaBlender" or len(add.producers) != 2 or not plan.free(add.index):
        return
    muls = [records[p] for p in add.producers if p >= 0]
    if len(muls) != 2 or any(m.base != "mul" or _owner_class(m) != "AlphaBlender" for m in muls):
        return
    if not plan.free(*(m.index for m in muls)):
        return
    inputs = [records[p] for m in muls for p in m.producers if p >= 0]
    if _blend_into_gemm(plan, records, add, muls):
        return
    if not any(
        plan.rule.get(r.index) == CONV_EPILOGUE and _enclosing(plan, r, frozenset({"TemporalResnetBlock"})) is not None
        for r in inputs
    ):
        return
    plan.claim(ALPHA_BLEND, {r.index: r.bytes for r in (*muls, add)}, removed=(muls[0].index, muls[1].index, add.index))


def _blend_into_gemm(plan: _Plan, records: list[OpRecord], add: OpRecord, muls: list[OpRecord]) -> bool:
    """SVD's container blend read by its proj_out (the last block's): the GEMM's loads form
    ``alpha * x + (1 - alpha) * y`` from both inputs, so the products and the add go; the GEMM reads one more input."""
    gemm = _sole_consumer(records, add)
    if gemm is None or gemm.base not in _GEMMS or not gemm.path.endswith(".proj_out"):
        return False
    if _enclosing(plan, add, frozenset({"TransformerSpatioTemporalModel"})) is None:
        return False
    savings = {m.index: m.bytes for m in muls}
    savings[add.index] = add.bytes - add.out_bytes  # the second input the GEMM now reads
    plan.claim(BLEND_GEMM, savings, removed=(muls[0].index, muls[1].index, add.index))
    return True


def _temporal_permute(plan: _Plan, records: list[OpRecord], copy: OpRecord) -> None:
    if not plan.free(copy.index) or (copy.base == "_to_copy" and copy.out_bytes != sum(copy.in_bytes)):
        return  # a cast is not a permute
    neighbours = [records[p] for p in copy.producers if p >= 0] + [records[c] for c in copy.consumers]
    if copy.temporal or any(r.temporal for r in neighbours):
        plan.claim(TEMPORAL_PERMUTES, {copy.index: copy.bytes}, removed=(copy.index,))


#: Blocks whose LayerNorms ldmopt reads in the GEMMs' loads (ldmopt.nn.layer_norm_input), and which of their norms.
LN_GEMM_NORMS = {
    "BasicTransformerBlock": frozenset({"norm1", "norm2", "norm3"}),
    "TemporalBasicTransformerBlock": frozenset({"norm_in", "norm1", "norm3"}),
}
