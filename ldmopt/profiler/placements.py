"""Which placement of ldmopt's fused conv and GEMMs the patched projection (fusions.py) models.

"auto" (the default): what ldmopt runs by default on the device the analysis targets, a GPU ("cuda": ``analyze``
projects on a GPU spec): each fused conv's placement from ``ops.gn_conv2d_prologue.choose_placement`` ("cudnn",
or "loader" where the loader normalises each element fewer than 3 times), each fused GEMM's from
``ops.linear_cublas.gemm_placement`` ("cublas"), the bias + GELU-tanh GEMMs' from ``linear_cublas.cublaslt_gelu``.
The ops' own functions decide, so ``LDMOPT_GN_CONV_PROLOGUE``, ``LDMOPT_GEMM_PLACEMENT`` and ``LDMOPT_GEMM_GELU``
set in the environment change the projection as they change the run; no GPU is queried.
"triton": ldmopt's Triton kernels everywhere (conv "loader", GEMM "triton"), which the CPU runs: what a patch would
save at most.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

PLACEMENTS = ("auto", "triton")


@dataclass
class Placements:
    """The placements one projection models; ``used`` counts the fused sites per (kind, placement) it modelled."""

    mode: str = "triton"
    device: str = "cuda"
    training: bool = False
    used: Counter = field(default_factory=Counter)

    def __post_init__(self) -> None:
        if self.mode not in PLACEMENTS:
            raise ValueError(f"placement {self.mode!r}: expected one of {', '.join(PLACEMENTS)}")

    def conv(self, kernel: tuple[int, ...], c_out: int, stride: int, normalize: bool, linear: bool = False) -> str:
        """ "loader", "staged" or "cudnn" for one fused conv (a GEMM read as a 1x1 conv: ``linear``)."""
        if self.mode == "triton":
            return "loader"
        import torch

        from ..ops.gn_conv2d_prologue import choose_placement

        return choose_placement(torch.device(self.device), tuple(kernel[:2]), c_out, stride, "none", normalize, linear)

    def gemm(self, blend: bool = False) -> str:
        """ "triton" or "cublas" for a fused GEMM; ``blend``: its input is SVD's blend, formed in the Triton GEMM's
        loads only (the op keeps that GEMM Triton's under either placement)."""
        if self.mode == "triton":
            return "triton"
        import torch

        from ..ops.linear_cublas import gemm_placement

        return gemm_placement(torch.device(self.device), blend)

    def cublaslt_gelu(self, bias: bool) -> bool:
        """Whether a cublas GEMM + GELU-tanh applies GELU in cuBLASLt's epilogue (no pass)."""
        from ..ops.linear_cublas import cublaslt_gelu

        return cublaslt_gelu(self.device, bias, self.training)

    def count(self, kind: str, placement: str) -> str:
        self.used[(kind, placement)] += 1
        return placement

    def summary(self) -> dict:
        """For JSON: the mode, the device, the sites per placement, and the overrides in the environment."""
        from .._env import getenv
        from ..ops import gn_conv2d_prologue, linear_cublas

        by_kind: dict[str, dict[str, int]] = {}
        for (kind, placement), n in sorted(self.used.items()):
            by_kind.setdefault(kind, {})[placement] = n
        envs = (gn_conv2d_prologue.ENV, linear_cublas.ENV, linear_cublas.GELU_ENV)
        overrides = {env: getenv(env) for env in envs if getenv(env)} if self.mode == "auto" else {}
        return {"mode": self.mode, "device": self.device, "sites": by_kind, "overrides": overrides}

    def describe(self) -> str:
        """One line naming what the projection modelled."""
        what = "the GPU defaults" if self.mode == "auto" else "ldmopt's Triton kernels (the CPU's placement)"
        parts = []
        for kind in ("conv", "GEMM"):
            sites = sorted(((p, n) for (k, p), n in self.used.items() if k == kind), key=lambda pn: -pn[1])
            if sites:
                parts.append(f"{kind} " + ", ".join(f"'{p}' ({n} sites)" for p, n in sites))
        summary = self.summary()
        overrides = "".join(f", {k}={v}" for k, v in summary["overrides"].items())
        return f"patched projected for {what} (placement '{self.mode}'{overrides}): " + ("; ".join(parts) or "none")
