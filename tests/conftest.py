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

from tests.support import arena_cache

# CPython's frame stack chunks, cached: the Triton interpreter runs up to 3x faster under pytest with it.
ARENA_CACHE_SKIPPED = arena_cache.install()

SESSION_SEED = int(os.environ.get("LDMOPT_TEST_SEED", random.SystemRandom().randrange(2**31)))
# pytest-xdist workers inherit the environment of the process that starts them: one seed for the whole run.
os.environ["LDMOPT_TEST_SEED"] = str(SESSION_SEED)

_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:  # share the cores between workers instead of each worker's torch taking all of them
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // _WORKERS))


def pytest_report_header(config):
    cache = f"not installed: {ARENA_CACHE_SKIPPED}" if ARENA_CACHE_SKIPPED else "installed"
    return [
        f"ldmopt test seed: {SESSION_SEED} (replay with LDMOPT_TEST_SEED={SESSION_SEED})",
        f"frame stack chunk cache (tests/support/arena_cache.c): {cache}",
    ]


@pytest.fixture(autouse=True)
def _seed_per_test(request):
    # Distinct inputs per test, reproducible from the session seed.
    torch.manual_seed(SESSION_SEED + zlib.crc32(request.node.nodeid.encode()) % 100_003)
    yield


@pytest.fixture(autouse=True)
def _no_forced_backend(monkeypatch):
    monkeypatch.delenv("LDMOPT_BACKEND", raising=False)


@pytest.fixture
def triton_launches(monkeypatch):
    """Counts Triton kernel launches (interpreter grid executions), by kernel name."""
    from triton.runtime import interpreter

    launches = []
    original = interpreter.InterpretedFunction.run

    def run(self, *args, **kwargs):
        launches.append(self.fn.__name__)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(interpreter.InterpretedFunction, "run", run)
    return launches


@pytest.fixture
def fresh_handover():
    """No statistics hand-over state from other tests (ldmopt.nn.stats_handover), before and after."""
    from ldmopt.nn import stats_handover as handover

    handover.forget()
    handover.handed_over.clear()
    yield handover
    handover.forget()
