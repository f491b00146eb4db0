"""Kernels of Sluice's own: batch-invariant float32 linear layers and paged attention for x86 CPUs."""
