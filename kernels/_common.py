"""Pieces every kernel module shares: activation functions passed to kernels as constexpr, output allocation, the
tl.dot precision of fp32 operands."""

from __future__ import annotations

import inspect
import os
import weakref

import torch
import triton
import triton.language as tl

from ldmopt._env import getenv

#: Compile options every ldmopt launch passes. FMA contraction is asked for explicitly, as torch inductor does: Triton
#: 3.9 warns that its default, on until then, turns off in 3.10, which would split every multiply-add of the kernels'
#: epilogues and prologues in two (slower, and rounded once more).
LAUNCH_OPTIONS = {"enable_fp_fusion": True}


@triton.jit
def identity(x):
    return x


@triton.jit
def identity_grad(x, dy):
    return dy


@triton.jit
def silu(x):
    return x * tl.sigmoid(x)


@triton.jit
def silu_grad(x, dy):
    # d/dx x*s(x) = s(x) * (1 + x * (1 - s(x)))
    s = tl.sigmoid(x)
    return dy * s * (1.0 + x * (1.0 - s))


@triton.jit
def gelu_erf(x):
    return 0.5 * x * (1.0 + tl.erf(x * 0.7071067811865476))


@triton.jit
def gelu_erf_grad(x, dy):
    cdf = 0.5 * (1.0 + tl.erf(x * 0.7071067811865476))
    pdf = tl.exp(-0.5 * x * x) * 0.3989422804014327
    return dy * (cdf + x * pdf)


@triton.jit
def _tanh(x):
    # tanh through exp: stable for large |x| because exp(-2|x|) only underflows to 0.
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x >= 0, t, -t)


@triton.jit
def gelu_tanh(x):
    inner = 0.7978845608028654 * (x + 0.044715 * x * x * x)
    return 0.5 * x * (1.0 + _tanh(inner))


@triton.jit
def gelu_tanh_grad(x, dy):
    inner = 0.7978845608028654 * (x + 0.044715 * x * x * x)
    t = _tanh(inner)
    d_inner = 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * x * x)
    return dy * (0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * d_inner)


@triton.jit
def layer_normed(a, mean, rstd, norm_w_ptr, norm_b_ptr, k, k_ok, HAS_NORM_WEIGHT: tl.constexpr,
                 HAS_NORM_BIAS: tl.constexpr, pos_ptr=None, pos_rows=None, HAS_POS: tl.constexpr = False):  # fmt: skip
    """LayerNorm of an input tile a [BLOCK_M, BLOCK_K] (columns k, k_ok masking the tail) from fp32 row statistics
    mean and rstd [BLOCK_M] and the affine weight/bias [K], in fp32, plus (HAS_POS) a positional embedding per row
    (its table row's offset pos_rows [BLOCK_M]); the caller rounds it once to the GEMM's operand dtype, as the
    unfused norm's output is rounded (or cast by autocast) before the GEMM reads it."""
    h = (a.to(tl.float32) - mean[:, None]) * rstd[:, None]
    if HAS_NORM_WEIGHT:  # the weight's masked load zeroes the K tail
        h = h * tl.load(norm_w_ptr + k, mask=k_ok, other=0.0).to(tl.float32)[None, :]
    else:  # zero the K tail: -mean * rstd there can overflow the operand dtype, and inf * 0 in the dot is NaN
        h = tl.where(k_ok[None, :], h, 0.0)
    if HAS_NORM_BIAS:
        h = h + tl.load(norm_b_ptr + k, mask=k_ok, other=0.0).to(tl.float32)[None, :]
    if HAS_POS:
        h = h + tl.load(pos_ptr + pos_rows[:, None] + k[None, :], mask=k_ok[None, :], other=0.0).to(tl.float32)
    return h


@triton.jit
def variance_floor(var):
    """A variance computed as a difference, floored at 0 against rounding, with a NaN kept: stock's variance of values
    holding one is NaN (so is rstd), and tl.maximum alone returns the other operand for a NaN."""
    return tl.maximum(var, 0.0, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def row_moments(x, mask, count):
    """(mean, biased variance) of each row of an fp32 [rows, cols] tile held whole (``mask``: its values; ``count``:
    how many a row has). Two-pass with the residual correction: the first mean, sum / count, rounds away from a
    constant row's value (1000.1 * 320 / 320 misses it by 6e-5 in fp32), and the centred squares alone would report
    that rounding as variance (an output of +-1 instead of 0 for a tiny eps); the centred values' own sum corrects
    both."""
    first = tl.sum(x, axis=1) / count
    d = tl.where(mask, x - first[:, None], 0.0)
    residual = tl.sum(d, axis=1)
    mean = first + residual / count
    m2 = tl.sum(d * d, axis=1) - residual * residual / count
    return mean, variance_floor(m2 / count)


#: activation name -> (forward, gradient) jit functions, passed to kernels as constexpr arguments.
ACTIVATIONS = {
    None: (identity, identity_grad),
    "silu": (silu, silu_grad),
    "gelu": (gelu_erf, gelu_erf_grad),
    "gelu_tanh": (gelu_tanh, gelu_tanh_grad),
}


def poison_enabled() -> bool:
    """LDMOPT_POISON_OUTPUTS=1 (set by the tests) fills fresh kernel outputs with NaN so unwritten elements show."""
    return getenv("LDMOPT_POISON_OUTPUTS", "0") == "1"


def new_output(*args, like: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
    """torch.empty / torch.empty_like that poisons floating outputs with NaN when LDMOPT_POISON_OUTPUTS=1."""
    out = torch.empty_like(like, **kwargs) if like is not None else torch.empty(*args, **kwargs)
    if poison_enabled() and out.is_floating_point():
        out.fill_(float("nan"))
    return out


#: what an op's fp32 products follow: PyTorch's convolution ("conv": cuDNN, ``torch.backends.cudnn.allow_tf32``, on by
#: default) or its matmul ("matmul": cuBLAS, nn.Linear, ``torch.set_float32_matmul_precision``, "highest" by default)
FP32_PRECISIONS = ("conv", "matmul")


def torch_fp32_precision(follow: str) -> str:
    """'tf32' or 'ieee': the precision PyTorch's own fp32 ``follow`` op (see FP32_PRECISIONS) uses on a GPU now.

    Reads the per-op settings of torch >= 2.9 (``torch.backends.cudnn.conv.fp32_precision``,
    ``torch.backends.cuda.matmul.fp32_precision``), which the legacy flags set too and whose getters, unlike the
    legacy ones, do not raise once both APIs have been used; 'none' (nothing set) is not TF32. Older torch: the legacy
    flags."""
    if follow == "conv":
        conv = getattr(torch.backends.cudnn, "conv", None)
        tf32 = conv.fp32_precision == "tf32" if conv is not None else torch.backends.cudnn.allow_tf32
    elif follow == "matmul":
        setting = getattr(torch.backends.cuda.matmul, "fp32_precision", None)  # its __getattr__ raises AttributeError
        tf32 = setting == "tf32" if setting is not None else torch.get_float32_matmul_precision() != "highest"
    else:
        raise ValueError(f"fp32_precision={follow!r} is not supported; expected one of {list(FP32_PRECISIONS)}")
    return "tf32" if tf32 else "ieee"


def fp32_dot_precision(dtype: torch.dtype, follow: str) -> str:
    """tl.dot ``input_precision`` for operands of ``dtype``: fp32 ones as PyTorch's ``follow`` op would compute them
    (torch_fp32_precision); 'tf32' otherwise, which tl.dot ignores for fp16/bf16."""
    return torch_fp32_precision(follow) if dtype == torch.float32 else "tf32"


#: Where a tile for fp32 operands compiles clean (no spills, shared memory within the limit): (input precision, arch)
#: pairs, from ptxas for sm_80 and sm_90 (the ahead-of-time gate compiles each pair a tile claims).
FP32_CLEAN_EVERYWHERE = frozenset({("ieee", 80), ("ieee", 90), ("tf32", 80), ("tf32", 90)})


def fp32_archs(clean, precision: str) -> tuple[int, ...]:
    """The archs where a tile claims to compile clean with this tl.dot precision (what the AOT gate compiles)."""
    return tuple(arch for p, arch in sorted(clean) if p == precision)


# What pruning reads about a tile (its lowest arch, the fp32 precisions it is clean for, the conv prologues it serves)
# is kept beside its autotune config, not on it: Triton's autotune disk cache writes each config's __dict__ as JSON
# and rebuilds it as Config(**fields), which a frozenset attribute would fail (TRITON_CACHE_AUTOTUNING=1 then crashed
# the first tuning of every ldmopt kernel on a GPU) and any extra field would too. The tags serve pruning only, which
# runs on the module's own configs before tuning.
_CONFIG_TAGS: dict[int, dict[str, object]] = {}


def tag_config(config: triton.Config, **tags: object) -> triton.Config:
    """``config`` with ``tags`` recorded for :func:`config_tag` (dropped when the config is collected)."""
    if id(config) not in _CONFIG_TAGS:
        _CONFIG_TAGS[id(config)] = {}
        weakref.finalize(config, _CONFIG_TAGS.pop, id(config), None)
    _CONFIG_TAGS[id(config)].update(tags)
    return config


def config_tag(config: triton.Config, name: str, default: object = None) -> object:
    """The tag ``name`` of ``config`` (:func:`tag_config`), else ``default``."""
    return _CONFIG_TAGS.get(id(config), {}).get(name, default)


_AUTOTUNE_CACHES = "cache_results" in inspect.signature(triton.autotune).parameters


def autotune(**kwargs) -> object:
    """``triton.autotune`` that keeps its timings in Triton's disk cache (beside the compiled kernels, keyed by the
    kernel's source, the GPU target, the tuning key and the configs), so a new process reuses the choice instead of
    timing every tile again at its first call of each shape: a patched pipeline's first step no longer autotunes in
    every process. LDMOPT_AUTOTUNE_CACHE=0 (read when each autotuner is made: at import for most kernels, at first
    use for temporal attention's) times every process afresh; the interpreter never caches."""
    if _AUTOTUNE_CACHES and os.environ.get("LDMOPT_AUTOTUNE_CACHE", "1") != "0":
        kwargs.setdefault("cache_results", True)
    return triton.autotune(**kwargs)


def tag_fp32_configs(configs: list, clean: list) -> list:
    """Marks autotune configs as tiles for fp32 operands, each clean at the (precision, arch) pairs given; configs
    without the mark serve 16-bit operands."""
    for config, pairs in zip(configs, clean):
        tag_config(config, fp32_clean=frozenset(pairs))
    return configs


def prune_by_operand_width(configs: list, operand: torch.Tensor, precision: str) -> list:
    """The configs for ``operand``'s width: 16-bit operands take the untagged tiles; fp32 ones the tiles clean for
    this tl.dot precision on this arch (sm_8x reads sm_80's compile, sm_9x and later sm_90's), else any fp32 tile.
    fp32 tiles differ: IEEE products run on the CUDA cores and TF32 ones stage twice the bytes, where the 16-bit
    tiles spill or overflow shared memory. Asked at tuning time, never at import."""
    if operand.device.type != "cuda":
        return configs
    fp32 = [c for c in configs if config_tag(c, "fp32_clean") is not None]
    if operand.element_size() < 4 or not fp32:
        return [c for c in configs if config_tag(c, "fp32_clean") is None] or configs
    arch = 90 if torch.cuda.get_device_capability(operand.device)[0] >= 9 else 80
    return [c for c in fp32 if (precision, arch) in config_tag(c, "fp32_clean")] or fp32


# Host-side launch arithmetic in plain Python: triton.cdiv and triton.next_power_of_2 are constexpr functions in
# Triton 3.8, whose host calls unwrap every argument first (about 2 us a call; a fused conv made ten a call).
def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for positive b."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << (max(1, int(n)) - 1).bit_length()


#: Elements per row tile of the row kernels (adaLN, RMSNorm): 4K fp32 values keep each thread at 16 per live tensor.
ROW_TILE = 4096


def row_tiles(c: int, max_rows: int) -> tuple[int, int, int]:
    """(BLOCK_R, BLOCK_C, num_warps) of a row kernel holding whole rows of ``c``: ~ROW_TILE elements per tile (at most
    ``max_rows`` rows), 16 fp32 values per thread."""
    block_c = next_power_of_2(c)
    block_r = max(1, min(max_rows, ROW_TILE // block_c))
    warps = max(1, min(16, block_r * block_c // 512))
    return block_r, block_c, warps
