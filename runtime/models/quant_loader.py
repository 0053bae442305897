"""Where a quantized model's projections come from at load: a Hugging Face checkpoint's quantized
tensors (quant_checkpoints) or a GGUF file's blocks (gguf_weights), each fused projection
(q/k/v, gate/up) assembled from its parts in the kernels' layout.

A fused projection whose parts cannot share one quantized weight (a part the checkpoint leaves
unquantized, or GGUF parts of different types, as Q4_K_M files mix) is served plain, its parts
dequantized: correct, only without the bandwidth saving. FP8 weights on CPU are dequantized too:
no x86 CPU here computes in FP8, and a per-call dequantization would cost more than it saves.
"""

from __future__ import annotations

import logging

import torch
from kvfleet.kernels.quant_weight import QuantizedWeight, concat_out, dequantize
from kvfleet.runtime.models.gguf_weights import GGUFWeights
from kvfleet.runtime.models.quant_checkpoints import Fetch, read_projection
from kvfleet.runtime.models.quantization import QuantScheme

log = logging.getLogger(__name__)

# (module name, out_features, in_features) of each part of one fused projection.
Part = tuple[str, int, int]


class QuantizedSource:
    """Reads fused projections of a quantized checkpoint, onto `device`."""

    def __init__(
        self,
        scheme: QuantScheme,
        device: torch.device,
        fetch: Fetch | None = None,
        gguf: GGUFWeights | None = None,
    ) -> None:
        self.scheme, self.device = scheme, torch.device(device)
        self._fetch, self._gguf = fetch, gguf
        self.mixed: list[str] = []  # fused projections served plain, for one log line

    def _part(self, module: str, out_f: int, in_f: int) -> QuantizedWeight | torch.Tensor | None:
        if self._gguf is not None:
            return self._gguf.projection(module, out_f, in_f)
        return read_projection(self._fetch, module, out_f, in_f, self.scheme)

    def fused(self, parts: list[Part]) -> QuantizedWeight | torch.Tensor | None:
        """The parts stacked along out_features: one QuantizedWeight where they share a layout,
        a plain float32 tensor where they do not, None where the checkpoint keeps every part
        plain (the caller reads their `.weight` as for any model)."""
        read = [self._part(*p) for p in parts]
        if all(r is None for r in read):
            return None
        if any(r is None for r in read):
            read = [
                self._fetch(f"{name}.weight") if r is None else r
                for r, (name, _, _) in zip(read, parts, strict=True)
            ]
        quantized = [r for r in read if isinstance(r, QuantizedWeight)]
        layouts = {(q.format, q.group_size, q.offsets is None) for q in quantized}
        on_cpu_fp8 = self.device.type == "cpu" and any(q.format == "fp8" for q in quantized)
        if len(quantized) < len(read) or len(layouts) > 1 or on_cpu_fp8:
            if not on_cpu_fp8:
                self.mixed.append(parts[0][0])
            return torch.cat(
                [dequantize(r) if isinstance(r, QuantizedWeight) else r.float() for r in read]
            )
        fused = concat_out(quantized) if len(quantized) > 1 else quantized[0]
        return fused.to(self.device) if self.device.type != "cpu" else fused

    def report(self) -> None:
        """Log, once, which projections could not stay quantized."""
        if self.mixed:
            log.warning(
                "%d fused projections mix quantized and plain or differently quantized parts "
                "and run dequantized (first: %s)",
                len(self.mixed),
                self.mixed[0],
            )
