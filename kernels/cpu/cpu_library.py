"""The C library behind the CPU path: in this folder (kernels/cpu/), cpu_attention.c (with its
paths cpu_attention_f32.c, cpu_attention_bf16.c and cpu_attention_amx.c), cpu_prefill.c,
cpu_prefill_f32.c, cpu_cache.c, cpu_elementwise.c, cpu_argmax.c, cpu_gemm.c, cpu_gemm_f32.c,
cpu_gemm_quant.c, cpu_quant_dequantize.c and cpu_decode_step.c (with their headers cpu_math.h,
cpu_amx.h, cpu_cache.h, cpu_entry_points.h, cpu_attention.h, cpu_vec_f32.h and cpu_quant_block.h,
#included by name from the same folder), built into one shared object.

Compiled on first use with the machine's gcc (`-O3 -march=native -fopenmp`) into
`$KVFLEET_CACHE_DIR/kernels` (else ~/.cache/kvfleet/kernels) under a name hashing the sources,
the compiler's version and the flags, so a changed source, compiler or flag set builds afresh
and an unchanged one loads the cached library. Where gcc is missing or the build fails,
`available()` logs the compiler's message once and returns False, and callers keep the torch
reference; `KVFLEET_CPU_KERNELS=0` turns the C kernels off.

torch ships its own libgomp.so.1; the dynamic loader resolves our library's libgomp.so.1 to
that already-loaded copy, so the kernels' OpenMP threads are the same pool torch uses.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import subprocess
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

HERE = Path(__file__).parent
_SOURCE_NAMES = (
    "cpu_attention.c",
    "cpu_attention_f32.c",
    "cpu_attention_bf16.c",
    "cpu_attention_amx.c",
    "cpu_prefill.c",
    "cpu_prefill_f32.c",
    "cpu_cache.c",
    "cpu_elementwise.c",
    "cpu_argmax.c",
    "cpu_gemm.c",
    "cpu_gemm_f32.c",
    "cpu_gemm_quant.c",
    "cpu_quant_dequantize.c",
    "cpu_decode_step.c",
)
SOURCES = [HERE / name for name in _SOURCE_NAMES]
_HEADER_NAMES = (
    "cpu_math.h",
    "cpu_amx.h",
    "cpu_cache.h",
    "cpu_entry_points.h",
    "cpu_attention.h",
    "cpu_vec_f32.h",
    "cpu_prefill_tile.h",
    "cpu_quant_block.h",
)
HEADERS = [HERE / name for name in _HEADER_NAMES]
COMPILER = ["gcc"]  # the compiler command; tests replace it to simulate a broken toolchain
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"]
# $KVFLEET_CPU_MAX_ISA=avx2 builds the kernels as for a CPU without AVX-512 (AMD before Zen 4,
# many Intel parts), on a CPU that has it: to measure or test the AVX2 forms there.
MAX_ISA_FLAGS = {"native": [], "avx2": ["-mno-avx512f"]}

# cpu_entry_points.h's DTYPE_* codes: the element type of activations and caches across the ABI.
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float8_e4m3fn: 2, torch.float8_e5m2: 3}

_i, _i32, _i64 = ctypes.c_int, ctypes.c_int32, ctypes.c_int64
_f, _p = ctypes.c_float, ctypes.c_void_p
# The library's C ABI in one place: argument types of every exported function (all return int).
SIGNATURES: dict[str, list[type]] = {
    # query, q_stride, out, out_stride, io_dtype, k_cache, v_cache, dtype, block_tables,
    # table_stride, seq_lens, num_seqs, num_heads, num_kv_heads, head_dim, block_size,
    # num_blocks, scale, num_threads, allow_amx
    "kvfleet_decode_attention": [_p, _i64, _p, _i64, _i, _p, _p, _i, _p, _i64, _p, _i, _i, _i, _i, _i, _i64, _f, _i, _i],
    "kvfleet_cpu_attention_bf16_dot": [],
    "kvfleet_cpu_attention_amx": [],
    # query, q_stride, out, out_stride, k_cache, v_cache, block_table, seq_len, q_len,
    # num_heads, num_kv_heads, head_dim, block_size, num_blocks, scale, num_threads
    "kvfleet_prefill_attention_bf16": [_p, _i64, _p, _i64, _p, _p, _p, _i, _i, _i, _i, _i, _i, _i64, _f, _i],
    "kvfleet_prefill_attention_amx": [],
    # the same arguments, float32 throughout; then bf16 on AVX-512 (no AMX), float32 inside
    "kvfleet_prefill_attention_f32": [_p, _i64, _p, _i64, _p, _p, _p, _i, _i, _i, _i, _i, _i, _i64, _f, _i],
    "kvfleet_prefill_attention_bf16_vec": [_p, _i64, _p, _i64, _p, _p, _p, _i, _i, _i, _i, _i, _i, _i64, _f, _i],
    "kvfleet_prefill_f32_lanes": [],
    # key, key_stride, value, value_stride, k_cache, v_cache, slots, tokens, kv_heads,
    # head_dim, block_size, num_blocks, elem_size
    "kvfleet_reshape_and_cache": [_p, _i64, _p, _i64, _p, _p, _p, _i64, _i, _i, _i, _i64, _i],
    # x, x_stride, residual, has_residual, weight, out, rows, hidden, eps, io_dtype, num_threads
    "kvfleet_add_rms_norm": [_p, _i64, _p, _i, _p, _p, _i64, _i, _f, _i, _i],
    # positions, tokens, q, q_stride, q_heads, k, k_stride, k_heads, head_dim, rot_dim,
    # cos_sin, cos_sin_stride, max_position, io_dtype, num_threads
    "kvfleet_rotary_neox": [_p, _i64, _p, _i64, _i, _p, _i64, _i, _i, _i, _p, _i64, _i64, _i, _i],
    # positions, tokens, q, q_stride, q_heads, k, k_stride, v, v_stride, kv_heads, head_dim,
    # rot_dim, cos_sin, cos_sin_stride, max_position, k_cache, v_cache, slots, num_blocks,
    # block_size, io_dtype, num_threads
    "kvfleet_rotary_and_cache": [_p, _i64, _p, _i64, _i, _p, _i64, _p, _i64, _i, _i, _i, _p, _i64, _i64, _p, _p, _p, _i64, _i, _i, _i],
    # x, x_stride, out, rows, d, io_dtype, num_threads
    "kvfleet_silu_and_mul": [_p, _i64, _p, _i64, _i, _i, _i],
    "kvfleet_avx512": [],
    # x, x_stride, rows, cols, out, num_threads
    "kvfleet_argmax_f32": [_p, _i64, _i64, _i64, _p, _i],
    # x, x_stride, prologue, residual, has_residual, norm_weight, eps, packed, bias, out,
    # out_stride, m, n, k, kernel, num_threads
    "kvfleet_linear_bf16": [_p, _i64, _i, _p, _i, _p, _f, _p, _p, _p, _i64, _i64, _i64, _i64, _i, _i],
    "kvfleet_linear_amx": [],
    "kvfleet_linear_avx512_bf16": [],
    # x, x_stride, w, bias, out, out_stride, m, n, k, num_threads
    "kvfleet_linear_f32": [_p, _i64, _p, _p, _p, _i64, _i64, _i64, _i64, _i],
    "kvfleet_linear_f32_lanes": [],
    # x, x_stride, weight (a QuantWeight), bias, out, out_stride, m, n, k, num_threads
    "kvfleet_linear_quant": [_p, _i64, _p, _p, _p, _i64, _i64, _i64, _i64, _i],
    # weight, out, n, k, num_threads
    "kvfleet_dequantize": [_p, _p, _i64, _i64, _i],
    "kvfleet_quant_block": [],
    "kvfleet_quant_fused_dot": [],
    # stack (a DecodeStack), hidden, residual, m, positions, slots, block_tables,
    # table_stride, seq_lens, num_seqs, num_decodes, query_start (or NULL), (bf16:
    # prefill_amx,) allow_amx, num_threads (bf16: then the GEMM kernel)
    "kvfleet_stack_step_bf16": [_p, _p, _p, _i64, _p, _p, _p, _i64, _p, _i32, _i32, _p, _i, _i, _i, _i],
    "kvfleet_stack_step_f32": [_p, _p, _p, _i64, _p, _p, _p, _i64, _p, _i32, _i32, _p, _i, _i],
    # stack, ends (a DecodeEnds), ids, m, positions, slots, block_tables, table_stride,
    # seq_lens, logits, argmax (or NULL), allow_amx, num_threads (bf16: then the GEMM kernel)
    "kvfleet_decode_logits_bf16": [_p, _p, _p, _i64, _p, _p, _p, _i64, _p, _p, _p, _i, _i, _i],
    "kvfleet_decode_logits_f32": [_p, _p, _p, _i64, _p, _p, _p, _i64, _p, _p, _p, _i, _i],
}  # fmt: skip


def _cache_dir() -> Path:
    root = os.environ.get("KVFLEET_CACHE_DIR")
    base = Path(root) if root else Path.home() / ".cache" / "kvfleet"
    return base / "kernels"


def _compiler_version() -> str:
    out = subprocess.run([*COMPILER, "--version"], capture_output=True, text=True, check=True)
    return out.stdout


def build_flags() -> list[str]:
    """The compiler flags of this build: FLAGS, narrowed by $KVFLEET_CPU_MAX_ISA."""
    isa = os.environ.get("KVFLEET_CPU_MAX_ISA", "native").strip().lower() or "native"
    if isa not in MAX_ISA_FLAGS:
        raise ValueError(
            f"KVFLEET_CPU_MAX_ISA: must be one of {', '.join(MAX_ISA_FLAGS)}, got {isa!r}"
        )
    return [*FLAGS, *MAX_ISA_FLAGS[isa]]


def library_path(flags: list[str]) -> Path:
    """Where the library built from these sources with `flags` and this compiler is cached."""
    digest = hashlib.sha256()
    for path in SOURCES + HEADERS:
        digest.update(path.read_bytes())
    digest.update(_compiler_version().encode() + " ".join(COMPILER + flags).encode())
    return _cache_dir() / f"cpu_kernels-{digest.hexdigest()[:16]}.so"


def build() -> Path:
    """The compiled library's path, building it unless a cached one matches. Raises
    OSError/subprocess.CalledProcessError with the compiler's output on failure."""
    flags = build_flags()
    target = library_path(flags)
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build under a temporary name and rename: a concurrent process (another engine, a
    # parallel test) sees either no library or a complete one, never a half-written file.
    fd, tmp = tempfile.mkstemp(prefix=target.stem, suffix=".so.tmp", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run(
            [*COMPILER, *flags, *map(str, SOURCES), "-o", tmp, "-lm"],
            capture_output=True,
            text=True,
            check=True,
        )
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


@functools.cache
def library() -> ctypes.CDLL | None:
    """The loaded library with its functions' signatures declared, or None if it cannot be
    built here (logged once)."""
    try:
        lib = ctypes.CDLL(str(build()))
    except subprocess.CalledProcessError as exc:
        detail = (exc.stderr or exc.stdout or "").strip() or f"exit status {exc.returncode}"
        log.warning("CPU kernels: build failed, using the torch reference: %s", detail)
        return None
    except OSError as exc:
        log.warning("CPU kernels unavailable, using the torch reference: %s", exc)
        return None
    for name, argtypes in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = ctypes.c_int, argtypes
    return lib


def available() -> bool:
    """Whether the C kernels can run here (compiles them on the first call)."""
    if os.environ.get("KVFLEET_CPU_KERNELS", "1") == "0":
        return False
    return library() is not None


def avx512() -> bool:
    """Whether the C kernels run here and were built for AVX-512 (the float32 prefill and
    GEMM kernels need it)."""
    return available() and _built_for_avx512(library())


@functools.cache
def _built_for_avx512(lib: ctypes.CDLL) -> bool:
    # Keyed by the loaded library: a reloaded one (tests clear library()'s cache) asks again.
    return bool(lib.kvfleet_avx512())
