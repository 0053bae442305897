"""Our Llama-family model (Llama, SmolLM2, Mistral, Qwen2): one forward over every token a step
schedules, prefill chunks and decodes mixed, with K/V kept in the paged cache.

Every op that touches the cache or has a fused kernel goes through the model's
`dispatch.Kernels`, built once from the kernel policy the model is given, so the same code runs
the C kernels or the torch reference on CPU and Triton on CUDA. Projections are fused (q/k/v in
one matmul, gate/up in one) to halve the number of GEMM launches per layer, and run through
`Kernels.linear`, whose weights `LlamaModel.prepack` may swap for a faster layout.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from kvfleet.kernels import dispatch
from kvfleet.kernels.cpu import cpu_decode_logits, cpu_decode_step
from kvfleet.kernels.cpu.huge_pages import HugePageArena
from kvfleet.kernels.metadata import AttentionMetadata
from kvfleet.kernels.policy import DEFAULT_POLICY, KernelPolicy
from kvfleet.runtime.models.config import ModelConfig
from kvfleet.runtime.models.shard_layout import ShardLayout, shard_layout
from kvfleet.runtime.models.tp_group import TPGroup
from torch import nn

if TYPE_CHECKING:
    from kvfleet.runtime.models.lora_layer import LoraLayer


def _param(*shape: int, dtype: torch.dtype, device: torch.device | str) -> nn.Parameter:
    # Uninitialised: weights are always loaded (or randomised) right after construction, and
    # the default nn.Linear init of a 1B model would cost seconds.
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


# The projection weights of a layer: what `prepack` swaps for the kernels' fastest layout.
PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def _prepack(
    module: nn.Module, name: str, arena: HugePageArena | None, policy: KernelPolicy
) -> None:
    """Replace parameter `name` with its prepacked form, a plain attribute (an opaque tensor is
    no Parameter); the plain weight is freed unless something else holds it. A weight that
    only moved (the same tensor in `arena`) stays the same Parameter with new storage, so a
    tied LM head stays the embedding table."""
    weight = getattr(module, name)
    packed = dispatch.prepack_linear_weight(weight, arena, policy)
    if packed is weight:
        return
    if isinstance(packed, torch.Tensor) and isinstance(weight, nn.Parameter):
        weight.data = packed
        return
    delattr(module, name)
    setattr(module, name, packed)


class LlamaDecoderLayer(nn.Module):
    """Pre-norm attention block + SwiGLU MLP, with the residual add fused into each norm.

    Under tensor parallelism it holds `layout`'s heads and MLP columns: q/k/v and gate/up are
    column-split, o_proj and down_proj row-split, and `tp` sums their partial outputs."""

    def __init__(
        self,
        cfg: ModelConfig,
        dtype: torch.dtype,
        device: torch.device | str,
        layout: ShardLayout,
        tp: TPGroup | None = None,
    ):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.tp = tp
        self.num_heads, self.num_kv_heads, self.head_dim = (
            layout.num_q_heads,
            layout.num_kv_heads,
            d,
        )
        self.q_size, self.kv_size = self.num_heads * d, self.num_kv_heads * d
        inter = layout.intermediate_size
        self.eps = cfg.rms_norm_eps
        self.scale = d**-0.5
        self.input_layernorm = _param(h, dtype=dtype, device=device)
        self.qkv_proj = _param(self.q_size + 2 * self.kv_size, h, dtype=dtype, device=device)
        self.qkv_bias = (
            _param(self.q_size + 2 * self.kv_size, dtype=dtype, device=device)
            if cfg.attention_bias
            else None
        )
        self.o_proj = _param(h, self.q_size, dtype=dtype, device=device)
        self.post_attention_layernorm = _param(h, dtype=dtype, device=device)
        self.gate_up_proj = _param(2 * inter, h, dtype=dtype, device=device)
        self.down_proj = _param(h, inter, dtype=dtype, device=device)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        cos_sin_cache: torch.Tensor,
        kernels: dispatch.Kernels,
        lora: LoraLayer | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden, residual) after this layer, every op on the model's `kernels`; with `lora`
        (the step's adapters), each projection's output gains their delta."""
        num_tokens = hidden.shape[0]
        if lora is None:
            qkv, residual = kernels.rms_norm_linear(
                hidden, self.input_layernorm, self.eps, residual, self.qkv_proj, self.qkv_bias
            )
        else:  # the adapters read the normalised rows, so the fused norm + GEMM is split
            normed, residual = kernels.rms_norm(hidden, self.input_layernorm, self.eps, residual)
            qkv = kernels.linear(normed, self.qkv_proj, self.qkv_bias)
            lora.add(qkv, normed, "qkv_proj")
        q, k, v = qkv.split((self.q_size, self.kv_size, self.kv_size), dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        k_cache, v_cache = kv_cache
        q = kernels.rotary_and_cache(
            positions, q, k, v, cos_sin_cache, k_cache, v_cache, meta.slot_mapping
        )
        attn = kernels.paged_attention(q, k_cache, v_cache, meta, self.scale)
        attn = attn.reshape(num_tokens, self.q_size)
        hidden = kernels.linear(attn, self.o_proj)
        if lora is not None:
            lora.add(hidden, attn, "o_proj")
        if self.tp is not None:
            hidden = self.tp.all_reduce(hidden)
        if lora is None:
            gate_up, residual = kernels.rms_norm_linear(
                hidden, self.post_attention_layernorm, self.eps, residual, self.gate_up_proj
            )
            hidden = kernels.silu_and_mul_linear(gate_up, self.down_proj)
        else:
            normed, residual = kernels.rms_norm(
                hidden, self.post_attention_layernorm, self.eps, residual
            )
            gate_up = kernels.linear(normed, self.gate_up_proj)
            lora.add(gate_up, normed, "gate_up_proj")
            act = kernels.silu_and_mul(gate_up)
            hidden = kernels.linear(act, self.down_proj)
            lora.add(hidden, act, "down_proj")
        if self.tp is not None:
            hidden = self.tp.all_reduce(hidden)
        return hidden, residual


class LlamaModel(nn.Module):
    """The whole network. Build it in the dtype and on the device it will run on (do not
    `.to()` it later: the RoPE table must stay float32). Parameters start uninitialised; fill
    them with `loader.load_weights` or `random_models.init_random_weights`.

    With `tp` (a tensor-parallel rank) it holds only `tp.layout`'s shard: its heads, its MLP
    columns and its vocabulary rows of the embedding and the LM head. Its ops run the kernels
    `policy` chooses (`kernels`: one `dispatch.Kernels` for the model's lifetime, unless a
    benchmark swaps it with `use_kernel_policy`)."""

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        tp: TPGroup | None = None,
        policy: KernelPolicy = DEFAULT_POLICY,
    ):
        super().__init__()
        self.config = config
        self.tp = tp
        self.kernels = dispatch.Kernels(policy)
        self.layout = tp.layout if tp is not None else full_layout(config)
        self.dtype, self.device = dtype, torch.device(device)
        h, vocab = config.hidden_size, self.layout.vocab_rows
        self.embed_tokens = _param(vocab, h, dtype=dtype, device=device)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, dtype, device, self.layout, tp)
            for _ in range(config.num_layers)
        )
        self.norm = _param(h, dtype=dtype, device=device)
        # Tied models read logits straight off the embedding table: one tensor, no copy.
        self.lm_head = (
            self.embed_tokens
            if config.tie_word_embeddings
            else _param(vocab, h, dtype=dtype, device=device)
        )
        self.register_buffer("cos_sin_cache", rope_cos_sin_cache(config, device), persistent=False)

    def use_kernel_policy(self, policy: KernelPolicy) -> KernelPolicy:
        """Run every later op under `policy` instead; returns the policy it replaces. For
        benchmarks that time one model's steps under several policies in turns (its fused
        steps hold no policy, so nothing is rebuilt). The backend stays the one the model was
        built with: its KV caches were laid out for it."""
        previous = self.kernels.policy
        if policy.backend != previous.backend:
            raise ValueError(
                f"backend: {policy.backend!r} differs from the model's {previous.backend!r}, "
                "which its KV caches were laid out for; build another model instead"
            )
        self.kernels = dispatch.Kernels(policy)
        return previous

    def prepack(self) -> None:
        """Swap every projection weight and the LM head for the layout `Kernels.linear` runs
        fastest (on CPU in bfloat16: oneDNN's prepacked one and kvfleet's tiles; in other
        dtypes on CPU the same weight moved onto huge pages; on a GPU nothing changes). Call
        once, after loading: packed weights are no longer parameters (moved ones still are).
        A tied bf16 LM head gets its own packed copy, since the embedding lookup still needs
        the plain table."""
        arena = dispatch.memory_arena(self.embed_tokens.device)
        for layer in self.layers:
            for name in PROJECTIONS:
                _prepack(layer, name, arena, self.kernels.policy)
        _prepack(self, "lm_head", arena, self.kernels.policy)

    def build_decode_stack(
        self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> cpu_decode_step.DecodeStack | None:
        """The fused decode step over these caches where the kernels offer one, else None.
        Not for a tensor-parallel shard: the fused step has no place for the all-reduces, so
        a shard runs op by op. Build it after `prepack` (it reads the packed weights); the
        model runner builds it once, for its caches."""
        if self.tp is not None:
            return None
        cfg = self.config
        layers = [
            cpu_decode_step.LayerWeights(
                layer.input_layernorm,
                layer.qkv_proj,
                layer.qkv_bias,
                layer.o_proj,
                layer.post_attention_layernorm,
                layer.gate_up_proj,
                layer.down_proj,
            )
            for layer in self.layers
        ]
        shape = cpu_decode_step.StackShape(
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
            cfg.intermediate_size,
            cfg.rms_norm_eps,
            self.layers[0].scale,
        )
        return self.kernels.decode_stack(layers, kv_caches, self.cos_sin_cache, shape)

    def build_decode_logits(
        self, stack: cpu_decode_step.DecodeStack, max_rows: int, max_blocks: int
    ) -> cpu_decode_logits.DecodeLogits | None:
        """The one-call decode step from token ids to logits (`forward` then `compute_logits`
        for a decode-only step, the same bits) over `stack`, for steps of up to `max_rows`
        sequences of up to `max_blocks` blocks; None where it does not apply."""
        return cpu_decode_logits.build(
            stack, self.embed_tokens, self.norm, self.lm_head, max_rows, max_blocks
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        stack: cpu_decode_step.DecodeStack | None = None,
        lora: list[LoraLayer] | None = None,
    ) -> torch.Tensor:
        """Final hidden states [T, hidden] for the step's T scheduled tokens (batch order:
        decodes first, as `meta` describes); K/V of every token is written to `kv_caches`.
        `stack`: the fused decode step over these caches (`build_decode_stack`), used for the
        steps it takes; `lora`: each layer's adapters for a step that runs some (op by op)."""
        kernels = self.kernels
        hidden = self._embed(input_ids)
        if lora is not None:
            residual = None
            for layer, kv_cache, layer_lora in zip(self.layers, kv_caches, lora, strict=True):
                hidden, residual = layer(
                    positions, hidden, residual, kv_cache, meta, self.cos_sin_cache, kernels,
                    layer_lora,
                )  # fmt: skip
        elif stack is not None and stack.accepts(meta, hidden.shape[0], kernels.policy):
            # The same six kernels per layer as below, in one call (cpu_decode_step).
            hidden, residual = stack.run(hidden, positions, meta, kernels.policy)
        else:
            residual = None
            for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
                hidden, residual = layer(
                    positions, hidden, residual, kv_cache, meta, self.cos_sin_cache, kernels
                )
        hidden, _ = kernels.rms_norm(hidden, self.norm, self.config.rms_norm_eps, residual)
        return hidden

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp is None:
            return F.embedding(input_ids, self.embed_tokens)
        # Vocabulary-split table: each rank looks up the ids in its range, zeros elsewhere,
        # and the sum over ranks is the full lookup.
        lo, hi = self.layout.vocab
        outside = (input_ids < lo) | (input_ids >= hi)
        local = torch.where(outside, 0, input_ids - lo)
        hidden = F.embedding(local, self.embed_tokens)
        hidden[outside] = 0
        return self.tp.all_reduce(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """float32 logits [N, vocab] for N hidden states (the engine passes one per sequence).
        A tensor-parallel rank computes its vocabulary slice; rank 0 gets the gathered whole
        and the other ranks None. Every rank must make the same calls, in the same order."""
        logits = self.kernels.linear(hidden, self.lm_head).float()
        if self.tp is None:
            return logits
        return self.tp.gather_logits(logits)


def full_layout(config: ModelConfig) -> ShardLayout:
    """The whole model as one rank's "shard" (no tensor parallelism)."""
    return shard_layout(
        config.num_heads, config.num_kv_heads, config.intermediate_size, config.vocab_size
    )


def rope_cos_sin_cache(config: ModelConfig, device: torch.device | str = "cpu") -> torch.Tensor:
    """[max_position, head_dim] float32: cos of every position's angles, then their sin.

    Computed in float32 exactly as transformers does, so logits match it to rounding."""
    inv_freq = config.inv_freq()
    positions = torch.arange(config.max_position_embeddings, dtype=torch.float32)
    angles = positions[:, None] * inv_freq[None, :]
    return torch.cat((angles.cos(), angles.sin()), dim=-1).to(device)
