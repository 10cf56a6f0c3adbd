"""Build and drive the CPU emulator of the ldmopt._C kernels (cuda_emu.h + emu_entry.cpp) through ctypes.

The kernel sources in csrc/ are compiled by the host C++ compiler with -DLDMOPT_EMULATE; each CUDA thread runs as a
fiber, so the real launch code and kernels execute on CPU tensors. Needs g++ (C++20) and the CUDA headers
cuda_fp16.h / cuda_bf16.h (from CUDA_HOME or torch's nvidia/cu13 wheel); no GPU, no torch extension build.
"""

from __future__ import annotations

import ctypes
import os
import shutil
from pathlib import Path

import torch

from tests.support.compile_cached import compile_cached

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
_TA_PLAN_FIELDS = ("f_pad", "d_pad", "per_block", "smem_bytes", "blocks", "static_smem_bytes")


def cuda_include_dir() -> Path | None:
    """A directory holding cuda_fp16.h: $CUDA_HOME/include, /usr/local/cuda/include or torch's nvidia wheel."""
    candidates = [Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "include", Path("/usr/local/cuda/include")]
    site = Path(torch.__file__).resolve().parents[1]
    candidates += [site / "nvidia" / sub / "include" for sub in ("cu13", "cu12")]
    return next((c for c in candidates if (c / "cuda_fp16.h").is_file()), None)


def unavailable_reason() -> str | None:
    if shutil.which("g++") is None:
        return "g++ not found (the kernel emulator is compiled with the host C++ compiler)"
    if cuda_include_dir() is None:
        return "cuda_fp16.h not found (set CUDA_HOME or install torch's nvidia cu13 wheel)"
    return None


def _sources() -> list[Path]:
    return sorted([*(ROOT / "csrc").rglob("*"), HERE / "cuda_emu.h", HERE / "emu_entry.cpp"])


#: Set (to any value) in a process started with libasan preloaded: the emulator is built with AddressSanitizer, which
#: also guards the kernels' static ``__shared__`` arrays (function-local statics here), where the dynamic shared
#: memory's guard bytes (cuda_emu.h) do not reach (test_emulated_asan.py).
ASAN_ENV = "LDMOPT_EMU_ASAN"


def build() -> ctypes.CDLL:
    """Compile (cached by a hash of the sources) and load the emulator library."""
    sanitize = ["-fsanitize=address", "-fno-omit-frame-pointer"] if os.environ.get(ASAN_ENV) else []

    def command(out: Path) -> list[str]:
        return [
            "g++", "-std=c++20", "-O1", "-fPIC", "-shared", "-DLDMOPT_EMULATE", *sanitize,
            f"-I{ROOT / 'csrc'}", f"-I{HERE}", f"-I{cuda_include_dir()}",
            "-x", "c++", str(HERE / "emu_entry.cpp"), "-o", str(out),
        ]  # fmt: skip

    lib = ctypes.CDLL(str(compile_cached("emu-asan" if sanitize else "emu", _sources(), command)))
    lib.emu_last_error.restype = ctypes.c_char_p
    return lib


def misaligned(x: torch.Tensor) -> torch.Tensor:
    """A copy of x at a storage offset of one element: not 16-byte aligned, so the kernels' scalar path runs."""
    buf = torch.empty(x.numel() + 1, dtype=x.dtype)
    y = buf[1:].as_strided(x.shape, x.stride())
    y.copy_(x)
    return y


def _step(t: torch.Tensor, dim: int) -> int:
    """A stride as the torch glue passes it: 0 along a dimension of size 1 (never stepped over)."""
    return t.stride(dim) if t.shape[dim] > 1 else 0


def _ptr(t: torch.Tensor | None) -> ctypes.c_void_p | None:
    return None if t is None else ctypes.c_void_p(t.data_ptr())


def _affine(weight, bias):
    """weight and bias in their own dtype (fp32/fp16/bf16, as the kernels read them) and their dtype codes."""
    w = None if weight is None else weight.contiguous()
    b = None if bias is None else bias.contiguous()
    codes = (ctypes.c_int * 2)(*(0 if t is None else DTYPE_CODES[t.dtype] for t in (w, b)))
    return w, b, codes


class Emulator:
    """Python wrappers with the argument conventions of the ldmopt._C ops."""

    def __init__(self, lib: ctypes.CDLL):
        self.lib = lib
        self.last_plan: dict = {}

    def _check(self, rc: int) -> None:
        if rc != 0:
            raise RuntimeError(self.lib.emu_last_error().decode())

    def reverse_schedule(self, reverse: bool) -> None:
        self.lib.emu_set_reverse_schedule(int(reverse))

    @staticmethod
    def _ncs(x: torch.Tensor) -> tuple[int, int, int, bool]:
        n, c = x.shape[:2]
        return n, c, x.numel() // (n * c), not x.is_contiguous()

    def group_norm_fwd(self, x, weight, bias, num_groups: int, eps: float, activation: str):
        """(y, mean, rstd) like torch.ops.ldmopt.group_norm_fwd_cuda; y has x's strides, outputs poisoned first."""
        n, c, s, channels_last = self._ncs(x)
        y = torch.empty_like(x).fill_(float("nan"))
        mean = torch.full((n, num_groups), float("nan"))
        rstd = torch.full((n, num_groups), float("nan"))
        w, b, affine = _affine(weight, bias)
        dims = (ctypes.c_int64 * 4)(n, c, s, num_groups)
        plan = (ctypes.c_int64 * 5)()
        self._check(
            self.lib.emu_group_norm_forward(
                dims, int(channels_last), DTYPE_CODES[x.dtype], int(activation == "silu"), _ptr(x), _ptr(y),
                _ptr(w), _ptr(b), affine, _ptr(mean), _ptr(rstd), ctypes.c_float(eps), plan,
            )
        )  # fmt: skip
        self.last_plan = dict(zip(("vec", "s_per_chunk", "n_chunks", "tc", "n_cblocks"), list(plan)))
        return y, mean, rstd

    def group_norm_stats(self, x, num_groups: int, eps: float):
        """(mean, rstd) like torch.ops.ldmopt.group_norm_stats_cuda, poisoned first."""
        n, c, s, channels_last = self._ncs(x)
        mean = torch.full((n, num_groups), float("nan"))
        rstd = torch.full((n, num_groups), float("nan"))
        dims = (ctypes.c_int64 * 4)(n, c, s, num_groups)
        plan = (ctypes.c_int64 * 5)()
        self._check(
            self.lib.emu_group_norm_statistics(
                dims, int(channels_last), DTYPE_CODES[x.dtype], _ptr(x), _ptr(mean), _ptr(rstd), ctypes.c_float(eps),
                plan,
            )
        )  # fmt: skip
        self.last_plan = dict(zip(("vec", "s_per_chunk", "n_chunks", "tc", "n_cblocks"), list(plan)))
        return mean, rstd

    def group_norm_stats_parts(self, x, x_tail, num_groups: int, eps: float):
        """(mean, rstd) over cat([x, x_tail], 1) like torch.ops.ldmopt.group_norm_stats_cuda with x_tail
        (channels-last parts), poisoned first."""
        n, c_head, h, w_ = x.shape
        c = c_head + x_tail.shape[1]
        mean = torch.full((n, num_groups), float("nan"))
        rstd = torch.full((n, num_groups), float("nan"))
        dims = (ctypes.c_int64 * 4)(n, c, h * w_, num_groups)
        plan = (ctypes.c_int64 * 5)()
        self._check(
            self.lib.emu_group_norm_statistics_parts(
                dims, ctypes.c_int64(c_head), DTYPE_CODES[x.dtype], _ptr(x), _ptr(x_tail), _ptr(mean), _ptr(rstd),
                ctypes.c_float(eps), plan,
            )
        )  # fmt: skip
        self.last_plan = dict(zip(("vec", "s_per_chunk", "n_chunks", "tc", "n_cblocks"), list(plan)))
        return mean, rstd

    def group_norm_apply(self, x, mean, rstd, weight, bias, num_groups: int, activation: str):
        """y like torch.ops.ldmopt.group_norm_apply_cuda (x's strides), poisoned first."""
        n, c, s, channels_last = self._ncs(x)
        y = torch.empty_like(x).fill_(float("nan"))
        w, b, affine = _affine(weight, bias)
        mean, rstd = mean.float().contiguous(), rstd.float().contiguous()
        dims = (ctypes.c_int64 * 4)(n, c, s, num_groups)
        plan = (ctypes.c_int64 * 5)()
        self._check(
            self.lib.emu_group_norm_apply(
                dims, int(channels_last), DTYPE_CODES[x.dtype], int(activation == "silu"), _ptr(x), _ptr(y),
                _ptr(w), _ptr(b), affine, _ptr(mean), _ptr(rstd), plan,
            )
        )  # fmt: skip
        self.last_plan = dict(zip(("vec", "s_per_chunk", "n_chunks", "tc", "n_cblocks"), list(plan)))
        return y

    def group_norm_apply_parts(self, x, x_tail, mean, rstd, weight, bias, num_groups: int, activation: str):
        """y over cat([x, x_tail], 1) like torch.ops.ldmopt.group_norm_apply_cuda with x_tail (channels-last parts
        in, channels-last y out), poisoned first."""
        n, c_head, h, w_ = x.shape
        c = c_head + x_tail.shape[1]
        y = torch.empty((n, c, h, w_), dtype=x.dtype, memory_format=torch.channels_last).fill_(float("nan"))
        wt, b, affine = _affine(weight, bias)
        mean, rstd = mean.float().contiguous(), rstd.float().contiguous()
        dims = (ctypes.c_int64 * 4)(n, c, h * w_, num_groups)
        plan = (ctypes.c_int64 * 5)()
        self._check(
            self.lib.emu_group_norm_apply_parts(
                dims, ctypes.c_int64(c_head), DTYPE_CODES[x.dtype], int(activation == "silu"), _ptr(x),
                _ptr(x_tail), _ptr(y), _ptr(wt), _ptr(b), affine, _ptr(mean), _ptr(rstd), plan,
            )
        )  # fmt: skip
        self.last_plan = dict(zip(("vec", "s_per_chunk", "n_chunks", "tc", "n_cblocks"), list(plan)))
        return y

    def group_norm_bwd(self, dy, x, weight, bias, mean, rstd, num_groups: int, activation: str):
        """(dx, dweight, dbias) like torch.ops.ldmopt.group_norm_bwd_cuda (dy must have x's strides here)."""
        n, c, s, channels_last = self._ncs(x)
        assert dy.stride() == x.stride()
        dx = torch.empty_like(x).fill_(float("nan"))
        sums = torch.full((2, n, c), float("nan"))
        w, b, affine = _affine(weight, bias)
        dims = (ctypes.c_int64 * 4)(n, c, s, num_groups)
        plan = (ctypes.c_int64 * 5)()
        self._check(
            self.lib.emu_group_norm_backward(
                dims, int(channels_last), DTYPE_CODES[x.dtype], int(activation == "silu"), _ptr(dy), _ptr(x),
                _ptr(dx), _ptr(w), _ptr(b), affine, _ptr(mean), _ptr(rstd), _ptr(sums[0]), _ptr(sums[1]), plan,
            )
        )  # fmt: skip
        self.last_plan = dict(zip(("vec", "s_per_chunk", "n_chunks", "tc", "n_cblocks"), list(plan)))
        return dx, sums[1].sum(0), sums[0].sum(0)

    def layer_norm_stats(self, x, eps: float):
        """stats [2, M] like torch.ops.ldmopt.layer_norm_stats_cuda (x [M, C], unit column stride), poisoned first."""
        m, c = x.shape
        assert c == 1 or x.stride(1) == 1
        stats = torch.full((2, m), float("nan"))
        dims = (ctypes.c_int64 * 3)(m, c, x.stride(0) if m > 1 else c)
        plan = (ctypes.c_int64 * 1)()
        self._check(
            self.lib.emu_layer_norm_statistics(
                dims, DTYPE_CODES[x.dtype], _ptr(x), _ptr(stats), ctypes.c_float(eps), plan
            )
        )
        self.last_plan = {"vec": plan[0]}
        return stats

    def layer_norm_apply(self, x, stats, weight, bias, positions=None, position_rows: int = 1):
        """h [M, C] in x's dtype like torch.ops.ldmopt.layer_norm_apply_cuda (x unit column stride), poisoned first."""
        m, c = x.shape
        assert c == 1 or x.stride(1) == 1
        h = torch.full((m, c), float("nan"), dtype=x.dtype)
        w, b, affine = _affine(weight, bias)
        p = 0 if positions is None else positions.shape[0]
        pos_stride = 0 if positions is None else (positions.stride(0) if p > 1 else c)
        dims = (ctypes.c_int64 * 6)(m, c, x.stride(0) if m > 1 else c, p, pos_stride, position_rows)
        plan = (ctypes.c_int64 * 1)()
        stats = stats.contiguous()  # held until the call returns: the kernel reads its memory
        self._check(
            self.lib.emu_layer_norm_apply(
                dims, DTYPE_CODES[x.dtype], _ptr(x), _ptr(stats), _ptr(w), _ptr(b), affine,
                _ptr(positions), _ptr(h), plan,
            )
        )  # fmt: skip
        self.last_plan = {"vec": plan[0]}
        return h

    def linear_epilogue(self, z, activation, gate=None, residual=None, *, glu=False, saturate=False, y=None,
                        stats=False, eps=1e-5, write=True):  # fmt: skip
        """(y, stats) like torch.ops.ldmopt.linear_epilogue_cuda: y a fresh poisoned [M, N] unless given (z itself:
        in place), stats a poisoned [2, M] when asked (else None). Strides as the torch glue passes them."""
        m = z.shape[0]
        n = z.shape[1] // 2 if glu else z.shape[1]
        if write and y is None:
            y = torch.full((m, n), float("nan"), dtype=z.dtype)
        out_stats = torch.full((2, m), float("nan")) if stats else None

        res_rows, res_sample, res_row = max(m, 1), 0, 0
        if residual is not None and residual.dim() == 3:
            res_rows, res_sample, res_row = residual.shape[1], _step(residual, 0), _step(residual, 1)
        elif residual is not None:
            res_row = _step(residual, 0)
        dims = (ctypes.c_int64 * 9)(
            m, n, _step(z, 0), _step(y, 0) if write else 0, _step(gate, 0) if gate is not None else 0,
            max(m // gate.shape[0], 1) if gate is not None else 1, res_sample, res_row, res_rows,
        )  # fmt: skip
        codes = {None: 0, "silu": 1, "gelu": 2, "gelu_tanh": 3}
        flags = (ctypes.c_int * 4)(codes[activation], int(glu), int(saturate), int(write))
        plan = (ctypes.c_int64 * 1)()
        self._check(
            self.lib.emu_linear_epilogue(
                dims, DTYPE_CODES[z.dtype], flags, ctypes.c_float(torch.finfo(z.dtype).max), ctypes.c_float(eps),
                _ptr(z), _ptr(y) if write else None, _ptr(gate), _ptr(residual), _ptr(out_stats), plan,
            )
        )  # fmt: skip
        self.last_plan = {"vec": plan[0]}
        return y, out_stats

    def adaln_modulate(self, x, scale, shift, residual=None, gate=None, eps=1e-6, store_sum=False, save=False):
        """(y, s, mean, rstd) like torch.ops.ldmopt.adaln_modulate_cuda (its checks are the torch glue's: the inputs
        here are what it accepts), outputs poisoned first; s, mean and rstd empty unless asked."""
        m, c = x.shape

        y = torch.full((m, c), float("nan"), dtype=x.dtype)
        s = torch.full((m, c), float("nan"), dtype=x.dtype) if store_sum else torch.empty(0, dtype=x.dtype)
        mean = torch.full((m,), float("nan")) if save else torch.empty(0)
        rstd = torch.full((m,), float("nan")) if save else torch.empty(0)
        params = (scale, shift, gate)
        dims = (ctypes.c_int64 * 5)(m, c, max(m // scale.shape[0], 1), _step(x, 0),
                                    _step(residual, 0) if residual is not None else 0)  # fmt: skip
        flags = (ctypes.c_int * 4)(int(residual is not None), int(gate is not None), int(store_sum), int(save))
        pointers = (ctypes.c_void_p * 3)(*(None if t is None else t.data_ptr() for t in params))
        codes = (ctypes.c_int * 3)(*(0 if t is None else DTYPE_CODES[t.dtype] for t in params))
        row_bytes = (ctypes.c_int64 * 3)(*(0 if t is None else _step(t, 0) * t.element_size() for t in params))
        plan = (ctypes.c_int64 * 1)()
        self._check(
            self.lib.emu_adaln_modulate(
                dims, DTYPE_CODES[x.dtype], flags, ctypes.c_float(eps), _ptr(x), _ptr(residual), pointers, codes,
                row_bytes, _ptr(y), _ptr(s) if store_sum else None, _ptr(mean) if save else None,
                _ptr(rstd) if save else None, plan,
            )
        )  # fmt: skip
        self.last_plan = {"vec": plan[0]}
        return y, s, mean, rstd

    def conv_epilogue(self, z, shortcut=None, residual=None, temb=None, gate=None, *, inv_scale=1.0, write=True,
                      groups=0, channel_sums=False, eps=1e-5):  # fmt: skip
        """(mean, rstd, sums) like torch.ops.ldmopt.conv_epilogue_cuda, z [N, C, OH, OW] (channels-last, pixels at one
        stride) written in place; the outputs poisoned first. The packed path where the torch glue would take it.
        temb [N, C] or per output row [N, C, OH]; gate [N, 1] or [N, OH] fp32."""
        n, c, oh, ow = z.shape

        def rows(t):
            if t is None:
                return 0, 0
            return (t.stride(0) if n > 1 else 0), (t.stride(3) if ow > 1 else (t.stride(2) if oh > 1 else c))

        temb_strides = [0, 0] if temb is None else [temb.stride(0) if n > 1 else 0]
        if temb is not None:
            temb_strides.append(temb.stride(2) if temb.dim() == 3 and oh > 1 else 0)
        strides = [*rows(z), *rows(shortcut), *rows(residual), *temb_strides]
        gate_strides = (
            [0, 0] if gate is None else [gate.stride(0) if n > 1 else 0, gate.stride(1) if gate.shape[1] > 1 else 0]
        )
        pack = 16 // z.element_size()
        aligned = all(t is None or t.data_ptr() % 16 == 0 for t in (z, shortcut, residual, temb))
        packable = aligned and all(s % pack == 0 for s in strides)
        mean = torch.full((n, groups), float("nan"))
        rstd = torch.full((n, groups), float("nan"))
        sums = torch.full((n, c if channel_sums else 0, 2), float("nan"), dtype=torch.float64)
        plan = (ctypes.c_int64 * 4)()
        self._check(
            self.lib.emu_conv_epilogue(
                (ctypes.c_int64 * 5)(n, oh * ow, c, groups, ow), DTYPE_CODES[z.dtype],
                (ctypes.c_int64 * 10)(*strides, *gate_strides), (ctypes.c_int * 3)(int(write), int(channel_sums),
                int(packable)), ctypes.c_float(inv_scale), ctypes.c_float(eps), _ptr(z), _ptr(shortcut),
                _ptr(residual), _ptr(temb), _ptr(gate), _ptr(mean), _ptr(rstd), _ptr(sums) if channel_sums else None,
                plan,
            )
        )  # fmt: skip
        self.last_plan = dict(zip(("vec", "channel_tiles", "chunks", "chunk_pixels"), list(plan)))
        return mean, rstd, sums

    def group_norm_stats_from_sums(self, sums, num_groups: int, eps: float, count: int, sums_tail=None, frames=1):
        """(mean, rstd) [N / frames, G] like torch.ops.ldmopt.group_norm_stats_from_sums_cuda, poisoned first."""
        n, c_head = sums.shape[:2]
        c = c_head + (0 if sums_tail is None else sums_tail.shape[1])
        mean = torch.full((n // frames, num_groups), float("nan"))
        rstd = torch.full((n // frames, num_groups), float("nan"))
        dims = (ctypes.c_int64 * 6)(n, c_head, c, num_groups, frames, count)
        head = sums.contiguous()  # held until the call returns: the kernel reads their memory
        tail = None if sums_tail is None else sums_tail.contiguous()
        self._check(
            self.lib.emu_group_norm_stats_from_sums(
                dims, ctypes.c_float(eps), _ptr(head), _ptr(tail), _ptr(mean), _ptr(rstd)
            )
        )
        return mean, rstd

    def temporal_attention_plan(self, shape, dtype) -> dict:
        """make_plan's fields for (B, F, N, H, D) inputs of ``dtype``, computed on the host; no kernel runs."""
        plan = (ctypes.c_int64 * len(_TA_PLAN_FIELDS))()
        self._check(self.lib.emu_temporal_attention_plan((ctypes.c_int64 * 5)(*shape), DTYPE_CODES[dtype], plan))
        return dict(zip(_TA_PLAN_FIELDS, list(plan)))

    def temporal_attention_fwd(self, q, k, v, scale: float, out=None):
        """out like torch.ops.ldmopt.temporal_attention_fwd_cuda (torch.empty_like(q)) or written into ``out`` like
        temporal_attention_fwd_out_cuda; poisoned first."""
        out = torch.empty_like(q) if out is None else out
        out.fill_(float("nan"))
        dims = (ctypes.c_int64 * 5)(*q.shape)
        strides = (ctypes.c_int64 * 20)(*q.stride(), *k.stride(), *v.stride(), *out.stride())
        plan = (ctypes.c_int64 * len(_TA_PLAN_FIELDS))()
        self._check(
            self.lib.emu_temporal_attention_forward(
                dims, DTYPE_CODES[q.dtype], ctypes.c_float(scale), _ptr(q), _ptr(k), _ptr(v), _ptr(out), strides,
                plan,
            )
        )  # fmt: skip
        self.last_plan = dict(zip(_TA_PLAN_FIELDS, list(plan)))
        return out
