"""Test configuration: Triton kernels run in the CPU interpreter and fresh kernel outputs are poisoned with NaN.

Both variables must be set before any Triton kernel module is imported (triton.jit reads TRITON_INTERPRET when it
decorates), hence at the top of conftest. Inputs are drawn fresh per test from a seed printed in the header;
LDMOPT_TEST_SEED=<int> replays a run.
"""

import os
import random
import zlib

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("LDMOPT_POISON_OUTPUTS", "1")

import pytest
import torch

SESSION_SEED = int(os.environ.get("LDMOPT_TEST_SEED", random.SystemRandom().randrange(2**31)))


def pytest_report_header(config):
    return [f"ldmopt test seed: {SESSION_SEED} (replay with LDMOPT_TEST_SEED={SESSION_SEED})"]


@pytest.fixture(autouse=True)
def _seed_per_test(request):
    # Distinct inputs per test, reproducible from the session seed.
    torch.manual_seed(SESSION_SEED + zlib.crc32(request.node.nodeid.encode()) % 100_003)
    yield


@pytest.fixture(autouse=True)
def _no_forced_backend(monkeypatch):
    monkeypatch.delenv("LDMOPT_BACKEND", raising=False)
