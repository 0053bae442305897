"""Which quantization a checkpoint uses, read once from its config.json's `quantization_config`
(or from its being a GGUF file), checked against `--quantization` and against what kvfleet
runs: every accepted scheme keeps its weights quantized in the kernels' one layout
(kernels/quant_weight.py); anything else is a start-up error naming the scheme and what is
supported. torch-free: the server's edge checks the flag without loading the model.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvfleet.runtime.models.errors import ModelLoadError

# --quantization's values, vLLM's names; "none" (kvfleet's) dequantizes a quantized checkpoint
# at load into --dtype, the form its greedy tokens are checked against.
METHODS = ("awq", "gptq", "fp8", "compressed-tensors", "gguf", "none")
# GPTQ's historical checkpoint format stores each zero point minus one; "gptq_v2" does not.
_GPTQ_FORMATS = ("gptq", "gptq_v2")


@dataclass(frozen=True, slots=True)
class QuantScheme:
    """A checkpoint's quantization as the loader reads it.

    method: one of METHODS but "none"; bits: 4 or 8; group_size: weights per scale along the
    input dimension (0: one scale per output row); zero_point: whether weights carry zero
    points (asymmetric); checkpoint_format: GPTQ's format ("gptq": zeros stored minus one);
    weight_type: "int" or "float" (FP8); ignore: module names left unquantized."""

    method: str
    bits: int
    group_size: int = 0
    zero_point: bool = False
    checkpoint_format: str = ""
    weight_type: str = "int"
    ignore: tuple[str, ...] = ()


def _unsupported(what: str) -> ModelLoadError:
    return ModelLoadError(
        f"quantization: {what} is not supported; kvfleet runs AWQ (4-bit, GEMM packing), GPTQ "
        "(4-bit, desc_act false), FP8 (fp8 or compressed-tensors float-quantized, per-tensor or "
        "per-channel scales), compressed-tensors pack-quantized 4-bit, and GGUF Q4_0/Q4_1/Q8_0 "
        "(other GGUF types load dequantized); --quantization none loads a checkpoint "
        "dequantized"
    )


def _group(value: Any, field: str) -> int:
    group = -1 if value is None else int(value)
    if group == -1:
        return 0
    if group < 32 or group % 32:
        raise _unsupported(f"{field} {group} (group sizes must be multiples of 32, or -1)")
    return group


def _awq(cfg: dict[str, Any]) -> QuantScheme:
    version = str(cfg.get("version", "gemm")).lower()
    if version != "gemm":
        raise _unsupported(f"AWQ version {version!r} (only 'gemm' packing)")
    bits = int(cfg.get("bits", cfg.get("w_bit", 4)))
    if bits != 4:
        raise _unsupported(f"AWQ with {bits}-bit weights")
    group = _group(cfg.get("group_size", cfg.get("q_group_size", 128)), "AWQ group_size")
    ignore = tuple(cfg.get("modules_to_not_convert") or ())
    return QuantScheme("awq", 4, group, bool(cfg.get("zero_point", True)), ignore=ignore)


def _gptq(cfg: dict[str, Any]) -> QuantScheme:
    bits = int(cfg.get("bits", 4))
    if bits != 4:
        raise _unsupported(f"GPTQ with {bits}-bit weights")
    fmt = str(cfg.get("checkpoint_format", "gptq")).lower()
    if fmt not in _GPTQ_FORMATS:
        raise _unsupported(f"GPTQ checkpoint_format {fmt!r}")
    group = _group(cfg.get("group_size", 128), "GPTQ group_size")
    # desc_act true is read too: its g_idx is checked per tensor, and only an identity order
    # (every input row in its own contiguous group) loads.
    return QuantScheme("gptq", 4, group, True, checkpoint_format=fmt)


def _fp8(cfg: dict[str, Any]) -> QuantScheme:
    block = cfg.get("weight_block_size")
    if block:
        raise _unsupported(f"FP8 with block-wise weight scales ({block})")
    ignore = tuple(cfg.get("ignored_layers") or cfg.get("modules_to_not_convert") or ())
    return QuantScheme("fp8", 8, weight_type="float", ignore=ignore)


def _compressed_tensors(cfg: dict[str, Any]) -> QuantScheme:
    fmt = str(cfg.get("format", "")).lower()
    groups = list((cfg.get("config_groups") or {}).values())
    if len(groups) != 1 or not isinstance(groups[0], dict) or "weights" not in groups[0]:
        raise _unsupported(f"compressed-tensors with {len(groups)} config groups (one expected)")
    weights = groups[0]["weights"] or {}
    kind, bits = str(weights.get("type", "int")), int(weights.get("num_bits", 0))
    strategy = str(weights.get("strategy", "")).lower()
    ignore = tuple(cfg.get("ignore") or ())
    if fmt == "float-quantized" and kind == "float" and bits == 8:
        if strategy not in ("tensor", "channel"):
            raise _unsupported(f"compressed-tensors FP8 with strategy {strategy!r}")
        return QuantScheme("compressed-tensors", 8, weight_type="float", ignore=ignore)
    if fmt == "pack-quantized" and kind == "int" and bits == 4:
        if weights.get("actorder"):
            raise _unsupported("compressed-tensors with activation ordering (actorder)")
        group = _group(weights.get("group_size"), "compressed-tensors group_size")
        if strategy == "group" and not group:
            raise _unsupported("compressed-tensors group strategy without a group_size")
        return QuantScheme(
            "compressed-tensors", 4, group, not weights.get("symmetric", True),
            ignore=ignore,
        )  # fmt: skip
    raise _unsupported(f"compressed-tensors format {fmt!r} with {bits}-bit {kind} weights")


_READERS = {
    "awq": _awq,
    "gptq": _gptq,
    "fp8": _fp8,
    "compressed-tensors": _compressed_tensors,
}


def check_method(requested: str | None) -> None:
    """Raise ModelLoadError unless `requested` (the --quantization value) is None or known."""
    if requested is not None and requested not in METHODS:
        raise ModelLoadError(
            f"quantization: must be one of {', '.join(METHODS)}, got {requested!r}"
        )


def scheme_of_folder(folder: Path, requested: str | None = None) -> QuantScheme | None:
    """The quantization of a Hugging Face folder's checkpoint (None: plain weights, or
    `requested` "none": load it dequantized). A scheme kvfleet cannot run, or a `requested`
    method that is not the checkpoint's, raises ModelLoadError naming both."""
    check_method(requested)
    try:
        config = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        config = {}  # the model config's own reader reports a missing or broken file
    cfg = config.get("quantization_config") or config.get("compression_config")
    if not cfg:
        if requested not in (None, "none"):
            raise ModelLoadError(
                f"quantization: --quantization {requested} was asked for, but {folder} has no "
                "quantization_config in its config.json (plain weights)"
            )
        return None
    method = str(cfg.get("quant_method", "")).lower()
    if method not in _READERS:
        raise _unsupported(f"quant_method {method!r}")
    if requested not in (None, "none", method):
        raise ModelLoadError(
            f"quantization: --quantization {requested} was asked for, but the checkpoint is "
            f"{method}"
        )
    scheme = _READERS[method](cfg)
    return None if requested == "none" else scheme


def scheme_of_gguf(requested: str | None = None) -> QuantScheme | None:
    """A GGUF file's scheme: its quantized tensors kept (None with `requested` "none")."""
    check_method(requested)
    if requested not in (None, "none", "gguf"):
        raise ModelLoadError(
            f"quantization: --quantization {requested} was asked for, but the model is a GGUF "
            "file (gguf)"
        )
    return None if requested == "none" else QuantScheme("gguf", 4)


def is_ignored(scheme: QuantScheme, module: str) -> bool:
    """Whether `module` (e.g. "model.layers.0.mlp.down_proj") stays unquantized: a listed
    name, its suffix, or a compressed-tensors "re:" pattern matching it."""
    for entry in scheme.ignore:
        if entry.startswith("re:"):
            if re.fullmatch(entry[3:], module):
                return True
        elif module == entry or module.endswith("." + entry) or entry == module.split(".")[-1]:
            return True
    return False
