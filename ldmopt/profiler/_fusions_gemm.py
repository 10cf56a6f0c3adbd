"""Fusion rules of the transformer blocks (GEMM epilogues, adaLN, RMSNorm and RoPE, Flux's and Wan's blocks): see
fusions.py."""

from __future__ import annotations

from . import categories as C
from ._fusion_plan import (
    _GEMMS,
    ADALN,
    CLIP_EPILOGUE,
    CONCAT_GEMM,
    CONCAT_GEMM_OWNERS,
    DIFFUSERS_RMS_NORM,
    FLUX_BLOCKS,
    FLUX_SINGLE_BLOCKS,
    GATED_RESIDUAL,
    GEGLU,
    GELU_EPILOGUE,
    GENERIC_ATTENTION,
    HALVES_IN_PLACE,
    QK_CONCAT,
    QK_NORM_ROPE,
    RMS_NORM,
    ROPE_ATTENTION_CLASSES,
    ROPE_PROCESSORS,
    TORCH_RMS_NORM,
    WAN_ROUND_TRIPS,
    _as_pass,
    _is_rescale,
    _other_inputs,
    _owner_class,
    _Plan,
    _sole_consumer,
    _through_cast,
    _through_rescale,
)
from .recorder import OpRecord


def _gelu_epilogues(plan: _Plan, records: list[OpRecord], gelu: OpRecord) -> None:
    if not gelu.producers or gelu.producers[0] < 0:
        return
    gemm = records[gelu.producers[0]]
    if gemm.base not in _GEMMS or gemm.category != C.LINEAR:
        return
    mul = _sole_consumer(records, gelu)
    if mul is not None and mul.base == "mul" and gemm.index in mul.producers and plan.free(gelu.index, mul.index):
        # GEGLU: hidden * gelu(gate) where both halves come from one GEMM (chunk is a view).
        if plan.gemm() == "cublas":  # the 2I-wide output written, read back by the pass (the mul) that writes I
            plan.claim(GEGLU, {gelu.index: gelu.bytes, mul.index: 0}, removed=(gelu.index,))
            return
        plan.claim(GEGLU, {gelu.index: gelu.bytes, mul.index: mul.bytes, gemm.index: gemm.out_bytes // 2},
                   removed=(gelu.index, mul.index))  # fmt: skip
    elif set(gemm.consumers) == {gelu.index} and plan.free(gelu.index):
        if plan.gemm() == "cublas" and not (
            gelu.approximate == "tanh" and plan.placements.cublaslt_gelu(gemm.base in ("addmm", "_addmm_activation"))
        ):  # the GEMM's output is written and read back by one pass (the gelu): as the stock ops move
            plan.claim(GELU_EPILOGUE, {gelu.index: 0})
            return
        plan.claim(GELU_EPILOGUE, {gelu.index: gelu.bytes}, removed=(gelu.index,))


def _adaln(plan: _Plan, records: list[OpRecord], ln: OpRecord) -> None:
    mul = _sole_consumer(records, ln)
    if mul is None or mul.base != "mul" or len(mul.in_bytes) != 2:
        return
    add = _sole_consumer(records, mul)
    if add is None or add.base != "add" or len(add.in_bytes) != 2 or not plan.free(ln.index, mul.index, add.index):
        return
    scale, shift = _other_inputs(mul, ln.index), _other_inputs(add, mul.index)
    if not scale or not shift or max(scale + shift) >= ln.out_bytes:
        return  # modulation vectors are per sample, far smaller than the activation
    plan.claim(ADALN, {ln.index: ln.out_bytes, mul.index: mul.bytes - sum(scale),
                       add.index: add.bytes - sum(shift) - add.out_bytes}, removed=(mul.index, add.index))  # fmt: skip


def _gated_residual(plan: _Plan, records: list[OpRecord], mul: OpRecord) -> None:
    if len(mul.in_bytes) != 2 or not plan.free(mul.index):
        return
    # The activation comes from the largest GEMM; the gate may come from another (the adaLN projection). Wan casts
    # the GEMM output to fp32 first (ff(x).float() * gate): look through that one cast.
    # An attention's "/ rescale_output_factor" pass may sit between, in the blocks whose attention output ldmopt
    # gates in the epilogue (adaln_block: DiT, PixArt, Latte), not in blocks no rule patches (e.g. Allegro's).
    rescaled = _owner_class(mul) in GATED_ATTENTION_OWNERS
    direct = {
        p: _through_cast(records, _through_rescale(records, records[p]) if rescaled else records[p], mul.index)
        for p in mul.producers
        if p >= 0
    }
    gemms = [(p, r) for p, r in direct.items() if r.base in _GEMMS and r.category == C.LINEAR]
    source, gemm = max(gemms, key=lambda pr: pr[1].out_bytes, default=(-1, None))
    if gemm is None or set(records[source].consumers) != {mul.index}:
        return
    if source != gemm.index and set(gemm.consumers) != {source}:
        return  # the GEMM output is read elsewhere too: it must be written anyway
    rescale = records[source] if _is_rescale(records[source]) else None
    gate = _other_inputs(mul, source)
    add = _sole_consumer(records, mul)
    if not gate or max(gate) >= gemm.out_bytes or add is None or add.base != "add" or not plan.free(add.index):
        return
    residual = _other_inputs(add, mul.index)
    if len(residual) != 1 or residual[0] < gemm.out_bytes:
        return
    savings = {mul.index: mul.bytes - sum(gate), add.index: add.bytes - residual[0]}
    if rescale is not None and plan.free(rescale.index):
        savings[rescale.index] = rescale.bytes
    removed = tuple(savings)
    if plan.gemm() == "cublas":  # the add is the epilogue pass: reads the GEMM's output, writes the sum
        _as_pass(savings, [add.index, mul.index], gemm.out_bytes + add.out_bytes)
        removed = tuple(i for i in removed if i != add.index)
    plan.claim(GATED_RESIDUAL, savings, removed=removed)


#: Blocks whose gated attention output (after the processor's rescale pass) ldmopt adds in to_out's GEMM epilogue.
GATED_ATTENTION_OWNERS = frozenset({"BasicTransformerBlock"})
#: Blocks whose gated residual update before an adaLN norm runs in the norm's row kernel (rules_blocks._stream).
GATED_UPDATE_OWNERS = frozenset({"JointTransformerBlock", "FluxTransformerBlock"})


def _gated_update_into_adaln(plan: _Plan, records: list[OpRecord], mul: OpRecord) -> None:
    add = _sole_consumer(records, mul)
    if _owner_class(mul) not in GATED_UPDATE_OWNERS or len(mul.in_bytes) != 2 or add is None:
        return
    if add.base != "add" or len(add.in_bytes) != 2 or not plan.free(mul.index, add.index):
        return
    if min(mul.in_bytes) >= mul.out_bytes or not any(plan.rule.get(c) == ADALN for c in add.consumers):
        return  # not a per-sample gate times the update, or the sum does not feed a fused adaLN norm
    # The product's write and its read by the add go; the add's other reads and its write stay (in the row kernel).
    plan.claim(ADALN, {mul.index: mul.out_bytes, add.index: mul.out_bytes}, removed=(mul.index, add.index))


def _concat_gemm(plan: _Plan, records: list[OpRecord], cat: OpRecord) -> None:
    gemm = _sole_consumer(records, cat)
    if _owner_class(cat) not in CONCAT_GEMM_OWNERS or gemm is None or gemm.base not in _GEMMS:
        return
    if len(cat.in_bytes) != 2 or not plan.free(cat.index):
        return
    saving = cat.bytes
    if plan.gemm() == "cublas":  # two GEMMs into one output (the second reads and writes it); fp32 concatenates
        saving = 0 if cat.dtype == "float32" else cat.bytes - 2 * gemm.out_bytes
    plan.claim(CONCAT_GEMM, {cat.index: saving}, removed=(cat.index,) if saving else ())


def _halves_in_place(plan: _Plan, records: list[OpRecord], cat: OpRecord) -> None:
    """A Flux single block's cat of the two halves of one tensor (both inputs from one producer, together its whole
    output): read in place."""
    if _owner_class(cat) not in FLUX_SINGLE_BLOCKS or len(cat.producers) != 2 or not plan.free(cat.index):
        return
    first, second = cat.producers
    if first < 0 or first != second or records[first].out_bytes != cat.out_bytes:
        return
    plan.claim(HALVES_IN_PLACE, {cat.index: cat.bytes}, removed=(cat.index,))


def _clip_epilogue(plan: _Plan, records: list[OpRecord], clamp: OpRecord) -> None:
    """A Flux block's clamp of a gated residual sum that a GEMM epilogue computes: clamped there."""
    if _owner_class(clamp) not in FLUX_BLOCKS or len(clamp.producers) != 1 or not plan.free(clamp.index):
        return
    producer = clamp.producers[0]
    if producer < 0 or plan.rule.get(producer) != GATED_RESIDUAL:
        return
    plan.claim(CLIP_EPILOGUE, {clamp.index: clamp.bytes}, removed=(clamp.index,))


def _wan_round_trip(plan: _Plan, records: list[OpRecord], cast: OpRecord) -> None:
    if cast.index in plan.removed:
        return
    up = cast.out_bytes > cast.in_bytes[0]
    plan.removed.add(cast.index)
    plan.stats[WAN_ROUND_TRIPS].ops_removed += 1
    plan.stats[WAN_ROUND_TRIPS].count += 1
    plan.add_saving(WAN_ROUND_TRIPS, cast.index, cast.bytes)
    if up:
        # Consumers read the stream in its own dtype instead of the fp32 copy.
        for c in set(cast.consumers):
            consumer = records[c]
            if c in plan.removed:
                continue
            wide = sum(b for p, b in zip(consumer.producers, consumer.in_bytes) if p == cast.index)
            plan.add_saving(WAN_ROUND_TRIPS, c, wide - cast.in_bytes[0])
    elif cast.producers[0] >= 0 and cast.producers[0] not in plan.removed:
        # The producer writes the stream's dtype directly (the cast's output), not an fp32 tensor.
        producer = records[cast.producers[0]]
        plan.add_saving(WAN_ROUND_TRIPS, producer.index, producer.out_bytes - cast.out_bytes)


def _rms_norm_runs(records: list[OpRecord]) -> list[list[OpRecord]]:
    """Consecutive records of one diffusers RMSNorm call (the same norm applied to q, then k, is two calls)."""
    runs: list[list[OpRecord]] = []
    for rec in records:
        if rec.owner != DIFFUSERS_RMS_NORM:
            continue
        if runs and runs[-1][-1].index == rec.index - 1 and runs[-1][-1].call == rec.call:
            runs[-1].append(rec)
        else:
            runs.append([rec])
    return runs


def _rms_norm(plan: _Plan, run: list[OpRecord]) -> None:
    if len(run) < 3 or not plan.free(*(r.index for r in run)):
        return
    # What the row kernel still moves: x (the run's first input), the weight and bias (parameters), and y.
    x_read = run[0].in_bytes[0]
    params = sum(b for r in run[1:] for p, b in zip(r.producers, r.in_bytes) if p < 0 and b < x_read)
    last = run[-1]
    savings = {r.index: r.bytes for r in run[:-1]}
    savings[last.index] = max(0, last.bytes - (x_read + params + last.out_bytes))
    plan.claim(RMS_NORM, savings, removed=tuple(r.index for r in run[:-1]))


def _in_rope_attention(rec: OpRecord) -> bool:
    if rec.owner == GENERIC_ATTENTION:
        return rec.processor in ROPE_PROCESSORS
    module, _, name = rec.owner.rpartition(".")
    return module.startswith("diffusers.") and name in ROPE_ATTENTION_CLASSES


def _qk_norm_rope(plan: _Plan, records: list[OpRecord], norm: OpRecord) -> None:
    """The rotation of one query/key norm's output: the elementwise ops of the attention's own forward reached from
    the norm's output (through a concatenation, which stays). Removed; their reads of anything else (the angle
    tables) stay, once each."""
    attention = next((records[c].owner for c in norm.consumers if _in_rope_attention(records[c])), None)
    chain: list[int] = []
    seen: set[int] = set()
    todo = list(norm.consumers)
    while todo:
        rec = records[todo.pop()]
        if rec.index in seen or rec.owner != attention or rec.base not in _ROPE_OPS | _KEPT_ON_THE_WAY:
            continue
        seen.add(rec.index)
        if rec.base in _ROPE_OPS:
            chain.append(rec.index)
        todo.extend(rec.consumers)
    if not any(records[i].base == "mul" for i in chain) or not plan.free(*chain):
        return
    kept: dict[int, int] = {}  # producer outside the chain -> the bytes one read of it costs
    savings = {}
    for i in sorted(chain):
        rec = records[i]
        keep = 0
        for p, b in zip(rec.producers, rec.in_bytes):
            if p != norm.index and p not in seen and p not in kept:
                kept[p] = b
                keep += b
        savings[i] = rec.bytes - keep
    plan.claim(QK_NORM_ROPE, savings, removed=tuple(sorted(chain)))


def _qk_stream_concat(plan: _Plan, records: list[OpRecord], cat: OpRecord) -> None:
    """A rope attention's concatenation of two query/key norm outputs, rotated or not (two streams' in the dual-stream
    blocks; a single-stream block's rotated video rows and text rows): the patched norm kernel writes the joint
    tensor, so the concatenation (both parts read, the sum written) goes."""
    if not _in_rope_attention(cat) or len(cat.producers) != 2 or not plan.free(cat.index):
        return
    for p in cat.producers:
        norm_output = p >= 0 and records[p].owner in (TORCH_RMS_NORM, DIFFUSERS_RMS_NORM)
        if not (norm_output or (p in plan.removed and plan.rule.get(p) == QK_NORM_ROPE)):
            return
    plan.claim(QK_CONCAT, {cat.index: cat.bytes}, removed=(cat.index,))


# clone: the copy a reshape makes of the sliced video tokens (HunyuanVideo's single-stream blocks)
_ROPE_OPS = {"empty_like", "mul", "sub", "add", "copy_", "_to_copy", "neg", "stack", "clone"}
_KEPT_ON_THE_WAY = {"cat"}  # Flux concatenates the normalised streams before rotating (see _qk_stream_concat)
