"""From a `--model` string to a runnable model: resolve it to a Hugging Face folder
(`model_files`), read the config, build our model and fill it from safetensors or a GGUF.
`random:<name>` builds a shape with random weights, for benchmarks.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from kvfleet.kernels.policy import DEFAULT_POLICY, KernelPolicy
from kvfleet.kernels.quant_weight import QuantizedWeight
from kvfleet.runtime.models.config import ModelConfig, ModelConfigError
from kvfleet.runtime.models.errors import ModelLoadError
from kvfleet.runtime.models.gguf_index import read_gguf_index
from kvfleet.runtime.models.gguf_weights import GGUFWeights
from kvfleet.runtime.models.llama import LlamaModel
from kvfleet.runtime.models.model_files import (
    BUNDLED,
    RANDOM_PREFIX,
    bundled_gguf_path,
    resolve_model,
)
from kvfleet.runtime.models.quant_loader import Part, QuantizedSource
from kvfleet.runtime.models.quantization import (
    QuantScheme,
    scheme_of_folder,
    scheme_of_gguf,
)
from kvfleet.runtime.models.shard_layout import Range
from kvfleet.runtime.models.tp_group import TPGroup


def load_weights(
    model: LlamaModel,
    folder: Path,
    dtype: torch.dtype,
    device: torch.device | str,
    scheme: QuantScheme | None = None,
    gguf_path: Path | None = None,
) -> None:
    """Fill `model` from the *.safetensors in `folder` (sharded or not), fusing q/k/v and
    gate/up, converting to `dtype` on `device`. A tensor-parallel shard (`model.layout`) reads
    only its slices of each tensor (safetensors slices without reading the rest). A missing
    tensor, or one whose shape is not the one config.json implies, raises ModelLoadError.
    With `scheme`, projections (and a quantized LM head) stay quantized, read from the
    checkpoint's quantized tensors or, with `gguf_path`, from that GGUF file's blocks."""
    from safetensors import safe_open

    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
    else:
        files = sorted(p.name for p in folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"model: {folder} has no *.safetensors weights")
    handles = [safe_open(str(folder / f), framework="pt", device="cpu") for f in files]
    where: dict[str, Any] = {}
    for handle in handles:
        for name in handle.keys():  # noqa: SIM118 (safe_open handles are not mappings)
            where[name] = handle

    def read(
        name: str, full: tuple[int, ...], rows: Range | None = None, cols: Range | None = None
    ) -> torch.Tensor:
        """Rows [rows) and columns [cols) of tensor `name`, whose whole shape must be `full`."""
        handle = where.get(name)
        if handle is None:
            raise ModelLoadError(f"model: {folder} lacks the weight tensor {name!r}")
        part = handle.get_slice(name)
        shape = tuple(part.get_shape())
        if shape != full:
            raise ModelLoadError(
                f"model: weight {name!r} has shape {shape}, config.json implies {full}"
            )
        r = slice(*rows) if rows is not None else slice(None)
        return part[r, slice(*cols)] if cols is not None else part[r]

    cfg, lay = model.config, model.layout
    h, d, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q_rows = (lay.q_heads[0] * d, lay.q_heads[1] * d)
    kv_rows = (lay.kv_heads[0] * d, lay.kv_heads[1] * d)
    full_q, full_kv = cfg.num_heads * d, cfg.num_kv_heads * d

    source = None
    if scheme is not None:
        if model.tp is not None:
            raise ModelLoadError(
                "quantization: quantized checkpoints do not run with tensor parallelism yet "
                "(GGUF files load dequantized); use --tensor-parallel-size 1"
            )
        gguf = None
        if gguf_path is not None:
            gguf = GGUFWeights(read_gguf_index(gguf_path), cfg.num_heads, cfg.num_kv_heads)

        def fetch(name: str) -> torch.Tensor | None:
            handle = where.get(name)
            return handle.get_tensor(name) if handle is not None else None

        source = QuantizedSource(scheme, torch.device(device), fetch, gguf)

    def placed(module: torch.nn.Module, attr: str, parts: list[Part]) -> bool:
        """Set projection `attr` from the quantized source where it has one and say so; False:
        the checkpoint keeps it plain, for the caller to read as for any model."""
        got = source.fused(parts) if source is not None else None
        if isinstance(got, QuantizedWeight):
            delattr(module, attr)  # a Parameter until now; the quantized form is no tensor
            setattr(module, attr, got)
        elif got is not None:
            getattr(module, attr).copy_(got)
        return got is not None

    vocab_full = (cfg.vocab_size, h)
    with torch.no_grad():
        model.embed_tokens.copy_(read("model.embed_tokens.weight", vocab_full, lay.vocab))
        model.norm.copy_(read("model.norm.weight", (h,)))
        if source is not None and gguf_path is not None:
            # GGUF keeps the LM head (or the tied embedding table) quantized too; the lookup
            # table stays the plain copy read above.
            head = "model.embed_tokens" if cfg.tie_word_embeddings else "lm_head"
            if cfg.tie_word_embeddings:
                del model.lm_head
                model.lm_head = model.embed_tokens
            placed(model, "lm_head", [(head, *vocab_full)])
        elif not cfg.tie_word_embeddings:
            model.lm_head.copy_(read("lm_head.weight", vocab_full, lay.vocab))
        for i, layer in enumerate(model.layers):
            p = f"model.layers.{i}."
            a = f"{p}self_attn."
            parts = [("q", full_q, q_rows), ("k", full_kv, kv_rows), ("v", full_kv, kv_rows)]
            if not placed(layer, "qkv_proj", [(f"{a}{n}_proj", f, h) for n, f, _ in parts]):
                layer.qkv_proj.copy_(
                    torch.cat([read(f"{a}{n}_proj.weight", (f, h), r) for n, f, r in parts])
                )
            if layer.qkv_bias is not None:
                layer.qkv_bias.copy_(
                    torch.cat([read(f"{a}{n}_proj.bias", (f,), r) for n, f, r in parts])
                )
            if not placed(layer, "o_proj", [(f"{a}o_proj", h, full_q)]):
                layer.o_proj.copy_(read(f"{a}o_proj.weight", (h, full_q), None, q_rows))
            mlp = [f"{p}mlp.{n}_proj" for n in ("gate", "up")]
            if not placed(layer, "gate_up_proj", [(m, inter, h) for m in mlp]):
                layer.gate_up_proj.copy_(
                    torch.cat([read(f"{m}.weight", (inter, h), lay.intermediate) for m in mlp])
                )
            if not placed(layer, "down_proj", [(f"{p}mlp.down_proj", h, inter)]):
                layer.down_proj.copy_(
                    read(f"{p}mlp.down_proj.weight", (h, inter), None, lay.intermediate)
                )
            layer.input_layernorm.copy_(read(f"{p}input_layernorm.weight", (h,)))
            layer.post_attention_layernorm.copy_(read(f"{p}post_attention_layernorm.weight", (h,)))
    if source is not None:
        source.report()


def load_model(
    model: str,
    dtype: torch.dtype,
    device: torch.device | str,
    revision: str | None = None,
    token: str | None = None,
    tp: TPGroup | None = None,
    policy: KernelPolicy = DEFAULT_POLICY,
    quantization: str | None = None,
) -> tuple[LlamaModel, ModelConfig, Path | None]:
    """Our model with its weights, its config, and the folder it came from (None for
    random:* models, which have none). `revision` and `token` are for Hub ids; with `tp` only
    that rank's shard is built and read; its ops run the kernels `policy` chooses.
    `quantization` (--quantization): None keeps a quantized checkpoint quantized, "none" loads
    it dequantized, a method name insists on that method (`quantization.scheme_of_folder`)."""
    if model.startswith(RANDOM_PREFIX):
        from kvfleet.runtime.models.random_models import build_random_model

        net, config = build_random_model(model, dtype, device, tp=tp, policy=policy)
        return net, config, None
    folder = resolve_model(model, revision, token)
    config = load_config(folder)
    gguf_path = gguf_file_of(model)
    scheme = _kept(
        scheme_of_gguf(quantization) if gguf_path else scheme_of_folder(folder, quantization),
        sharded=tp is not None,
    )
    net = LlamaModel(config, dtype=dtype, device=device, tp=tp, policy=policy)
    load_weights(net, folder, dtype, device, scheme, gguf_path)
    net.eval()
    return net, config, folder


def gguf_file_of(model: str) -> Path | None:
    """The GGUF file a `--model` value names ('bundled' or a .gguf path), else None."""
    if model == BUNDLED:
        return bundled_gguf_path()
    path = Path(model).expanduser()
    return path if path.is_file() and path.suffix.lower() == ".gguf" else None


def _kept(scheme: QuantScheme | None, sharded: bool) -> QuantScheme | None:
    """The scheme weights stay quantized under: a shard reads slices of plain tensors, which a
    GGUF's dequantized copy has (other quantized checkpoints are refused when sharded)."""
    return None if sharded and scheme is not None and scheme.method == "gguf" else scheme


def quantization_of(
    model: str,
    quantization: str | None = None,
    revision: str | None = None,
    token: str | None = None,
    sharded: bool = False,
) -> QuantScheme | None:
    """The scheme `load_model` would keep `model`'s weights quantized under (resolving it, so a
    Hub id is fetched first, at `revision` with `token`; `sharded`: under tensor parallelism);
    None for plain weights, weights loaded dequantized and random:* models."""
    if model.startswith(RANDOM_PREFIX):
        return None
    gguf_path = gguf_file_of(model)
    if gguf_path is not None:
        return _kept(scheme_of_gguf(quantization), sharded)
    return _kept(scheme_of_folder(resolve_model(model, revision, token), quantization), sharded)


def load_config(folder: Path) -> ModelConfig:
    """The model config of a resolved folder, a bad one as ModelLoadError."""
    try:
        return ModelConfig.from_folder(folder)
    except ModelConfigError as e:
        raise ModelLoadError(str(e)) from None


def model_config_of(model: str) -> ModelConfig:
    """The config of a resolved folder or a random:* name, without loading any weight."""
    if model.startswith(RANDOM_PREFIX):
        from kvfleet.runtime.models.random_models import random_model_config

        return random_model_config(model)
    return load_config(Path(model))
