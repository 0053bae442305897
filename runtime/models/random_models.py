"""Models with realistic shapes and random weights (`--model random:<name>`): throughput does
not depend on the weights' values, so a benchmark can run a Llama-3.2-1B-sized model with no
download. Weights are drawn straight into our model (no transformers model is built).

Their tokenizer is the bundled model's (vocab 49152), or where that is not installed a built-in
byte-level one with the same special ids (`byte_tokenizer.py`). A larger vocabulary (llama-1b's
128256) only means sampled ids past the tokenizer's decode to nothing, which throughput runs
(ignore_eos, counted in tokens) never look at.
"""

from __future__ import annotations

import torch
from kvfleet.kernels.policy import DEFAULT_POLICY, KernelPolicy
from kvfleet.runtime.models.config import ModelConfig
from kvfleet.runtime.models.llama import LlamaModel
from kvfleet.runtime.models.tp_group import TPGroup

# Special ids of the bundled tokenizer (SmolLM2): <|im_start|> is bos, <|im_end|> is eos.
_BOS, _EOS = 1, [2]

RANDOM_MODELS: dict[str, ModelConfig] = {
    "llama-1b": ModelConfig(
        architecture="LlamaForCausalLM",
        hidden_size=2048,
        num_layers=16,
        num_heads=32,
        num_kv_heads=8,
        head_dim=64,
        intermediate_size=8192,
        vocab_size=128256,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        # Llama-3.2-1B allows 131072; 8192 keeps the RoPE table small and covers any benchmark.
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        eos_token_ids=_EOS,
        bos_token_id=_BOS,
    ),
    "tiny": ModelConfig(
        architecture="LlamaForCausalLM",
        hidden_size=128,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        intermediate_size=384,
        vocab_size=49152,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        eos_token_ids=_EOS,
        bos_token_id=_BOS,
    ),
}


def random_model_config(model: str) -> ModelConfig:
    """The config named by `random:<name>`."""
    name = model.removeprefix("random:")
    if name not in RANDOM_MODELS:
        from kvfleet.runtime.models.errors import ModelLoadError

        raise ModelLoadError(
            f"model: {model!r} is not a known random model; known: "
            + ", ".join(f"random:{n}" for n in RANDOM_MODELS)
        )
    return RANDOM_MODELS[name]


_POOL = 1 << 20  # random values drawn once, then tiled over every weight


def init_random_weights(model: LlamaModel, seed: int = 0) -> None:
    """Fill every projection and embedding with N(0, 0.02) values and every norm weight with 1.

    Drawing 1.2B normals takes ~15 s on two cores; throughput does not depend on the values,
    so one pool of 1M draws is tiled over each tensor (from a random offset per tensor, so
    layers still differ) in well under a second. Element i of a (full) tensor gets the pool
    value at (offset + i mod 1M): a tensor-parallel shard computes the values of its own slice
    from their indices in the full tensor, so a sharded random model is the same model."""
    gen = torch.Generator().manual_seed(seed)
    pool = torch.randn(2 * _POOL, generator=gen).mul_(0.02).to(model.dtype).to(model.device)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1 and "bias" not in name:
                param.fill_(1.0)
                continue
            offset = int(torch.randint(_POOL, (1,), generator=gen))
            chunk = pool[offset : offset + _POOL]
            for dst, base in _segments(name, param, model):
                _fill_tiled(dst, chunk, base)


def _fill_tiled(dst: torch.Tensor, chunk: torch.Tensor, base: int) -> None:
    """dst[j] = chunk[(base + j) % len(chunk)] for a 1-D view `dst`."""
    n, pos, start = dst.numel(), 0, base % _POOL
    if start == 0 and n >= _POOL:  # whole tiles in one copy
        whole = n // _POOL * _POOL
        dst[:whole].view(-1, _POOL).copy_(chunk.expand(whole // _POOL, _POOL))
        pos = whole
    while pos < n:
        k = min(_POOL - start, n - pos)
        dst[pos : pos + k].copy_(chunk[start : start + k])
        pos, start = pos + k, 0


def _segments(name: str, param: torch.Tensor, model: LlamaModel) -> list[tuple[torch.Tensor, int]]:
    """`param` as 1-D views, each with the flat index in the full (unsharded) tensor of its
    first element."""
    lay, cfg = model.layout, model.config
    if lay.size == 1:
        return [(param.view(-1), 0)]
    d, h, inter = cfg.head_dim, cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_heads * d, cfg.num_kv_heads * d
    leaf = name.rsplit(".", 1)[-1]
    if leaf in ("embed_tokens", "lm_head"):
        return _row_pieces(param, [(lay.vocab[0], lay.vocab_rows)], h)
    if leaf in ("qkv_proj", "qkv_bias"):
        k0, nk = lay.kv_heads[0] * d, lay.num_kv_heads * d
        pieces = [(lay.q_heads[0] * d, lay.num_q_heads * d), (q + k0, nk), (q + kv + k0, nk)]
        return _row_pieces(param, pieces, h if param.dim() == 2 else 1)
    if leaf == "gate_up_proj":
        i0, ni = lay.intermediate[0], lay.intermediate_size
        return _row_pieces(param, [(i0, ni), (inter + i0, ni)], h)
    if leaf == "o_proj":
        return [(row, r * q + lay.q_heads[0] * d) for r, row in enumerate(param)]
    if leaf == "down_proj":
        return [(row, r * inter + lay.intermediate[0]) for r, row in enumerate(param)]
    raise AssertionError(f"no shard mapping for parameter {name}")


def _row_pieces(
    param: torch.Tensor, pieces: list[tuple[int, int]], cols: int
) -> list[tuple[torch.Tensor, int]]:
    """Consecutive local rows taken from full rows [start, start + n) for each (start, n)."""
    out, local = [], 0
    for start, n in pieces:
        out.append((param[local : local + n].reshape(-1), start * cols))
        local += n
    return out


def build_random_model(
    model: str,
    dtype: torch.dtype,
    device: torch.device | str,
    seed: int = 0,
    tp: TPGroup | None = None,
    policy: KernelPolicy = DEFAULT_POLICY,
) -> tuple[LlamaModel, ModelConfig]:
    """Our model in the shape `random:<name>` names, randomly initialised (a tensor-parallel
    shard: its slice of the same values), its ops on the kernels `policy` chooses."""
    config = random_model_config(model)
    net = LlamaModel(config, dtype=dtype, device=device, tp=tp, policy=policy)
    init_random_weights(net, seed)
    net.eval()
    return net, config
