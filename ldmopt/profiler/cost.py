"""``analyze``: FLOPs, minimum HBM bytes and a roofline projection of one denoiser call (or one training step:
forward, MSE loss, backward and an AdamW update), on meta tensors.

Nothing is allocated and no GPU is needed: the model is built (or rebuilt from its config) on the ``meta`` device
and run once under a dispatch mode that records every operator (see ``recorder.py``). Reported per operator
category: FLOPs, minimum bytes, projected time on a GPU from the spec table (``gpus.py``), for the model as it is
and as ldmopt patches it (``fusions.py``); the sequence-length distribution of the attention calls; spatial vs
cross vs temporal attention. FLOPs are exact counts of the traced operators; bytes and times are projections.
"""

from __future__ import annotations

import contextlib
import copy
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from . import categories as C
from .fusions import FUSIONS, FusionStat, plan_fusions, single_key_paths
from .gpus import GPUSpec, dtype_key, get_gpu
from .placements import Placements
from .recorder import AttentionCall, AttentionRegions, OpRecord, Recorder
from .scopes import ModuleScopes
from .settings import check_dtype, check_setting, refuse_setting_with_inputs

_RECORD_DTYPES = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}


@dataclass
class CategoryCost:
    flops: int = 0
    bytes: int = 0
    ops: int = 0
    time_s: float = 0.0  # projection
    patched_bytes: int = 0
    patched_ops: int = 0
    patched_time_s: float = 0.0  # projection


@dataclass
class Analysis:
    """Result of ``analyze``. Times are roofline projections on ``gpu``; FLOPs are counted, bytes are minimum."""

    model: str
    model_class: str
    params: int
    resolution: tuple[int, int] | None
    frames: int | None
    batch: int | None
    dtype: str
    gpu: GPUSpec
    categories: dict[str, CategoryCost]
    attention: list[AttentionCall]
    fusions: dict[str, FusionStat]
    flop_counter_total: int | None = None  # of the forward pass (the loss included, in training)
    elapsed_s: float = 0.0
    notes: list[str] = field(default_factory=list)
    records: list[OpRecord] = field(default_factory=list, repr=False)
    training: bool = False
    #: the categories split by phase: "forward" (with the loss), and in training "backward" and "optimizer"
    phases: dict[str, dict[str, CategoryCost]] = field(default_factory=dict)
    #: the placement of the fused conv and GEMMs the patched projection models (Placements.summary(), .describe())
    placement: dict[str, Any] = field(default_factory=dict)
    placement_line: str = ""

    # ------------------------------------------------------------------ totals and shares
    @property
    def total_flops(self) -> int:
        return sum(c.flops for c in self.categories.values())

    @property
    def total_bytes(self) -> int:
        return sum(c.bytes for c in self.categories.values())

    @property
    def patched_bytes(self) -> int:
        return sum(c.patched_bytes for c in self.categories.values())

    @property
    def time_s(self) -> float:
        return sum(c.time_s for c in self.categories.values())

    @property
    def patched_time_s(self) -> float:
        return sum(c.patched_time_s for c in self.categories.values())

    @property
    def ops(self) -> int:
        return sum(c.ops for c in self.categories.values())

    def flops_of(self, *cats: str, phase: str | None = None) -> int:
        categories = self.categories if phase is None else self.phases.get(phase, {})
        return sum(categories[c].flops for c in cats if c in categories)

    def phase_time_s(self, phase: str, patched: bool = False) -> float:
        """Projected time of one phase ("forward", "backward", "optimizer"); 0 for a phase that did not run."""
        attr = "patched_time_s" if patched else "time_s"
        return sum(getattr(c, attr) for c in self.phases.get(phase, {}).values())

    def shares(self, by: str = "time", patched: bool = False, phase: str | None = None) -> dict[str, float]:
        """Fraction per category of projected time (``by="time"``), ``"flops"`` or ``"bytes"``; sums to 1.
        ``phase`` restricts the count to one phase (its shares sum to 1 on their own)."""
        attr = {"time": "time_s", "flops": "flops", "bytes": "bytes"}[by]
        if patched and by != "flops":
            attr = "patched_" + attr
        categories = self.categories if phase is None else self.phases.get(phase, {})
        values = {k: getattr(categories[k], attr) if k in categories else 0 for k in self.categories}
        total = sum(values.values())
        return {k: (v / total if total else 0.0) for k, v in values.items()}

    def step_shares(self, patched: bool = False) -> dict[tuple[str, str], float]:
        """(phase, category) -> share of the whole projected step time (a training profile's view: convolution
        forward and convolution backward as separate lines)."""
        attr = "patched_time_s" if patched else "time_s"
        total = self.patched_time_s if patched else self.time_s
        return {
            (phase, k): (getattr(c, attr) / total if total else 0.0)
            for phase, cats in self.phases.items()
            for k, c in cats.items()
        }

    def attention_split(self, by: str = "time") -> dict[str, float]:
        """Spatial self / cross / temporal share of attention (projected time or FLOPs)."""
        shares = self.shares(by)
        total = sum(shares[c] for c in C.ATTENTION)
        return {c.split(".")[1]: (shares[c] / total if total else 0.0) for c in C.ATTENTION}

    def attention_layer_split(self) -> dict[str, float]:
        """Spatial / cross / temporal share of projected time of whole attention modules (Q/K/V/out projections,
        norms inside them and the attention itself), the view of a module-level profile."""
        times: dict[str, float] = defaultdict(float)
        for rec in self.records:
            if rec.layer is not None:
                times[rec.layer] += self.gpu.op_time(rec.flops, rec.bytes, _record_dtype(rec, self.gpu, self.dtype))
        total = sum(times.values())
        return {k: (times[k] / total if total else 0.0) for k in ("spatial", "cross", "temporal")}

    def sequence_lengths(self) -> list[dict[str, Any]]:
        """Attention calls grouped by (kind, query length, key length, head dim, batch x heads), largest FLOPs
        first."""
        groups: dict[tuple, dict[str, Any]] = {}
        total = sum(a.flops for a in self.attention) or 1
        for a in self.attention:
            key = (a.kind, a.q_len, a.kv_len, a.head_dim, a.batch_heads)
            g = groups.setdefault(
                key,
                {
                    "kind": a.kind,
                    "q_len": a.q_len,
                    "kv_len": a.kv_len,
                    "head_dim": a.head_dim,
                    "calls": 0,
                    "batch_heads": a.batch_heads,
                    "flops": 0,
                },
            )
            g["calls"] += 1
            g["flops"] += a.flops
        rows = sorted(groups.values(), key=lambda g: -g["flops"])
        for g in rows:
            g["flops_share"] = g["flops"] / total
        return rows

    # ------------------------------------------------------------------ output
    def setting(self) -> str:
        parts = [self.model]
        if self.resolution:
            parts.append(f"{self.resolution[0]}x{self.resolution[1]}")
        if self.frames:
            parts.append(f"{self.frames} frames")
        if self.batch:
            parts.append(f"batch {self.batch}")
        parts.append(self.dtype)
        if self.training:
            parts.append("training step")
        return ", ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": "analytic (meta tensors; times are roofline projections)",
            "model": self.model,
            "model_class": self.model_class,
            "params": self.params,
            "resolution": list(self.resolution) if self.resolution else None,
            "frames": self.frames,
            "batch": self.batch,
            "dtype": self.dtype,
            "gpu": self.gpu.name,
            "total_flops": self.total_flops,
            "flop_counter_total": self.flop_counter_total,
            "total_bytes": self.total_bytes,
            "patched_bytes": self.patched_bytes,
            "projected_time_s": self.time_s,
            "projected_patched_time_s": self.patched_time_s,
            "ops": self.ops,
            "categories": {k: vars(c) | {"label": C.LABELS[k]} for k, c in self.categories.items()},
            "shares_time": self.shares("time"),
            "shares_flops": self.shares("flops"),
            "attention_split_time": self.attention_split("time"),
            "attention_layer_split_time": self.attention_layer_split(),
            "sequence_lengths": self.sequence_lengths(),
            "fusions": {k: vars(v) for k, v in self.fusions.items()},
            "placement": self.placement | {"description": self.placement_line},
            "training": self.training,
            "phases": {phase: {k: vars(c) for k, c in cats.items() if c.ops} for phase, cats in self.phases.items()},
            "elapsed_s": self.elapsed_s,
            "notes": self.notes,
        }

    def table(self) -> str:
        from .report import format_analysis

        return format_analysis(self)

    def __str__(self) -> str:
        return self.table()


def _check_model_argument(model_or_name) -> None:
    if isinstance(model_or_name, (str, nn.Module)):
        return
    components = getattr(model_or_name, "components", None)
    if isinstance(components, dict):  # a diffusers pipeline
        models = [name for name, c in components.items() if isinstance(c, nn.Module)]
        denoiser = next((name for name in ("unet", "transformer", "prior") if name in models), None)
        hint = f"pass pipe.{denoiser}" if denoiser else "pass one of its models"
        raise TypeError(
            f"analyze takes one model, not a pipeline ({type(model_or_name).__name__}, models {models}): {hint} "
            "(or pipe.vae for a decode)"
        )
    raise TypeError(
        f"analyze: model_or_name is of type {type(model_or_name).__name__}; expected a zoo name "
        "(ldmopt.configs.names()) or a torch.nn.Module"
    )


def _is_patched(model_or_name) -> bool:
    from ..patch.core import is_patched

    return isinstance(model_or_name, nn.Module) and is_patched(model_or_name)


def _resolve_model(model_or_name, *, dtype, frames, tiny) -> nn.Module:
    from .. import configs

    if isinstance(model_or_name, str):
        return configs.build_model(model_or_name, device="meta", dtype=dtype, tiny=tiny, frames=frames)
    model = model_or_name
    if not any(hasattr(m, "_hf_hook") for m in model.modules()):
        # A copy whose tensors are meta from the start (no weight is copied): processors, adapters (LoRA), fused
        # projections and patches stay as the user set them, which a rebuild from the config would drop. A model
        # already on meta is copied too: it is analysed in ``dtype`` and in eval mode, and the caller's is untouched.
        return _meta_copy(model, dtype).eval()
    # accelerate's hooks hold the weights apart and move them in on every call: rebuild from the config instead.
    config = getattr(model, "config", None)
    if config is None or not hasattr(type(model), "from_config"):
        raise ValueError(
            f"analyze runs on the meta device; {type(model).__name__} has real weights and no diffusers config to "
            f"rebuild it from. Pass a zoo name, a diffusers model, or a copy of the model on the meta device."
        )
    with torch.device("meta"), configs._quiet_diffusers():
        meta = type(model).from_config(dict(config))
    meta = meta.to(device="meta", dtype=dtype).eval()
    for attr in ("ldmopt_zoo_name", "ldmopt_tiny"):
        if hasattr(model, attr):
            setattr(meta, attr, getattr(model, attr))
    return meta


def _meta_copy(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """``copy.deepcopy(model)`` with every parameter and buffer replaced by a meta tensor (floating ones in
    ``dtype``, but fp32 where ``from_pretrained`` keeps the class's ``_keep_in_fp32_modules``, as a model built by
    name has them), shared ones kept shared."""
    from ..configs import fp32_kept_tensors

    fp32 = {id(store[name]) for store, name in fp32_kept_tensors(model)}
    memo: dict[int, Any] = {}
    for t in (*model.parameters(), *model.buffers()):
        if id(t) in memo:
            continue
        floating = torch.float32 if id(t) in fp32 else dtype
        meta = torch.empty_like(t, device="meta", dtype=floating if t.is_floating_point() else t.dtype)
        memo[id(t)] = nn.Parameter(meta, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else meta
    return copy.deepcopy(model, memo)


def _to_meta(value, dtype: torch.dtype):
    """``value`` with its tensors on the meta device, floating-point ones in ``dtype`` (the model is rebuilt in it)."""
    if isinstance(value, torch.Tensor):
        like = dtype if value.is_floating_point() else value.dtype
        return torch.empty_like(value, device="meta", dtype=like)
    if isinstance(value, dict):
        return {k: _to_meta(v, dtype) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_meta(v, dtype) for v in value)
    return value


def analyze(
    model_or_name: str | nn.Module,
    *,
    resolution: int | tuple[int, int] | None = None,
    frames: int | None = None,
    batch: int | None = None,
    dtype: torch.dtype | str = torch.float16,
    gpu: str | GPUSpec = "H100",
    inputs: Any = None,
    check_flops: bool = False,
    tiny: bool = False,
    training: bool = False,
    patched: bool = False,
    placement: str | None = None,
) -> Analysis:
    """Count FLOPs and minimum bytes of one denoiser call (VAE: one decode) and project its time on ``gpu``.

    ``training=True`` counts a training step instead: the forward pass in train mode, an MSE loss against a target
    of the output's shape (noise prediction), the backward pass (the gradients of every parameter that requires
    them; attention's as one FlashAttention backward) and an AdamW update (foreach) of those parameters, which keep
    the analysed dtype. ``phases`` splits the result; ldmopt's patched projection covers its forward fusions only.

    ``patched=True`` counts the model as ``ldmopt.patch`` leaves it instead (a meta copy, channels-last, patched for
    ``training``): ldmopt's ops are recorded as they dispatch, in their own category, their FLOPs by the formulas
    of the operators they replace. Independent of the fusion rules' projection, and what projects a patched
    training step's backward.

    ``model_or_name`` is a zoo name (``ldmopt.configs.names()``), a model from ``ldmopt.configs.build_model``, or a
    diffusers model (rebuilt from its config on the meta device; its weights are never touched). ``inputs``
    overrides the zoo's example inputs: a kwargs dict, an args tuple, one tensor or ``configs.ModelInputs``. The
    model is analysed in ``dtype`` (not its own), and so are floating-point inputs (integer ones, e.g. timesteps,
    keep theirs).
    ``check_flops=True`` also runs torch.utils.flop_counter.FlopCounterMode and stores its total (stock models only:
    it has no formulas for ldmopt's ops).

    ``placement`` picks what the patched projection models (``placements.py``): "auto" (the default), the fused
    conv's and GEMMs' default placements on a GPU ("cudnn", "cublas"; ``LDMOPT_GN_CONV_PROLOGUE`` /
    ``LDMOPT_GEMM_PLACEMENT`` set in the environment are honoured), or "triton", ldmopt's Triton kernels (the CPU's
    placement). The result names it. A ``patched=True`` recording counts each of ldmopt's ops as the one kernel it
    runs on the meta tensors, the Triton placement's: it takes "triton" (the default there) and refuses "auto".
    """
    from .. import configs

    start = time.perf_counter()
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[check_dtype(dtype)]
    spec = get_gpu(gpu)
    if placement is None:
        placement = "triton" if patched else "auto"
    elif patched and placement != "triton":
        raise ValueError(
            f"placement={placement!r} with patched=True: the recording counts each ldmopt op as one kernel, as the "
            "Triton placement runs it ('triton', the default there); the GPUs' default placements are projected from "
            "the stock model's recording: analyze(model, placement='auto') without patched=True"
        )
    placements = Placements(placement, "cuda", training)  # analyze projects on a GPU
    _check_model_argument(model_or_name)
    if check_flops and (patched or _is_patched(model_or_name)):
        raise ValueError(
            "check_flops=True with a patched model: the check compares the recorder's FLOPs with torch's "
            "FlopCounterMode on PyTorch's operators, which has no formulas for ldmopt's fused ops, and whose module "
            "hooks would send every fused block to its stock forward (the recording would be the stock model's). "
            "Check the stock model: analyze(model, check_flops=True) without patched=True, or on the model before "
            "ldmopt.patch"
        )
    # Given inputs fix the setting (one given with them would not be applied); otherwise refuse one the model would
    # change or ignore.
    refuse_setting_with_inputs(inputs, resolution=resolution, frames=frames, batch=batch)
    if inputs is None:
        check_setting(model_or_name, resolution=resolution, frames=frames, batch=batch, tiny=tiny)
    model = _resolve_model(model_or_name, dtype=dtype, frames=frames, tiny=tiny)
    if inputs is None:
        inputs = configs.example_inputs(model, resolution=resolution, frames=frames, batch=batch, dtype=dtype)
    if not isinstance(inputs, configs.ModelInputs):
        # As profile() calls a target: a tuple or list is the positional arguments, anything else (one tensor) is one
        # argument, not unpacked along its first dimension.
        args = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
        kwargs = inputs if isinstance(inputs, dict) else {"args": args}
        inputs = configs.ModelInputs("forward", kwargs, None, None, None)  # a setting unknown, not guessed
    inputs = configs.ModelInputs(inputs.method, _to_meta(inputs.kwargs, dtype), inputs.resolution, inputs.frames,
                                 inputs.batch)  # fmt: skip
    patch_note = _patch_for_analysis(model, inputs, training) if patched else None
    if patch_note is not None:
        model = patch_note[0]

    scopes = ModuleScopes(model)
    recorder = Recorder(scopes, track_sites=training)
    counter = forward_flops = None
    modes = {m: m.training for m in model.modules()}
    checkpointing: list[nn.Module] = []
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.enable_grad() if training else torch.no_grad())
        if training:
            grads = {p: p.grad for p in model.parameters()}
            checkpointing = [m for m in model.modules() if getattr(m, "gradient_checkpointing", False) is True]
            model.train()
            stack.callback(_restore_modes, modes, grads, checkpointing)
            for module in checkpointing:  # counted without it (its recomputation in backward is not modelled)
                module.gradient_checkpointing = False
            for param in grads:
                param.grad = None  # a gradient already there would add accumulation ops to the count
        if check_flops:
            from torch.utils.flop_counter import FlopCounterMode

            # Outside the recorder: the innermost mode sees each op first, and FlopCounterMode decomposes the ops it
            # has no formula for (upsample_nearest2d -> arange, mul, _unsafe_index...), which the recorder would
            # then log in place of the op, changing the bytes and times.
            counter = stack.enter_context(FlopCounterMode(display=False))
        stack.enter_context(scopes)
        stack.enter_context(AttentionRegions(recorder))
        stack.enter_context(recorder)
        if "args" in inputs.kwargs and len(inputs.kwargs) == 1:
            out = model(*inputs.kwargs["args"])
        else:
            out = configs.run_model(model, inputs)
        if counter is not None:
            forward_flops = counter.get_total_flops()  # before the backward, which it would count its own way
        if training:
            _loss_backward_update(model, out, recorder)

    analysis = _summarise(model, recorder, spec, dtype_key(dtype), placements)
    analysis.training = training
    if patch_note is not None:
        analysis.notes.append(patch_note[1])
    if training and checkpointing:
        analysis.notes.append(
            f"gradient checkpointing (on in {len(checkpointing)} modules) was off for the count: its recomputation "
            "of the forward in backward is not in these figures"
        )
    analysis.resolution, analysis.frames, analysis.batch = inputs.resolution, inputs.frames, inputs.batch
    analysis.flop_counter_total = forward_flops
    analysis.elapsed_s = time.perf_counter() - start
    if tiny:
        analysis.notes.append("tiny random-weight variant of the model family")
    return analysis


def _patch_for_analysis(model: nn.Module, inputs, training: bool) -> tuple[nn.Module, str]:
    """(a patched meta copy of ``model`` in channels-last, as the demo runs it, with ``inputs`` converted in place;
    the note saying so)."""
    import ldmopt
    from ldmopt.demo import channels_last_call

    model = copy.deepcopy(model)  # the caller's (meta) model stays as it is
    channels_last_call(model, inputs)
    report = ldmopt.patch(model, training=training)
    return model, (
        f"the model as ldmopt.patch leaves it ({report.total} modules patched, channels-last): its fused ops are the "
        "'ldmopt fused kernels' row (its temporal attention the temporal attention row), each counted as the one "
        "kernel it is in the Triton placement; the patched columns project the fusion rules on what is left"
    )


def _restore_modes(
    modes: dict[nn.Module, bool], grads: dict[nn.Parameter, Any], checkpointing: list[nn.Module]
) -> None:
    """Leave a model the caller passed (already on meta) as it was: train/eval flags, ``.grad``, checkpointing."""
    for module, was_training in modes.items():
        module.training = was_training
    for param, grad in grads.items():
        param.grad = grad
    for module in checkpointing:
        module.gradient_checkpointing = True


def _loss_backward_update(model: nn.Module, out: Any, recorder: Recorder) -> None:
    """The rest of a training step after the forward: MSE against a target of the output's shape, backward, AdamW."""
    from .measure import _first_tensor

    prediction = _first_tensor(out)
    with recorder.suppressed():  # the target is data, as the latents are
        target = torch.empty_like(prediction)
    loss = nn.functional.mse_loss(prediction.float(), target.float())
    params = [p for p in model.parameters() if p.requires_grad]
    if not params or not loss.requires_grad:
        raise ValueError("training=True: the model has no parameter that requires a gradient")
    with recorder.in_phase("backward"):  # (the engine's seed gradient runs outside any node)
        loss.backward()
    optimizer = torch.optim.AdamW(params, lr=1e-5, foreach=True)
    with recorder.suppressed():  # the first step allocates and zeroes the moments: count a steady-state step
        optimizer.step()
    with recorder.in_phase("optimizer"):
        optimizer.step()


_CONV_OPS = frozenset({"convolution", "_convolution", "conv2d", "conv3d", "conv1d", "cudnn_convolution"})
_MATMUL_OPS = frozenset({"mm", "bmm", "addmm", "baddbmm", "matmul", "linear", "addbmm"})


def _runs_tf32(rec: OpRecord) -> bool:
    """Whether an fp32 operator runs on TF32 tensor cores under this process's torch settings: convolutions by
    default (torch.backends.cudnn.allow_tf32), matrix products only when allowed (torch's default: IEEE fp32).
    ldmopt's fused conv and GEMMs follow the setting of the op they replace (``OpRecord.fp32_follows``)."""
    follows = rec.fp32_follows or ("conv" if rec.base in _CONV_OPS else "matmul" if rec.base in _MATMUL_OPS else "")
    if follows == "conv":
        return torch.backends.cudnn.allow_tf32
    return follows == "matmul" and torch.backends.cuda.matmul.allow_tf32


def _record_dtype(rec: OpRecord, spec: GPUSpec, default: str) -> str:
    """Peak to use for one operator: its own dtype when the table has it (fp32 time embeddings), else the model's;
    fp32 convolutions and products at the TF32 rate where torch runs them so."""
    key = _RECORD_DTYPES.get(rec.dtype, default)
    key = key if key in spec.matmul_flops else default
    return "tf32" if key == "fp32" and "tf32" in spec.matmul_flops and _runs_tf32(rec) else key


def _summarise(model: nn.Module, recorder: Recorder, spec: GPUSpec, dkey: str, placements: Placements) -> Analysis:
    records = recorder.records
    # The fusion rules read the forward data flow, which comes first (backward and optimizer records follow it).
    forward = [rec for rec in records if rec.phase == "forward"]
    if forward != records[: len(forward)]:
        raise AssertionError("forward records are not a prefix of the recording")
    saved, _rule, removed, fusion_stats = plan_fusions(forward, single_key_paths(recorder.attention), placements)
    cats = {c: CategoryCost() for c in C.CATEGORIES}
    phases: dict[str, dict[str, CategoryCost]] = {}
    for rec in records:
        key = _record_dtype(rec, spec, dkey)
        phase_cats = phases.setdefault(rec.phase, {c: CategoryCost() for c in C.CATEGORIES})
        for cost in (cats[rec.category], phase_cats[rec.category]):
            _add_record(cost, rec, spec, key, saved.get(rec.index, 0), rec.index in removed)
    name = getattr(model, "ldmopt_zoo_name", None) or type(model).__name__
    placement_line = placements.describe()
    notes = [
        f"times are roofline projections on {spec.name} datasheet peaks ({spec.source}), not measurements",
        "patched = projection of ldmopt's fusions from the recorded data flow (see ldmopt/profiler/fusions.py)",
        placement_line,
    ]
    if any(rec.dtype == "float32" and _runs_tf32(rec) for rec in records):
        notes.append(
            "fp32 convolutions/products at the TF32 tensor-core rate, as torch runs them under this process's "
            f"settings (cudnn.allow_tf32={torch.backends.cudnn.allow_tf32}, "
            f"cuda.matmul.allow_tf32={torch.backends.cuda.matmul.allow_tf32})"
        )
    if len(phases) > 1:
        notes.append(
            "training step: forward (with the MSE loss), backward and AdamW update; the patched projection counts "
            "ldmopt's forward fusions only (backward and optimizer operators as they are)"
        )
    unattributed = cats[C.ATTN_UNATTRIBUTED].flops
    if unattributed:
        notes.append("some attention ran outside a diffusers attention module and could not be attributed")
    return Analysis(
        model=name,
        model_class=type(model).__name__,
        params=sum(p.numel() for p in model.parameters()),
        resolution=None,
        frames=None,
        batch=None,
        dtype=dkey,
        gpu=spec,
        categories=cats,
        attention=recorder.attention,
        fusions={k: fusion_stats[k] for k in FUSIONS},
        notes=notes,
        records=records,
        phases=phases,
        placement=placements.summary(),
        placement_line=placement_line,
    )


def _add_record(cost: CategoryCost, rec: OpRecord, spec: GPUSpec, key: str, saved: int, removed: bool) -> None:
    cost.flops += rec.flops
    cost.bytes += rec.bytes
    cost.ops += 1
    cost.time_s += spec.op_time(rec.flops, rec.bytes, key)
    patched = rec.bytes - saved
    cost.patched_bytes += patched
    if removed:
        # The op is gone, but a rule may leave some of its bytes counted: the bias/gate/shift reads and the output
        # write the fusing kernel still does (e.g. the adaLN add, the gated-residual add).
        cost.patched_time_s += spec.op_time(0, patched, key)
        return
    cost.patched_ops += 1
    cost.patched_time_s += spec.op_time(rec.flops, patched, key)


def sweep(
    model: str,
    *,
    resolutions: list[int | tuple[int, int]] | None = None,
    frames: list[int] | None = None,
    **kwargs: Any,
) -> list[Analysis]:
    """``analyze`` over resolutions x frame counts (a scaling sweep)."""
    out = []
    for res in resolutions or [None]:
        for f in frames or [None]:
            out.append(analyze(model, resolution=res, frames=f, **kwargs))
    return out
