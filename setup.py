"""Build script: the pure-Python package always; the CUDA extension ``ldmopt._C`` when it can.

The Triton kernels live in the top-level ``kernels/`` folder and are installed as ``ldmopt.kernels``.
The extension is built from ``csrc/`` with torch.utils.cpp_extension + ninja when torch (a CUDA build) and nvcc are
present at build time. Knobs: LDMOPT_SKIP_CUDA_BUILD=1, TORCH_CUDA_ARCH_LIST (default "8.0;9.0+PTX"), MAX_JOBS,
NVCC_THREADS. What was built is written to ldmopt/_build_info.json, which ``ldmopt info`` shows.
"""

import glob
import json
import os
import shutil
import subprocess
import sys
import time

from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))
BUILD_INFO = os.path.join(ROOT, "ldmopt", "_build_info.json")


def _say(message: str) -> None:
    print(f"ldmopt setup: {message}", file=sys.stderr)


def _write_build_info(info: dict, path: str = BUILD_INFO) -> None:
    with open(path, "w") as f:
        json.dump(info, f, indent=2, sort_keys=True)


def _cuda_extension():
    """Return (ext_modules, cmdclass) for ldmopt._C, or ([], {}) with a one-line reason printed."""
    if os.environ.get("LDMOPT_SKIP_CUDA_BUILD", "0") == "1":
        return [], {}, "skipped: LDMOPT_SKIP_CUDA_BUILD=1"
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError:
        return [], {}, "skipped: torch is not importable at build time (install with --no-build-isolation)"
    if torch.version.cuda is None:
        return [], {}, f"skipped: torch {torch.__version__} is not a CUDA build"
    torch_site = os.path.dirname(os.path.dirname(torch.__file__))
    cuda_home, cuda_include, why_not = _cuda_home(cpp_extension.CUDA_HOME, torch_site)
    if cuda_home is None:
        return [], {}, f"skipped: {why_not}"
    # torch reads its module-level CUDA_HOME when it builds the include paths and the nvcc command line.
    cpp_extension.CUDA_HOME = os.environ["CUDA_HOME"] = cuda_home
    sources = sorted(glob.glob(os.path.join("csrc", "**", "*.cpp"), recursive=True))
    sources += sorted(glob.glob(os.path.join("csrc", "**", "*.cu"), recursive=True))
    if not sources:
        return [], {}, "skipped: csrc/ has no sources"
    # Cubins for A100 and H100/H200 (sm_86/89 run the sm_80 one), PTX that newer GPUs (sm_100, sm_120) compile.
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0+PTX")
    include_dirs = [os.path.join(ROOT, "csrc"), cuda_include]
    # pip's CUDA 13 torch wheels carry the CUDA headers (cuda_runtime.h, cuda_fp16.h, ...) under nvidia/cu13/include.
    for sub in ("cu13", "cu12"):
        candidate = os.path.join(torch_site, "nvidia", sub, "include")
        if os.path.isdir(candidate):
            include_dirs.append(candidate)
    # torch 2.14 headers need C++20 (std::strong_ordering, requires-clauses).
    nvcc_flags = ["-O3", "--use_fast_math", "-std=c++20", "-lineinfo", "--expt-relaxed-constexpr"]
    nvcc_threads = os.environ.get("NVCC_THREADS")
    if nvcc_threads:
        nvcc_flags.append(f"--threads={nvcc_threads}")
    ext = cpp_extension.CUDAExtension(
        name="ldmopt._C",
        sources=sources,
        include_dirs=include_dirs,
        extra_compile_args={"cxx": ["-O3", "-std=c++20"], "nvcc": nvcc_flags},
        py_limited_api=False,
    )
    info = {
        "built": True,
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "nvcc": _nvcc_version(cuda_home),
        "cuda_home": cuda_home,
        "arch_list": os.environ["TORCH_CUDA_ARCH_LIST"],
        "max_jobs": os.environ.get("MAX_JOBS"),
        "nvcc_threads": nvcc_threads,
        "sources": sources,
    }
    return [ext], {"build_ext": _timed_build_ext(cpp_extension, info)}, info


def _cuda_headers(root: str) -> str | None:
    """The include directory of a CUDA toolkit at ``root`` (include/, or targets/<arch>/include as conda-forge lays
    it out), or None when it has no nvcc or no runtime headers."""
    if shutil.which("nvcc", path=os.path.join(root, "bin")) is None:
        return None
    for include in [os.path.join(root, "include"), *sorted(glob.glob(os.path.join(root, "targets", "*", "include")))]:
        if os.path.isfile(os.path.join(include, "crt", "host_config.h")):
            return include
    return None


def _cuda_home(detected: str | None, torch_site: str) -> tuple[str | None, str | None, str]:
    """(toolkit root, its include directory, why not). A CUDA_HOME or CUDA_PATH the user set is used or refused, never
    replaced. Otherwise torch's guess is checked, as it can be a wrapper script's prefix: with /usr/local/bin/nvcc a
    shell script calling the real one, it picks /usr/local, whose include/ lacks crt/host_config.h, and the host
    compile fails. Then the nvcc on PATH (links resolved), /usr/local/cuda and the CUDA wheels beside torch."""
    for var in ("CUDA_HOME", "CUDA_PATH"):
        root = os.environ.get(var)
        if root:
            include = _cuda_headers(root)
            why = "" if include else f"{var}={root} has no bin/nvcc with crt/host_config.h in include/ or targets/*"
            return (root if include else None), include, why
    candidates = [detected]
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
    candidates.append("/usr/local/cuda")
    candidates += [os.path.join(torch_site, "nvidia", sub) for sub in ("cu13", "cu12")]
    for root in filter(None, candidates):
        include = _cuda_headers(root)
        if include:
            if root != detected:
                _say(f"CUDA toolkit: {root} (torch guessed {detected}, which has no nvcc with runtime headers)")
            return root, include, ""
    return None, None, "no CUDA toolkit with nvcc and its headers found (set CUDA_HOME)"


def _nvcc_version(cuda_home: str) -> str | None:
    try:
        out = subprocess.run([os.path.join(cuda_home, "bin", "nvcc"), "--version"], capture_output=True, text=True)
    except OSError:
        return None
    lines = [line for line in out.stdout.splitlines() if "release" in line]
    return lines[-1].strip() if lines else None


def _timed_build_ext(cpp_extension, info: dict):
    """BuildExtension (ninja) that records the build's wall time and marks the extension built only on success."""
    base = cpp_extension.BuildExtension.with_options(use_ninja=True)

    class TimedBuildExt(base):
        def run(self):
            _write_build_info({"built": False, "reason": "the ldmopt._C build started but did not finish"})
            start = time.monotonic()
            super().run()
            _write_build_info({**info, "build_seconds": round(time.monotonic() - start, 1)})
            if not self.inplace:  # build_py copied the package data before this ran: the wheel gets this build's
                target = os.path.join(self.build_lib, "ldmopt", os.path.basename(BUILD_INFO))
                if os.path.isdir(os.path.dirname(target)):
                    shutil.copyfile(BUILD_INFO, target)

    return TimedBuildExt


def _recording_build_py(info: dict):
    """build_py that records a skipped extension build where the install will read it: the source tree for an
    editable install, the wheel's copy otherwise. Not at import of setup.py: reading metadata or building an sdist
    (python -m build, pip's metadata step) must not mark a working editable install's ldmopt._C as not built."""
    from setuptools.command.build_py import build_py

    class RecordingBuildPy(build_py):
        def run(self):
            editable = getattr(self, "editable_mode", False)
            if editable:
                _write_build_info(info)
            super().run()
            target = os.path.join(self.build_lib, "ldmopt", os.path.basename(BUILD_INFO))
            if not editable and os.path.isdir(os.path.dirname(target)):
                _write_build_info(info, target)

    return RecordingBuildPy


ext_modules, cmdclass, status = _cuda_extension()
if isinstance(status, str):
    _say(f"CUDA extension ldmopt._C {status}")
    cmdclass = {**cmdclass, "build_py": _recording_build_py({"built": False, "reason": status})}
else:
    _say(f"building CUDA extension ldmopt._C for TORCH_CUDA_ARCH_LIST={status['arch_list']}")

setup(
    packages=[*find_packages(include=["ldmopt", "ldmopt.*"]), "ldmopt.kernels"],
    package_dir={"ldmopt.kernels": "kernels"},
    # Not _build_info.json: it records one build (the sdist must not carry the checkout's); build_py / build_ext
    # write the wheel's copy into build_lib themselves.
    package_data={"ldmopt": ["configs/*.json", "configs/*.md"]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
