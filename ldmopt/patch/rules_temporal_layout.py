"""Temporal-layout rules (family ``temporal_layout``): whole temporal transformers run in (B, F, N, C) token order,
so diffusers' permuted copies of the activation (to (B*N, F, C) and back) are never made.

- ``svd_temporal_block``: SVD's ``TemporalBasicTransformerBlock``; attn1 runs the strided temporal kernel, attn2
  (one image-embedding key) the exact single-key shortcut.
- ``temporal_container``: AnimateDiff's ``AnimateDiffTransformer3D`` (motion modules) and UNet3D/ModelScope's
  ``TransformerTemporalModel`` (``transformer_in``, ``temp_attentions``): GroupNorm on the channels_last_3d view,
  proj_in, the BasicTransformerBlocks and proj_out on the token array. Channels-last inputs need no copy at all; an
  NCHW input is copied once (counted in the report's layout copies).
- ``latte_temporal``: ``LatteTransformer3DModel`` (a model-level class swap: its temporal blocks are called from the
  model's forward): each temporal block runs on the spatial blocks' (B*F, N, C) tokens viewed as (B, F, N, C).

All three are class swaps (see rule.py). The attention modules inside are bypassed (their projections are called), so
they are claimed here and get no processor from the ``temporal_attention`` rule; a call the token-order path does
not cover runs the class's own forward with the stock processors, the reason counted in the report's fall-backs
(ldmopt.nn.temporal_layout.fallback_reasons). Tolerance: the temporal kernel's.
"""

from __future__ import annotations

from torch import nn

from ..nn import temporal_layout as L
from ..nn import temporal_layout_latte
from .rule import ClassSwapRule, Rule, Site, attention_reads, feed_forward_reads


def _svd_block_forward(self, hidden_states, num_frames, encoder_hidden_states=None):
    return L.run_svd_block(self, hidden_states, num_frames, encoder_hidden_states)


def _container_forward(self, hidden_states, *args, **kwargs):
    return L.run_container(self, hidden_states, *args, **kwargs)


class _LayoutRule(ClassSwapRule):
    family = "temporal_layout"
    #: module -> why it can never run in token order (None when it can): the module-level check of ldmopt.nn's path
    static_reason = None

    def reasons(self, site: Site) -> list[str]:
        reason = type(self).static_reason(site.module)
        return [reason] if reason else []

    def shallow(self, site: Site) -> set[str]:
        return set(self.touched(site))  # the children of every bypassed module still run


def _prefixed(prefix: str, reads: dict[str, nn.Module]) -> dict[str, nn.Module]:
    return {f"{prefix}.{name}": child for name, child in reads.items()}


def _block_reads(block: nn.Module) -> dict[str, nn.Module]:
    """What the token-order path of a "layer_norm" BasicTransformerBlock (self-attention over frames) reads in place:
    each norm in the projections after it, the residual adds in to_out.0's and ff.net.2's epilogues."""
    reads = {**attention_reads(block.attn1, "attn1", "self"), **attention_reads(block.attn2, "attn2", "self")}
    return {**reads, **feed_forward_reads(block.ff)}


class SVDTemporalBlockRule(_LayoutRule):
    name = "svd_temporal_block"
    static_reason = staticmethod(L.svd_block_static_reason)
    description = "SVD temporal block in (B, F, N, C) order: strided attention, single-key attn2, no permute copies"

    def methods(self, site: Site):
        return _svd_block_forward

    def targets(self) -> tuple[type, ...]:
        from diffusers.models.attention import TemporalBasicTransformerBlock

        return (TemporalBasicTransformerBlock,)

    def touched(self, site: Site) -> dict[str, nn.Module]:
        block = site.module
        # norm2 only feeds attn2's query, which the single-key shortcut skips (unless attn2 has a residual connection).
        names = ("attn1", "attn2", "norm2")
        return {"": block, **{n: getattr(block, n) for n in names if getattr(block, n, None) is not None}}

    def read_in_place(self, site: Site) -> dict[str, nn.Module]:
        # attn2's single-key shortcut calls to_v and to_out; ff_in and ff take their norm in their loads when is_res.
        block = site.module
        reads = attention_reads(block.attn1, "attn1", "self")
        if block.is_res:
            reads.update({**feed_forward_reads(block.ff_in, "ff_in"), **feed_forward_reads(block.ff)})
        return reads


class TemporalContainerRule(_LayoutRule):
    name = "temporal_container"
    static_reason = staticmethod(L.container_static_reason)
    description = "AnimateDiff/UNet3D temporal transformer in (B, F, N, C) order: no permute copies"

    def methods(self, site: Site):
        return _container_forward

    def targets(self) -> tuple[type, ...]:
        from diffusers.models.transformers.transformer_temporal import TransformerTemporalModel
        from diffusers.models.unets.unet_motion_model import AnimateDiffTransformer3D

        return (AnimateDiffTransformer3D, TransformerTemporalModel)

    def claims(self, site: Site) -> dict[str, nn.Module]:
        # container_bfnc reads the GroupNorm in proj_in's loads when both are plain (checked per call, else calls
        # them); the group_norm rule would swap the norm for its own class, which that path does not read.
        return {"norm": site.module.norm, "proj_in": site.module.proj_in}

    def touched(self, site: Site) -> dict[str, nn.Module]:
        out: dict[str, nn.Module] = {"": site.module}
        for i, block in enumerate(site.module.transformer_blocks):
            out[f"transformer_blocks.{i}"] = block
            for name in ("attn1", "attn2", "pos_embed"):
                if getattr(block, name, None) is not None:
                    out[f"transformer_blocks.{i}.{name}"] = getattr(block, name)
        return out

    def read_in_place(self, site: Site) -> dict[str, nn.Module]:
        # The GroupNorm in proj_in's loads, the residual in proj_out's epilogue (a channels-last input), the blocks.
        container = site.module
        reads = {"proj_in": container.proj_in, "proj_out": container.proj_out}
        for i, block in enumerate(container.transformer_blocks):
            reads.update(_prefixed(f"transformer_blocks.{i}", _block_reads(block)))
        return reads


class LatteTemporalRule(_LayoutRule):
    """Latte's temporal blocks sit in the model's own forward (no container module), so the model class is swapped:
    its forward runs each temporal block on the spatial blocks' tokens viewed as (B, F, N, C), with the adaLN
    modulation and gated residual as in ``adaln_block`` (ldmopt.nn.temporal_layout_latte.latte_forward)."""

    name = "latte_temporal"
    static_reason = staticmethod(temporal_layout_latte.latte_static_reason)
    description = "Latte: temporal blocks on (B, F, N, C) tokens, no permute copies; adaLN + gated-residual fused"

    def methods(self, site: Site):
        return temporal_layout_latte.latte_forward

    def targets(self) -> tuple[type, ...]:
        from diffusers.models.transformers.latte_transformer_3d import LatteTransformer3DModel

        return (LatteTransformer3DModel,)

    def touched(self, site: Site) -> dict[str, nn.Module]:
        out: dict[str, nn.Module] = {"": site.module}
        for i, block in enumerate(site.module.temporal_transformer_blocks):
            prefix = f"temporal_transformer_blocks.{i}"
            out.update({prefix: block, f"{prefix}.attn1": block.attn1})
            if block.norm_type == "ada_norm_single":  # its norms and output projection run as fused ops
                out.update({f"{prefix}.ff": block.ff, f"{prefix}.norm1": block.norm1, f"{prefix}.norm2": block.norm2})
                out[f"{prefix}.ff.net.2"] = block.ff.net[2]
            elif block.pos_embed is not None:
                out[f"{prefix}.pos_embed"] = block.pos_embed
        return out

    def shallow(self, site: Site) -> set[str]:
        # attn1's projections and ff.net.0/net.1 still run; the norms and ff.net.2 are bypassed (fused ops).
        return {n for n in self.touched(site) if not n.endswith(("norm1", "norm2", "net.2"))}

    def read_in_place(self, site: Site) -> dict[str, nn.Module]:
        # ada_norm_single: attn1's gated residual in to_out.0's epilogue (ff.net.2 is touched); else as containers.
        reads = {}
        for i, block in enumerate(site.module.temporal_transformer_blocks):
            single = block.norm_type == "ada_norm_single"
            block_reads = attention_reads(block.attn1, "attn1", None) if single else _block_reads(block)
            reads.update(_prefixed(f"temporal_transformer_blocks.{i}", block_reads))
        return reads


RULES: list[Rule] = [SVDTemporalBlockRule(), TemporalContainerRule(), LatteTemporalRule()]
