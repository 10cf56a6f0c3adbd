"""Triton kernels of ldmopt, installed as ``ldmopt.kernels``.

One op per module: the ``@triton.jit`` kernels and the launchers that allocate outputs and pick tile sizes. Nothing here
imports torch.library or diffusers; ``ldmopt.ops`` wraps these launchers as custom ops. Importing a module here imports
Triton, so ``ldmopt.ops`` imports them lazily, inside the ``triton`` backend.
"""

import sys as _sys


def _hand_over_to_the_installed_package() -> None:
    """Imported as top-level ``kernels``, this folder shadows Hugging Face's ``kernels`` package (which transformers
    requires and diffusers imports when it is installed): a checkout's root is on sys.path under pytest or ``python -m``
    run from it. ldmopt itself only imports ``ldmopt.kernels``, so the name goes to that package when there is one."""
    import importlib.machinery
    import importlib.util
    import os

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = [p for p in _sys.path if os.path.abspath(p or os.curdir) != root]
    spec = importlib.machinery.PathFinder.find_spec(__name__, path)
    if spec is None or spec.loader is None:
        return
    package = importlib.util.module_from_spec(spec)
    _sys.modules[__name__] = package  # what the import statement returns once this module has run
    spec.loader.exec_module(package)


if __name__ == "kernels":
    _hand_over_to_the_installed_package()
