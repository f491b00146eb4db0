"""Kernels of Sluice's own: cpu/ the C++ ones (batch-invariant linear layers, attention, whole decoder layers,
experts and the sampler, built on first start), gpu/ the Triton ones (paged attention, batch-invariant layers,
fusions and the sampler)."""
