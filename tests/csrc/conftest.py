"""Shared by the emulated-kernel tests: one emulator per test module (the library is built once, cached by source
hash), its schedule back in order afterwards."""

import pytest

from tests.csrc import emulator


@pytest.fixture(scope="module")
def emu():
    e = emulator.Emulator(emulator.build())
    yield e
    e.reverse_schedule(False)
