"""What the fusion rules share (see fusions.py): the rules' names, the module classes they key on, the plan that
records each record's saved bytes, and helpers that walk the recorded data flow."""

from __future__ import annotations

from dataclasses import dataclass

from .placements import Placements
from .recorder import OpRecord

GN_CONV = "GroupNorm(+SiLU) -> conv/GEMM loads"
GN_SILU = "GroupNorm + SiLU in one pass"
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
LN_STATS = "LayerNorm statistics from the GEMM epilogue"
QKV_GEMM = "to_q/to_k/to_v as one GEMM"
ALPHA_BLEND = "alpha blend -> conv epilogue"
BLEND_GEMM = "alpha blend -> GEMM loads"
RESIDUAL = "GEMM epilogue (residual)"
TEMPORAL_PERMUTES = "temporal permutes"
RMS_NORM = "RMSNorm (diffusers)"
WAN_ROUND_TRIPS = "fp32 round trips (Wan blocks)"
QK_NORM_ROPE = "q/k RMSNorm + RoPE"
QK_CONCAT = "q/k stream concatenation -> norm kernel"
HALVES_IN_PLACE = "Flux single blocks' joint input in place"
CLIP_EPILOGUE = "fp16 clip -> GEMM epilogue"
FUSIONS = (
    GN_CONV, GN_SILU, GN_STATS, CONV_EPILOGUE, ALPHA_BLEND, BLEND_GEMM, GEGLU, GELU_EPILOGUE, ADALN, LN_GEMM, LN_STATS,
    QKV_GEMM, SINGLE_KEY, GATED_RESIDUAL, RESIDUAL,
    CONCAT_GEMM, HALVES_IN_PLACE, CLIP_EPILOGUE, SKIP_CONCAT, UPSAMPLE_CONV, TEMPORAL_PERMUTES, RMS_NORM,
    WAN_ROUND_TRIPS, QK_NORM_ROPE, QK_CONCAT,
)  # fmt: skip
#: Blocks whose forward ldmopt.patch replaces by fp32-in-registers kernels (ldmopt/patch/rules_wan.py), by class name
#: in any diffusers module, and the module ldmopt's rms_norm rule replaces (torch.nn.RMSNorm is left to torch).
WAN_BLOCK_CLASSES = frozenset({"WanTransformerBlock", "SkyReelsV2TransformerBlock"})
#: Flux's blocks (ldmopt/patch/rules_blocks.py), by class name: their fp16 clip and the single blocks' joint input.
FLUX_SINGLE_BLOCKS = frozenset({"FluxSingleTransformerBlock"})
FLUX_BLOCKS = FLUX_SINGLE_BLOCKS | {"FluxTransformerBlock"}
DIFFUSERS_RMS_NORM = "diffusers.models.normalization.RMSNorm"
TORCH_RMS_NORM = "torch.nn.modules.normalization.RMSNorm"
TORCH_LAYER_NORM = "torch.nn.modules.normalization.LayerNorm"  # CogVideoX's, HunyuanDiT's per-head q/k norms
#: Attention modules whose processor rotates the query/key norms' outputs (ldmopt/patch/rules_*_attention.py), and
#: the processors of diffusers' generic Attention that do (its records carry the processor's name).
ROPE_ATTENTION_CLASSES = frozenset({"WanAttention", "SkyReelsV2Attention", "FluxAttention", "LTXAttention"})
GENERIC_ATTENTION = "diffusers.models.attention_processor.Attention"
ROPE_PROCESSORS = frozenset({
    "diffusers.models.transformers.transformer_qwenimage.QwenDoubleStreamAttnProcessor2_0",
    "diffusers.models.transformers.transformer_hunyuan_video.HunyuanVideoAttnProcessor2_0",
    "diffusers.models.attention_processor.CogVideoXAttnProcessor2_0",
    "diffusers.models.attention_processor.HunyuanAttnProcessor2_0",
})  # fmt: skip


def _owner_class(rec: OpRecord) -> str:
    """The class name of the module that ran ``rec`` (its owner without the module path)."""
    return rec.owner.rpartition(".")[2]


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
#: Blocks whose convs ldmopt runs with an add in the epilogue (rules_gn_conv.py): a conv + add elsewhere (a patch
#: embedding's positional add in DiT, PixArt, SD3, Latte) stays as diffusers runs it.
EPILOGUE_CONV_OWNERS = frozenset({"ResnetBlock2D", *CONTAINER_OWNERS, *TEMPORAL_CONV_OWNERS})
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
    def __init__(self, records: list[OpRecord], placements: Placements | None = None) -> None:
        self.records = records
        self.placements = placements if placements is not None else Placements("triton")
        self._conv_placements: dict[int, str] = {}
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

    def claim(self, rule: str, savings: dict[int, int], removed: tuple[int, ...] = (), cost: bool = False) -> None:
        """``cost``: a negative saving stays (a placement that moves more than the stock ops there)."""
        stat = self.stats[rule]
        stat.count += 1
        for index, nbytes in savings.items():
            nbytes = min(nbytes, self.records[index].bytes)
            nbytes = nbytes if cost else max(0, nbytes)
            self.saved[index] = nbytes
            self.rule[index] = rule
            stat.bytes_saved += nbytes
        for index in removed:
            self.removed.add(index)
            stat.ops_removed += 1

    def conv(self, conv: OpRecord, normalize: bool, linear: bool = False) -> str:
        """The placement of the fused conv at ``conv`` (a convolution or a GEMM record), counted once per site."""
        if conv.index not in self._conv_placements:
            kh, kw, c_out, stride = conv.conv or (1, 1, 0, 1)
            placement = self.placements.conv((kh, kw), c_out, stride, normalize, linear)
            self._conv_placements[conv.index] = self.placements.count("conv", placement)
        return self._conv_placements[conv.index]

    def gemm(self, blend: bool = False) -> str:
        """The placement of one fused GEMM site (``blend``: its input is SVD's blend, BLEND_GEMM), counted."""
        return self.placements.count("GEMM", self.placements.gemm(blend))


def _as_pass(savings: dict[int, int], order: list[int], extra: int) -> None:
    """cublas/cudnn: what a fused epilogue kept in registers is written by the GEMM or conv and read back by one
    pass, ``extra`` bytes more: taken off ``savings`` from the records in ``order`` (the pass's own first)."""
    for index in order:
        take = min(extra, max(0, savings.get(index, 0)))
        savings[index] = savings.get(index, 0) - take
        extra -= take


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


def _in_wan_block(rec: OpRecord) -> bool:
    module, _, name = rec.owner.rpartition(".")
    return module.startswith("diffusers.") and name in WAN_BLOCK_CLASSES
