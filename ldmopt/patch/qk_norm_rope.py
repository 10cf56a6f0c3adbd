"""What the query/key norm + RoPE rules share (rules_{wan,flux,qwen,hunyuan,ltx}_attention.py,
rules_layer_norm_attention.py): the norm checks and calls for torch's and diffusers' RMSNorm, the processor check, and a
base rule for diffusers' generic ``Attention`` keyed by the qualified name of its processor.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from ..nn.child_check import qualified_name
from ..ops.rms_norm import rms_norm
from .rule import ClassSwapRule, Site, diffusers_classes
from .rules_rms_norm import stock_out_dtype

#: What Attention.forward / FluxAttention.forward drop without a warning when the processor does not take them.
QUIET_KWARGS = frozenset({"ip_adapter_masks", "ip_hidden_states"})


def processor_reasons(attn: nn.Module) -> list[str]:
    """Why ``attn``'s processor is not the stock one of its class (whose steps the fused forward reproduces)."""
    default = getattr(type(attn), "_ldmopt_base", type(attn))._default_processor_cls
    if type(attn.processor) is default:
        return []
    return [f"its processor is {type(attn.processor).__name__}, not diffusers' {default.__name__}"]


def torch_rms_norm_reason(name: str, norm: object, width: int) -> str | None:
    """Why ``norm`` is not a torch.nn.RMSNorm over the last ``width`` channels with a plain (or no) weight."""
    if type(norm) is not nn.RMSNorm:
        return f"{name} is {type(norm).__name__}, not torch.nn.RMSNorm"
    if tuple(norm.normalized_shape) != (width,):
        return f"{name} normalises {tuple(norm.normalized_shape)}, not the {width} channels the kernel rotates"
    weight = norm.weight
    if weight is not None and (not weight.is_floating_point() or weight.shape != (width,)):
        return f"{name}.weight is not a floating vector of {width}"
    return None


def torch_eps(norm: nn.RMSNorm, x: torch.Tensor) -> float:
    """torch.nn.RMSNorm's epsilon for x (its default: the machine epsilon of x's compute dtype)."""
    return norm.eps if norm.eps is not None else torch.finfo(torch.promote_types(x.dtype, torch.float32)).eps


def torch_norm_rope(norm: nn.RMSNorm, x: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor], **mapping):
    """``norm(x)`` (a torch.nn.RMSNorm) then a processor's RoPE, in x's dtype as torch's rms_norm returns it;
    ``mapping``: rms_norm's rope_layout (default pairs) / rope_dim."""
    return rms_norm(x, norm.weight, None, torch_eps(norm, x), rope=tables, **{"rope_layout": "pairs", **mapping})


def joint_norm_rope(parts, weights, eps, out_dtypes, tables, cat_dim: int, **mapping) -> torch.Tensor:
    """``torch.cat([norm_0(parts[0]), norm_1(parts[1])], cat_dim)`` rotated over the joint sequence (``tables`` hold
    its positions along cat_dim; ``mapping``: rms_norm's rope_layout / rope_dim): one kernel that writes neither the
    normalised parts nor their concatenation. Norms of different epsilons or output dtypes cannot share it: each part
    is normalised and rotated by its rows of the tables, then concatenated."""
    if eps[0] == eps[1] and out_dtypes[0] == out_dtypes[1]:
        return rms_norm(tuple(parts), tuple(weights), None, eps[0], out_dtype=out_dtypes[0], rope=tables,
                        cat_dim=cat_dim, **mapping)  # fmt: skip
    first = parts[0].shape[cat_dim]
    rows = (slice(None, first), slice(first, None))
    done = [
        rms_norm(part, w, None, e, out_dtype=dt, rope=tuple(t[r] for t in tables), **mapping)
        for part, w, e, dt, r in zip(parts, weights, eps, out_dtypes, rows)
    ]
    return torch.cat(done, dim=cat_dim)


def torch_joint_norm_rope(norms, parts, tables, cat_dim: int, **mapping) -> torch.Tensor:
    """:func:`joint_norm_rope` for two torch.nn.RMSNorm (each part's output in its dtype, as torch returns it)."""
    weights, eps = [n.weight for n in norms], [torch_eps(n, p) for n, p in zip(norms, parts)]
    return joint_norm_rope(parts, weights, eps, [None, None], tables, cat_dim, **{"rope_layout": "pairs", **mapping})


def with_identity_rows(tables: tuple[torch.Tensor, torch.Tensor], rows: int, first: bool):
    """(cos, sin) extended by ``rows`` rows that turn by zero (cos = 1, sin = 0: an exact identity), before the
    tables' own rows when ``first`` (CogVideoX's text tokens lead the video's) or after them (HunyuanVideo's follow)."""
    extended = []
    for table, fill in zip(tables, (1.0, 0.0)):
        identity = table.new_full((rows, table.shape[1]), fill)
        extended.append(torch.cat([identity, table] if first else [table, identity]))
    return tuple(extended)


def processor_attention(helpers, processor, query, key, value, attn_mask=None) -> torch.Tensor:
    """The attention step of a diffusers processor as the processor runs it: its module's ``dispatch_attention_fn``
    (``helpers``) over [B, S, H, D] q, k and v with the processor's backend and parallel config, flattened to
    [B, S, H * D] in the queries' dtype."""
    if not hasattr(helpers, "dispatch_attention_fn"):  # HunyuanVideo's processor before diffusers 0.36: torch's SDPA
        out = F.scaled_dot_product_attention(
            query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), attn_mask=attn_mask, dropout_p=0.0,
            is_causal=False,
        ).transpose(1, 2)  # fmt: skip
        return out.flatten(2, 3).to(query.dtype)
    # Context parallelism (``_parallel_config``) arrived in diffusers 0.36, after the dispatcher (0.35).
    parallel = {"parallel_config": processor._parallel_config} if hasattr(processor, "_parallel_config") else {}
    out = helpers.dispatch_attention_fn(
        query, key, value, attn_mask=attn_mask, dropout_p=0.0, is_causal=False,
        backend=processor._attention_backend, **parallel,
    )  # fmt: skip
    return out.flatten(2, 3).to(query.dtype)


def diffusers_norm_reason(name: str, norm: object, width: int) -> str | None:
    """Why ``norm`` is not diffusers' RMSNorm over ``width`` channels, without bias, with a plain (or no) weight."""
    from diffusers.models.normalization import RMSNorm

    if type(norm) is not RMSNorm and type(norm).__dict__.get("_ldmopt_base") is not RMSNorm:  # a subclass may differ
        return f"{name} is {type(norm).__name__}, not diffusers' RMSNorm"
    if tuple(norm.dim) != (width,) or getattr(norm, "bias", None) is not None:
        return f"{name} normalises {tuple(norm.dim)} or has a bias (the kernel rotates {width}-wide heads, no bias)"
    if norm.weight is not None and not (isinstance(norm.weight, torch.Tensor) and norm.weight.is_floating_point()):
        return f"{name}.weight is not a floating-point tensor"
    return None


def diffusers_norm_rope(norm: nn.Module, x: torch.Tensor, tables=None, **mapping) -> torch.Tensor:
    """diffusers' RMSNorm of x in the stock module's output dtype, then the rotation when ``tables`` are given
    (``mapping``: rms_norm's rope_layout / rope_dim)."""
    rope = dict(rope=tables, **mapping) if tables is not None else {}
    return rms_norm(x, norm.weight, None, norm.eps, out_dtype=stock_out_dtype(x, norm.weight, None), **rope)


def diffusers_joint_norm_rope(norms, parts, tables, cat_dim: int, **mapping) -> torch.Tensor:
    """:func:`joint_norm_rope` for two of diffusers' RMSNorm (each part's output in the stock module's dtype)."""
    weights, eps = [n.weight for n in norms], [n.eps for n in norms]
    out_dtypes = [stock_out_dtype(p, n.weight, None) for n, p in zip(norms, parts)]
    return joint_norm_rope(parts, weights, eps, out_dtypes, tables, cat_dim, **mapping)


class ProcessorQKNormRopeRule(ClassSwapRule):
    """A rule on diffusers' generic ``Attention`` whose processor is exactly ``processor`` (by qualified name: no
    import runs inside a traced forward), with diffusers' RMSNorm q/k norms. A subclass of it is another processor:
    matched, and left stock with that reason."""

    family = "rms_norm"
    processor: ClassVar[str]

    def norm_names(self, attn: nn.Module) -> tuple[str, ...]:
        raise NotImplementedError

    def head(self, attn: nn.Module) -> int:
        """The per-head width the norms and tables have."""
        raise NotImplementedError

    def extra_reasons(self, attn: nn.Module) -> list[str]:
        return []

    def targets(self) -> tuple[type, ...]:
        return diffusers_classes("attention_processor:Attention")

    def match(self, site: Site) -> bool:
        # A subclass matches too, so that the report says why it stays stock instead of saying nothing.
        processor_mro = type(getattr(site.module, "processor", None)).__mro__
        return any(qualified_name(cls) == self.processor for cls in processor_mro)

    def subclass_reasons(self, attn: nn.Module) -> list[str]:
        """Why a processor :meth:`match` took for a subclass of ``processor`` stays stock."""
        processor = type(attn.processor)
        if qualified_name(processor) == self.processor:
            return []
        own = self.processor.rpartition(".")[2]
        return [f"its processor is {processor.__name__}, a subclass of diffusers' {own} whose forward may differ"]

    def reasons(self, site: Site) -> list[str]:
        attn = site.module
        if subclass := self.subclass_reasons(attn):
            return subclass
        first = self.norm_names(attn)[0]
        if not hasattr(getattr(attn, first, None), "dim"):  # no head size to check against
            return [f"{first} is {type(getattr(attn, first, None)).__name__}, not diffusers' RMSNorm"]
        head = self.head(attn)
        reasons = [diffusers_norm_reason(n, getattr(attn, n, None), head) for n in self.norm_names(attn)]
        reasons = [r for r in reasons if r]
        if head % 2:
            reasons.append(f"head size {head} is odd: the rotary pairs need an even one")
        return reasons + self.extra_reasons(attn)

    def touched(self, site: Site) -> dict[str, nn.Module]:
        # A missing norm (qk_norm off, no text stream) is a reason above, and is left out here.
        norms = {n: getattr(site.module, n, None) for n in self.norm_names(site.module)}
        return {"": site.module, **{n: m for n, m in norms.items() if isinstance(m, nn.Module)}}
