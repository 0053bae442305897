"""The C paged decode-attention kernel for the CPU path (kernels/cpu_attention.c).

Compiled on first use with the machine's gcc (`-O3 -march=native -fopenmp`) into
`$KVFLEET_CACHE_DIR/kernels` (else ~/.cache/kvfleet/kernels) under a name hashing the source,
the compiler's version and the flags, so a changed source, compiler or flag set builds afresh
and an unchanged one loads the cached library. Where gcc is missing or the build fails,
`available()` logs the compiler's message once and returns False, and callers keep the torch
reference; `KVFLEET_CPU_KERNELS=0` turns the kernel off.

torch ships its own libgomp.so.1; the dynamic loader resolves our library's libgomp.so.1 to
that already-loaded copy, so the kernel's OpenMP threads are the same pool torch uses.
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
from kvfleet.kernels import reference

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_attention.c")
COMPILER = ["gcc"]  # the compiler command; tests replace it to simulate a broken toolchain
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"]

_DTYPES = {torch.float32: 0, torch.bfloat16: 1}  # the C file's DTYPE_* codes
_MAX_HEAD_DIM, _LANES, _MAX_BLOCK_SIZE = 256, 16, 256
_ERRORS = {1: "unsupported shape or dtype", 2: "out of memory for per-thread scratch"}


def _cache_dir() -> Path:
    root = os.environ.get("KVFLEET_CACHE_DIR")
    base = Path(root) if root else Path.home() / ".cache" / "kvfleet"
    return base / "kernels"


def _compiler_version() -> str:
    out = subprocess.run([*COMPILER, "--version"], capture_output=True, text=True, check=True)
    return out.stdout


def _build() -> Path:
    """The compiled library's path, building it unless a cached one matches. Raises
    OSError/subprocess.CalledProcessError with the compiler's output on failure."""
    source = SOURCE.read_bytes()
    key = hashlib.sha256(
        source + _compiler_version().encode() + " ".join(COMPILER + FLAGS).encode()
    ).hexdigest()[:16]
    target = _cache_dir() / f"cpu_attention-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build under a temporary name and rename: a concurrent process (another engine, a
    # parallel test) sees either no library or a complete one, never a half-written file.
    fd, tmp = tempfile.mkstemp(prefix=target.stem, suffix=".so.tmp", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run(
            [*COMPILER, *FLAGS, str(SOURCE), "-o", tmp, "-lm"],
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
def _library() -> ctypes.CDLL | None:
    try:
        lib = ctypes.CDLL(str(_build()))
    except subprocess.CalledProcessError as exc:
        detail = (exc.stderr or exc.stdout or "").strip() or f"exit status {exc.returncode}"
        log.warning("CPU attention kernel: build failed, using the torch reference: %s", detail)
        return None
    except OSError as exc:
        log.warning("CPU attention kernel unavailable, using the torch reference: %s", exc)
        return None
    fn = lib.kvfleet_decode_attention
    fn.restype = ctypes.c_int
    fn.argtypes = [
        ctypes.c_void_p,  # query
        ctypes.c_void_p,  # out
        ctypes.c_void_p,  # k_cache
        ctypes.c_void_p,  # v_cache
        ctypes.c_int,  # dtype
        ctypes.c_void_p,  # block_tables
        ctypes.c_int64,  # table_stride
        ctypes.c_void_p,  # seq_lens
        ctypes.c_int,  # num_seqs
        ctypes.c_int,  # num_heads
        ctypes.c_int,  # num_kv_heads
        ctypes.c_int,  # head_dim
        ctypes.c_int,  # block_size
        ctypes.c_int64,  # num_blocks
        ctypes.c_float,  # scale
        ctypes.c_int,  # num_threads
    ]
    lib.kvfleet_cpu_attention_bf16_dot.restype = ctypes.c_int
    lib.kvfleet_cpu_attention_bf16_dot.argtypes = []
    return lib


def uses_bf16_dot() -> bool:
    """Whether the built kernel computes bf16 caches with AVX512-BF16 dot products (gcc saw
    AVX512-BF16 under -march=native) rather than by widening K/V blocks to float32."""
    return available() and bool(_library().kvfleet_cpu_attention_bf16_dot())


def available() -> bool:
    """Whether the kernel can run here (compiles it on the first call)."""
    if os.environ.get("KVFLEET_CPU_KERNELS", "1") == "0":
        return False
    return _library() is not None


def supports(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether these inputs fit the kernel: CPU tensors, head-major caches of one supported
    dtype, head_dim a multiple of 16 up to 256, whole GQA groups."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    return (
        query.device.type == k_cache.device.type == v_cache.device.type == "cpu"
        and k_cache.dtype in _DTYPES
        and v_cache.dtype == k_cache.dtype
        and query.dtype in (torch.float32, torch.bfloat16, torch.float16)
        and k_cache.shape == v_cache.shape
        and reference._is_head_major(k_cache)
        and reference._is_head_major(v_cache)
        and head_dim % _LANES == 0
        and 0 < head_dim <= _MAX_HEAD_DIM
        and 0 < block_size <= _MAX_BLOCK_SIZE
        and num_heads % num_kv_heads == 0
    )


def decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seq_len: int,
    scale: float,
) -> torch.Tensor:
    """`reference.decode_attention` computed by the C kernel; inputs it cannot take (see
    `supports`) or a disabled/unbuildable kernel go to the reference instead."""
    if not (available() and supports(query, k_cache, v_cache)):
        return reference.decode_attention(
            query, k_cache, v_cache, block_tables, seq_lens, max_seq_len, scale
        )
    num_seqs, num_heads, head_dim = query.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    q = query.to(torch.float32).contiguous()
    out = torch.empty_like(q)
    tables = block_tables.to(torch.int32)
    if tables.stride(-1) != 1:
        tables = tables.contiguous()
    lens = seq_lens[:num_seqs].to(torch.int32).contiguous()
    # The storage behind the permuted view: [kv_heads, blocks, block, D], contiguous.
    k_store, v_store = k_cache.permute(2, 0, 1, 3), v_cache.permute(2, 0, 1, 3)
    status = _library().kvfleet_decode_attention(
        q.data_ptr(),
        out.data_ptr(),
        k_store.data_ptr(),
        v_store.data_ptr(),
        _DTYPES[k_cache.dtype],
        tables.data_ptr(),
        tables.stride(0),
        lens.data_ptr(),
        num_seqs,
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        num_blocks,
        scale,
        torch.get_num_threads(),
    )
    if status != 0:
        raise RuntimeError(f"CPU decode attention kernel: {_ERRORS.get(status, status)}")
    return out.to(query.dtype)
