"""GPU spec table and the roofline projection used by ``analyze``.

The figures are datasheet peaks (dense, no sparsity) for the SXM parts. A roofline time is a lower bound: each
operator takes ``max(flops / peak_flops, bytes / peak_bandwidth)``; kernel-launch gaps, tail effects, cache reuse
and achievable fractions of peak are not modelled unless ``compute_efficiency`` / ``memory_efficiency`` are set.
Every figure computed from this table is a projection, never a measurement.

Add a GPU: ``register_gpu(GPUSpec("L40S", hbm_bytes_per_s=864e9, matmul_flops={"fp16": 362e12, ...}))``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

_DTYPE_KEYS = {
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.float32: "fp32",
    torch.float64: "fp64",
    getattr(torch, "float8_e4m3fn", None): "fp8",
}


def dtype_key(dtype: torch.dtype | str) -> str:
    """``torch.float16`` or ``"float16"``/``"fp16"``/``"half"`` -> ``"fp16"``."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPE_KEYS:
            raise ValueError(f"dtype {dtype} has no peak in the GPU table (fp16, bf16, fp32, tf32, fp8)")
        return _DTYPE_KEYS[dtype]
    aliases = {"float16": "fp16", "half": "fp16", "bfloat16": "bf16", "float32": "fp32", "float": "fp32"}
    key = aliases.get(dtype.lower(), dtype.lower())
    if key not in ("fp16", "bf16", "fp32", "tf32", "fp8", "fp64"):
        raise ValueError(f"unknown dtype {dtype!r}; expected one of fp16, bf16, fp32, tf32, fp8, fp64")
    return key


@dataclass(frozen=True)
class GPUSpec:
    """Peak rates of one GPU. ``matmul_flops`` are tensor-core rates by operand type ("fp32" means the plain
    CUDA-core rate, "tf32" the TF32 tensor-core rate); ``vector_flops`` is the fp32 CUDA-core rate."""

    name: str
    hbm_bytes_per_s: float
    matmul_flops: dict[str, float]
    vector_flops: float
    memory_gib: float = 0.0
    source: str = ""
    compute_efficiency: float = 1.0  # fraction of peak FLOP/s assumed attainable
    memory_efficiency: float = 1.0  # fraction of peak bandwidth assumed attainable
    notes: tuple[str, ...] = field(default=())

    def peak_flops(self, dtype: str) -> float:
        rate = self.matmul_flops.get(dtype)
        if rate is None:
            raise ValueError(f"{self.name} has no matmul peak for {dtype}; known: {sorted(self.matmul_flops)}")
        return rate * self.compute_efficiency

    @property
    def bandwidth(self) -> float:
        return self.hbm_bytes_per_s * self.memory_efficiency

    def op_time(self, flops: float, nbytes: float, dtype: str) -> float:
        """Roofline time of one operator (seconds)."""
        compute = flops / self.peak_flops(dtype) if flops else 0.0
        return max(compute, nbytes / self.bandwidth)

    def ridge(self, dtype: str) -> float:
        """Arithmetic intensity (FLOP/byte) above which an operator is compute-bound."""
        return self.peak_flops(dtype) / self.bandwidth


_HOPPER_MATMUL = {"fp16": 989.4e12, "bf16": 989.4e12, "tf32": 494.7e12, "fp8": 1978.9e12, "fp32": 66.9e12}
GPUS: dict[str, GPUSpec] = {
    "A100": GPUSpec(
        "A100",
        hbm_bytes_per_s=2.039e12,
        matmul_flops={"fp16": 312e12, "bf16": 312e12, "tf32": 156e12, "fp32": 19.5e12, "fp64": 19.5e12},
        vector_flops=19.5e12,
        memory_gib=80,
        source="NVIDIA A100 datasheet (SXM4 80GB)",
    ),
    "H100": GPUSpec(
        "H100",
        hbm_bytes_per_s=3.35e12,
        matmul_flops={**_HOPPER_MATMUL, "fp64": 66.9e12},
        vector_flops=66.9e12,
        memory_gib=80,
        source="NVIDIA H100 datasheet (SXM5 80GB)",
    ),
    "H200": GPUSpec(
        "H200",
        hbm_bytes_per_s=4.8e12,
        matmul_flops={**_HOPPER_MATMUL, "fp64": 66.9e12},
        vector_flops=66.9e12,
        memory_gib=141,
        source="NVIDIA H200 datasheet (SXM 141GB)",
    ),
}


def register_gpu(spec: GPUSpec) -> None:
    """Add or replace a GPU in the table (name lookup is case-insensitive)."""
    GPUS[spec.name] = spec


def get_gpu(gpu: str | GPUSpec) -> GPUSpec:
    """The table's GPUSpec named ``gpu`` (case-insensitive; a GPUSpec is returned as is); KeyError if none."""
    if isinstance(gpu, GPUSpec):
        return gpu
    for name, spec in GPUS.items():
        if name.lower() == gpu.lower():
            return spec
    raise KeyError(f"unknown GPU {gpu!r}; the table has {', '.join(GPUS)} (add one with register_gpu)")
