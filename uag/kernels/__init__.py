"""kernels floor."""
