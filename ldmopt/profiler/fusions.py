"""Projected HBM bytes of a model as ldmopt patches it, from the recorded data flow.

Each rule finds a chain of recorded operators that one ldmopt kernel replaces and says, per operator, how many of
its bytes disappear. Accounting (minimum bytes, as in the unpatched count): an intermediate tensor that a fused
kernel keeps in registers is neither written nor read back; operands the fused kernel still needs (a GroupNorm
input for its statistics pass, the residual, the broadcast scale/shift/gate/temb vectors) stay counted.

Rules (names as reported):
- ``GroupNorm(+SiLU) -> conv/GEMM loads``: GroupNorm -> [SiLU] -> [layout copy] -> convolution or GEMM. The
  conv reads the GroupNorm input through ``silu(a*x + b)``; a separate statistics pass still reads ``x`` once.
  Saves the normalised tensor's write, the SiLU pass and any copy between (3 tensor passes with SiLU, 1 without),
  and the bias add a Linear on a strided input runs apart (mm + add; the fused conv adds the bias).
  Convolutions: 2-D ones, and the Conv3d (kernel (3, 1, 1)) of the temporal blocks ldmopt fuses
  (TemporalResnetBlock, TemporalConvLayer); any other Conv3d (a video VAE's 3x3x3) stays cuDNN's, unfused.
- ``GroupNorm statistics from the conv epilogue``: when that GroupNorm's input is the output of the previous fused
  conv of the same block (ResnetBlock2D's norm2, the temporal blocks' later norms), the conv's epilogue produced
  the statistics: the statistics pass goes too (norm1 of each block keeps it).
- ``conv epilogue (temb / residual / scale)``: convolution -> add(broadcast temb) or add(residual) [-> div or mul
  by a scalar]: the conv writes the final tensor. Saves 2 passes per broadcast add, 4 for residual + scale. A UNet
  container's 1x1 ``proj_out`` (Transformer2DModel, SD1.5) also loses the copy of its tokens to NCHW before it.
- ``alpha blend -> conv epilogue``: SVD's SpatioTemporalResBlock blends ``alpha * x + (1 - alpha) * (x + conv)``
  after a temporal resnet whose residual add the conv epilogue took; the conv writes ``x + (1 - alpha) * conv``, so
  the two products and the add go.
- ``alpha blend -> GEMM loads``: SVD's TransformerSpatioTemporalModel blends the last block's spatial and temporal
  outputs only for ``proj_out`` to read: the GEMM's loads form the blend from both (``ops.linear``'s ``mix``), so the
  products and the add go, less the one more input the GEMM reads.
- ``GEGLU tail``: GEMM -> chunk -> gelu(gate) * hidden: one GEMM with two accumulators writes I columns, not 2I.
- ``GEMM + GELU epilogue``: GEMM -> gelu (GELU-tanh feed-forwards of DiT/PixArt/SD3/Flux, Flux ``proj_mlp``).
- ``adaLN (LayerNorm + modulate)``: layer_norm -> mul(1 + scale) -> add(shift) in one row kernel. In SD3 and Flux
  joint blocks (``joint_block``) the gated residual update before the norm, mul(gate) -> add(residual), runs in the
  same row kernel: the product is neither written nor read back (the update, gate and residual are still read).
- ``LayerNorm -> GEMM loads``: a UNet transformer block's LayerNorm whose output only GEMMs read (norm1 -> to_q,
  to_k, to_v; norm2 -> the cross-attention's to_q; norm3 -> the feed-forward's first projection; SVD's temporal
  blocks' norm_in and norm3 likewise): each GEMM normalises x in its loads (``ops.layer_norm_linear``) from one
  statistics pass, which still reads x; the norm's output write goes (the GEMMs read x instead of it: same bytes).
  diffusers' sinusoidal positional embedding added to the norm's output (AnimateDiff motion modules' norm1/norm2) is
  added in the loads too: its add goes (the table rows read are not counted). Not counted: the norm before a
  single-key attention (SVD's attn2, whose query path is skipped: the shortcut rule).
  Approximation, counted although the patched run keeps the norm: norm3 of a BasicTransformerBlock with norm_type
  "ada_norm" (no ldmopt rule).
- ``single-key attention shortcut``: SVD's ``attn2`` attends over one image-embedding token, so its softmax is 1 and
  ldmopt's SingleKeyAttnProcessor computes ``to_out(to_v(context))`` on that token and broadcasts it: the query and
  key projections, the attention and the full-size ``to_out`` GEMM and ``/ rescale_output_factor`` go (to_v stays,
  one token per sample), the block's add reads a vector per sample instead of the attention output, and the norm
  before it (norm2), which only the skipped query path reads, goes too (the patched spatial and temporal blocks do
  not compute it). Approximation: the broadcast ``to_out`` on one token per sample is not counted.
- ``GEMM epilogue (gated residual)``: GEMM -> [the attention's ``/ rescale_output_factor``, removed] -> mul(gate)
  -> add(residual): the feed-forward and attention outputs of adaLN blocks (DiT, PixArt, SD3, Flux, Wan).
- ``GEMM epilogue (residual)``: the un-gated residual adds of UNet transformer blocks (``residual_block``) and of
  the temporal blocks and containers run in token order (``temporal_layout``): GEMM (``to_out.0``, ``ff.net.2``,
  a container's ``proj_out``) -> [the attention's ``/ rescale_output_factor``] -> [a permute copy another rule
  removed, or the ``.contiguous()`` back to NCHW of a Transformer2DModel / TransformerSpatioTemporalModel, whose
  ``proj_out`` writes channels-last with the residual in its epilogue] -> add(residual), and PixArt's
  cross-attention add (``adaln_block``). The add's read of the residual stays (in the epilogue). Not counted: the
  output projection of a single-key attention (SVD's ``attn2``: the single-key shortcut above, whose add stays).
  Approximations, counted although the patched run keeps the stock add: a BasicTransformerBlock with norm_type
  "ada_norm" or "ada_norm_continuous" (no ldmopt rule), a feed-forward with final_dropout, an attention with
  rescale_output_factor != 1, a temporal container over more than 64 frames, and a container fed NCHW activations
  (ModelScope's ``transformer_in`` after ``conv_in``: the patched run copies its input to channels-last, uncounted,
  and keeps the proj_out add so that the output keeps the input's layout).
- ``concatenation -> GEMM loads``: Flux's single-stream blocks concatenate the attention output and the MLP
  activation along channels only for ``proj_out`` to read them (``flux_single_gated``): the GEMM's K loop reads the
  two tensors where they are, so the concatenation (both read, the sum written) goes.
- ``skip concatenation -> conv loads``: the UNet up blocks (SD's, AnimateDiff's, UNet3D's and SVD's; ``up_block_skip``)
  concatenate the running activation with the down path's skip only for the next ResnetBlock2D's (in SVD, the
  SpatioTemporalResBlock's spatial one) norm1 statistics, conv1 loads and 1x1 ``conv_shortcut`` to read it: they
  read the two parts where they lie, so the concatenation (both read, the sum written) goes; their own reads are
  unchanged. Approximation, as for the GroupNorm rules: counted also where the resnet cannot run fused (another
  time_embedding_norm, a non-SiLU activation), whose up block ldmopt leaves stock.
- ``nearest upsample -> conv loads``: diffusers' Upsample2D (UNet up blocks, VAE decoder) writes the nearest 2x
  upsampled tensor only for its conv to read (``upsample_conv``): the conv reads x by index arithmetic instead, so the
  upsample (x read, 4x written) goes and the conv reads x, not 4x. Not counted: an upsampler with a norm of its own.
  Approximation: counted for every other such pair, also where the patched run keeps diffusers' forward (an
  output_size other than twice the input, a conv other than 3x3 or 1x1 "same"; no diffusers model builds those).
- ``temporal permutes``: copies that materialise a frame-major layout in or next to a temporal block (the
  temporal attention kernel reads frames by stride).
- ``RMSNorm (diffusers)``: diffusers' RMSNorm module runs eight ops (fp32 copy, square, mean, rsqrt, two
  multiplies, casts); ldmopt's row kernel reads x once and writes y once (torch.nn.RMSNorm is already one fused op).
- ``fp32 round trips (Wan blocks)``: the casts of the token stream to fp32 and back around the norms, modulation
  and gated adds of Wan-style blocks (``wan_block`` rule): the row kernels and the GEMM epilogue read and write the
  stream in its own dtype, so the casts go and their neighbours move half the bytes. Runs after the rules above,
  whose chains may pass through one such cast in these blocks (GEMM -> cast -> mul(gate) -> add(residual)).
  Approximations: a block without norm2 (cross_attn_norm=False) keeps one stock gated add the projection counts as
  fused, and a block the rule refuses (another norm or feed-forward) is still projected as patched.
- ``q/k RMSNorm + RoPE``: in Wan-style self-attention and Flux, Qwen-Image and HunyuanVideo attention
  (the ``*_qk_norm_rope`` rules), the elementwise ops that rotate the query/key norms' outputs
  (casts to fp32, multiplies by cos/sin, add/sub, the partner's negation and interleave, the copies back) go: the
  norm's row kernel rotates before its one write. The angle tables stay read once per rotated tensor; Flux's
  concatenation of the text and image streams stays (the fused forward concatenates the rotated streams).
  Approximation: every such attention is projected as patched, also one the rule would leave stock (another
  processor, hooked norms).
"""

from __future__ import annotations

from dataclasses import dataclass

from . import categories as C
from .recorder import OpRecord

GN_CONV = "GroupNorm(+SiLU) -> conv/GEMM loads"
CONV_EPILOGUE = "conv epilogue (temb / residual / scale)"
GEGLU = "GEGLU tail"
GELU_EPILOGUE = "GEMM + GELU epilogue"
ADALN = "adaLN (LayerNorm + modulate)"
LN_GEMM = "LayerNorm -> GEMM loads"
SINGLE_KEY = "single-key attention shortcut"
GATED_RESIDUAL = "GEMM epilogue (gated residual)"
CONCAT_GEMM = "concatenation -> GEMM loads"
SKIP_CONCAT = "skip concatenation -> conv loads"
UPSAMPLE_CONV = "nearest upsample -> conv loads"
GN_STATS = "GroupNorm statistics from the conv epilogue"
ALPHA_BLEND = "alpha blend -> conv epilogue"
BLEND_GEMM = "alpha blend -> GEMM loads"
RESIDUAL = "GEMM epilogue (residual)"
TEMPORAL_PERMUTES = "temporal permutes"
RMS_NORM = "RMSNorm (diffusers)"
WAN_ROUND_TRIPS = "fp32 round trips (Wan blocks)"
QK_NORM_ROPE = "q/k RMSNorm + RoPE"
FUSIONS = (
    GN_CONV, GN_STATS, CONV_EPILOGUE, ALPHA_BLEND, BLEND_GEMM, GEGLU, GELU_EPILOGUE, ADALN, LN_GEMM, SINGLE_KEY,
    GATED_RESIDUAL, RESIDUAL,
    CONCAT_GEMM, SKIP_CONCAT, UPSAMPLE_CONV, TEMPORAL_PERMUTES, RMS_NORM, WAN_ROUND_TRIPS, QK_NORM_ROPE,
)  # fmt: skip
#: Blocks whose forward ldmopt.patch replaces by fp32-in-registers kernels (ldmopt/patch/rules_wan.py), by class name
#: in any diffusers module, and the module ldmopt's rms_norm rule replaces (torch.nn.RMSNorm is left to torch).
WAN_BLOCK_CLASSES = frozenset({"WanTransformerBlock", "SkyReelsV2TransformerBlock"})
DIFFUSERS_RMS_NORM = "diffusers.models.normalization.RMSNorm"
TORCH_RMS_NORM = "torch.nn.modules.normalization.RMSNorm"
#: Attention modules whose processor rotates the query/key norms' outputs (ldmopt/patch/rules_*_attention.py), and
#: the processors of diffusers' generic Attention that do (its records carry the processor's name).
ROPE_ATTENTION_CLASSES = frozenset({"WanAttention", "SkyReelsV2Attention", "FluxAttention"})
GENERIC_ATTENTION = "diffusers.models.attention_processor.Attention"
ROPE_PROCESSORS = frozenset({
    "diffusers.models.transformers.transformer_qwenimage.QwenDoubleStreamAttnProcessor2_0",
    "diffusers.models.transformers.transformer_hunyuan_video.HunyuanVideoAttnProcessor2_0",
})  # fmt: skip
# clone: the copy a reshape makes of the sliced video tokens (HunyuanVideo's single-stream blocks)
_ROPE_OPS = {"empty_like", "mul", "sub", "add", "copy_", "_to_copy", "neg", "stack", "clone"}
_KEPT_ON_THE_WAY = {"cat"}  # Flux concatenates the normalised text and image streams before rotating: still done


def _owner_class(rec: OpRecord) -> str:
    """The class name of the module that ran ``rec`` (its owner without the module path)."""
    return rec.owner.rpartition(".")[2]


def _in_wan_block(rec: OpRecord) -> bool:
    module, _, name = rec.owner.rpartition(".")
    return module.startswith("diffusers.") and name in WAN_BLOCK_CLASSES


_COPIES = {"clone", "copy_", "contiguous", "_to_copy"}
#: Modules whose un-gated residual adds ldmopt moves into a GEMM epilogue (ldmopt/patch/rules_residual.py and the
#: token-order forwards of ldmopt/nn/temporal_layout.py), by class name.
#: Containers whose proj_out writes channels-last with the residual in its epilogue (rules_gn_conv.py): the copy
#: back to NCHW before their add goes with it.
CONTAINER_OWNERS = frozenset({"Transformer2DModel", "TransformerSpatioTemporalModel"})
RESIDUAL_OWNERS = frozenset({
    "BasicTransformerBlock", "TemporalBasicTransformerBlock", "AnimateDiffTransformer3D", "TransformerTemporalModel",
    *CONTAINER_OWNERS,
})  # fmt: skip
#: Blocks whose channel concatenation feeding a GEMM ldmopt's GEMM reads in two parts (rules_blocks.py).
CONCAT_GEMM_OWNERS = frozenset({"FluxSingleTransformerBlock"})
#: Up blocks whose resnets read the skip concatenation in two parts (ldmopt/patch/rules_up_block.py).
SKIP_CONCAT_OWNERS = frozenset({
    "UpBlock2D", "CrossAttnUpBlock2D", "UpBlockMotion", "CrossAttnUpBlockMotion", "UpBlock3D", "CrossAttnUpBlock3D",
    "UpBlockSpatioTemporal", "CrossAttnUpBlockSpatioTemporal",
})  # fmt: skip
#: Blocks whose Conv3d (kernel (3, 1, 1)) ldmopt runs as a fused (3, 1) conv (ldmopt/nn/temporal_resnet.py); other
#: Conv3d (a video VAE's 3x3x3) stay cuDNN's.
TEMPORAL_CONV_OWNERS = frozenset({"TemporalResnetBlock", "TemporalConvLayer"})
#: Blocks whose fused convs hand the next GroupNorm of the same block its statistics (no statistics pass).
STATS_CHAIN_OWNERS = frozenset({"ResnetBlock2D", *TEMPORAL_CONV_OWNERS})
_GELU = {"gelu", "gelu_"}
_SILU = {"silu", "silu_"}
_GEMMS = {"mm", "addmm", "_addmm_activation", "bmm", "baddbmm"}


@dataclass
class FusionStat:
    count: int = 0
    bytes_saved: int = 0
    ops_removed: int = 0


class _Plan:
    def __init__(self, records: list[OpRecord]) -> None:
        self.records = records
        self.saved: dict[int, int] = {}
        self.rule: dict[int, str] = {}
        self.removed: set[int] = set()
        self.stats = {name: FusionStat() for name in FUSIONS}
        self.block_class = _block_classes(records)  # module path -> class name

    def free(self, *indices: int) -> bool:
        return all(i not in self.rule for i in indices)

    def add_saving(self, rule: str, index: int, nbytes: int) -> None:
        """More bytes saved on a record another rule may have claimed already (capped at the record's bytes)."""
        before = self.saved.get(index, 0)
        after = max(before, min(self.records[index].bytes, before + max(0, nbytes)))
        self.saved[index] = after
        self.rule.setdefault(index, rule)
        self.stats[rule].bytes_saved += after - before

    def claim(self, rule: str, savings: dict[int, int], removed: tuple[int, ...] = ()) -> None:
        stat = self.stats[rule]
        stat.count += 1
        for index, nbytes in savings.items():
            nbytes = max(0, min(nbytes, self.records[index].bytes))
            self.saved[index] = nbytes
            self.rule[index] = rule
            stat.bytes_saved += nbytes
        for index in removed:
            self.removed.add(index)
            stat.ops_removed += 1


def single_key_paths(calls) -> frozenset[str]:
    """Paths of the attention modules among ``calls`` (recorder AttentionCalls) called with one key/value token: the
    ``single_key`` argument of :func:`plan_fusions`."""
    return frozenset(call.path for call in calls if call.kv_len == 1)


def _sole_consumer(records: list[OpRecord], rec: OpRecord) -> OpRecord | None:
    consumers = set(rec.consumers)
    return records[consumers.pop()] if len(consumers) == 1 else None


def _other_inputs(rec: OpRecord, producer: int) -> list[int]:
    """Bytes of the inputs of ``rec`` that are not produced by ``producer``."""
    return [b for p, b in zip(rec.producers, rec.in_bytes) if p != producer]


def plan_fusions(
    records: list[OpRecord], single_key: frozenset[str] = frozenset()
) -> tuple[dict[int, int], dict[int, str], set[int], dict[str, FusionStat]]:
    """Bytes saved per record index, the rule that saved them, records removed outright, per-rule totals.
    ``single_key``: paths of attention modules called with one key/value token (their output projection is not
    fused with the residual)."""
    plan = _Plan(records)
    by_base: dict[str, list[OpRecord]] = {}
    for rec in records:
        by_base.setdefault(rec.base, []).append(rec)

    _single_key_shortcut(plan, records, single_key)
    for gn in by_base.get("native_group_norm", []):
        _group_norm_prologue(plan, records, gn)
    for gelu in [r for base in _GELU for r in by_base.get(base, [])]:
        _gelu_epilogues(plan, records, gelu)
    for ln in by_base.get("native_layer_norm", []):
        _adaln(plan, records, ln)
    for ln in by_base.get("native_layer_norm", []):
        _layer_norm_gemm_loads(plan, records, ln, single_key)
    for mul in by_base.get("mul", []):
        _gated_residual(plan, records, mul)
    for mul in by_base.get("mul", []):
        _gated_update_into_adaln(plan, records, mul)
    for conv in by_base.get("convolution", []):
        _conv_epilogue(plan, records, conv)
    for gn in by_base.get("native_group_norm", []):
        _statistics_from_epilogue(plan, records, gn)
    for add in by_base.get("add", []):
        _alpha_blend(plan, records, add)
    for rec in records:
        if rec.base in _COPIES and rec.category == C.LAYOUT:
            _temporal_permute(plan, records, rec)
    for rec in records:
        if rec.base in _GEMMS and rec.category == C.LINEAR:
            _residual_epilogue(plan, records, rec, single_key)
    for cat in by_base.get("cat", []):
        _concat_gemm(plan, records, cat)
        _skip_concat(plan, records, cat)
    for up in by_base.get("upsample_nearest2d", []):
        _upsample_conv(plan, records, up)
    for run in _rms_norm_runs(records):
        _rms_norm(plan, run)
    for rec in records:
        if rec.owner == TORCH_RMS_NORM:
            _qk_norm_rope(plan, records, rec)
    for run in _rms_norm_runs(records):  # diffusers' RMSNorm (Qwen-Image, HunyuanVideo): from its last op
        _qk_norm_rope(plan, records, run[-1])
    stream_bytes: dict[int, int] = {}  # per Wan block call: its widest cast, a cast of the token stream
    wan_casts = [r for r in records if _is_cast(r) and _in_wan_block(r) and r.layer is None]
    for rec in wan_casts:
        stream_bytes[rec.call] = max(stream_bytes.get(rec.call, 0), rec.in_bytes[0])
    for rec in wan_casts:
        # Casts of the small modulation vectors (temb.float()) stay: the fused forward still forms the chunks.
        if 8 * rec.in_bytes[0] >= stream_bytes[rec.call]:
            _wan_round_trip(plan, records, rec)
    return plan.saved, plan.rule, plan.removed, plan.stats


def _group_norm_prologue(plan: _Plan, records: list[OpRecord], gn: OpRecord) -> None:
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
    # The statistics pass still reads x once; everything else the chain moved stays in registers.
    savings = {gn.index: gn.bytes - gn.in_bytes[0]}
    savings.update({r.index: r.bytes for r in chain[1:]})
    # A Linear on a strided input runs mm + add(bias); the fused conv adds the bias in its epilogue.
    bias = _sole_consumer(records, nxt)
    if nxt.base == "mm" and bias is not None and bias.base == "add" and bias.path == nxt.path and plan.free(bias.index):
        savings[bias.index] = bias.bytes - sum(_other_inputs(bias, nxt.index))
        chain.append(bias)
    plan.claim(GN_CONV, savings, removed=tuple(r.index for r in chain[1:]))


def _gelu_epilogues(plan: _Plan, records: list[OpRecord], gelu: OpRecord) -> None:
    if not gelu.producers or gelu.producers[0] < 0:
        return
    gemm = records[gelu.producers[0]]
    if gemm.base not in _GEMMS or gemm.category != C.LINEAR:
        return
    mul = _sole_consumer(records, gelu)
    if mul is not None and mul.base == "mul" and gemm.index in mul.producers and plan.free(gelu.index, mul.index):
        # GEGLU: hidden * gelu(gate) where both halves come from one GEMM (chunk is a view).
        plan.claim(GEGLU, {gelu.index: gelu.bytes, mul.index: mul.bytes, gemm.index: gemm.out_bytes // 2},
                   removed=(gelu.index, mul.index))  # fmt: skip
    elif set(gemm.consumers) == {gelu.index} and plan.free(gelu.index):
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
    plan.claim(GATED_RESIDUAL, savings, removed=tuple(savings))


#: Blocks whose gated attention output (after the processor's rescale pass) ldmopt adds in to_out's GEMM epilogue.
GATED_ATTENTION_OWNERS = frozenset({"BasicTransformerBlock"})
#: Blocks whose gated residual update before an adaLN norm runs in the norm's row kernel (rules_blocks._stream).
GATED_UPDATE_OWNERS = frozenset({"JointTransformerBlock", "FluxTransformerBlock"})


#: Blocks whose LayerNorms ldmopt reads in the GEMMs' loads (ldmopt.nn.layer_norm_input), and which of their norms.
LN_GEMM_NORMS = {
    "BasicTransformerBlock": frozenset({"norm1", "norm2", "norm3"}),
    "TemporalBasicTransformerBlock": frozenset({"norm_in", "norm1", "norm3"}),
}


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
    if positions is None:
        plan.claim(LN_GEMM, {ln.index: ln.in_bytes[0]})
    else:
        plan.claim(LN_GEMM, {ln.index: ln.in_bytes[0], positions.index: positions.bytes}, removed=(positions.index,))


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
    plan.claim(RESIDUAL, savings, removed=(*savings,))


def _concat_gemm(plan: _Plan, records: list[OpRecord], cat: OpRecord) -> None:
    gemm = _sole_consumer(records, cat)
    if _owner_class(cat) not in CONCAT_GEMM_OWNERS or gemm is None or gemm.base not in _GEMMS:
        return
    if len(cat.in_bytes) == 2 and plan.free(cat.index):
        plan.claim(CONCAT_GEMM, {cat.index: cat.bytes}, removed=(cat.index,))


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
    if plan.free(cat.index):
        plan.claim(SKIP_CONCAT, {cat.index: cat.bytes}, removed=(cat.index,))


def _upsample_conv(plan: _Plan, records: list[OpRecord], up: OpRecord) -> None:
    conv = _sole_consumer(records, up)
    if _owner_class(up) != "Upsample2D" or conv is None or conv.base != "convolution" or not plan.free(up.index):
        return
    if conv.path.rpartition(".")[0] != up.path or not conv.in_bytes or conv.producers[0] != up.index:
        return
    source = up.producers[0] if up.producers else -1
    if source >= 0 and records[source].path.startswith(f"{up.path}."):
        return  # a norm of the upsampler's own ran first: ldmopt leaves such an upsampler stock
    plan.claim(UPSAMPLE_CONV, {up.index: up.bytes}, removed=(up.index,))
    plan.add_saving(UPSAMPLE_CONV, conv.index, conv.in_bytes[0] - up.in_bytes[0])  # reads x, not 4x


def _block_classes(records: list[OpRecord]) -> dict[str, str]:
    """Module path -> class name, for the modules that ran an operator themselves."""
    return {r.path: _owner_class(r) for r in records if r.owner}


def _ancestors(path: str):
    while path:
        path = path.rpartition(".")[0]
        yield path


def _single_key_attention(rec: OpRecord, single_key: frozenset[str]) -> str | None:
    """Path of the single-key attention module that ran ``rec`` (itself or a child), else None."""
    return next((p for p in (rec.path, *_ancestors(rec.path)) if p in single_key), None)


def _enclosing(plan: _Plan, rec: OpRecord, classes: frozenset[str]) -> str | None:
    """Path of the innermost module around ``rec`` whose class is one of ``classes``."""
    return next((p for p in (rec.path, *_ancestors(rec.path)) if plan.block_class.get(p) in classes), None)


def _served_conv(plan: _Plan, rec: OpRecord) -> bool:
    """A convolution ldmopt's fused conv computes: 2-D, or the temporal Conv3d of the blocks it fuses."""
    if rec.base != "convolution":
        return False
    return _owner_class(rec) != "Conv3d" or _enclosing(plan, rec, TEMPORAL_CONV_OWNERS) is not None


def _conv_epilogue(plan: _Plan, records: list[OpRecord], conv: OpRecord) -> None:
    if not _served_conv(plan, conv):
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
    plan.claim(CONV_EPILOGUE, savings, removed=tuple(removed))


def _statistics_from_epilogue(plan: _Plan, records: list[OpRecord], gn: OpRecord) -> None:
    """A GroupNorm read through a conv's loads whose input the previous fused conv of the same block wrote (directly
    or through its epilogue's time-embedding add): that conv's epilogue produced the statistics, so the statistics
    pass GN_CONV left counted goes too (ResnetBlock2D norm2, the temporal blocks' later norms)."""
    if plan.rule.get(gn.index) != GN_CONV or not gn.producers or gn.producers[0] < 0:
        return
    producer = records[gn.producers[0]]
    if producer.base == "add" and plan.rule.get(producer.index) == CONV_EPILOGUE and producer.index in plan.removed:
        producer = next((records[p] for p in producer.producers if p >= 0 and records[p].base == "convolution"), None)
    if producer is None or not _served_conv(plan, producer):
        return
    block = _enclosing(plan, gn, STATS_CHAIN_OWNERS)
    if block is None or not producer.path.startswith(block + "."):
        return
    plan.add_saving(GN_STATS, gn.index, gn.bytes)
    plan.removed.add(gn.index)
    plan.stats[GN_STATS].count += 1
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
        plan.rule.get(r.index) == CONV_EPILOGUE
        and r.index in plan.removed
        and _enclosing(plan, r, frozenset({"TemporalResnetBlock"})) is not None
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


def _is_rescale(rec: OpRecord) -> bool:
    """diffusers' attention processors' ``/ rescale_output_factor`` (a scalar divide or multiply)."""
    return rec.base in ("div", "mul") and len(rec.in_bytes) == 1 and rec.owner.endswith(".Attention")


def _through_rescale(records: list[OpRecord], rec: OpRecord) -> OpRecord:
    """The GEMM behind ``rec`` when ``rec`` is an attention's rescale pass, read by nothing else, of that GEMM."""
    if _is_rescale(rec) and rec.producers and rec.producers[0] >= 0:
        gemm = records[rec.producers[0]]
        if gemm.base in _GEMMS and set(gemm.consumers) == {rec.index}:
            return gemm
    return rec


def _is_cast(rec: OpRecord) -> bool:
    return rec.base == "_to_copy" and len(rec.in_bytes) == 1 and rec.out_bytes != rec.in_bytes[0]


def _through_cast(records: list[OpRecord], rec: OpRecord, consumer: int) -> OpRecord:
    """The producer behind ``rec`` when ``rec`` is a dtype cast in a Wan block (the blocks ldmopt fuses that way) whose
    only consumer is ``consumer``."""
    if _is_cast(rec) and _in_wan_block(rec) and set(rec.consumers) == {consumer} and rec.producers[0] >= 0:
        return records[rec.producers[0]]
    return rec


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
