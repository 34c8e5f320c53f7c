"""Pallas kernels (TPU: Mosaic TPU; GPU: Mosaic GPU) with their plain-jnp references.

nsa/ - Native Sparse Attention: compressed, selected and sliding-window branches.
"""
