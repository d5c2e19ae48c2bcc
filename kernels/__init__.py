"""Paged attention kernels and their plain torch references."""
