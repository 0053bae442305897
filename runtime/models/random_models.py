"""Models with realistic shapes and random weights (`--model random:<name>`): throughput does
not depend on the weights' values, so a benchmark can run a Llama-3.2-1B-sized model with no
download. Weights are drawn straight into our model (no transformers model is built).

Their tokenizer is the bundled model's (vocab 49152). Their token ids and special ids are those
of that tokenizer; a larger vocabulary (llama-1b's 128256) only means sampled ids past 49152
decode to nothing, which throughput runs (ignore_eos, counted in tokens) never look at.
"""

from __future__ import annotations

import torch
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
        from kvfleet.runtime.models.loader import ModelLoadError

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
    layers still differ) in well under a second."""
    gen = torch.Generator().manual_seed(seed)
    pool = torch.randn(2 * _POOL, generator=gen).mul_(0.02).to(model.dtype).to(model.device)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1 and "bias" not in name:
                param.fill_(1.0)
                continue
            offset = int(torch.randint(_POOL, (1,), generator=gen))
            chunk = pool[offset : offset + _POOL]
            flat = param.view(-1)
            whole = flat.numel() // _POOL * _POOL
            if whole:
                flat[:whole].view(-1, _POOL).copy_(chunk.expand(whole // _POOL, _POOL))
            flat[whole:].copy_(chunk[: flat.numel() - whole])


def build_random_model(
    model: str,
    dtype: torch.dtype,
    device: torch.device | str,
    seed: int = 0,
    tp: TPGroup | None = None,
) -> tuple[LlamaModel, ModelConfig]:
    """Our model in the shape `random:<name>` names, randomly initialised. A tensor-parallel
    shard draws its own values (seeded by rank): not a slice of the one-rank model's, which
    throughput, the only use of random weights, does not notice."""
    config = random_model_config(model)
    net = LlamaModel(config, dtype=dtype, device=device, tp=tp)
    init_random_weights(net, seed + (tp.rank if tp is not None else 0))
    net.eval()
    return net, config
