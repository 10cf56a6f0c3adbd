"""Register, shared-memory and spill report of every kernel in the built ldmopt._C, per GPU architecture.

Runs ``cuobjdump --dump-resource-usage`` on the extension library (cuobjdump from $CUDA_HOME/bin, PATH, or the
copy Triton ships under triton/backends/nvidia/bin). Usage: ``python -m tests.csrc.resource_report [LIBRARY.so]``.
LOCAL is per-thread local memory (register spills, or arrays the compiler could not keep in registers).
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class KernelUsage:
    arch: str
    name: str  # demangled, anonymous-namespace hashes removed
    registers: int
    shared: int
    local: int
    stack: int


def find_cuobjdump() -> str | None:
    candidates = [Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "bin" / "cuobjdump"]
    found = shutil.which("cuobjdump")
    if found:
        candidates.append(Path(found))
    spec = importlib.util.find_spec("triton")
    if spec is not None and spec.origin is not None:
        candidates.append(Path(spec.origin).parent / "backends" / "nvidia" / "bin" / "cuobjdump")
    return next((str(c) for c in candidates if c.is_file() and os.access(c, os.X_OK)), None)


def extension_path() -> str | None:
    """Path of the built ldmopt._C library, found without importing it."""
    spec = importlib.util.find_spec("ldmopt._C")
    return None if spec is None else spec.origin


def _demangle(names: list[str]) -> list[str]:
    if shutil.which("c++filt") is None:
        return names
    out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True, check=True).stdout
    pretty = out.splitlines()
    if len(pretty) != len(names):
        return names
    # "(anonymous namespace)::" and the signature add nothing to the report.
    return [re.sub(r"\(.*\)$", "", p.replace("(anonymous namespace)::", "")) for p in pretty]


def resource_usage(library: str, cuobjdump: str) -> list[KernelUsage]:
    text = subprocess.run(
        [cuobjdump, "--dump-resource-usage", library], capture_output=True, text=True, check=True
    ).stdout
    rows = []
    arch = None
    name = None
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("arch = "):
            arch = line.split("=", 1)[1].strip()
        elif line.startswith("Function "):
            name = line[len("Function ") :].rstrip(":")
        elif line.startswith("REG:") and name is not None:
            fields = dict(re.findall(r"(\w+):(\d+)", line))
            rows.append(
                (arch, name, int(fields["REG"]), int(fields["SHARED"]), int(fields["LOCAL"]), int(fields["STACK"]))
            )
            name = None
    pretty = _demangle([r[1] for r in rows])
    return [KernelUsage(r[0], p, *r[2:]) for r, p in zip(rows, pretty)]


def format_report(usage: list[KernelUsage]) -> str:
    lines = [f"{'arch':<6} {'reg':>4} {'smem':>6} {'local':>5} {'stack':>5}  kernel"]
    for u in sorted(usage, key=lambda u: (u.arch, u.name)):
        lines.append(f"{u.arch:<6} {u.registers:>4} {u.shared:>6} {u.local:>5} {u.stack:>5}  {u.name}")
    spills = [u for u in usage if u.local or u.stack]
    arches = sorted({u.arch for u in usage})
    lines.append(
        f"{len(usage)} kernels on {', '.join(arches)}; max registers {max(u.registers for u in usage)}; "
        f"{len(spills)} with local memory or stack"
    )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    library = argv[1] if len(argv) > 1 else extension_path()
    cuobjdump = find_cuobjdump()
    if library is None:
        print("ldmopt._C is not built (pip install --no-build-isolation -e . with nvcc and CUDA_HOME)")
        return 1
    if cuobjdump is None:
        print("cuobjdump not found (CUDA_HOME/bin, PATH, triton/backends/nvidia/bin)")
        return 1
    print(f"{library}\n{cuobjdump}")
    print(format_report(resource_usage(library, cuobjdump)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
