"""Feed-forward and adaLN rules: child modules replaced by the ldmopt.nn.linear modules (shared parameters).

- ``geglu`` (feed_forward): diffusers ``GEGLU`` -> ``FusedGEGLU`` (SD/SDXL/AnimateDiff/SVD/ModelScope feed-forwards).
- ``gelu`` (feed_forward): diffusers ``GELU`` (erf or tanh) -> ``FusedGELU`` (DiT, PixArt, SD3, Flux, Latte).
- ``flux_mlp`` (feed_forward): ``proj_mlp`` + ``act_mlp`` (GELU tanh) of Flux's single block and its look-alikes
  (Chroma, HunyuanVideo, HunyuanImage, Bria, LongCat, Motif) -> one ``FusedLinear(activation="gelu_tanh")``,
  ``act_mlp`` -> :class:`FusedAway`.
- ``adaln_zero`` / ``adaln_zero_single`` / ``adaln_continuous`` (adaln): ``AdaLayerNormZero`` (DiT, SD3, Flux),
  ``AdaLayerNormZeroSingle`` (Flux single blocks), ``AdaLayerNormContinuous`` (SD3/Flux ``norm_out``) -> the fused
  norms, which keep calling the stock ``emb``/``silu``/``linear`` children and fuse LayerNorm + modulation.

Each module's own ``unsupported_reason`` (LoRA/quantized projection, hooks, odd shapes) is the rule's reason.
Tolerances: those of the ldmopt.nn.linear modules (within 2x the error of the stock modules in the input dtype).
"""

from __future__ import annotations

from torch import nn

from ..nn import linear as L
from .rule import ChildSwapRule, Rule, Site, diffusers_classes, link_moved_work, moved_work_intact


class _ChildSwap(ChildSwapRule):
    """Replace the matched module, in its parent, by ``fused_cls.from_module(module)``."""

    fused_cls: type
    bypassed: tuple[str, ...] = ()  # children whose forward the fused module does not call

    def reasons(self, site: Site) -> list[str]:
        if site.parent is None:
            return [f"a {type(site.module).__name__} passed as the root module cannot be replaced in place"]
        reason = self.fused_cls.unsupported_reason(site.module)
        return [reason] if reason else []

    def touched(self, site: Site) -> dict[str, nn.Module]:
        return {"": site.module, **{name: getattr(site.module, name) for name in self.bypassed}}

    def swaps(self, site: Site) -> tuple[nn.Module, dict[str, nn.Module]]:
        return site.parent, {site.attr: self.fused_cls.from_module(site.module)}


class GEGLURule(_ChildSwap):
    name = "geglu"
    family = "feed_forward"
    description = "GEGLU projection: one GEMM, (h+b) * gelu(g+b) epilogue, writes half the columns"
    fused_cls = L.FusedGEGLU
    bypassed = ("proj",)

    def targets(self) -> tuple[type, ...]:
        from diffusers.models.activations import GEGLU

        return (GEGLU,)


class GELURule(_ChildSwap):
    name = "gelu"
    family = "feed_forward"
    description = "GELU projection: GEMM with bias + GELU epilogue"
    fused_cls = L.FusedGELU
    bypassed = ("proj",)

    def targets(self) -> tuple[type, ...]:
        from diffusers.models.activations import GELU

        return (GELU,)


class AdaLNZeroRule(_ChildSwap):
    name = "adaln_zero"
    family = "adaln"
    description = "AdaLayerNormZero: LayerNorm + (1+scale)/shift modulation in one row kernel"
    fused_cls = L.FusedAdaLayerNormZero
    bypassed = ("norm",)

    def targets(self) -> tuple[type, ...]:
        from diffusers.models.normalization import AdaLayerNormZero

        return (AdaLayerNormZero,)


class AdaLNZeroSingleRule(_ChildSwap):
    name = "adaln_zero_single"
    family = "adaln"
    description = "AdaLayerNormZeroSingle: LayerNorm + modulation in one row kernel"
    fused_cls = L.FusedAdaLayerNormZeroSingle
    bypassed = ("norm",)

    def targets(self) -> tuple[type, ...]:
        from diffusers.models.normalization import AdaLayerNormZeroSingle

        return (AdaLayerNormZeroSingle,)


class AdaLNContinuousRule(_ChildSwap):
    name = "adaln_continuous"
    family = "adaln"
    description = "AdaLayerNormContinuous: LayerNorm + modulation in one row kernel"
    fused_cls = L.FusedAdaLayerNormContinuous
    bypassed = ("norm",)

    def targets(self) -> tuple[type, ...]:
        from diffusers.models.normalization import AdaLayerNormContinuous

        return (AdaLayerNormContinuous,)


#: Single-stream blocks whose forward computes ``act_mlp(proj_mlp(x))`` and uses neither child anywhere else (read
#: in diffusers 0.42): Flux and the models built on its single block.
SINGLE_STREAM_BLOCKS = (
    "transformers.transformer_flux:FluxSingleTransformerBlock",
    "transformers.transformer_chroma:ChromaSingleTransformerBlock",
    "transformers.transformer_hunyuan_video:HunyuanVideoSingleTransformerBlock",
    "transformers.transformer_hunyuan_video:HunyuanVideoTokenReplaceSingleTransformerBlock",
    "transformers.transformer_hunyuanimage:HunyuanImageSingleTransformerBlock",
    "transformers.transformer_bria:BriaSingleTransformerBlock",
    "transformers.transformer_bria_fibo:BriaFiboSingleTransformerBlock",
    "transformers.transformer_longcat_image:LongCatImageSingleTransformerBlock",
    "transformers.transformer_motif_video:MotifVideoSingleTransformerBlock",
)


class FluxMLPRule(ChildSwapRule):
    """A Flux-style single-stream block: its forward computes ``act_mlp(proj_mlp(x))`` with act_mlp = GELU(tanh)."""

    name = "flux_mlp"
    family = "feed_forward"
    description = "Flux-style single-block MLP: proj_mlp GEMM with bias + GELU(tanh) epilogue"

    def targets(self) -> tuple[type, ...]:
        return diffusers_classes(*SINGLE_STREAM_BLOCKS)

    def match(self, site: Site) -> bool:
        act = site.module._modules.get("act_mlp")
        return type(act) is nn.GELU and act.approximate == "tanh" and "proj_mlp" in site.module._modules

    def reasons(self, site: Site) -> list[str]:
        reason = L.FusedLinear.unsupported_reason(site.module.proj_mlp)
        return [f"proj_mlp: {reason}"] if reason else []

    def touched(self, site: Site) -> dict[str, nn.Module]:
        return {"proj_mlp": site.module.proj_mlp, "act_mlp": site.module.act_mlp}

    def swaps(self, site: Site) -> tuple[nn.Module, dict[str, nn.Module]]:
        m = site.module
        fused = _ProjMLP.from_module(m.proj_mlp, activation="gelu_tanh")
        return m, {"proj_mlp": fused, "act_mlp": link_moved_work(m, "proj_mlp", fused, "act_mlp")}


class _ProjMLP(L.FusedLinear):
    """A single-stream block's ``proj_mlp`` with the GELU(tanh) of ``act_mlp`` in its epilogue while the pair is
    intact (rule.py's MovedWork). Wrapped by a layer installed after patch (PEFT's LoRA layer calls it as its base
    layer, then adds the low-rank update), it computes the plain projection the wrapper expects, and the FusedAway in
    ``act_mlp``'s place applies the GELU to the wrapper's sum."""

    def forward(self, x, *, gate=None, residual=None):
        activation = self.activation if moved_work_intact(self) else None
        return self.compute(x, activation, gate, residual)

    def _get_name(self) -> str:
        return "FusedLinear"


RULES: list[Rule] = [
    GEGLURule(),
    GELURule(),
    FluxMLPRule(),
    AdaLNZeroRule(),
    AdaLNZeroSingleRule(),
    AdaLNContinuousRule(),
]
