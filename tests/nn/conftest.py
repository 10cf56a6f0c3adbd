"""Fixtures shared by the fused-module tests."""

import pytest


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
