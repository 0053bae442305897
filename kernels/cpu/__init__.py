"""kvfleet.kernels.cpu: the C kernels of the CPU path (cpu_*.c, cpu_*.h), the loader that
compiles them on first use (`cpu_library`), the CPU feature probes (`cpu_features`) and one
Python wrapper per kernel. Kept import-light: each wrapper module pulls in torch."""
