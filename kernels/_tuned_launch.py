"""Launching an autotuned kernel without Triton's per-call autotuner bookkeeping.

``Autotuner.run`` rebuilds, on every call, a dict of every argument, filters it by a list search over the kernel's
parameter names and calls ``str()`` on every tensor's dtype, to form a key it has usually tuned long before. For the
fused convolution (about 80 parameters) that was the largest single item of a call's host time on an H200 (cProfile,
2026-12-04, benchmarks/measured/2026-12-04_h200_run2_host_profile.txt). :func:`tuned_launch` forms the same key from
parameter positions computed once, looks it up in the autotuner's own cache, and when the autotuner has already
chosen a configuration for it launches the kernel with that configuration directly, as ``Autotuner.run`` would.
Anything else (a key not tuned yet, a configuration with a pre-hook, a Triton whose cache is keyed otherwise) goes
through the autotuner itself, so the choice is always the autotuner's. The first key tuned through the autotuner is
checked against the key it stored; if they differ the fast path stays off. Unlike ``Autotuner.run``, a fast launch
leaves the autotuner's ``nargs`` alone (only tuning reads it) and sets ``best_config`` to the launched config.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from triton.runtime.autotuner import Autotuner


class TunedLaunch:
    """``TunedLaunch(autotuned)[grid](*args, **kwargs)`` launches like ``autotuned[grid](*args, **kwargs)``."""

    def __init__(self, autotuned: Autotuner) -> None:
        self.autotuned = autotuned
        names = list(autotuned.arg_names)
        # (position among the parameters, name) of each key parameter, in the autotuner's key order
        self._key_params = [(names.index(name), name) for name in autotuned.keys if name in names]
        self._params = frozenset(names)
        #: None until a key tuned through the autotuner shows whether it keys its cache as :meth:`key` does
        self._keys_match: bool | None = None

    def key(self, args: tuple, kwargs: dict) -> tuple:
        """The autotuner's key: its key parameters' values, then str(dtype) of each argument that has a dtype."""
        n = len(args)
        values = [args[i] if i < n else kwargs[name] for i, name in self._key_params if i < n or name in kwargs]
        params = self._params
        values += [str(a.dtype) for a in args if hasattr(a, "dtype")]
        values += [str(a.dtype) for name, a in kwargs.items() if name in params and hasattr(a, "dtype")]
        return tuple(values)

    def chosen(self, args: tuple, kwargs: dict) -> Any:
        """The configuration the autotuner would launch for these arguments without tuning, or None."""
        configs = self.autotuned.configs
        if len(configs) == 1:
            config = configs[0]
        elif self._keys_match:
            config = self.autotuned.cache.get(self.key(args, kwargs))
        else:
            return None
        return config if config is not None and config.pre_hook is None else None

    def _through_autotuner(self, grid, args: tuple, kwargs: dict) -> Any:
        cache = self.autotuned.cache
        before = set(cache) if self._keys_match is None else None
        out = self.autotuned[grid](*args, **kwargs)
        if before is not None:
            added = set(cache) - before
            if added:  # this call tuned a key: is it the one key() forms?
                self._keys_match = added == {self.key(args, kwargs)}
        return out

    def __getitem__(self, grid) -> Callable[..., Any]:
        def launch(*args, **kwargs):
            config = self.chosen(args, kwargs)
            if config is None:
                return self._through_autotuner(grid, args, kwargs)
            self.autotuned.best_config = config
            return self.autotuned.fn[grid](*args, **kwargs, **config.all_kwargs())

        return launch


def tuned_launch(kernel: Any) -> Any:
    """``kernel``'s :class:`TunedLaunch` (one per autotuner, made on first use), or ``kernel`` itself when it is not
    an autotuner (a plain kernel, or a stand-in a test put in its place)."""
    if type(kernel) is not Autotuner:  # a subclass may do more in run(): launch it as it is
        return kernel
    launch = kernel.__dict__.get("_ldmopt_tuned_launch")
    if launch is None:
        launch = kernel.__dict__["_ldmopt_tuned_launch"] = TunedLaunch(kernel)
    return launch
