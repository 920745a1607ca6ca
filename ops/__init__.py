"""Python face of the paged-attention kernels."""
