"""Temporal attention over short sequences (frames), forward and backward, reading q/k/v through strided views.

Layout: q, k, v, out and the gradients are 5-D views (B, F, N, H, D) with arbitrary strides: B batch, F frames (the
attention axis), N pixels, H heads, D head_dim. diffusers' (B*N, F, H*D) activations are ``.view(B*N, F, 1, H, D)``,
the permute-free (B, F, N, H*D) order is ``.view(B, F, N, H, D)``, a fused to_qkv output (B*N, F, 3*H*D) is
``.view(B*N, F, 3, H, D)[:, :, i:i+1]``. Dtypes fp32/fp16/bf16 in and out; scores, softmax and accumulators in fp32;
int64 offsets (a sequence may span 2^31 elements or more: the contiguous dq of a strided q, a large frame stride).
Algorithm: one program owns BLOCK_P sequences of the flattened (b, n, h) index (heads fastest, so neighbouring
sequences share cache lines) and keeps their F x F scores in registers: S = Q K^T as a 3-D batched tl.dot
accumulated over head-dim chunks (masked, never padded in memory), an exact softmax, then O = P V chunk by chunk.
F <= 64 (padded to a power of two >= 16 in registers only). The head dim is a compile-time constant: the chunk mask
is then constant over aligned 8-element vectors, so head dims of 40 and 72 load as 16-byte vectors. The backward
recomputes S (no logsumexp is stored), forms dS = P * (dP - rowsum(P * dP)) with dP = dO V^T, then dV = P^T dO,
dQ = dS K, dK = dS^T Q chunk by chunk. The grid is 1-D: cdiv(B*N*H, BLOCK_P) programs, far below axis 0's limit.
Tiles: on a GPU, 16-bit inputs autotune over a few tiles (:func:`candidate_configs`: sequences per program, warps,
head-dim chunk), keyed by F, H, D, a power-of-two bucket of the sequence count and q's layout class (TUNING_KEY):
the measured forward reached 54-61% of copy bandwidth at head dim 40 against 89-92% at 64, the backward 22-49%
(benchmarks/RESULTS.md, H200, 2026-12-04), so which tile suits a head dim and a layout is for the GPU to time. The
heuristic tile (:func:`block_config`) is always a candidate, and is what fp32 and the CPU interpreter run.
The @triton.jit kernels are in _temporal_attention_kernels.py; this module picks their tiles and launches them.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import triton

from ._common import LAUNCH_OPTIONS, autotune, cdiv, new_output, next_power_of_2
from ._temporal_attention_kernels import _temporal_attention_bwd_kernel, _temporal_attention_fwd_kernel
from ._tuned_launch import tuned_launch

MAX_FRAMES = 64
MAX_HEAD_DIM = 256
_LOG2E = 1.4426950408889634
_GRID_AXIS0_LIMIT = 2**31 - 1


def block_d(d: int, dtype: torch.dtype = torch.float16) -> int:
    """Head-dim chunk: 16 or 32, whichever wastes fewer masked lanes (32 on a tie); wider chunks cost registers,
    and fp32 operands (twice the registers) always take 16."""
    if dtype == torch.float32:
        return 16
    return min((16, 32), key=lambda b: (cdiv(d, b) * b, -b))


def block_config(f: int, d: int, dtype: torch.dtype = torch.float16, backward: bool = False) -> dict:
    """Tile of one program for F frames and head_dim d: BLOCK_P sequences of BLOCK_F x BLOCK_D, and num_warps.

    The 3-D MMA layout puts the warps on the sequence axis, so F <= 16 runs BLOCK_P = num_warps = 4 sequences (one
    16 x 16 score tile per warp); longer sequences run one per program as 2-D dots with 4 (F <= 32) or 8 warps on
    the score rows. Every configuration compiles without spills on sm_80/sm_90 (see aot_specs); the fp16/bf16
    forward takes <= 128 registers, so at least four programs fit on an SM.
    """
    bf = max(16, next_power_of_2(f))
    if bf == 16 and not (backward and dtype == torch.float32):
        p, warps = 4, 4
    elif bf == 16:
        # The fp32 backward's four [P, 16, 16] fp32 tiles per warp spill at P = 4: one sequence over 4 warps instead.
        p, warps = 1, 4
    else:
        p, warps = 1, 4 if bf == 32 else 8
    return {"BLOCK_P": p, "BLOCK_F": bf, "BLOCK_D": block_d(d, dtype), "num_warps": warps}


def _tile(p: int, f_block: int, d_block: int, warps: int) -> dict:
    return {"BLOCK_P": p, "BLOCK_F": f_block, "BLOCK_D": d_block, "num_warps": warps}


def tile_name(tile: dict) -> str:
    """A tile as "P8xD64w8": sequences per program, head-dim chunk, warps (how checks, benchmarks and the AOT gate
    name it)."""
    return f"P{tile['BLOCK_P']}xD{tile['BLOCK_D']}w{tile['num_warps']}"


def candidate_configs(f: int, d: int, dtype: torch.dtype = torch.float16, backward: bool = False) -> list[dict]:
    """The tiles a GPU autotunes over for F frames and head_dim d, the heuristic :func:`block_config` first (see
    :func:`_candidates`)."""
    return [dict(t) for t in _candidates(f, d, dtype, backward)]


@functools.lru_cache(maxsize=256)
def _candidates(f: int, d: int, dtype: torch.dtype, backward: bool) -> tuple[dict, ...]:
    """:func:`candidate_configs`, made once per (F, head_dim, dtype, direction): launches read it on every call.

    16-bit inputs only: fp32 keeps its one tile (the reference-precision path; its fp32 tiles leave no register
    room), and so does the backward of a head dim that one 32-wide chunk holds over 16 padded frames (see below).
    Besides the heuristic chunk, the head dim is tried in one chunk where it is at most 128 over 16 padded frames, 64
    over more (40: one masked 64-wide load instead of three 16-wide ones; 80: one 128-wide instead of five 16-wide),
    else in the other of 16 / 32. F <= 16: 4 sequences on 4 warps, 8 on 8 (all of a pixel's 8 heads: longer
    contiguous rows) and 2 on 2 (more programs per SM); longer sequences: one per program on 4 or 8 warps, with no
    chunk narrower than the heuristic's, and 8 warps over 32 padded frames only with a 64-wide chunk (narrower, their
    loads drop to 8 bytes); the backward over 64 padded frames keeps its chunk (in one 64-wide chunk it spills
    272-288 bytes on sm_80). At the models' shapes (AOT_SHAPES) every tile compiles without spills on sm_80 / sm_90
    under Triton 3.8 and 3.6 (aot_specs).
    """
    base = block_config(f, d, dtype, backward)
    if dtype == torch.float32:
        return (base,)
    f_block, chunk = base["BLOCK_F"], base["BLOCK_D"]
    # the head dim in one chunk (up to 128 wide over 16 padded frames, 64 over more), else the other of 16 / 32
    whole = max(16, next_power_of_2(d))
    other = whole if whole <= (128 if f_block == 16 else 64) else 48 - chunk
    chunks = (chunk,) if other == chunk else (chunk, other)
    if f_block == 16:
        # Under Triton 3.6 (the GPU image's) the backward with 32-wide chunks spills 8-16 bytes at 8 or 2 sequences
        # per program (ptxas, 2026-12-07): 4 only there.
        spreads = lambda c: (4,) if backward and c == 32 else (4, 8, 2)
        tiles = [_tile(p, 16, chunk, p) for p in spreads(chunk)]
        tiles += [_tile(p, 16, c, p) for c in chunks[1:] for p in spreads(c) if p != 2]
    else:  # one sequence per program: a narrower chunk than the heuristic's drops its loads to 8 bytes
        chunks = tuple(c for c in chunks if c >= chunk and not (backward and f_block == 64 and c > chunk))
        if f_block == 32:
            tiles = [_tile(1, 32, c, 4) for c in chunks] + [_tile(1, 32, c, 8) for c in chunks if c == 64]
        else:
            tiles = [_tile(1, f_block, c, w) for c in chunks for w in (8, 4)]
    assert tiles[0] == base, (tiles[0], base)
    return tuple(tiles)


def tile_pairs(forward: list[dict], backward: list[dict]) -> list[tuple[dict, dict]]:
    """(forward tile, backward tile) pairs covering both candidate lists, the shorter one's heuristic tile (its first)
    filling in: what a check or test forces to run every tile once."""
    return [
        (forward[i] if i < len(forward) else forward[0], backward[i] if i < len(backward) else backward[0])
        for i in range(max(len(forward), len(backward)))
    ]


def launch_grid(n_seq: int, f: int, d: int, dtype: torch.dtype = torch.float16, backward: bool = False) -> tuple[int]:
    """The 1-D grid for n_seq = B*N*H sequences under the candidate tile with the fewest sequences per program (the
    largest grid autotuning may launch): every sequence of every head on axis 0."""
    fewest = min(t["BLOCK_P"] for t in _candidates(f, d, dtype, backward))
    grid = (cdiv(n_seq, fewest),)
    if grid[0] > _GRID_AXIS0_LIMIT:
        raise ValueError(f"{n_seq} sequences need {grid[0]} programs, over grid axis 0's limit {_GRID_AXIS0_LIMIT}")
    return grid


def layout_class(q: torch.Tensor) -> int:
    """The layout part of the tuning key for a (B, F, N, H, D) view: bit 0 when a pixel's heads are adjacent (head
    stride D), bit 1 when consecutive pixels are too (pixel stride H * D; not for a slice of a packed qkv), bit 2
    when frames are the outer axis (the permute-free (B, F, N, C) order; not diffusers' (B*N, F, C))."""
    _b, _f, n, h, d = q.shape
    _sb, sf, sn, sh, _sd = q.stride()
    heads_adjacent = h == 1 or sh == d
    pixels_adjacent = heads_adjacent and (n == 1 or sn == h * d)
    frames_outer = sf > sn
    return int(heads_adjacent) | int(pixels_adjacent) << 1 | int(frames_outer) << 2


def _tuning_key_args(q: torch.Tensor, n_seq: int) -> tuple[int, int]:
    """The kernels' autotune-only arguments (SEQ_BUCKET, LAYOUT)."""
    return next_power_of_2(n_seq), layout_class(q)


#: backward? -> the tile forced by :func:`forced_config` (None: each launch chooses, see the module docstring)
_FORCED: dict[bool, dict | None] = {False: None, True: None}


@contextlib.contextmanager
def forced_config(forward: dict | None = None, backward: dict | None = None):
    """Within the block, forward and backward launches run the tiles given (each one of :func:`candidate_configs`
    for the shape launched; None: chosen as usual), without autotuning: for checks and benchmarks of each tile.
    Process-wide, like the backend switches of benchmarks: autograd runs backward on threads of its own."""
    saved = dict(_FORCED)
    _FORCED.update({False: forward, True: backward})
    try:
        yield
    finally:
        _FORCED.update(saved)


#: An autotuned launch's key: the frame count, heads and head dim, the sequence count rounded up to a power of two
#: (``SEQ_BUCKET``: every resolution and batch size does not time the tiles again) and the class of q's layout
#: (``LAYOUT``, :func:`layout_class`: whether neighbouring sequences' rows are adjacent in memory, which is what a tile
#: of several sequences per program gains from, not the strides' exact values); the autotuner adds the tensors'
#: dtypes. Any candidate is valid for any shape and strides: the key only says when a choice is still apt.
TUNING_KEY = ("SEQ_BUCKET", "F", "H", "D", "LAYOUT")
#: (backward, candidate tiles as (BLOCK_P, BLOCK_D, num_warps)) -> its autotuner, made on first use (shapes with the
#: same candidates share one; D is in its key)
_AUTOTUNERS: dict[tuple[bool, tuple], object] = {}


@functools.lru_cache(maxsize=256)
def _autotuner(f: int, d: int, dtype: torch.dtype, backward: bool):
    """The autotuner over :func:`_candidates` (f, d, dtype, backward), looked up once per shape."""
    tiles = tuple((t["BLOCK_P"], t["BLOCK_D"], t["num_warps"]) for t in _candidates(f, d, dtype, backward))
    tuner = _AUTOTUNERS.get((backward, tiles))
    if tuner is None:
        configs = [triton.Config({"BLOCK_P": p, "BLOCK_D": c}, num_warps=w) for p, c, w in tiles]
        kernel = _temporal_attention_bwd_kernel if backward else _temporal_attention_fwd_kernel
        tuner = _AUTOTUNERS[(backward, tiles)] = autotune(configs=configs, key=list(TUNING_KEY))(kernel)
    return tuner


def _autotunes(q: torch.Tensor) -> bool:
    """Whether launches on ``q`` autotune: on GPUs. The interpreter cannot time tiles (tests stand a timing in)."""
    return q.is_cuda


def _capturing(q: torch.Tensor) -> bool:
    """Whether ``q``'s launches are being captured into a CUDA graph."""
    return q.is_cuda and torch.cuda.is_current_stream_capturing()


def _launch(backward: bool, q: torch.Tensor, n_seq: int, args: tuple, kwargs: dict, may_time: bool = True) -> None:
    """Launches the forward (backward) kernel on ``args``: with the forced tile, the heuristic one (fp32, CPU
    tensors), or the candidates' autotuner. Timing a key not tuned yet runs the kernel many times, so where that is
    not allowed the heuristic tile runs instead (a key tuned before still launches its choice): under CUDA graph
    capture (timing synchronises) and when ``may_time`` is False (an output overlapping an input, which a second run
    would read overwritten)."""
    _b, f, _n, _h, d = q.shape
    candidates = _candidates(f, d, q.dtype, backward)
    tile = _FORCED[backward]
    if tile is None and len(candidates) > 1 and _autotunes(q):
        tuner = _autotuner(f, d, q.dtype, backward)
        launch = tuned_launch(tuner)
        tuned_kwargs = {**kwargs, "BLOCK_F": candidates[0]["BLOCK_F"]}
        if (may_time and not _capturing(q)) or _tuned(launch, args, tuned_kwargs):
            _LAST_LAUNCHED[backward] = tuner
            launch[lambda meta: (cdiv(n_seq, meta["BLOCK_P"]),)](*args, **tuned_kwargs, **LAUNCH_OPTIONS)
            return
    tile = tile or candidates[0]
    if tile not in candidates:
        raise ValueError(
            f"tile {tile} is not a candidate for F={f}, head_dim={d}, {q.dtype} "
            f"({'backward' if backward else 'forward'}); candidates: {list(candidates)}"
        )
    _LAST_LAUNCHED[backward] = tile
    kernel = _temporal_attention_bwd_kernel if backward else _temporal_attention_fwd_kernel
    kernel[(cdiv(n_seq, tile["BLOCK_P"]),)](*args, **kwargs, **tile, **LAUNCH_OPTIONS)


def _tuned(launch, args: tuple, kwargs: dict) -> bool:
    """Whether the autotuner behind ``launch`` has chosen a tile for these arguments (False when it cannot tell)."""
    chosen = getattr(launch, "chosen", None)  # a TunedLaunch; tuned_launch hands an Autotuner subclass back as is
    return chosen is not None and chosen(args, kwargs) is not None


def _overlaps(out: torch.Tensor, *inputs: torch.Tensor) -> bool:
    """Whether ``out`` shares storage with any of ``inputs`` (conservatively: any sharing at all)."""
    storage = out.untyped_storage().data_ptr()
    return any(t.untyped_storage().data_ptr() == storage for t in inputs)


#: backward? -> the tile (or the autotuner) of the last launch, for launched_tile
_LAST_LAUNCHED: dict[bool, object] = {False: None, True: None}


def launched_tile(backward: bool = False) -> str:
    """The tile of the last forward (backward) launch in this process, any thread, as "P8xD64w8" (sequences per
    program, head-dim chunk, warps); "" before any."""
    last = _LAST_LAUNCHED[backward]
    if last is None:
        return ""
    if isinstance(last, dict):
        return tile_name(last)
    config = last.best_config  # the autotuner's (set by tuning and by each tuned launch)
    return tile_name({**config.kwargs, "num_warps": config.num_warps})


def tuned_choices() -> dict[str, dict[tuple, dict]]:
    """What autotuning chose in this process: {"forward" / "backward": {key: tile}}, the key being TUNING_KEY's
    values and then the tensors' dtypes."""
    out: dict[str, dict[tuple, dict]] = {"forward": {}, "backward": {}}
    for (backward, _tiles), tuner in _AUTOTUNERS.items():
        for key, config in tuner.cache.items():
            out["backward" if backward else "forward"][key] = {**config.kwargs, "num_warps": config.num_warps}
    return out


def row_alignment(*tensors: torch.Tensor) -> int:
    """ALIGN: the largest power of two, up to 16 bytes of elements, that divides the batch, frame, pixel and head
    strides of every view. Each sequence's rows then start at a multiple of it (pointers Triton checks itself), so
    loads of that many head-dim elements are vectorised; 1 disables the hint."""
    align = 16 // tensors[0].element_size()
    strides = [st for t in tensors for st in t.stride()[:4]]
    while align > 1 and any(st % align for st in strides):
        align //= 2
    return align


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs get full-precision products (the reference is fp32 math); fp16/bf16 use tensor cores natively.
    return "ieee" if dtype == torch.float32 else "tf32"


def _check_views(*tensors: torch.Tensor) -> None:
    shape = tensors[0].shape
    for t in tensors:
        if t.dim() != 5 or t.shape != shape:
            raise ValueError(f"expected 5-D (B, F, N, H, D) views of one shape {tuple(shape)}, got {tuple(t.shape)}")
    _b, f, _n, _h, d = shape
    if f > MAX_FRAMES or d > MAX_HEAD_DIM:
        raise ValueError(f"F={f}, head_dim={d}: the kernel supports F <= {MAX_FRAMES}, head_dim <= {MAX_HEAD_DIM}")


def temporal_attention_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, out: torch.Tensor | None = None
) -> torch.Tensor:
    """softmax(q k^T * scale) v over the F axis of (B, F, N, H, D) views, written into ``out``.

    ``out`` defaults to ``torch.empty_like(q)``: q's strides when q is dense, else the contiguous (B, F, N, H, D)
    layout (e.g. for a slice of a packed qkv tensor). Returns ``out``.
    """
    out = new_output(like=q) if out is None else out
    _check_views(q, k, v, out)
    b, f, n, h, d = q.shape
    n_seq = b * n * h
    launch_grid(n_seq, f, d, q.dtype)  # the grid limit
    args = (
        out, q, k, v, *out.stride(), *q.stride(), *k.stride(), *v.stride(), n_seq, n, h, f, scale * _LOG2E,
        *_tuning_key_args(q, n_seq),
    )  # fmt: skip
    kwargs = dict(D=d, DOT_PRECISION=_dot_precision(q.dtype), ALIGN=row_alignment(out, q, k, v))
    _launch(False, q, n_seq, args, kwargs, may_time=not _overlaps(out, q, k, v))
    return out


def temporal_attention_bwd(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of temporal_attention_fwd, each ``torch.empty_like`` its input; dout may have any strides."""
    _check_views(dout, q, k, v)
    b, f, n, h, d = q.shape
    dq, dk, dv = new_output(like=q), new_output(like=k), new_output(like=v)
    n_seq = b * n * h
    launch_grid(n_seq, f, d, q.dtype, backward=True)  # the grid limit
    args = (
        dq, dk, dv, dout, q, k, v, *dq.stride(), *dk.stride(), *dv.stride(), *dout.stride(), *q.stride(),
        *k.stride(), *v.stride(), n_seq, n, h, f, scale, scale * _LOG2E, *_tuning_key_args(q, n_seq),
    )  # fmt: skip
    kwargs = dict(D=d, DOT_PRECISION=_dot_precision(q.dtype), ALIGN=row_alignment(dq, dk, dv, dout, q, k, v))
    _launch(True, q, n_seq, args, kwargs)
    return dq, dk, dv


#: (F, head_dim) of the models the kernel is for: AnimateDiff (16, 40/80/160), SVD (14, 64), SVD-XT (25, 64), Latte
#: (16, 72) and the longest sequence served (64, 64).
AOT_SHAPES = ((16, 40), (14, 64), (16, 80), (16, 160), (25, 64), (64, 64), (16, 72))


def _aot_signature(names: tuple[str, ...], dtype: str, backward: bool) -> tuple[dict, dict]:
    sig = {f"{n}_ptr": f"*{dtype}" for n in names}
    for n in names:
        sig.update({f"stride_{n}{axis}": "i32" for axis in "bfnh"})
    sig.update({"n_seq": "i32", "N": "i32", "H": "i32", "F": "i32"})
    sig.update({"scale": "fp32", "qk_scale": "fp32"} if backward else {"qk_scale": "fp32"})
    sig.update({"SEQ_BUCKET": "i32", "LAYOUT": "i32"})
    # Head dims are contiguous in every real layout; Triton specialises a unit stride the same way at launch.
    return sig, {f"stride_{n}d": 1 for n in names}


def aot_specs() -> list[dict]:
    """Compile configurations for the ahead-of-time gate: real (F, head_dim) shapes, forward and backward, every
    candidate tile (:func:`candidate_configs`; the heuristic one unnamed, the others named by their tile)."""
    specs = []
    dtypes = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
    for f, d in AOT_SHAPES:
        for dtype in ("fp16", "fp32") + (("bf16",) if (f, d) in ((16, 40), (14, 64)) else ()):
            for backward in (False, True):
                names = ("dq", "dk", "dv", "do", "q", "k", "v") if backward else ("o", "q", "k", "v")
                for i, cfg in enumerate(candidate_configs(f, d, dtypes[dtype], backward)):
                    sig, constexprs = _aot_signature(names, dtype, backward)
                    constexprs.update({key: cfg[key] for key in ("BLOCK_P", "BLOCK_F", "BLOCK_D")}, D=d)
                    constexprs["DOT_PRECISION"] = _dot_precision(dtypes[dtype])
                    # diffusers' (B*N, F, heads*d) views: every stride a multiple of d, of 8 (fp16) or 4 (fp32)
                    # elements.
                    constexprs["ALIGN"] = 16 // dtypes[dtype].itemsize
                    kernel = _temporal_attention_bwd_kernel if backward else _temporal_attention_fwd_kernel
                    tile = f"{tile_name(cfg)}," if i else ""
                    specs.append(
                        dict(
                            name=f"temporal_attention_{'bwd' if backward else 'fwd'}[F={f},d={d},{tile}{dtype}]",
                            fn=kernel,
                            signature=sig,
                            constexprs=constexprs,
                            num_warps=cfg["num_warps"],
                            # What Triton marks at launch at the real shapes: pointers, and the batch/frame/pixel
                            # strides (multiples of heads*d); the head stride d only when d is a multiple of 16
                            # (not 40 or 72).
                            divisible_by_16=[
                                k
                                for k in sig
                                if k.endswith("_ptr")
                                or (k.startswith("stride_") and k not in constexprs and (d % 16 == 0 or k[-1] != "h"))
                            ],
                        )
                    )
    return specs
