"""`kvfleet bench {throughput,serve,startup,latency,kernels,cpu-kernels,decode-step,gemm-rows,
tensor-parallel}`: speed claims are measured, with their baseline in the same run. Each
sub-command lives in its own module."""

from __future__ import annotations

import argparse

BENCH_MODULES = (
    "kvfleet.runtime.bench.throughput",
    "kvfleet.runtime.bench.serve",
    "kvfleet.runtime.bench.startup",
    "kvfleet.runtime.bench.latency",
    "kvfleet.kernels.bench.triton_kernels",
    "kvfleet.kernels.bench.cpu_kernels",
    "kvfleet.runtime.bench.decode_step",
    "kvfleet.runtime.bench.gemm_rows",
    "kvfleet.runtime.bench.tensor_parallel",
)


def register(sub: argparse._SubParsersAction) -> None:
    from kvfleet.runtime.cli import register_commands

    p = sub.add_parser(
        "bench",
        help="benchmarks: throughput, serve, startup, latency, kernels, cpu-kernels, decode-step, gemm-rows, "
        "tensor-parallel",
        description="Measure kvfleet against a baseline in the same run.",
    )
    bench_sub = p.add_subparsers(dest="bench", required=True, metavar="BENCHMARK")
    register_commands(bench_sub, BENCH_MODULES)
