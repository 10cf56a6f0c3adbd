"""The repository stays ruff clean (lint and format), as CI promises."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


# This interpreter's ruff (the test extra pins its minor version), not whichever one PATH finds first.
@pytest.mark.skipif(importlib.util.find_spec("ruff") is None, reason="ruff is not installed (it is in the test extra)")
@pytest.mark.parametrize("command", [["check", "."], ["format", "--check", "."]])
def test_ruff_clean(command):
    result = subprocess.run([sys.executable, "-m", "ruff", *command], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
