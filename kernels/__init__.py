"""kvfleet.kernels: attention and cache ops — Triton kernels with torch references, one dispatch."""
