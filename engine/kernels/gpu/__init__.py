"""The GPU's kernels, in Triton: paged attention, batch-invariant linear layers and norms, the fusions of a
decoder layer, and the sampler."""
