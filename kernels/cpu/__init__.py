"""The CPU kernels: a C++ (OpenMP, vectorised) extension built on this machine, and its backend."""
