"""Projected HBM bytes of a model as ldmopt patches it, from the recorded data flow.

Each rule finds a chain of recorded operators that one ldmopt kernel replaces and says, per operator, how many of
its bytes disappear. Accounting (minimum bytes, as in the unpatched count): an intermediate tensor that a fused
kernel keeps in registers is neither written nor read back; operands the fused kernel still needs (a GroupNorm
input for its statistics pass, the residual, the broadcast scale/shift/gate/temb vectors) stay counted.

Each rule projects the placement that runs (``placements.py``; ``analyze(placement=...)``, ``ldmopt analyze
--placement``). "auto" (analyze's default) asks the ops' own functions what a GPU runs by default, honouring
``LDMOPT_GN_CONV_PROLOGUE``, ``LDMOPT_GEMM_PLACEMENT`` and ``LDMOPT_GEMM_GELU``: per fused conv
``ops.gn_conv2d_prologue.choose_placement`` ("cudnn", or "loader" for a normalising conv whose loader would normalise
each element fewer than 3 times; a container's proj_out read as a 1x1 conv follows the GEMM's placement, "cudnn" under
"cublas"), per fused GEMM ``ops.linear_cublas.gemm_placement``
("cublas"), and ``linear_cublas.cublaslt_gelu`` for bias + GELU-tanh. "triton" projects ldmopt's Triton kernels
(conv "loader", GEMM "triton": the CPU's placement), what the rules below describe first. What the others change:
- staged normalisation ("staged", "cudnn"): a pass reads x again and writes act(group_norm(x)) for the conv to read
  (the GroupNorm record keeps 3x: a cost where no SiLU or copy went); the statistics rule then removes only the
  statistics pass, and not at all after a conv with nothing to add (cudnn's statistics-only pass reads the output);
- "cudnn": the conv writes its output and one epilogue pass (the add's record, kept) reads it back and writes the
  result: the add's saving goes, the scale and copies still go; an upsampler's conv reads the upsampled tensor, so
  the upsample rule claims nothing; the up blocks' 1x1 shortcut runs as two GEMMs into one output (its output read
  and written once more; fp32 concatenates: no saving);
- "cublas": the GEMM writes its output and one pass reads it back and writes the result (the last op of the chain's
  record, kept): GEGLU saves only gelu's pass (the 2I-wide projection is written and read), a residual epilogue
  nothing but the rescale and copies, a gated one the product's write and read, a GELU epilogue nothing unless
  cuBLASLt applies GELU-tanh (inference, a bias); a LayerNorm read by n GEMMs gets n normalisation passes (x read,
  the output written: a cost, ``plan_fusions`` keeps negative savings), two of which stacking to_q/to_k/to_v saves
  (when 3M > N, as ``nn/layer_norm_input.py`` decides); a two-part GEMM input is two GEMMs into one output (fp32:
  concatenated). SVD's blended GEMM input stays in the Triton GEMM under either, with the container's residual add
  in its epilogue. Approximation: a UNet container's Linear proj_out + residual is projected as its GEMM (under
  cublas the add stays a pass), a 1x1 Conv2d one (SD1.5) as the fused 1x1 conv (under "cudnn" the GEMM and its
epilogue pass); the patched model runs either as
  that conv once the GroupNorm reading its output asks it for statistics (inference), as the GEMM otherwise (before
  a down- or upsampler, in training).

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
  container's 1x1 ``proj_out`` (Transformer2DModel, SD1.5) also loses the copy of its tokens to NCHW before it. Only
  in the blocks whose convs ldmopt fuses (ResnetBlock2D, the containers, the temporal resnets): a patch embedding's
  conv + positional add (DiT, PixArt, SD3, Latte) stays as diffusers runs it.
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
- ``LayerNorm statistics from the GEMM epilogue``: a BasicTransformerBlock norm read in the loads whose input is a
  residual sum a GEMM epilogue wrote (the rule below): norm2 and norm3 after the attentions' ``to_out`` in the same
  block, norm1 after the previous block's feed-forward in the same container (SDXL's blocks in a row). That epilogue
  summed the rows' statistics, so the statistics pass goes too; the first block's norm1 keeps it.
- ``to_q/to_k/to_v as one GEMM``: the three projections reading one norm in their loads run as one GEMM over their
  stacked weights: x is read once, not three times, less the copy that stacks the weights (a saving counted as none
  where the copy is larger; the patched inference path then keeps three GEMMs). The two launches saved are not
  counted.
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
- ``Flux single blocks' joint input in place``: each FluxSingleTransformerBlock concatenates the text and image
  tokens that the previous single block split its output into (``flux_single_gated``): the two are still one tensor,
  which the patched block reads as it lies, so the concatenation goes (inference; the first single block, fed by the
  double blocks' two streams, still concatenates).
- ``fp16 clip -> GEMM epilogue``: Flux's blocks clip their fp16 streams to +-65504 right after a gated residual the
  GEMM epilogue computes (``proj_out`` of the single blocks, ``ff_context`` of the double blocks): the epilogue
  clamps before its rounding, so the clip pass goes.
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
- ``q/k RMSNorm + RoPE``: in Wan-style and LTX-Video self-attention and Flux, Qwen-Image, HunyuanVideo, CogVideoX
  and HunyuanDiT attention (the ``*_qk_norm_rope`` rules; the last two norm with LayerNorms), the elementwise ops
  that rotate the query/key norms' outputs (casts to fp32, multiplies by cos/sin, add/sub, the partner's negation
  and interleave, the copies back) go: the norm's row kernel rotates before its one write. The angle tables stay
  read once per rotated tensor. Approximation: every such attention is projected as patched, also one the rule
  would leave stock (another processor, hooked norms).
- ``q/k stream concatenation -> norm kernel``: the same attentions' concatenation of two streams' normalised (and
  rotated) queries or keys (Flux, Qwen-Image, HunyuanVideo's dual-stream blocks: text and image/video tokens) goes:
  one row kernel reads each stream and writes the joint tensor (``ops.rms_norm((head, tail), cat_dim=1)``), the
  bytes the two norms wrote before. Likewise HunyuanVideo's single-stream blocks' concatenation of the rotated video
  rows with the unrotated text rows of q and k: the patched kernel rotates all rows in place (the text rows by a
  zero angle). The values' concatenation (projections, not norms) stays. Approximation: also counted where the two
  norms differ in epsilon or output dtype (the patched run then concatenates).
"""

from __future__ import annotations

from . import categories as C

# The rules' names (FUSIONS, GN_CONV, ...) and FusionStat are re-exported for reports and tests.
from ._fusion_plan import (
    _COPIES,
    _GELU,
    _GEMMS,
    ADALN,
    ALPHA_BLEND,
    BLEND_GEMM,
    CLIP_EPILOGUE,
    CONCAT_GEMM,
    CONV_EPILOGUE,
    FUSIONS,
    GATED_RESIDUAL,
    GEGLU,
    GELU_EPILOGUE,
    GN_CONV,
    GN_STATS,
    HALVES_IN_PLACE,
    LN_GEMM,
    LN_STATS,
    QK_CONCAT,
    QK_NORM_ROPE,
    QKV_GEMM,
    RESIDUAL,
    RMS_NORM,
    SINGLE_KEY,
    SKIP_CONCAT,
    TEMPORAL_PERMUTES,
    TORCH_LAYER_NORM,
    TORCH_RMS_NORM,
    UPSAMPLE_CONV,
    WAN_ROUND_TRIPS,
    FusionStat,
    _in_wan_block,
    _is_cast,
    _Plan,
    single_key_paths,
)
from ._fusions_conv import (
    _alpha_blend,
    _conv_epilogue,
    _group_norm_prologue,
    _joint_projections,
    _layer_norm_gemm_loads,
    _layer_norm_statistics_from_epilogue,
    _residual_epilogue,
    _single_key_shortcut,
    _skip_concat,
    _statistics_from_epilogue,
    _temporal_permute,
    _upsample_conv,
)
from ._fusions_gemm import (
    _adaln,
    _clip_epilogue,
    _concat_gemm,
    _gated_residual,
    _gated_update_into_adaln,
    _gelu_epilogues,
    _halves_in_place,
    _qk_norm_rope,
    _qk_stream_concat,
    _rms_norm,
    _rms_norm_runs,
    _wan_round_trip,
)
from .placements import Placements
from .recorder import OpRecord

__all__ = [
    "ADALN",
    "ALPHA_BLEND",
    "BLEND_GEMM",
    "CLIP_EPILOGUE",
    "CONCAT_GEMM",
    "CONV_EPILOGUE",
    "FUSIONS",
    "GATED_RESIDUAL",
    "GEGLU",
    "GELU_EPILOGUE",
    "GN_CONV",
    "GN_STATS",
    "HALVES_IN_PLACE",
    "LN_GEMM",
    "LN_STATS",
    "QKV_GEMM",
    "QK_CONCAT",
    "QK_NORM_ROPE",
    "RESIDUAL",
    "RMS_NORM",
    "SINGLE_KEY",
    "SKIP_CONCAT",
    "TEMPORAL_PERMUTES",
    "UPSAMPLE_CONV",
    "WAN_ROUND_TRIPS",
    "FusionStat",
    "plan_fusions",
    "single_key_paths",
]


def plan_fusions(
    records: list[OpRecord], single_key: frozenset[str] = frozenset(), placements: Placements | None = None
) -> tuple[dict[int, int], dict[int, str], set[int], dict[str, FusionStat]]:
    """Bytes saved per record index (negative where the placement moves more than the stock ops), the rule that
    saved them, records removed outright, per-rule totals. ``single_key``: paths of attention modules called with
    one key/value token (their output projection is not fused with the residual). ``placements``: which placement
    of the fused conv and GEMMs to project (placements.py; by default ldmopt's Triton kernels), counting the sites
    per placement in it."""
    plan = _Plan(records, placements)
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
    for ln in by_base.get("native_layer_norm", []):
        _layer_norm_statistics_from_epilogue(plan, records, ln)
        _joint_projections(plan, records, ln)
    for cat in by_base.get("cat", []):
        _concat_gemm(plan, records, cat)
        _skip_concat(plan, records, cat)
        _halves_in_place(plan, records, cat)
    for clamp in by_base.get("clamp", []):
        _clip_epilogue(plan, records, clamp)
    for up in by_base.get("upsample_nearest2d", []):
        _upsample_conv(plan, records, up)
    for run in _rms_norm_runs(records):
        _rms_norm(plan, run)
    for rec in records:
        if rec.owner in (TORCH_RMS_NORM, TORCH_LAYER_NORM):  # a LayerNorm outside rope attentions: nothing to do
            _qk_norm_rope(plan, records, rec)
    for run in _rms_norm_runs(records):  # diffusers' RMSNorm (Qwen-Image, HunyuanVideo): from its last op
        _qk_norm_rope(plan, records, run[-1])
    for cat in by_base.get("cat", []):
        _qk_stream_concat(plan, records, cat)
    stream_bytes: dict[int, int] = {}  # per Wan block call: its widest cast, a cast of the token stream
    wan_casts = [r for r in records if _is_cast(r) and _in_wan_block(r) and r.layer is None]
    for rec in wan_casts:
        stream_bytes[rec.call] = max(stream_bytes.get(rec.call, 0), rec.in_bytes[0])
    for rec in wan_casts:
        # Casts of the small modulation vectors (temb.float()) stay: the fused forward still forms the chunks.
        if 8 * rec.in_bytes[0] >= stream_bytes[rec.call]:
            _wan_round_trip(plan, records, rec)
    return plan.saved, plan.rule, plan.removed, plan.stats
