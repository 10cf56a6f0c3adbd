"""Ahead-of-time compile gate: every Triton kernel compiles for sm_80 and sm_90 without a GPU, with no register
spills and shared memory within the target's limit. Each record also names the tensor-core instruction the compiler
chose (wgmma / mma.sync), the widest global load (16 bytes for a vectorised streaming kernel) and the most barriers in
one loop body (none for a streaming statistics loop), and for a tensor-core kernel its main loop's issue cycles over
its MMA cycles (read from the SASS: above 1 the loop waits on instruction issue, not on the tensor cores), which the
tests check per kernel family. These are static estimates of what a GPU would show, not measurements.

Each module of ``ldmopt.kernels`` exposes ``aot_specs()``: representative configurations (signature, constexprs,
num_warps, num_stages, and the divisibility Triton specialises at run time: ``attrs`` or ``divisible_by_16``).
Run ``python -m ldmopt.aot`` (or ``ldmopt info --kernels``) for the report; ``--json`` for machines. Must run
without TRITON_INTERPRET=1 (interpreted kernels cannot be compiled).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import pkgutil
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass

#: Maximum dynamic shared memory per block (bytes) by compute capability.
SHARED_MEMORY_LIMIT = {80: 166_912, 86: 101_376, 89: 101_376, 90: 232_448}
TARGETS = (80, 90)


@dataclass
class CompileRecord:
    kernel: str
    arch: int
    registers: int
    shared_bytes: int
    spill_bytes: int
    ok: bool
    problem: str = ""
    #: the tensor-core instruction family in the PTX: "wgmma" (Hopper warpgroup MMA), "mma" (Ampere mma.sync) or
    #: "" (none: CUDA-core kernels, or fp32 dots kept in IEEE precision)
    mma: str = ""
    #: the widest global-memory read one thread issues, in bytes (ld.global or cp.async): 16 is a full 128-bit
    #: vector; 2 or 4 for fp16 data means scalar loads, several times the instructions for the same bytes
    load_bytes: int = 0
    #: the most barriers (bar.sync) in one loop body: a reduction that crosses warps on every tile puts shared-memory
    #: round trips and barriers between one tile's loads and the next; streaming statistics loops should have none
    loop_barriers: int = 0
    #: the tensor-core main loop in the SASS (the loop with the most HGMMA/HMMA): instructions per warp per iteration,
    #: and how many of them are MMAs (0, 0 without one)
    mma_loop_instructions: int = 0
    mma_loop_mmas: int = 0
    #: that loop's issue cycles (num_warps x instructions / 4 schedulers) over its tensor-core cycles (the tile's MMA
    #: FLOPs at the arch's dense rate per SM and cycle): above 1 the loop waits on instruction issue, not on the MMA
    mma_loop_issue_ratio: float = 0.0


def kernel_modules() -> list[str]:
    import ldmopt.kernels as pkg

    return sorted(f"ldmopt.kernels.{m.name}" for m in pkgutil.iter_modules(pkg.__path__) if not m.name.startswith("_"))


def _tool(name: str) -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def _cuobjdump(cubin: bytes, flag: str) -> str:
    """cuobjdump's output for a cubin (it reads files only)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([_tool("cuobjdump"), flag, f.name], capture_output=True, text=True, check=True).stdout


def _resource_usage(cubin: bytes) -> tuple[int, int]:
    """(registers, spill bytes per thread) of the kernel in a cubin, read with cuobjdump.

    ptxas places spills in the stack frame (cuobjdump's STACK), not always in LOCAL: both count as spills here.
    """
    out = _cuobjdump(cubin, "--dump-resource-usage")
    regs = int(re.search(r"REG:(\d+)", out).group(1))
    local = int(re.search(r"LOCAL:(\d+)", out).group(1))
    stack = int(re.search(r"STACK:(\d+)", out).group(1))
    return regs, local + stack


def tensor_core_instruction(ptx: str) -> str:
    """Which MMA the compiler chose. On sm_90 a GEMM tile that lowers to mma.sync instead of wgmma runs at a
    fraction of the tensor-core rate, and nothing else in the compile output shows it."""
    if "wgmma.mma_async" in ptx:
        return "wgmma"
    return "mma" if re.search(r"\bmma\.sync\.aligned", ptx) else ""


# ld[.volatile|.relaxed.gpu|...].global[.nc|.L1::evict_last|...][.v2|.v4|.v8].<type><bits>[x2]
_LD_GLOBAL = re.compile(r"\bld(?:\.\w+)*?\.global(?:\.[\w:]+)*?\.(?:v(\d)\.)?[bfsu](\d+)(x2)?\s")
# cp.async.ca|cg.shared[::cta].global[.L2::128B|...] [dst], [src], <bytes>
_CP_ASYNC = re.compile(
    r"\bcp\.async\.c[ag]\.shared(?:::\w+)?\.global(?:\.[\w:]+)*\s+\[[^\]]*\],\s*\[[^\]]*\],\s*(0x[0-9a-fA-F]+|\d+)"
)
# TMA loads copy global -> shared (stores run shared -> global and do not count)
_TMA_LOAD = re.compile(r"\bcp\.async\.bulk\.tensor\.\w+\.shared::\w+\.global")


def widest_global_load(ptx: str) -> int:
    """Bytes of the widest global-memory read per thread in the PTX: ld.global (vector count x element width),
    cp.async (its copy size) or a TMA bulk load (counted as 16: it moves whole tiles)."""
    widths = [int(v or 1) * int(bits) * (2 if pair else 1) // 8 for v, bits, pair in _LD_GLOBAL.findall(ptx)]
    widths += [int(n, 0) for n in _CP_ASYNC.findall(ptx)]
    if _TMA_LOAD.search(ptx):
        widths.append(16)
    return max(widths, default=0)


_LOOP_HEADER = re.compile(r"^(\$\w+):\s*//.*Loop Header", re.MULTILINE)


def loop_barriers(ptx: str) -> int:
    """The most ``bar.sync`` / ``barrier.sync`` instructions between a loop's header label (LLVM marks it "Loop
    Header") and the last branch back to it, over the loops of the PTX."""
    most = 0
    for header in _LOOP_HEADER.finditer(ptx):
        label = header.group(1)
        back_edges = list(re.finditer(rf"\bbra(?:\.uni)?\s+{re.escape(label)};", ptx[header.end() :]))
        if back_edges:
            body = ptx[header.end() : header.end() + back_edges[-1].start()]
            most = max(most, len(re.findall(r"\b(?:bar|barrier)\.sync\b", body)))
    return most


_SASS_LINE = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)(.*)$")


#: dense tensor-core FLOPs per SM and cycle, by (arch, TF32 operands): H100/H200 989 TFLOP/s fp16 over 132 SMs at
#: 1.83 GHz; A100 312 over 108 at 1.41 GHz; TF32 at half
MMA_FLOPS_PER_CYCLE = {(90, False): 4096, (90, True): 2048, (80, False): 2048, (80, True): 1024}


def _mma_flops(suffix: str) -> tuple[int, bool]:
    """(FLOPs, TF32) of one MMA instruction from its SASS suffix: HGMMA.64x128x16.F32 (one warpgroup's), or
    HMMA.16816.F32 (one warp's m16n8k16; 1688 / 1684: k 8 / 4)."""
    shape = suffix.lstrip(".").split(".")[0]
    if "x" in shape:
        m, n, k = (int(v) for v in shape.split("x"))
    else:
        m, n, k = int(shape[:2]), int(shape[2]), int(shape[3:])
    return 2 * m * n * k, "TF32" in suffix


def mma_loop(sass: str) -> tuple[int, list[str]]:
    """(instructions, the MMA instructions' opcode.suffix) of the SASS loop with the most HGMMA/HMMA, per warp and
    iteration: the body between a backward branch's target and the branch. (0, []) when no loop holds an MMA."""
    lines = [(int(m.group(1), 16), m.group(2), m.group(3)) for m in map(_SASS_LINE.match, sass.splitlines()) if m]
    best: tuple[int, list[str]] = (0, [])
    for address, opcode, rest in lines:
        target = re.search(r"\b(0x[0-9a-f]+)", rest) if opcode == "BRA" else None
        if target is None or int(target.group(1), 16) >= address:
            continue
        body = [(op, rest) for a, op, rest in lines if int(target.group(1), 16) <= a <= address]
        mmas = [op + rest.split()[0] for op, rest in body if op in ("HGMMA", "HMMA")]
        if len(mmas) > len(best[1]):
            best = (len(body), mmas)
    return best


def issue_ratio(instructions: int, mmas: list[str], num_warps: int, arch: int) -> float:
    """A loop's issue cycles per SM over its tensor-core cycles (see CompileRecord.mma_loop_issue_ratio). A HGMMA
    runs once per warpgroup (4 warps), a HMMA once per warp."""
    tensor_cycles = 0.0
    for mma in mmas:
        flops, tf32 = _mma_flops(mma.split(".", 1)[1])
        copies = num_warps / 4 if mma.startswith("HGMMA") else num_warps
        tensor_cycles += copies * flops / MMA_FLOPS_PER_CYCLE[(90 if arch >= 90 else 80, tf32)]
    return num_warps * instructions / 4 / tensor_cycles if tensor_cycles else 0.0


def compile_spec(module_name: str, index: int, arch: int) -> CompileRecord:
    import triton
    from triton.backends.compiler import GPUTarget

    spec = importlib.import_module(module_name).aot_specs()[index]
    # attrs carry the divisibility hints Triton applies at run time (e.g. {(i,): [["tt.divisibility", 16]]}); without
    # them the gate would compile an unvectorised variant that never runs.
    attrs = spec.get("attrs")
    if attrs is None and spec.get("divisible_by_16"):
        # Shorthand: the pointer/size arguments Triton will see as multiples of 16 at run time.
        attrs = {(spec["fn"].arg_names.index(k),): [["tt.divisibility", 16]] for k in spec["divisible_by_16"]}
    src = triton.compiler.ASTSource(
        fn=spec["fn"], signature=spec["signature"], constexprs=spec["constexprs"], attrs=attrs
    )
    from ldmopt.kernels._common import LAUNCH_OPTIONS

    # what every launch passes besides the tile's own (FMA contraction: Triton 3.10 turns its default off)
    options = {"num_warps": spec.get("num_warps", 4), "num_stages": spec.get("num_stages", 3), **LAUNCH_OPTIONS}
    try:
        compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
    except Exception as exc:
        return CompileRecord(spec["name"], arch, 0, 0, 0, False, f"compile failed: {type(exc).__name__}: {exc}")
    regs, local = _resource_usage(compiled.asm["cubin"])
    shared = int(compiled.metadata.shared)
    problems = []
    if local:
        problems.append(f"{local} bytes of stack/local memory per thread (register spills)")
    if shared > SHARED_MEMORY_LIMIT[arch]:
        problems.append(f"shared memory {shared} B over the sm_{arch} limit {SHARED_MEMORY_LIMIT[arch]} B")
    ptx = compiled.asm["ptx"]
    record = CompileRecord(spec["name"], arch, regs, shared, local, not problems, "; ".join(problems))
    record.mma, record.load_bytes = tensor_core_instruction(ptx), widest_global_load(ptx)
    record.loop_barriers = loop_barriers(ptx)
    if record.mma:
        instructions, mmas = mma_loop(_cuobjdump(compiled.asm["cubin"], "-sass"))
        record.mma_loop_instructions, record.mma_loop_mmas = instructions, len(mmas)
        record.mma_loop_issue_ratio = round(issue_ratio(instructions, mmas, options["num_warps"], arch), 3)
    return record


def run_all(modules: list[str] | None = None, archs=TARGETS, workers: int | None = None) -> list[CompileRecord]:
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        raise RuntimeError("the AOT gate cannot run with TRITON_INTERPRET=1; unset it")
    jobs = []
    for name in modules or kernel_modules():
        module = importlib.import_module(name)
        if hasattr(module, "aot_specs"):
            # A spec may name the archs it is meant for (e.g. tiles that only sm_90 selects at run time).
            jobs += [
                (name, i, arch)
                for i, spec in enumerate(module.aot_specs())
                for arch in archs
                if arch in spec.get("archs", archs)
            ]
    workers = workers or min(4, os.cpu_count() or 1)
    with ProcessPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(compile_spec, *zip(*jobs))) if jobs else []


def format_table(records: list[CompileRecord]) -> str:
    width = max([len(r.kernel) for r in records] + [6])
    lines = [f"{'kernel':<{width}}  arch   regs  shared(B)  spill(B)  mma    load(B)  loop-bar  issue/mma  status"]
    for r in records:
        status = "ok" if r.ok else "FAIL: " + r.problem
        lines.append(
            f"{r.kernel:<{width}}  sm_{r.arch}  {r.registers:5d}  {r.shared_bytes:9d}  {r.spill_bytes:8d}"
            f"  {r.mma or '-':<5}  {r.load_bytes:7d}  {r.loop_barriers:8d}  {r.mma_loop_issue_ratio:9.2f}  {status}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ldmopt.aot", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print records as JSON")
    parser.add_argument("--module", action="append", help="only this kernels module (repeatable)")
    args = parser.parse_args(argv)
    known = kernel_modules()
    modules = None
    if args.module:
        # Short names too (--module linear); a name that compiles nothing must not pass the gate with an empty table.
        modules = [m if m in known else f"ldmopt.kernels.{m}" for m in args.module]
        unknown = [given for given, m in zip(args.module, modules) if m not in known]
        if unknown:
            short = ", ".join(m.rsplit(".", 1)[1] for m in known)
            parser.error(f"--module {', '.join(unknown)}: not a kernels module; expected one of {short}")
    records = run_all(modules)
    if args.json:
        print(json.dumps([asdict(r) for r in records]))
    else:
        print(format_table(records))
    return 0 if all(r.ok for r in records) else 1


if __name__ == "__main__":
    from ldmopt.cli import exit_quietly_on_broken_pipe

    sys.exit(exit_quietly_on_broken_pipe(main))
