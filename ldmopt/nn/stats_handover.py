"""Normalisation statistics handed from a fused block to the fused norm that reads its output next.

In a diffusers UNet a ResnetBlock2D's output goes straight into another GroupNorm: the next resnet's ``norm1`` or a
Transformer2DModel's ``norm``. Each fused consumer would otherwise run its own statistics pass (two launches and a
full read of the activation) over a tensor whose producer's last convolution could have summed it in its epilogue.
Diffusers' block code calls the modules one after another, so the hand-over goes beside it, not through it:

- a producer calls :func:`offer` with its output (and, once it knows what its consumer wants, that output's
  statistics from its epilogue);
- a consumer calls :func:`take` with its input and its GroupNorm's (groups, eps). It gets the statistics only when
  its input IS the offered tensor (same object, unmodified since: same ``_version``) and the (groups, eps) match;
  otherwise it computes them as before. A miss on the offered tensor records the consumer's (groups, eps) for that
  producer (:func:`wanted`), so from the next call on the producer's epilogue computes exactly those.

The same goes for LayerNorm statistics between UNet transformer blocks (SDXL runs ten in a row): a block's
feed-forward output GEMM sums its rows' ``layer_norm_stats`` in its epilogue for the next block's norm1
(:func:`offer_layer_norm`, :func:`take_layer_norm`, :func:`wanted_layer_norm_eps`).

A UNet up block's resnets read ``cat([hidden, skip], 1)`` (the pair ``(hidden, skip)``, never concatenated): skip was
written by the down block long before, and the single pending offer has moved on since. So every offered output is also
recorded, weakly, with its producer and, if the producer summed them, its per-(image, channel) sums (fp64 sum and sum of
squares, from the same epilogue: ``gn_silu_conv2d(out_channel_sums=True)``). A two-part consumer calls
:func:`take_parts`: when both parts are recorded unmodified with sums, their GroupNorm statistics are finalised from the
sums in one small launch (``ops.group_norm_sums``) instead of a pass over both tensors; otherwise, when both parts were
offered, their producers learn to sum their outputs from the next call on (:func:`wants_sums`). A video's GroupNorm over
(C/G, F, H, W) (AnimateDiff's motion modules, SVD's temporal resnets) adds its frames' sums likewise
(:func:`take_video`). A producer keeps summing until
``ldmopt.unpatch`` (or :func:`forget`): a few atomics per output tile, whether or not a consumer takes them.

So a hand-over skips work and computes the same thing: the statistics are those of the consumer's own input (the
epilogue sums the stored output), and the consumer's backward differentiates through them as its own. They agree with
a statistics pass to rounding, not bit for bit (fp64 sums against a two-pass mean and variance), so a model's first
call, which learns who wants what, can differ from its later calls in the last bits (a training script that resumes
bit for bit runs one call first: examples/train_ldm.py). Only plain
eager calls take part (no tracing, compiling, dispatch or function modes, ``with torch.device(...)`` among the
latter, no active torch.profiler, whose profiles therefore show the statistics passes a plain run skips, and no
inference tensors, which keep no version counter: use torch.no_grad rather than torch.inference_mode to have them),
on the producer's CUDA stream and capture state; each thread has its own slot. Writes PyTorch's version counter does
not see (through ``.data``, a NumPy or DLPack alias, or the raw ``untyped_storage()``) between the two modules are
the one way to make a hand-over stale.
"""

from __future__ import annotations

import math
import threading
import weakref
from collections import Counter
from typing import NamedTuple

import torch
from torch import Tensor, nn
from torch.utils.weak import WeakIdKeyDictionary

from ..ops._dispatch import _no_mode_active, call
from ..ops.group_norm_sums import group_norm_stats_from_sums

#: How many statistics passes were skipped because a producer handed them over, per consumer kind.
handed_over: Counter[str] = Counter()
#: producer module -> the statistics its output's consumer asked for (learned from a miss): (groups, eps) for a
#: GroupNorm, (LAYER_NORM, eps) for a LayerNorm over the last axis
_wanted: weakref.WeakKeyDictionary[nn.Module, tuple] = weakref.WeakKeyDictionary()
#: producer module -> its offers with statistics in a row that no consumer took (_drop_if_unused)
_untaken: weakref.WeakKeyDictionary[nn.Module, int] = weakref.WeakKeyDictionary()
#: producers whose outputs a two-part GroupNorm (an up block's cat([hidden, skip], 1)) read without their channel sums
_wants_sums: weakref.WeakKeyDictionary[nn.Module, bool] = weakref.WeakKeyDictionary()
#: offered output -> how it was produced (_Produced), while it lives
_produced = WeakIdKeyDictionary()
#: The first item of a LayerNorm's statistics request: its statistics are layer_norm_stats' [2, M] rows.
LAYER_NORM = "layer_norm"
_local = threading.local()


class _Offer(NamedTuple):
    tensor: weakref.ref
    version: int
    stream: tuple | None
    producer: weakref.ref
    config: tuple | None
    stats: tuple[Tensor, ...] | None


class _Produced(NamedTuple):
    version: int
    stream: tuple | None
    producer: weakref.ref
    sums: Tensor | None  # [N, C, 2] fp64: per (image, channel), the sum and the sum of squares


def _stream_of(t: Tensor) -> tuple | None:
    """(device, stream, capturing) for a CUDA tensor: statistics made on another stream, or outside a CUDA graph
    being captured (their addresses would be baked into the graph), are not handed over."""
    if t.device.type != "cuda":
        return None
    stream = torch.cuda.current_stream(t.device)
    return t.device.index, stream.cuda_stream, torch.cuda.is_current_stream_capturing()


def _eligible(t: Tensor) -> bool:
    # Inference tensors (torch.inference_mode) keep no version counter: an in-place change between producer and
    # consumer could not be seen, so they hand nothing over.
    return (
        not torch.compiler.is_compiling()
        and type(t) is Tensor
        and t.device.type != "meta"
        and not t.is_inference()
        and _no_mode_active()
    )


def wanted(producer: nn.Module, out_like: Tensor) -> tuple | None:
    """The (groups, eps) to compute the output statistics for, if the consumer of this producer's output asked for
    them on an earlier call (and this call takes part: ``out_like`` is a plain eager tensor)."""
    if not _eligible(out_like):
        return None
    return _wanted.get(producer)


def wanted_group_norm(producer: nn.Module, out_like: Tensor) -> tuple[int, float] | None:
    """:func:`wanted`, when what was asked for is a GroupNorm's (groups, eps) (what a conv's epilogue sums)."""
    config = wanted(producer, out_like)
    return config if config is not None and config[0] != LAYER_NORM else None


def wanted_layer_norm_eps(producer: nn.Module, out_like: Tensor) -> float | None:
    """The eps of the LayerNorm that read this producer's output on an earlier call, if one asked (see wanted)."""
    config = wanted(producer, out_like)
    return config[1] if config is not None and config[0] == LAYER_NORM else None


def wants_sums(producer: nn.Module, out_like: Tensor) -> bool:
    """Whether to sum this producer's output per (image, channel) for a two-part GroupNorm that reads it (learned by
    :func:`take_parts` on an earlier call; ``out_like``: as :func:`wanted`)."""
    return _eligible(out_like) and out_like.dtype != torch.float64 and _wants_sums.get(producer, False)


def offer_result(result, producer: nn.Module, config: tuple | None, sums: bool) -> Tensor:
    """Offer the output of ``gn_silu_conv2d(..., out_stats=config, out_channel_sums=sums)`` with what its epilogue
    summed (:func:`offer`); returns the output itself."""
    if config is None and not sums:
        offer(result, producer)
        return result
    y = result[0]
    offer(y, producer, config, result[1] if config is not None else None, result[-1] if sums else None)
    return y


def offer_layer_norm(out: Tensor, producer: nn.Module, eps: float | None, stats: Tensor | None) -> None:
    """:func:`offer` for a LayerNorm: ``out`` and, when summed (``stats`` not None), its ``layer_norm_stats`` for
    ``eps``."""
    if stats is None:
        offer(out, producer)
    else:
        offer(out, producer, (LAYER_NORM, float(eps)), (stats,))


def offer(out: Tensor, producer: nn.Module, config: tuple | None = None, stats=None, sums: Tensor | None = None):
    """Make ``out`` (and its ``stats`` for GroupNorm ``config``, if computed) the next consumer's to take, and record
    it (with its channel ``sums``, if computed) for a two-part consumer later on."""
    if torch.compiler.is_compiling():
        return  # no side effect in a traced graph (a checkpointed region under torch.compile refuses them)
    if not _eligible(out):
        _local.offer = None
        return
    sums = None if sums is None else sums.detach()
    _produced[out] = _Produced(out._version, _stream_of(out), weakref.ref(producer), sums)
    # Detached: the consumer treats them as constants, and a graph node held here would keep the producer's whole
    # autograd graph alive until the next offer.
    stats = None if stats is None else tuple(s.detach() for s in stats)
    _drop_if_unused(getattr(_local, "offer", None))  # a new offer before anyone took the last one
    _local.offer = _Offer(weakref.ref(out), out._version, _stream_of(out), weakref.ref(producer), config, stats)


def take(x: Tensor, groups: int, eps: float, consumer: str) -> tuple[Tensor, Tensor] | None:
    """(mean, rstd) of ``x`` for GroupNorm(groups, eps) if the last offer was ``x`` itself with those statistics;
    None otherwise (recording, for the producer of ``x``, which statistics to compute next time). An eligible ``x``
    uses the offer up either way; an ineligible one (the (hidden, skip) pair of an up block, an inference tensor, a
    call under a mode) leaves it pending, for nothing but ``x`` itself can take it."""
    return _take(x, (int(groups), float(eps)), consumer)


def take_layer_norm(x: Tensor, eps: float, consumer: str) -> Tensor | None:
    """``layer_norm_stats(x, eps)`` ([2, M]: means, rstds of x's rows) if the last offer was ``x`` itself with
    those statistics; as :func:`take` otherwise."""
    stats = _take(x, (LAYER_NORM, float(eps)), consumer)
    return None if stats is None else stats[0]


def _take(x: Tensor, config: tuple, consumer: str) -> tuple[Tensor, ...] | None:
    if not _eligible(x):  # (a tuple, the pair of an up block's skip concat, is not eligible; nor a traced call)
        return None
    # Read only once eligible: under torch.compile a read of the thread's offer would be guarded on, and an eager
    # call of the same model (which leaves one) would then retrace the compiled graph.
    offered = getattr(_local, "offer", None)
    if offered is None:
        return None
    _local.offer = None
    if offered.tensor() is not x or x._version != offered.version or _stream_of(x) != offered.stream:
        _drop_if_unused(offered)
        return None
    if offered.config == config and offered.stats is not None:
        handed_over[consumer] += 1
        producer = offered.producer()
        if producer is not None:
            _untaken.pop(producer, None)
        return offered.stats
    producer = offered.producer()
    if producer is not None:
        _wanted[producer] = config
        _untaken.pop(producer, None)  # a new request starts its own count
    return None


def take_parts(head: Tensor, tail: Tensor, groups: int, eps: float, consumer: str) -> tuple[Tensor, Tensor] | None:
    """(mean, rstd) of ``cat([head, tail], 1)`` for GroupNorm(groups, eps), finalised from both parts' channel sums
    when their producers recorded them and neither part changed since (one small launch); None otherwise, teaching
    the parts' producers to sum their outputs from the next call on (only when both parts were offered: with one
    part unrecorded, sums of the other could never serve)."""
    if not (_eligible(head) and _eligible(tail)) or head.dtype == torch.float64:
        return None
    records = [_record(head), _record(tail)]
    if all(r is not None and r.sums is not None for r in records):
        count = math.prod(head.shape[2:])
        handed_over[consumer] += 1
        return call(group_norm_stats_from_sums, records[0].sums, int(groups), float(eps), count, records[1].sums)
    if any(r is None for r in records):
        return None  # a part no producer offered (conv_in's, a stock downsampler's) never comes with sums
    for record in records:
        _teach_sums(record)
    return None


def take_video(x: Tensor, frames: int, groups: int, eps: float, consumer: str) -> tuple[Tensor, Tensor] | None:
    """(mean, rstd) [B, groups] of the (B * frames, C, H, W) map ``x`` for a GroupNorm over each video's
    (C/groups, frames, H, W) (AnimateDiff's motion modules), from its producer's per-frame channel sums (one small
    launch); None otherwise, teaching its producer to sum them from the next call on."""
    if not _eligible(x) or x.dtype == torch.float64:
        return None
    record = _record(x)
    if record is None:
        return None
    if record.sums is None:
        _teach_sums(record)
        return None
    handed_over[consumer] += 1
    count = math.prod(x.shape[2:])
    return call(group_norm_stats_from_sums, record.sums, int(groups), float(eps), count, None, int(frames))


def _teach_sums(record: _Produced) -> None:
    """Ask the producer of a recorded output that came without sums to sum its outputs from the next call on."""
    producer = None if record.sums is not None else record.producer()
    if producer is not None:
        _wants_sums[producer] = True


def _record(t: Tensor) -> _Produced | None:
    """How ``t`` was produced, if a producer offered it and it is unmodified since (same version, same stream)."""
    record = _produced.get(t)
    if record is None or t._version != record.version or _stream_of(t) != record.stream:
        return None
    return record


def _drop_if_unused(offered: _Offer | None) -> None:
    """The producer of statistics that no consumer took twice in a row stops computing them: what reads its output is
    no longer a fused norm (left stock, unpatched, hooked), so the request it learned is stale. Asked for again, it
    learns again. (Once is not enough: a gradient-checkpointing recompute runs the producer alone in backward.)"""
    if offered is None or offered.stats is None:
        return
    producer = offered.producer()
    if producer is None or _wanted.get(producer) != offered.config:
        return
    untaken = _untaken[producer] = _untaken.get(producer, 0) + 1
    if untaken >= 2:
        _wanted.pop(producer, None)
        _untaken.pop(producer, None)


def forget_modules(modules) -> None:
    """Drop the requests learned for these producers (``ldmopt.unpatch`` restores a model as it was before)."""
    for module in modules:
        _wanted.pop(module, None)
        _untaken.pop(module, None)
        _wants_sums.pop(module, None)


def forget() -> None:
    """Drop this thread's pending offer and every learned request (tests; a model changed under its blocks)."""
    _local.offer = None
    _wanted.clear()
    _untaken.clear()
    _wants_sums.clear()
    _produced.clear()
