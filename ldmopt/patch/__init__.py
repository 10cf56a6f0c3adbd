"""``ldmopt.patch(pipe)`` / ``ldmopt.unpatch(pipe)``: drop ldmopt's fused kernels into diffusers models, reversibly.

A table of rules keyed by module class (see :func:`rule_table`); each rule matches instances, says why one must stay
on the stock path, replaces and restores. ``patch`` returns a :class:`PatchReport`.
"""

import sys
import types

from .core import FAMILIES, PatchError, is_patched, patch, rule_table, unpatch
from .report import PatchReport

__all__ = ["FAMILIES", "PatchError", "PatchReport", "is_patched", "patch", "rule_table", "unpatch"]


class _CallablePackage(types.ModuleType):
    # Importing this package sets the attribute `ldmopt.patch` to the package itself, shadowing the function that
    # ldmopt/__init__.py exposes under the same name; calling the package calls the function, so both spellings work.
    def __call__(self, *args, **kwargs) -> PatchReport:
        return patch(*args, **kwargs)


sys.modules[__name__].__class__ = _CallablePackage
