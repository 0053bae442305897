"""A step through a whole Llama-family decoder stack in one C call
(kernels/cpu/cpu_decode_step.c): decode-only steps, and steps carrying prompt chunks after their
decodes.

The C side chains the kernels the per-op path calls per layer (RMSNorm + qkv, rotary + cache
write, decode attention and each chunk's prefill attention, o, RMSNorm + gate/up, SiLU-and-mul +
down) in the same order on the same inputs: the same bits, with one Python call a step instead
of six per layer. On the 2-core host that took a bf16 bundled-model decode step from 26.6 to
16.1 ms at 1 sequence and from 69.1 to 53.5 ms at 32 (medians, `kvfleet bench decode-step`,
docs/results/bench-decode-step.json), and on an AVX-512-only host a float32 one from 41.9 to
32.8 ms at 4 sequences, 87.2 to 73.6 at 32 and 293.6 to 275.3 at 128 (`--dtype float32`,
docs/results/bench-decode-step-float32.json); with a 128-token chunk beside 1 / 8 / 32 decodes
of the bundled model kept 4-bit, 147.7 / 168.8 / 208.9 ms op by op against 139.1 / 154.6 /
188.3 (`--prompt-tokens 128`, docs/results/bench-decode-step-q4-chunk128-avx512bf16.json).

Two forms, by the model's dtype. bf16: weights prepacked for cpu_gemm (whose AMX engine runs on
AMX hosts, its AVX512-BF16 one elsewhere), head-major bf16 caches, up to
`cpu_gemm.max_rows(policy)` sequences. float32 (the CPU default without AVX512-BF16): plain
weights, head-major float32 caches, the rows the per-op path runs on `cpu_gemm_f32`; or 4-bit /
8-bit weights (every projection), the rows the per-op path runs on `cpu_gemm_quant`.
`build` says once per stack and set of caches whether one applies; `DecodeStack.accepts` says
per step, under the kernel policy the step runs (as many rows as the per-op path runs on the
same GEMM kernel, prompt chunks only where the per-op path would run them on a prefill kernel,
and only where the policy allows the fused step).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from kvfleet.kernels.cpu import (
    cpu_attention,
    cpu_cache,
    cpu_elementwise,
    cpu_gemm,
    cpu_gemm_f32,
    cpu_gemm_quant,
    cpu_library,
    cpu_linear,
    cpu_prefill,
)
from kvfleet.kernels.metadata import AttentionMetadata
from kvfleet.kernels.policy import KernelPolicy
from kvfleet.kernels.quant_weight import QuantizedWeight

_BF16 = torch.bfloat16
# cpu_decode_step.c's stage codes, for error messages.
_STAGES = {
    1: "RMSNorm + qkv projection",
    2: "rotary + cache write",
    3: "attention",
    4: "o projection",
    5: "RMSNorm + gate/up projection",
    6: "SiLU-and-mul + down projection",
}
_NUM_STAGES, _STATUS_RANGE = 8, 16
_ROTARY_STAGE, _ERR_POSITION, _ERR_SLOT = 2, 2, 3
# The one-call step's own stage (cpu_decode_logits: embedding, final norm, LM head) and the
# status of a token id outside the embedding table.
_ENDS_STAGE = 7
TOKEN_STATUS = _ENDS_STAGE * _STATUS_RANGE + 4


class _Layer(ctypes.Structure):
    _fields_ = [
        ("input_norm", ctypes.c_void_p),
        ("qkv", ctypes.c_void_p),
        ("qkv_bias", ctypes.c_void_p),
        ("o", ctypes.c_void_p),
        ("post_norm", ctypes.c_void_p),
        ("gate_up", ctypes.c_void_p),
        ("down", ctypes.c_void_p),
        ("k_cache", ctypes.c_void_p),
        ("v_cache", ctypes.c_void_p),
    ]


class _Stack(ctypes.Structure):
    _fields_ = [
        ("layers", ctypes.POINTER(_Layer)),
        ("num_layers", ctypes.c_int32),
        ("hidden", ctypes.c_int32),
        ("num_heads", ctypes.c_int32),
        ("num_kv_heads", ctypes.c_int32),
        ("head_dim", ctypes.c_int32),
        ("intermediate", ctypes.c_int32),
        ("rot_dim", ctypes.c_int32),
        ("block_size", ctypes.c_int32),
        ("num_blocks", ctypes.c_int64),
        ("cos_sin", ctypes.c_void_p),
        ("cos_sin_stride", ctypes.c_int64),
        ("max_position", ctypes.c_int64),
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
        ("quantized", ctypes.c_int32),
        ("quant_max_rows", ctypes.c_int64),
        ("scratch", ctypes.c_void_p),
    ]


@dataclass(slots=True)
class LayerWeights:
    """One decoder layer's weights as the model holds them after `prepack`."""

    input_norm: torch.Tensor
    qkv: object  # bf16: cpu_linear.PackedLinear where the stack applies; float32: a tensor
    qkv_bias: torch.Tensor | None
    o: object
    post_norm: torch.Tensor
    gate_up: object
    down: object


@dataclass(slots=True, frozen=True)
class StackShape:
    """The decoder stack's dimensions the C call needs beside its weights."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int
    eps: float
    scale: float


class DecodeStack:
    """A decoder stack's weights and K/V caches as cpu_decode_step.c reads them. It holds every
    tensor it points at, so the pointers stay valid for its lifetime; it is bound to those
    caches (`build` again for others). It holds no kernel choice: each step's policy decides
    whether it runs and on which engines."""

    def __init__(
        self,
        layers: Sequence[LayerWeights],
        kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
        cos_sin_cache: torch.Tensor,
        shape: StackShape,
        dtype: torch.dtype = _BF16,
    ) -> None:
        # Kernel inputs: the bias as float32 (what cpu_gemm and cpu_gemm_f32 pass), bf16's
        # packed tiles, float32's plain weights or their quantized weights' structs.
        self.dtype = dtype
        self.quantized = isinstance(layers[0].qkv, QuantizedWeight)
        if dtype == _BF16:
            weight = lambda w: w.tiles.data_ptr()  # noqa: E731
        elif self.quantized:
            weight = lambda w: ctypes.addressof(cpu_gemm_quant.c_struct(w))  # noqa: E731
        else:
            weight = lambda w: w.data_ptr()  # noqa: E731
        biases = [None if w.qkv_bias is None else w.qkv_bias.float().contiguous() for w in layers]
        self._keep = [layers, kv_caches, cos_sin_cache, biases]
        self._layers = (_Layer * len(layers))()
        for entry, w, bias, (k_cache, v_cache) in zip(
            self._layers, layers, biases, kv_caches, strict=True
        ):
            entry.input_norm = w.input_norm.data_ptr()
            entry.qkv = weight(w.qkv)
            entry.qkv_bias = bias.data_ptr() if bias is not None else None
            entry.o = weight(w.o)
            entry.post_norm = w.post_norm.data_ptr()
            entry.gate_up = weight(w.gate_up)
            entry.down = weight(w.down)
            # A head-major cache is a permuted view of [kv_heads, blocks, block, D] storage,
            # which starts at the view's own data pointer.
            entry.k_cache, entry.v_cache = k_cache.data_ptr(), v_cache.data_ptr()
        num_blocks, block_size = kv_caches[0][0].shape[:2]
        self.hidden = layers[0].input_norm.shape[0]
        self._stack = _Stack(
            self._layers,
            len(layers),
            self.hidden,
            shape.num_heads,
            shape.num_kv_heads,
            shape.head_dim,
            shape.intermediate,
            cos_sin_cache.shape[1],
            block_size,
            num_blocks,
            cos_sin_cache.data_ptr(),
            cos_sin_cache.stride(0),
            cos_sin_cache.shape[0],
            shape.eps,
            shape.scale,
            int(self.quantized),
            0,  # set per step from its policy
            None,
        )
        if self.quantized:
            # Where steps past the in-register GEMM's rows dequantize each weight.
            largest = max(p.out_features * p.in_features for w in layers for p in _projections(w))
            self._scratch = torch.empty(largest, dtype=torch.float32)
            self._stack.scratch = self._scratch.data_ptr()
        self.num_blocks, self.block_size = num_blocks, block_size
        self.max_position = cos_sin_cache.shape[0]
        # One token's query as attention sees it, and the caches: what `cpu_prefill` is asked
        # whether it takes a step's prompt chunks, as the per-op path asks it of the real ones.
        query = torch.empty(1, shape.num_heads, shape.head_dim, dtype=dtype)
        self._prefill_probe = (query, *kv_caches[0])

    @property
    def c_struct(self) -> ctypes.Structure:
        """The DecodeStack struct the C calls take (by reference)."""
        return self._stack

    def route(self, policy: KernelPolicy) -> None:
        """Route the next C call's quantized projections as `policy` routes the per-op path's
        (in registers up to `cpu_gemm_quant.max_rows(policy)`)."""
        self._stack.quant_max_rows = cpu_gemm_quant.max_rows(policy)

    def row_range(self, policy: KernelPolicy) -> tuple[int, int]:
        """The rows (lo, hi) of a step that runs here under `policy`: as many as the per-op
        path would run on the same GEMM kernel (`cpu_gemm.max_rows(policy)` in bf16,
        `cpu_gemm_f32.min_rows()` to the policy's `f32_gemm_max_rows` in float32; through
        quantized weights 1 to `cpu_gemm_quant.max_rows` in registers, then dequantized up to
        `f32_gemm_max_rows`), so that fused and per-op give the same bits."""
        if self.dtype == _BF16:
            return 1, cpu_gemm.max_rows(policy)
        if self.quantized:
            # In-register up to its rows; past them dequantized into the float32 GEMM.
            return 1, max(cpu_gemm_quant.max_rows(policy), policy.f32_gemm_max_rows)
        return cpu_gemm_f32.min_rows(), policy.f32_gemm_max_rows

    def takes_rows(self, rows: int, policy: KernelPolicy) -> bool:
        """Whether a step of `rows` rows is within `row_range(policy)`."""
        lo, hi = self.row_range(policy)
        return lo <= rows <= hi

    def accepts(self, meta: AttentionMetadata, rows: int, policy: KernelPolicy) -> bool:
        """Whether this step runs here under `policy`: the fused step allowed, as many rows as
        `takes_rows`, and any prompt chunks allowed too and taken by the prefill kernel."""
        if not (
            policy.fused_decode_step
            and self.takes_rows(rows, policy)
            and meta.block_tables.dtype == torch.int32
            and meta.block_tables.stride(-1) == 1
            and meta.seq_lens.dtype == torch.int32
            and meta.seq_lens.is_contiguous()
            and meta.slot_mapping.dtype == torch.int64
            and meta.slot_mapping.is_contiguous()
            and meta.slot_mapping.numel() == rows
        ):
            return False
        if meta.num_decodes == meta.num_seqs:
            return meta.num_decodes == rows
        return policy.fused_prompt_step and self._prefill_takes(meta, policy)

    def _prefill_takes(self, meta: AttentionMetadata, policy: KernelPolicy) -> bool:
        """Whether the per-op path would run each of the step's prompt chunks on the prefill
        kernel the C step calls (elsewhere it computes them with SDPA, other bits)."""
        query, k_cache, v_cache = self._prefill_probe
        starts = meta.query_start_loc
        return (
            starts.dtype == torch.int32
            and starts.is_contiguous()
            and cpu_prefill.available(self.dtype, policy=policy)
            and cpu_prefill.supports(query, k_cache, v_cache, policy=policy)
            and all(
                cpu_prefill.takes(query, seq_len, policy=policy, q_len=q_len)
                for q_len, seq_len in zip(
                    meta.query_lens_host[meta.num_decodes :],
                    meta.seq_lens_host[meta.num_decodes :],
                    strict=True,
                )
            )
        )

    def run(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        policy: KernelPolicy,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden, residual) after the last layer for a step `accepts` took under `policy`
        (whose engines it runs): the pair the per-op layer loop returns. `hidden` ([rows,
        hidden] embeddings in the stack's dtype) is overwritten."""
        rows = hidden.shape[0]
        if (
            hidden.shape != (rows, self.hidden)
            or hidden.dtype != self.dtype
            or not hidden.is_contiguous()
        ):
            name = "bf16" if self.dtype == _BF16 else "float32"
            raise ValueError(
                f"fused step: hidden must be contiguous {name} [{rows}, {self.hidden}], got "
                f"{tuple(hidden.shape)} {hidden.dtype}"
            )
        if positions.dtype != torch.int64 or not positions.is_contiguous():
            positions = positions.to(torch.int64).contiguous()
        residual = torch.empty(rows, self.hidden, dtype=torch.float32)
        self.route(policy)
        tables = meta.block_tables
        lib = cpu_library.library()
        prompts = meta.num_decodes < meta.num_seqs
        args = (
            ctypes.byref(self._stack), hidden.data_ptr(), residual.data_ptr(), rows,
            positions.data_ptr(), meta.slot_mapping.data_ptr(), tables.data_ptr(),
            tables.stride(0), meta.seq_lens.data_ptr(), meta.num_seqs, meta.num_decodes,
            meta.query_start_loc.data_ptr() if prompts else None,
        )  # fmt: skip
        threads = torch.get_num_threads()
        if self.dtype == _BF16:
            # The engines the per-op path's projections and prefills run on, asked per step as
            # they ask them.
            amx = prompts and cpu_prefill.bf16_kernel(policy) == cpu_prefill.KERNEL_AMX
            status = lib.kvfleet_stack_step_bf16(
                *args, int(amx), int(policy.allow_amx), threads, cpu_gemm.kernel(policy)
            )
        else:
            status = lib.kvfleet_stack_step_f32(*args, int(policy.allow_amx), threads)
        if status != 0:
            self.raise_status(status)
        return hidden, residual

    def raise_status(self, status: int) -> None:
        """Raise the error a failed C step's status code describes."""
        code, stage = status % _STATUS_RANGE, status // _STATUS_RANGE
        layer, stage = divmod(stage, _NUM_STAGES)
        if stage == _ROTARY_STAGE and code == _ERR_POSITION:
            raise IndexError(f"rotary_embedding: a position is outside [0, {self.max_position})")
        if stage == _ROTARY_STAGE and code == _ERR_SLOT:
            capacity = self.num_blocks * self.block_size
            raise IndexError(f"reshape_and_cache: a slot is past the cache ({capacity})")
        if stage == 0:
            raise MemoryError("fused step: out of memory for its activations")
        if stage == _ENDS_STAGE:
            raise RuntimeError(
                f"fused step: the final RMSNorm or LM head failed with status {code}"
            )
        raise RuntimeError(
            f"fused step: layer {layer}'s {_STAGES.get(stage, stage)} kernel failed with "
            f"status {code}"
        )


def is_packed(weight: object) -> bool:
    """A bf16 weight packed with tiles that cpu_gemm reads (`cpu_linear.pack`)."""
    return isinstance(weight, cpu_linear.PackedLinear) and weight.tiles is not None


class _Probe:
    """A one-token step of the tensors the fused call hands its kernels (an embedding row, the
    residual, q/k/v as views of one qkv row, a position and a slot), so `build` asks each
    kernel's own `supports` instead of repeating its conditions."""

    def __init__(self, hidden: int, shape: StackShape, dtype: torch.dtype) -> None:
        d = shape.head_dim
        q_size, kv_size = shape.num_heads * d, shape.num_kv_heads * d
        self.x = torch.empty(1, hidden, dtype=dtype)
        self.residual = torch.empty(1, hidden, dtype=torch.float32)
        qkv = torch.empty(1, q_size + 2 * kv_size, dtype=dtype)
        self.q = qkv[:, :q_size].view(1, shape.num_heads, d)
        self.k = qkv[:, q_size : q_size + kv_size].view(1, shape.num_kv_heads, d)
        self.v = qkv[:, q_size + kv_size :].view(1, shape.num_kv_heads, d)
        self.position = torch.zeros(1, dtype=torch.int64)
        self.slot = torch.zeros(1, dtype=torch.int64)

    def kernels_take(self, w: LayerWeights, k_cache, v_cache, cos_sin_cache) -> bool:
        """Whether the per-op path would run each of this layer's non-GEMM ops on its C
        kernel."""
        return (
            cpu_elementwise.supports_rms_norm(self.x, w.input_norm, self.residual)
            and cpu_elementwise.supports_rms_norm(self.x, w.post_norm, self.residual)
            and cpu_elementwise.supports_rotary(self.position, self.q, self.k, cos_sin_cache, True)
            and cpu_cache.supports(self.k, self.v, k_cache, v_cache, self.slot)
            and cpu_attention.supports(self.q, k_cache, v_cache)
        )


def is_plain_f32(weight: object, rows: int, cols: int) -> bool:
    """A plain float32 weight [rows, cols] that cpu_gemm_f32 reads in place."""
    return (
        isinstance(weight, torch.Tensor)
        and weight.dtype == torch.float32
        and weight.device.type == "cpu"
        and weight.shape == (rows, cols)
        and weight.is_contiguous()
    )


def _projections(w: LayerWeights) -> tuple[object, ...]:
    return (w.qkv, w.o, w.gate_up, w.down)


def is_quantized(weight: object, rows: int, cols: int) -> bool:
    """A quantized [rows, cols] weight that cpu_gemm_quant reads."""
    return cpu_gemm_quant.supports(weight) and weight.shape == (rows, cols)


def build(
    layers: Sequence[LayerWeights],
    kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    cos_sin_cache: torch.Tensor,
    shape: StackShape,
) -> DecodeStack | None:
    """The fused decode step for these weights and caches, or None where it does not apply
    (then the model keeps its per-op layer loop, which handles every case). Whether a step
    takes it is its policy's say (`DecodeStack.accepts`)."""
    if not (layers and len(layers) == len(kv_caches)):
        return None
    dtype = layers[0].input_norm.dtype
    if not (
        (dtype == _BF16 and cpu_gemm.available())
        or (dtype == torch.float32 and cpu_gemm_f32.available())
    ):
        return None
    hidden = layers[0].input_norm.shape[0]
    q_size = shape.num_heads * shape.head_dim
    qkv_n = q_size + 2 * shape.num_kv_heads * shape.head_dim
    gate_up_n = 2 * shape.intermediate
    probe = _Probe(hidden, shape, dtype)
    first = kv_caches[0][0]
    for w, (k_cache, v_cache) in zip(layers, kv_caches, strict=True):
        if dtype == _BF16:
            weights_fit = (
                all(is_packed(p) for p in (w.qkv, w.o, w.gate_up, w.down))
                and (w.qkv.out_features, w.qkv.in_features) == (qkv_n, hidden)
                and (w.o.out_features, w.o.in_features) == (hidden, q_size)
                and (w.gate_up.out_features, w.gate_up.in_features) == (gate_up_n, hidden)
                and (w.down.out_features, w.down.in_features) == (hidden, shape.intermediate)
            )
        else:
            # All plain or all quantized: the C step takes one kind of projection.
            fits = is_quantized if isinstance(layers[0].qkv, QuantizedWeight) else is_plain_f32
            weights_fit = (
                fits(w.qkv, qkv_n, hidden)
                and fits(w.o, hidden, q_size)
                and fits(w.gate_up, gate_up_n, hidden)
                and fits(w.down, hidden, shape.intermediate)
            )
        if not (
            weights_fit
            and (w.qkv_bias is None or w.qkv_bias.shape == (qkv_n,))
            # One block count and size for the whole stack (the C side takes them once);
            # the caches' dtype comes with the probe's k and v.
            and k_cache.shape == first.shape
            and probe.kernels_take(w, k_cache, v_cache, cos_sin_cache)
        ):
            return None
    return DecodeStack(layers, kv_caches, cos_sin_cache, shape, dtype)
