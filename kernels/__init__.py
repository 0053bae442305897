"""kvfleet.kernels: attention and cache ops — Triton kernels (`triton/`) and C kernels for the CPU
(`cpu/`) with torch references (`reference`) behind one dispatch (`kvfleet.kernels.dispatch`),
routed by a frozen kernel policy (`kvfleet.kernels.policy`); their benchmarks in `bench/`. Kept
import-light: the dispatch module pulls in torch."""
