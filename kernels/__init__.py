"""Triton kernels of ldmopt, installed as ``ldmopt.kernels``.

One op per module: the ``@triton.jit`` kernels and the launchers that allocate outputs and pick tile sizes. Nothing here
imports torch.library or diffusers; ``ldmopt.ops`` wraps these launchers as custom ops. Importing a module here imports
Triton, so ``ldmopt.ops`` imports them lazily, inside the ``triton`` backend.
"""
