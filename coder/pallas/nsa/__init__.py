"""Native Sparse Attention (Yuan et al., 2025).

reference.py  plain jnp definition (dense masks; tests)      xla.py  blockwise XLA path (CPU training)
tpu.py        Mosaic TPU kernels, forward + backward         gpu.py  Mosaic GPU kernels, forward + backward
ops.py        custom_vjp wrappers and nsa_attention          module.py  NSA nnx.Module (compression, gates)
decode.py     one decode step reading only what NSA needs from the cache
"""
from coder.pallas.nsa.decode import decode_step
from coder.pallas.nsa.module import NSA
from coder.pallas.nsa.ops import Kernel, nsa_attention
from coder.pallas.nsa.reference import NSAConfig

__all__ = ["NSA", "Kernel", "NSAConfig", "decode_step", "nsa_attention"]
