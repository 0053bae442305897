"""kvfleet.kernels: attention and cache ops — Triton kernels with torch references behind one
dispatch (`kvfleet.kernels.dispatch`). Kept import-light: the dispatch module pulls in torch."""
