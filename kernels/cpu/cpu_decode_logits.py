"""A decode step from token ids to logits in one C call (cpu_decode_step.c's
kvfleet_decode_logits_*): the embedding lookup, the fused decoder stack (cpu_decode_step), the
final RMSNorm and the LM head, each the kernel the two-call path runs (the model's `forward`,
then `compute_logits`), so the same bits.

Why: after a step's kernels have streamed the weights, Python and torch code runs from cold
caches. On the 2-core Zen 4 host the dozen small torch calls around the fused stack (input
tensors, the embedding, the final norm, the row gather, the LM head's output and its widening
to float32) cost ~1 ms a one-sequence step, against ~0.2 ms for the same calls warm: a seventh
of a step whose weights stream in 4.4-7.6 ms. Here the inputs go into buffers made once and
the logits come back in one, so a step makes no torch call before the sampler.
"""

from __future__ import annotations

import ctypes

import torch
from kvfleet.kernels.cpu import (
    cpu_decode_step,
    cpu_elementwise,
    cpu_gemm,
    cpu_gemm_quant,
    cpu_library,
)
from kvfleet.kernels.policy import KernelPolicy
from kvfleet.kernels.quant_weight import QuantizedWeight

_BF16 = torch.bfloat16


class _Ends(ctypes.Structure):
    _fields_ = [
        ("embed", ctypes.c_void_p),
        ("vocab", ctypes.c_int64),
        ("norm", ctypes.c_void_p),
        ("lm_head", ctypes.c_void_p),
        ("lm_head_rows", ctypes.c_int64),
        ("lm_head_quantized", ctypes.c_int32),
        ("lm_head_scratch", ctypes.c_void_p),
    ]


class DecodeLogits:
    """The one-call step for a `DecodeStack` and the model's embedding table, final norm and LM
    head. Its inputs are Python lists (what the model runner builds anyway); its logits, a view
    of a buffer it owns, stay valid until its next `run`. Asked, it also returns each row's
    argmax (greedy sampling's pick, by the kernel `dispatch.argmax` runs), which spares the
    sampler its torch calls."""

    def __init__(
        self,
        stack: cpu_decode_step.DecodeStack,
        embed: torch.Tensor,
        norm: torch.Tensor,
        lm_head: torch.Tensor | QuantizedWeight,
        lm_head_rows: int,
        max_rows: int,
        max_blocks: int,
    ) -> None:
        self.stack, self.max_rows, self.max_blocks = stack, max_rows, max_blocks
        self.vocab = embed.shape[0]
        self._keep = (embed, norm, lm_head)
        quantized = isinstance(lm_head, QuantizedWeight)
        head = (
            ctypes.addressof(cpu_gemm_quant.c_struct(lm_head)) if quantized else lm_head.data_ptr()
        )
        # A quantized head's dequantized form for steps past the in-register GEMM's rows
        # (pages are touched only if such steps come).
        self._head_scratch = torch.empty(lm_head_rows * embed.shape[1]) if quantized else None
        self._ends = _Ends(
            embed.data_ptr(), self.vocab, norm.data_ptr(), head, lm_head_rows, int(quantized),
            self._head_scratch.data_ptr() if quantized else None,
        )  # fmt: skip
        self._ids = (ctypes.c_int64 * max_rows)()
        self._positions = (ctypes.c_int64 * max_rows)()
        self._slots = (ctypes.c_int64 * max_rows)()
        self._seq_lens = (ctypes.c_int32 * max_rows)()
        self._argmax = (ctypes.c_int64 * max_rows)()
        self._tables = (ctypes.c_int32 * (max_rows * max_blocks))()
        self._logits = torch.empty(max_rows, lm_head_rows, dtype=torch.float32)
        # One view per row count, made once: a slice per step would be a torch call.
        self._views: dict[int, torch.Tensor] = {}

    def accepts(self, rows: int, max_blocks: int, policy: KernelPolicy) -> bool:
        """Whether a decode-only step of `rows` sequences, the longest holding `max_blocks`
        blocks, runs here under `policy`: the fused step allowed, the rows the fused stack
        takes, no more than the policy's one-call rows, within the buffers."""
        return (
            policy.fused_decode_step
            and rows <= policy.one_call_max_rows
            and self.stack.takes_rows(rows, policy)
            and rows <= self.max_rows
            and max_blocks <= self.max_blocks
        )

    def run(
        self,
        input_ids: list[int],
        positions: list[int],
        slots: list[int],
        seq_lens: list[int],
        tables: list[list[int]],
        argmax: bool = False,
        *,
        policy: KernelPolicy,
    ) -> tuple[torch.Tensor, list[int] | None]:
        """float32 logits [rows, lm_head_rows] of a step `accepts` took under `policy` (whose
        engines it runs): one token per sequence
        (`input_ids[i]` at `positions[i]`, its K/V into slot `slots[i]`), each sequence's length
        with that token and its block table; with `argmax`, each row's argmax (else None).
        Writes the step's K/V into the stack's caches."""
        m = len(input_ids)
        self._ids[:m] = input_ids
        self._positions[:m] = positions
        self._slots[:m] = slots
        self._seq_lens[:m] = seq_lens
        stride = self.max_blocks
        for i, table in enumerate(tables):
            self._tables[i * stride : i * stride + len(table)] = table
        out = self._views.get(m)
        if out is None:
            out = self._views[m] = self._logits[:m]
        self.stack.route(policy)
        lib = cpu_library.library()
        args = (
            ctypes.byref(self.stack.c_struct), ctypes.byref(self._ends), self._ids, m,
            self._positions, self._slots, self._tables, stride, self._seq_lens,
            out.data_ptr(), self._argmax if argmax else None, int(policy.allow_amx),
            torch.get_num_threads(),
        )  # fmt: skip
        if self.stack.dtype == _BF16:
            status = lib.kvfleet_decode_logits_bf16(*args, cpu_gemm.kernel(policy))
        else:
            status = lib.kvfleet_decode_logits_f32(*args)
        if status == cpu_decode_step.TOKEN_STATUS:
            raise IndexError(f"decode step: a token id is outside [0, {self.vocab})")
        if status != 0:
            self.stack.raise_status(status)
        return out, (self._argmax[:m] if argmax else None)


def build(
    stack: cpu_decode_step.DecodeStack | None,
    embed: torch.Tensor,
    norm: torch.Tensor,
    lm_head: object,
    max_rows: int,
    max_blocks: int,
) -> DecodeLogits | None:
    """The one-call step where the stack exists and its ends run on the kernels the two-call
    path runs on them (a contiguous embedding table in the stack's dtype, a final norm the C
    RMSNorm takes, an LM head the stack's GEMM reads: packed tiles in bf16, a plain or quantized
    weight in float32); else None."""
    if stack is None or max_rows < 1 or max_blocks < 1:
        return None
    dtype, hidden = stack.dtype, stack.hidden
    row = torch.empty(1, hidden, dtype=dtype)
    if not (
        embed.dtype == dtype
        and embed.device.type == "cpu"
        and embed.dim() == 2
        and embed.shape[1] == hidden
        and embed.is_contiguous()
        and cpu_elementwise.supports_rms_norm(row, norm, torch.empty(1, hidden))
    ):
        return None
    if dtype == _BF16:
        if not (cpu_decode_step.is_packed(lm_head) and lm_head.in_features == hidden):
            return None
        weight, rows = lm_head.tiles, lm_head.out_features
    elif isinstance(lm_head, QuantizedWeight):
        weight, rows = lm_head, lm_head.out_features
        if not cpu_decode_step.is_quantized(weight, rows, hidden):
            return None
    else:
        weight, rows = lm_head, lm_head.shape[0] if isinstance(lm_head, torch.Tensor) else 0
        if not cpu_decode_step.is_plain_f32(weight, rows, hidden):
            return None
    return DecodeLogits(stack, embed, norm, weight, rows, max_rows, max_blocks)
