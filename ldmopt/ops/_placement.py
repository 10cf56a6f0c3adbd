"""Process-wide placement switches read from an environment variable at each call (``LDMOPT_GN_CONV_PROLOGUE``,
``LDMOPT_GEMM_PLACEMENT``): parsed once per value, forced within a block by benchmarks and checks, and counted per
call so that tests and benchmarks can see which placement ran."""

from __future__ import annotations

import contextlib
import functools
import os
from collections import Counter

from .._env import getenv, read_per_call


class PlacementSwitch:
    """One environment variable choosing among ``choices`` ("auto" first: the value when unset)."""

    def __init__(self, env: str, choices: tuple[str, ...]):
        self.env = env
        read_per_call(env)
        self.choices = choices
        #: placement -> number of calls that used it in this process
        self.counts: Counter[str] = Counter()
        self._parse = functools.lru_cache(maxsize=8)(self._parse_uncached)

    def _parse_uncached(self, raw: str | None) -> str:
        value = (raw or "").strip().lower() or self.choices[0]
        if value not in self.choices:
            raise ValueError(f"{self.env}={value!r} is not supported; expected one of {list(self.choices)}")
        return value

    def requested(self) -> str:
        """The placement the variable asks for ("auto" when unset), read at each call."""
        return self._parse(getenv(self.env))

    @contextlib.contextmanager
    def forced(self, placement: str):
        """Within the block, use ``placement``: sets the variable for the process (every thread) and restores what was
        there. For benchmarks and checks that time or test each placement."""
        self._parse(placement)  # the same error as the variable's
        saved = os.environ.get(self.env)
        os.environ[self.env] = placement
        try:
            yield
        finally:
            if saved is None:
                os.environ.pop(self.env, None)
            else:
                os.environ[self.env] = saved
