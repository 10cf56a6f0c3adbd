"""The source archive builds like a checkout: it carries every tracked source the CUDA extension, the kernels, the
tests and the benchmarks need (csrc/ headers included: without them the extension cannot compile from it)."""

import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _tracked() -> list[str]:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs a git checkout to know the tracked files")
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [line for line in out.splitlines() if (ROOT / line).is_file()]


def test_sdist_carries_every_tracked_source(tmp_path):
    tracked = _tracked()
    tree = tmp_path / "tree"
    for name in tracked:  # a copy: sdist writes egg-info and build info beside the sources
        (tree / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, tree / name)
    env = {**os.environ, "LDMOPT_SKIP_CUDA_BUILD": "1"}
    # An editable install's record of its built extension: making an sdist (or reading metadata) must leave it, or
    # ldmopt would stop loading that install's ldmopt._C as "left from an earlier build"
    record = tree / "ldmopt" / "_build_info.json"
    record.write_text('{"built": true, "reason": "an editable install built it"}')
    done = subprocess.run([sys.executable, "setup.py", "-q", "sdist", "-d", str(tmp_path / "dist")], cwd=tree,
                          env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert record.read_text() == '{"built": true, "reason": "an editable install built it"}'

    (archive,) = (tmp_path / "dist").glob("ldmopt-*.tar.gz")
    with tarfile.open(archive) as tar:
        names = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
    wanted = [n for n in tracked if n.split("/")[0] in ("csrc", "kernels", "ldmopt", "tests", "benchmarks")]
    wanted += ["LICENSE", "README.md", "pyproject.toml", "setup.py"]
    missing = sorted(set(wanted) - names)
    assert not missing, missing[:20]
    assert not [n for n in names if n.endswith((".so", ".pyc"))]
    # One build's record (this checkout's "built": true, its CUDA paths), not a source: the sdist run in place
    # would claim an ldmopt._C it does not have
    assert "ldmopt/_build_info.json" not in names


def test_checkout_kernels_folder_hands_its_name_to_an_installed_kernels_package(tmp_path):
    # transformers requires Hugging Face's `kernels` and diffusers imports it when installed; run from a checkout's
    # root (pytest, python -m), the repository's kernels/ folder would shadow it. ldmopt imports ldmopt.kernels only.
    installed = tmp_path / "site" / "kernels"
    installed.mkdir(parents=True)
    (installed / "__init__.py").write_text("WHO = 'the installed package'\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site")}
    code = "import kernels, ldmopt.kernels.group_norm as g; print(kernels.WHO, g.__name__)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["the", "installed", "package", "ldmopt.kernels.group_norm"]
