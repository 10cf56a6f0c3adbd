"""Temporal attention at video-model shapes: ldmopt vs diffusers' SDPA path (each SDPA backend), xformers,
FlexAttention with a block-diagonal mask and torch.compile; forward and forward+backward; peak memory.

Two layouts per shape (B = 2, classifier-free guidance; N pixels, F frames, C = heads * head_dim):
- ``bnfc``: the processor's inputs, to_q/to_k/to_v outputs of shape (B*N, F, C). diffusers views them as
  (B*N, heads, F, d) for SDPA and transposes the result back; ldmopt reads (B*N, F, 1, heads, d) views.
- ``bfnc``: activations as the spatial layers leave them, (B*F, N, C). diffusers' temporal blocks permute them to
  (B*N, F, C) (a copy) before attention and back after (another copy); ldmopt reads and writes (B, F, N, heads, d)
  views in place. Only the attention and these permutes are timed, not the projections.
Bytes: q, k, v read and the output written (forward); plus q, k, v, dO read and dq, dk, dv written (backward): the
minimum traffic, so GB/s is a lower bound. FLOPs: 4 F^2 d per sequence and head forward, 2.5x that backward.
A provider that cannot run a shape (e.g. a grid limit at 262,144 sequences x heads) is recorded as a "fails" row.
Targets (H200): >= 3x diffusers' SDPA path at AnimateDiff and SVD shapes, >= 60% of copy bandwidth, peak memory not
above SDPA's, and correct where SDPA/xformers fail. LDMOPT_BENCH_QUICK=1 keeps three shapes and skips compiles.
``ldmopt-triton`` autotunes its tile (the note names the tiles it launched); ``ldmopt-triton-heuristic`` runs the
heuristic tile alone, so the two rows show what autotuning buys.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from ldmopt.kernels.temporal_attention import block_config, forced_config, launched_tile

import ldmopt
from benchmarks import harness
from ldmopt.ops.temporal_attention import temporal_attention

pytestmark = harness.gpu_only

DEVICE = "cuda"  # tests/benchmarks_dry_run/ runs this benchmark's logic on the CPU
QUICK = os.environ.get("LDMOPT_BENCH_QUICK") == "1"
SHAPES = {
    # name: (B, N, F, heads, head_dim) of the models' temporal attention layers at their default sizes, CFG batch 2
    "animatediff512-64x64": (2, 4096, 16, 8, 40),
    "animatediff512-32x32": (2, 1024, 16, 8, 80),
    "animatediff512-16x16": (2, 256, 16, 8, 160),
    "svd576x1024-72x128": (2, 9216, 14, 5, 64),
    "svdxt576x1024-72x128": (2, 9216, 25, 5, 64),
    "latte512": (2, 1024, 16, 16, 72),
    "animatediff-sdxl1024-128x128": (2, 16384, 16, 8, 40),  # 262,144 sequences x heads: past 65,535
}
QUICK_SHAPES = ("animatediff512-64x64", "svd576x1024-72x128", "animatediff-sdxl1024-128x128")


def _split(b, n, f, h, d, layout):
    """(to_bnfc, from_bnfc, as_5d): diffusers' permutes for ``layout`` and ldmopt's strided view of an input."""
    c = h * d
    if layout == "bnfc":
        return (lambda t: t), (lambda o: o), (lambda t: t.view(b * n, f, 1, h, d))
    to_bnfc = lambda t: t.view(b, f, n, c).permute(0, 2, 1, 3).reshape(b * n, f, c)
    from_bnfc = lambda o: o.view(b, n, f, c).permute(0, 2, 1, 3).reshape(b * f, n, c)
    return to_bnfc, from_bnfc, lambda t: t.view(b, f, n, h, d)


def _diffusers_path(shape, layout, backend=None):
    b, n, f, h, d = shape
    to_bnfc, from_bnfc, _ = _split(*shape, layout)

    def fn(q, k, v):
        q, k, v = (to_bnfc(t).view(b * n, f, h, d).transpose(1, 2) for t in (q, k, v))
        if backend is None:
            o = F.scaled_dot_product_attention(q, k, v)
        else:
            from torch.nn.attention import sdpa_kernel

            with sdpa_kernel([backend]):
                o = F.scaled_dot_product_attention(q, k, v)
        return from_bnfc(o.transpose(1, 2).reshape(b * n, f, h * d))

    return fn


def _ldmopt_path(shape, layout, backend):
    b, n, f, h, d = shape
    _, _, as_5d = _split(*shape, layout)
    out_shape = (b * n, f, h * d) if layout == "bnfc" else (b * f, n, h * d)

    def fn(q, k, v):
        with ldmopt.use_backend(backend):
            return temporal_attention(as_5d(q), as_5d(k), as_5d(v)).view(out_shape)

    return fn


def _xformers_path(shape, layout):
    import xformers.ops as xops  # raises when missing; a load failure surfaces on the first call

    b, n, f, h, d = shape
    to_bnfc, from_bnfc, _ = _split(*shape, layout)

    def fn(q, k, v):
        q, k, v = (to_bnfc(t).view(b * n, f, h, d) for t in (q, k, v))
        return from_bnfc(xops.memory_efficient_attention(q, k, v).reshape(b * n, f, h * d))

    return fn


def _xformers_note() -> str:
    """What the xformers rows ran: PyPI's xformers (the one benchmarks/fetch_wheels.sh carries) is built against CUDA
    12; under a CUDA 13 torch its C++ kernels fail to load and its flash op runs PyTorch's own flash-attention."""
    import xformers

    if getattr(xformers, "_has_cpp_library", True):
        return f"xformers {xformers.__version__}"
    why = str(getattr(xformers._cpp_lib, "_cpp_library_load_exception", "")).splitlines() or [""]
    return f"xformers {xformers.__version__} without its C++ kernels ({why[0][:60]}): PyTorch's flash via xformers"


def _flex_path(shape, layout, device):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    b, n, f, h, d = shape
    to_bnfc, from_bnfc, _ = _split(*shape, layout)
    length = b * n * f
    # All sequences back to back as one long sequence per head; each query sees only its own F frames.
    # Compiled, the mask is built block by block; eagerly it materialises the dense length^2 mask (275 GB at 524k
    # tokens).
    mask = torch.compile(create_block_mask, dynamic=False)(
        lambda _b, _h, qi, ki: qi // f == ki // f, None, None, length, length, device=device
    )
    flex = torch.compile(flex_attention, dynamic=False)

    def fn(q, k, v):
        q, k, v = (to_bnfc(t).reshape(length, h, d).transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        o = flex(q, k, v, block_mask=mask)
        return from_bnfc(o.squeeze(0).transpose(0, 1).reshape(b * n, f, h * d))

    return fn


def _providers(shape, layout, device):
    from torch.nn.attention import SDPBackend

    providers = {"eager": lambda: _diffusers_path(shape, layout)}
    for name, backend in (
        ("flash", SDPBackend.FLASH_ATTENTION),
        ("efficient", SDPBackend.EFFICIENT_ATTENTION),
        ("cudnn", SDPBackend.CUDNN_ATTENTION),
        ("math", SDPBackend.MATH),
    ):
        providers[f"sdpa-{name}"] = lambda backend=backend: _diffusers_path(shape, layout, backend)
    providers["xformers"] = lambda: _xformers_path(shape, layout)
    if not QUICK:
        providers["flex-blockdiag"] = lambda: _flex_path(shape, layout, device)
        providers["compile"] = lambda: harness.compiled(
            _diffusers_path(shape, layout), mode="max-autotune-no-cudagraphs"
        )
    for backend in ("triton", "cuda"):
        providers[f"ldmopt-{backend}"] = lambda backend=backend: _ldmopt_path(shape, layout, backend)
    # the Triton kernel with its heuristic tile, not autotuned: what the autotuning of ldmopt-triton buys
    providers["ldmopt-triton-heuristic"] = lambda: _ldmopt_path(shape, layout, "triton")
    return providers


def _heuristic_tiles(shape, dtype):
    """Forward and backward launches with the heuristic tiles (kernels/temporal_attention.py's block_config)."""
    _b, _n, f, _h, d = shape
    return forced_config(block_config(f, d, dtype), block_config(f, d, dtype, backward=True))


def _within(context, run):
    def wrapped():
        with context():
            return run()

    return wrapped


def _tile_note(mode: str) -> str:
    """The Triton tiles the last call launched (autotuned or forced)."""
    note = f"tile {launched_tile()}"
    return note + (f", backward {launched_tile(backward=True)}" if mode == "fwd+bwd" else "")


def _reference(q, k, v, shape, layout, chunk=4096):
    """fp32 SDPA in chunks of sequences small enough for every backend's grid."""
    to_bnfc, from_bnfc, _ = _split(*shape, layout)
    b, n, f, h, d = shape
    q, k, v = (to_bnfc(t.detach()).float() for t in (q, k, v))
    out = torch.empty_like(q)
    for s in range(0, b * n, chunk):
        qs, ks, vs = (t[s : s + chunk].view(-1, f, h, d).transpose(1, 2) for t in (q, k, v))
        out[s : s + chunk] = F.scaled_dot_product_attention(qs, ks, vs).transpose(1, 2).reshape(-1, f, h * d)
    return from_bnfc(out)


@pytest.mark.parametrize("case", [s for s in SHAPES if not QUICK or s in QUICK_SHAPES])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("layout", ["bnfc", "bfnc"])
@pytest.mark.parametrize("mode", ["fwd", "fwd+bwd"])
def bench_temporal_attention(case, dtype, layout, mode, bench_recorder):
    shape = b, n, f, h, d = SHAPES[case]
    rows = (b * n, f, h * d) if layout == "bnfc" else (b * f, n, h * d)
    q, k, v = (torch.randn(rows, device=DEVICE, dtype=dtype) for _ in range(3))
    elem = q.numel() * q.element_size()
    flops = 4 * b * n * h * f * f * d
    if mode == "fwd+bwd":
        for t in (q, k, v):
            t.requires_grad_(True)
        nbytes, flops = 11 * elem, int(3.5 * flops)
    else:
        nbytes = 4 * elem
    dy = torch.randn(rows, device=DEVICE, dtype=dtype)
    reference = _reference(q, k, v, shape, layout) if mode == "fwd" else None
    for name, make in _providers(shape, layout, q.device).items():
        timing, peak, note = None, None, ""
        try:
            fn = make()
            if mode == "fwd":
                run = lambda fn=fn: fn(q, k, v)
            else:
                run = lambda fn=fn: torch.autograd.grad(fn(q, k, v), (q, k, v), dy)
            if name == "ldmopt-triton-heuristic":
                run = _within(lambda: _heuristic_tiles(shape, dtype), run)
            out = run()
            harness.synchronize(DEVICE)
            if reference is not None:
                note = f"max|err| vs fp32 SDPA {(out.float() - reference).abs().max().item():.2e}"
            if name.startswith("ldmopt-triton"):
                note = f"{note}; {_tile_note(mode)}".lstrip("; ")
            timing = harness.time_fn(run)
            peak = harness.peak_memory(run)
            if name == "xformers":
                note = f"{note}; {_xformers_note()}".lstrip("; ")
        except ldmopt.BackendUnavailableError as exc:
            note = f"unavailable: {str(exc)[:100]}"
        except ImportError as exc:
            missing = " (not installed: bash benchmarks/fetch_wheels.sh carries it)" if name == "xformers" else ""
            note = harness.error_note(exc) + missing
        except Exception as exc:  # grid limits, unsupported head dims, xformers' missing extensions
            harness.synchronize(DEVICE)
            note = harness.error_note(exc, "fails") + (f"; {_xformers_note()}" if name == "xformers" else "")
        bench_recorder.record(
            op="temporal_attention",
            case=f"{case}-{layout}",
            dtype=str(dtype).removeprefix("torch."),
            mode=mode,
            provider=name,
            timing=timing,
            bytes=nbytes,
            flops=flops,
            peak_mem=peak,
            note=note,
        )
