"""kvfleet.kernels.bench: the kernel benchmark programs, `kvfleet bench kernels`
(`triton_kernels`) and `kvfleet bench cpu-kernels` (`cpu_kernels`)."""
