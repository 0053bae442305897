"""`kvfleet doctor`: what this machine gives kvfleet, checked the way serving would use it.

It reports the Python, torch, CUDA, driver and Triton versions and the C compiler, compiles and
runs one of kvfleet's own Triton kernels on the GPU (on a CPU only under TRITON_INTERPRET=1),
and builds and loads the CPU kernels' library, naming the instruction set it was built for.
It exits 1 when something serving needs is missing, with one last line saying what: the line a
pod's termination message, and so the operator's condition, carries.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass

OK, WARN, FAIL, INFO = "ok", "warn", "FAIL", "info"
MIN_PYTHON = (3, 11)


@dataclass(frozen=True, slots=True)
class Finding:
    """One line of the report: what was checked, how it went, what was found."""

    name: str
    status: str  # OK, WARN (serving works, slower or with less), FAIL (serving cannot), INFO
    detail: str


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "doctor",
        help="check this machine for serving: versions, compiler, Triton and CPU kernels",
        description="Report Python, torch, CUDA, driver and Triton versions and the C compiler; "
        "compile and run a Triton kernel on the GPU; build and load the CPU kernels. Exits 1 "
        "with a last line naming what is missing.",
    )
    p.add_argument(
        "--device",
        default="auto",
        choices=("auto", "cpu", "cuda"),
        help="the device serving will use (auto: cuda when one is visible, else cpu)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    findings: list[Finding] = []
    for finding in diagnose(args.device):
        findings.append(finding)
        print(f"{finding.status:4}  {finding.name}: {finding.detail}", flush=True)
    ok, line = verdict(findings)
    print(f"kvfleet doctor: {line}", file=sys.stdout if ok else sys.stderr, flush=True)
    return 0 if ok else 1


def verdict(findings: list[Finding]) -> tuple[bool, str]:
    """(whether serving can run, the report's last line): the first failure, else a summary."""
    failed = next((f for f in findings if f.status == FAIL), None)
    if failed is not None:
        return False, f"error: {failed.name}: {failed.detail}"
    warned = sum(f.status == WARN for f in findings)
    note = f" ({warned} warning{'s' * (warned != 1)} above)" if warned else ""
    return True, f"ok: this machine can serve{note}"


def diagnose(device: str) -> Iterator[Finding]:
    """The report's findings, in order; a failure that leaves nothing further to check ends
    it."""
    if sys.version_info < MIN_PYTHON:
        yield Finding("python", FAIL, f"{sys.version.split()[0]}; kvfleet needs 3.11 or newer")
        return
    yield Finding("python", OK, sys.version.split()[0])
    try:
        import torch
    except ImportError as exc:
        yield Finding("torch", FAIL, f"not importable ({exc}); install torch (see README)")
        return
    build = f"CUDA {torch.version.cuda} build" if torch.version.cuda else "CPU build"
    yield Finding("torch", OK, f"{torch.__version__} ({build})")
    gpu = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    cuda = list(_cuda(torch, gpu))
    yield from cuda
    yield _triton_version(gpu)
    yield compiler_finding(gpu)
    if any(f.status == FAIL for f in cuda):
        yield Finding("triton kernel", INFO, "not run: the GPU is not usable (above)")
    else:
        yield from _triton_kernel(gpu)
    yield _cpu_kernels()


def _cuda(torch: object, gpu: bool) -> Iterator[Finding]:
    driver = cuda_driver_version()
    driver_text = f"driver supports CUDA {driver}" if driver else "no NVIDIA driver found"
    if not gpu:
        yield Finding("cuda", INFO, f"not used: serving on CPU ({driver_text})")
        return
    cuda = torch.cuda  # type: ignore[attr-defined]
    if not cuda.is_available():
        built = torch.version.cuda  # type: ignore[attr-defined]
        why = f"torch {torch.__version__} is a CPU build" if not built else driver_text  # type: ignore[attr-defined]
        yield Finding("cuda", FAIL, f"no CUDA device is visible ({why})")
        return
    names = sorted({cuda.get_device_name(i) for i in range(cuda.device_count())})
    major, minor = cuda.get_device_capability(0)
    yield Finding(
        "cuda", OK, f"{cuda.device_count()} x {', '.join(names)} (compute {major}.{minor})"
    )
    problem = driver_problem(torch.version.cuda, driver)  # type: ignore[attr-defined]
    yield Finding("driver", FAIL if problem else OK, problem or driver_text)


def serving_problem(device: str, kernel_backend: str) -> str | None:
    """What keeps `kvfleet serve` from running on `device`, of the checks cheap enough for every
    start (no kernel is compiled): a driver older than torch's CUDA build, or no C compiler for
    Triton's launchers. None on CPU, and when all is well."""
    if device == "cpu":
        return None
    # auto on a machine without an NVIDIA driver: the CPU serves. Asked of the driver, not of
    # torch: a CPU server then starts its core without importing torch first (1-2 s).
    driver = cuda_driver_version()
    if not device.startswith("cuda") and driver is None:
        return None
    import torch

    if not (device.startswith("cuda") or torch.cuda.is_available()):
        return None  # auto with a driver but no usable GPU (or a CPU build of torch)
    problem = driver_problem(torch.version.cuda, driver)
    if problem is not None:
        return f"driver: {problem}"
    compiler = compiler_finding(gpu=kernel_backend != "torch")  # the torch backend runs no Triton
    if compiler.status == FAIL:
        return f"{compiler.name}: {compiler.detail}"
    return None


def cuda_driver_version() -> str | None:
    """The CUDA version the installed NVIDIA driver supports, e.g. '13.0' (None: no driver)."""
    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    version = ctypes.c_int(0)
    if libcuda.cuDriverGetVersion(ctypes.byref(version)) != 0 or version.value <= 0:
        return None
    return f"{version.value // 1000}.{version.value % 1000 // 10}"


def driver_problem(torch_cuda: str | None, driver: str | None) -> str | None:
    """Why this driver cannot run this torch's CUDA build (None: it can). A driver runs
    builds of its own CUDA major version and older."""
    if torch_cuda is None:
        return None
    if driver is None:
        return f"no NVIDIA driver found; torch's CUDA {torch_cuda} build needs one"
    if int(driver.split(".")[0]) < int(torch_cuda.split(".")[0]):
        return (
            f"the driver supports CUDA {driver}, older than torch's CUDA {torch_cuda} build "
            f"needs; install a driver for CUDA {torch_cuda.split('.')[0]} or newer"
        )
    return None


def _triton_version(gpu: bool) -> Finding:
    try:
        import triton
    except ImportError:
        if gpu:
            return Finding("triton", FAIL, "not installed; the GPU kernels are Triton kernels")
        return Finding("triton", INFO, "not installed (not used on CPU)")
    return Finding("triton", OK, triton.__version__)


def compiler_finding(gpu: bool) -> Finding:
    """The C compiler: Triton builds a launcher per kernel with it at run time (needed on a
    GPU), and the CPU kernels are compiled with it (without one they fall back to torch)."""
    path = shutil.which("gcc") or shutil.which("cc")
    if path is None:
        if gpu:
            return Finding(
                "c compiler", FAIL, "none found (gcc or cc); Triton needs one to launch kernels"
            )
        return Finding(
            "c compiler", WARN, "none found (gcc); the CPU kernels fall back to the torch reference"
        )
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30)
        first = (out.stdout or out.stderr).splitlines()[0] if (out.stdout or out.stderr) else ""
    except (OSError, subprocess.TimeoutExpired) as exc:
        return Finding("c compiler", FAIL if gpu else WARN, f"{path} does not run: {exc}")
    return Finding("c compiler", OK, f"{path}: {first}")


def _triton_kernel(gpu: bool) -> Iterator[Finding]:
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    if not gpu and not interpreted:
        yield Finding(
            "triton kernel", INFO, "not exercised on CPU (TRITON_INTERPRET=1 runs it interpreted)"
        )
        return
    try:
        yield Finding("triton kernel", OK, run_triton_kernel("cuda" if gpu else "cpu"))
    except Exception as exc:  # any failure to compile or run is the finding
        yield Finding("triton kernel", FAIL, f"{type(exc).__name__}: {exc}".splitlines()[0])


def run_triton_kernel(device: str) -> str:
    """Compile and run kvfleet's Triton SiLU-and-mul on `device` against the torch reference;
    raises if it cannot, or if it computes something else."""
    import torch
    from kvfleet.kernels import reference
    from kvfleet.kernels.triton.triton_silu_and_mul import silu_and_mul

    x = torch.randn(4, 256, device=device)
    got, want = silu_and_mul(x), reference.silu_and_mul(x)
    if device == "cuda":
        torch.cuda.synchronize()
    err = (got - want).abs().max().item()
    if err > 1e-4:
        raise ArithmeticError(f"silu_and_mul differs from the torch reference by {err:.3g}")
    how = "interpreted (TRITON_INTERPRET=1)" if device == "cpu" else "compiled"
    return f"silu_and_mul {how} on {device}, matches the torch reference"


def _cpu_kernels() -> Finding:
    if os.environ.get("KVFLEET_CPU_KERNELS", "1") == "0":
        return Finding("cpu kernels", INFO, "off (KVFLEET_CPU_KERNELS=0): torch reference")
    from kvfleet.kernels.cpu import cpu_library

    try:
        cpu_library.build()
    except subprocess.CalledProcessError as exc:
        detail = (exc.stderr or exc.stdout or "").strip().splitlines()
        why = detail[0] if detail else f"exit status {exc.returncode}"
        return Finding("cpu kernels", WARN, f"build failed, torch reference runs: {why}")
    except (OSError, ValueError) as exc:
        return Finding("cpu kernels", WARN, f"cannot be built, torch reference runs: {exc}")
    if not cpu_library.available():
        return Finding("cpu kernels", WARN, "built but not loadable: torch reference runs")
    return Finding("cpu kernels", OK, f"loaded, built for {cpu_kernel_isa()}")


def cpu_kernel_isa() -> str:
    """The widest instruction set the loaded CPU kernels use."""
    from kvfleet.kernels.cpu import cpu_attention, cpu_features, cpu_library

    if cpu_attention.uses_amx():
        return "AMX (bf16 tiles)"
    if cpu_attention.uses_bf16_dot():
        return "AVX512-BF16"
    if cpu_library.avx512():
        return "AVX-512"
    if {"avx2", "fma"} <= cpu_features.cpu_flags():
        return "AVX2 + FMA"
    return "the compiler's baseline (no AVX2)"
