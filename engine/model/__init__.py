"""The model: loading, the paged forward and its kernels, and what runs it each step."""
