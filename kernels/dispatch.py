"""The one entry point the model calls for each op: Triton on CUDA; on CPU the C kernels
(cpu_attention, cpu_prefill, cpu_cache, cpu_elementwise, cpu_argmax), prepacked bf16 GEMMs
(cpu_linear: oneDNN's, and cpu_gemm's AMX or AVX512-BF16 kernel for decode-sized steps) and
float32 GEMMs of decode-sized steps (cpu_gemm_f32) where they take the inputs, else the torch
reference.

A `Kernels` object routes every op by one frozen `KernelPolicy` (kernels/policy.py): a model
builds one at start and calls its methods, so two models with different policies in one process
route independently, and no module state decides a path. The policy's backend "triton" forces
the Triton path on any device (tests run it on CPU under TRITON_INTERPRET=1); "auto" picks
Triton for CUDA tensors when triton is importable. What no policy decides (where weights and
caches live, how weights are packed, greedy argmax) are module functions.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from kvfleet.kernels import reference
from kvfleet.kernels.cpu import (
    cpu_argmax,
    cpu_attention,
    cpu_cache,
    cpu_decode_step,
    cpu_elementwise,
    cpu_gemm,
    cpu_gemm_f32,
    cpu_gemm_quant,
    cpu_linear,
    cpu_prefill,
)
from kvfleet.kernels.cpu.huge_pages import HugePageArena
from kvfleet.kernels.metadata import AttentionMetadata, LoraMapping
from kvfleet.kernels.policy import DEFAULT_POLICY, KernelPolicy
from kvfleet.kernels.quant_weight import QuantizedWeight

# The names `Kernels.linear_path` gives the kernels a projection may run on: a benchmark reports
# each figure with the one that produced it. "torch" is whatever torch runs (oneDNN, MKL,
# cuBLAS).
PATH_AMX = "AMX"
PATH_AVX512_BF16 = "AVX512-BF16"
PATH_AVX512_F32 = "AVX-512 float32"
PATH_AVX2 = "AVX2"
PATH_TORCH = "torch"
PATH_DEQUANTIZED = "torch (dequantized per call)"

# What a projection weight may be: plain, prepacked for the bf16 CPU kernels, or quantized.
Weight = torch.Tensor | cpu_linear.PackedLinear | QuantizedWeight


@functools.cache
def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


# Triton modules are imported on first use: importing triton costs a second, and CPU-only
# installs may lack it entirely.


def memory_arena(device: torch.device | str) -> HugePageArena | None:
    """Where a model's streamed weights or KV caches on `device` go: a fresh huge-page arena on
    CPU (`huge_pages`), None elsewhere (the device's own allocator)."""
    return HugePageArena() if torch.device(device).type == "cpu" else None


def prepack_linear_weight(
    weight: Weight, arena: HugePageArena | None = None, policy: KernelPolicy = DEFAULT_POLICY
) -> Weight:
    """The form of a [out, in] projection weight that `Kernels.linear` runs fastest: for bf16
    CPU weights a `cpu_linear.PackedLinear` (oneDNN's blocked layout, plus AMX tile order where
    that kernel runs, whatever a policy lets it take; the plain weight can then be freed);
    CPU int4/int8 weights in the quantized kernel's blocked layout (`cpu_gemm_quant.pack`)
    unless `policy` sends every op to Triton (which reads the row layout);
    other CPU weights, quantized ones too, copied into `arena` when one is given (the same
    values, on huge pages); else the weight itself. Call once, after the weights are loaded."""
    if isinstance(weight, QuantizedWeight):
        if weight.device.type != "cpu":
            return weight
        if policy.backend != "triton":
            weight = cpu_gemm_quant.pack(weight)
        if arena is None:
            return weight
        return QuantizedWeight(
            weight.format, arena.copy(weight.qweight), arena.copy(weight.scales),
            None if weight.offsets is None else arena.copy(weight.offsets),
            weight.out_features, weight.in_features, weight.group_size, weight.block,
        )  # fmt: skip
    if cpu_linear.supports(weight) and cpu_linear.available():
        return cpu_linear.pack(weight, arena)
    if arena is not None and weight.device.type == "cpu":
        return arena.copy(weight.detach())
    return weight


def argmax(x: torch.Tensor) -> torch.Tensor:
    """Each row's first index of its largest value: `torch.argmax(x, dim=-1)` for [rows, n]
    logits (greedy sampling). On CUDA torch's own is fast already."""
    return cpu_argmax.argmax(x)


@dataclass(frozen=True, slots=True)
class Kernels:
    """Every op whose kernel a policy chooses, routed by `policy`."""

    policy: KernelPolicy = DEFAULT_POLICY

    def use_triton(self, t: torch.Tensor) -> bool:
        """Whether ops on tensor `t` run the Triton kernels under this policy's backend."""
        backend = self.policy.backend
        if backend == "torch":
            return False
        if backend == "triton":
            return True
        return t.is_cuda and _triton_available()

    def allocate_kv_cache(
        self,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        arena: HugePageArena | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's K/V caches, [num_blocks, block_size, num_kv_heads, head_dim], in the
        memory layout the backend that will read them wants: contiguous for the Triton kernels,
        head-major storage for the torch path (its decode gather copies whole blocks of one
        head). CPU caches come from `arena` if given."""
        probe = torch.empty(0, device=device)
        return reference.allocate_kv_cache(
            num_blocks,
            block_size,
            num_kv_heads,
            head_dim,
            dtype,
            device,
            head_major=not self.use_triton(probe),
            arena=arena if probe.device.type == "cpu" else None,
        )

    def linear(
        self, x: torch.Tensor, weight: Weight, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x @ weight.T + bias, for a plain weight or one `prepack_linear_weight` returned.
        float32 decode-sized steps on CPU run kvfleet's AVX-512 or AVX2 kernel
        (`cpu_gemm_f32`) up to the policy's row limit; quantized weights `quantized_linear`."""
        if isinstance(weight, QuantizedWeight):
            return self.quantized_linear(x, weight, bias)
        if isinstance(weight, cpu_linear.PackedLinear):
            return cpu_linear.linear(x, weight, bias, policy=self.policy)
        if cpu_gemm_f32.takes(x, weight, bias, policy=self.policy):
            return cpu_gemm_f32.linear(x, weight, bias)
        return F.linear(x, weight, bias)

    def quantized_linear(
        self, x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x @ dequantize(weight).T + bias: Triton's GEMM dequantizing in registers on CUDA; on
        CPU the C kernel that does the same for decode-sized steps (float32 arithmetic: bf16
        rows are widened and the result rounded back), else the weight dequantized for this
        call into torch's GEMM (prefill steps, where the multiply outweighs that pass)."""
        if self.use_triton(x):
            if weight.block:  # prepack keeps the row layout where the policy is Triton's
                raise ValueError(
                    "weight: packed in column blocks for the CPU kernel; Triton reads the row "
                    "layout (prepack it under the Triton policy)"
                )
            from kvfleet.kernels.triton import triton_quant

            return triton_quant.linear(x, weight, bias)
        rows_f32 = x if x.dtype == torch.float32 else x.float()
        if cpu_gemm_quant.takes(rows_f32, weight, policy=self.policy):
            return cpu_gemm_quant.linear(rows_f32, weight, bias).to(x.dtype)
        # Dequantized into a buffer reused by every projection, then the plain weight's path
        # (cpu_gemm_f32's rows in lanes up to its row limit, else MKL).
        return self.linear(x, cpu_gemm_quant.dequantized(weight, x.dtype, scratch=True), bias)

    def add_lora(
        self,
        y: torch.Tensor,
        x: torch.Tensor,
        lora_a: torch.Tensor,
        lora_b: torch.Tensor,
        mapping: LoraMapping,
    ) -> None:
        """y[t] += lora_b[s] @ (lora_a[s] @ x[t]) for each token t of slot s = its mapping's
        (none for base-model tokens): several adapters in one projection. Triton's gather
        kernels on CUDA; on CPU two matmuls per run of one adapter's rows, which the model
        runner makes contiguous (a gather of every token's A and B would stream them once per
        token), in the tensors' dtype: in bf16 the rank-r intermediate is rounded once more
        than in `reference.add_lora`, which sums in float32."""
        if self.use_triton(x):
            from kvfleet.kernels.triton import triton_lora

            triton_lora.add_lora(y, x, lora_a, lora_b, mapping.token_slots)
            return
        slots, rank, _ = lora_a.shape
        a_flat = lora_a.view(slots * rank, -1) if lora_a.is_contiguous() else None
        # B stored as [out, slots * rank] (LoraSlots does): one weight for every adapter.
        b_flat = lora_b.permute(1, 0, 2).reshape(lora_b.shape[1], slots * rank)
        if (
            a_flat is not None
            and b_flat.data_ptr() == lora_b.data_ptr()
            and cpu_gemm_f32.takes(x, a_flat, policy=self.policy)
        ):
            # Decode-sized float32 steps: every slot's delta in two calls of the C GEMM, the
            # columns of other slots zeroed between them: a few calls per projection instead
            # of two matmuls per adapter, whose fixed cost dominated at these sizes.
            shrunk = cpu_gemm_f32.linear(x, a_flat)
            shrunk.mul_(mapping.column_mask(slots, rank, shrunk.dtype))
            y.add_(cpu_gemm_f32.linear(shrunk, b_flat))
            return
        for slot, start, end in mapping.segments:
            shrunk = torch.mm(x[start:end], lora_a[slot].t())
            y[start:end].addmm_(shrunk, lora_b[slot].t())

    def linear_path(self, weight: Weight, rows: int) -> str:
        """Which kernel `linear` runs for a step of `rows` rows through `weight` (one of the
        PATH_* names, with a quantized weight's format), asked of the same predicates that
        route the call."""
        if isinstance(weight, QuantizedWeight):
            x = torch.empty(rows, weight.in_features)
            if not cpu_gemm_quant.takes(x, weight, policy=self.policy):
                return PATH_DEQUANTIZED
            simd = PATH_AVX512_F32 if cpu_gemm_f32.lanes() == 16 else PATH_AVX2
            return f"{simd} {weight.format}"
        if isinstance(weight, cpu_linear.PackedLinear):
            if cpu_linear.gemm_tiles(weight, rows, self.policy) is None:
                return PATH_TORCH
            amx = cpu_gemm.kernel(self.policy) == cpu_gemm.KERNEL_AMX
            return PATH_AMX if amx else PATH_AVX512_BF16
        x = torch.empty(rows, weight.shape[1], dtype=weight.dtype, device=weight.device)
        if not cpu_gemm_f32.takes(x, weight, policy=self.policy):
            return PATH_TORCH
        return PATH_AVX512_F32 if cpu_gemm_f32.lanes() == 16 else PATH_AVX2

    def rms_norm_linear(
        self,
        x: torch.Tensor,
        norm_weight: torch.Tensor,
        eps: float,
        residual: torch.Tensor | None,
        weight: Weight,
        bias: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`linear(rms_norm(x, norm_weight, eps, residual)[0], weight, bias)` and the residual
        `rms_norm` returns. Decode-sized CPU steps on cpu_gemm (AMX or AVX512-BF16) normalise
        the rows on their way into it (one call, same numbers); everything else makes the two
        calls."""
        tiles = cpu_linear.gemm_tiles(weight, x.shape[0], self.policy)
        if tiles is not None and cpu_elementwise.supports_rms_norm(x, norm_weight, residual):
            return cpu_gemm.rms_norm_linear(
                x, norm_weight, eps, residual, tiles, bias, policy=self.policy
            )
        normed, residual = self.rms_norm(x, norm_weight, eps, residual)
        return self.linear(normed, weight, bias), residual

    def silu_and_mul_linear(
        self,
        x: torch.Tensor,
        weight: Weight,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`linear(silu_and_mul(x), weight, bias)`: SwiGLU's gate and the down projection, in
        one call on decode-sized CPU steps on cpu_gemm (same numbers), else the two calls."""
        tiles = cpu_linear.gemm_tiles(weight, x.shape[0], self.policy)
        if tiles is not None and cpu_elementwise.supports_silu_and_mul(x):
            return cpu_gemm.silu_and_mul_linear(x, tiles, bias, policy=self.policy)
        return self.linear(self.silu_and_mul(x), weight, bias)

    def rotary_and_cache(
        self, positions, query, key, value, cos_sin_cache, k_cache, v_cache, slot_mapping
    ):
        """`rotary_embedding` of q and k, then `reshape_and_cache` of the rotated k and v;
        returns the rotated q. On CPU one C call does both (a decode step makes 30 of them)."""
        if self.use_triton(query):
            query, key = self.rotary_embedding(positions, query, key, cos_sin_cache, is_neox=True)
            self.reshape_and_cache(key, value, k_cache, v_cache, slot_mapping)
            return query
        return cpu_elementwise.rotary_and_cache(
            positions, query, key, value, cos_sin_cache, k_cache, v_cache, slot_mapping
        )

    def decode_stack(
        self,
        layers: list[cpu_decode_step.LayerWeights],
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        cos_sin_cache: torch.Tensor,
        shape: cpu_decode_step.StackShape,
    ) -> cpu_decode_step.DecodeStack | None:
        """The whole decoder stack's decode step as one C call where the CPU path takes these
        weights and caches (`cpu_decode_step.build`), else None: the model then runs its layers
        op by op, as it always does under Triton. Each step asks it under this policy whether
        it runs (`DecodeStack.accepts`)."""
        if self.use_triton(cos_sin_cache):
            return None
        return cpu_decode_step.build(layers, kv_caches, cos_sin_cache, shape)

    def reshape_and_cache(self, key, value, k_cache, v_cache, slot_mapping) -> None:
        """Write new K/V ([tokens, kv_heads, head_dim]) into their cache slots; slot -1 is
        skipped."""
        if self.use_triton(key):
            from kvfleet.kernels.triton import triton_cache

            triton_cache.reshape_and_cache(key, value, k_cache, v_cache, slot_mapping)
            return
        cpu_cache.reshape_and_cache(key, value, k_cache, v_cache, slot_mapping)

    def paged_attention(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Attention for a mixed batch (decodes first) reading K/V from the paged cache."""
        if self.use_triton(query):
            from kvfleet.kernels.triton import triton_attention

            return triton_attention.paged_attention(query, k_cache, v_cache, meta, scale)
        # Decodes of CPU tensors on head-major caches go to the C kernel (several times faster
        # than the reference's gather + batched matmuls), bf16 prefills to the AMX kernel where
        # the CPU has AMX and the policy allows it (1.7-2.6x SDPA, `kvfleet bench cpu-kernels`),
        # others to the AVX-512 or AVX2 one (which leaves long contexts to the reference:
        # `cpu_prefill.takes`); anything else stays on the reference.
        policy = self.policy
        decode_fn = prefill_fn = None
        if cpu_attention.supports(query, k_cache, v_cache) and cpu_attention.available():
            decode_fn = functools.partial(cpu_attention.run_decode, policy=policy)
        has_prefills = meta.num_seqs > meta.num_decodes
        if (
            has_prefills
            and cpu_prefill.supports(query, k_cache, v_cache, policy=policy)
            and cpu_prefill.available(query.dtype, policy=policy)
        ):
            prefill_fn = functools.partial(cpu_prefill.run_prefill, policy=policy)
        return reference.paged_attention(
            query, k_cache, v_cache, meta, scale, decode_fn=decode_fn, prefill_fn=prefill_fn
        )

    def rms_norm(self, x, weight, eps, residual=None):
        """(norm(x + residual) * weight in x's dtype, x + residual in float32). A float32
        `residual` may be updated in place to become the second result: callers must not reuse
        it."""
        if self.use_triton(x):
            from kvfleet.kernels.triton import triton_rms_norm

            return triton_rms_norm.rms_norm(x, weight, eps, residual)
        return cpu_elementwise.rms_norm(x, weight, eps, residual)

    def silu_and_mul(self, x):
        """SwiGLU's gate: silu(x[..., :d]) * x[..., d:]."""
        if self.use_triton(x):
            from kvfleet.kernels.triton import triton_silu_and_mul

            return triton_silu_and_mul.silu_and_mul(x)
        return cpu_elementwise.silu_and_mul(x)

    def rotary_embedding(self, positions, query, key, cos_sin_cache, is_neox=True):
        """Rotate q and k by their positions; returns (q, k)."""
        if self.use_triton(query):
            from kvfleet.kernels.triton import triton_rotary

            return triton_rotary.rotary_embedding(positions, query, key, cos_sin_cache, is_neox)
        return cpu_elementwise.rotary_embedding(positions, query, key, cos_sin_cache, is_neox)
