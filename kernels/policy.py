"""The kernel policy: every choice of which kernel an op runs that is not a fact of the hardware,
in one frozen value. A model is built with one (`dispatch.Kernels(policy)`) and hands it to every
op and fused step it calls; two models in one process may run different policies, and nothing
changes a policy once it is made. Benchmarks that compare two paths build a policy for each
(`dataclasses.replace(DEFAULT_POLICY, f32_gemm_max_rows=0)`), tests likewise.

What the machine can do (`cpu_gemm.amx_available()`, `cpu_features.native_bf16()`, the C
library's build) is probed, not chosen, and stays with the kernels: a policy only narrows it.
"""

from __future__ import annotations

from dataclasses import dataclass

# "auto": Triton for CUDA tensors where triton imports, the CPU kernels and the torch reference
# for the rest; "torch": never Triton; "triton": Triton on any device (tests run it on CPU
# tensors under TRITON_INTERPRET=1).
BACKENDS = ("auto", "torch", "triton")
# Fields that turn a path on or off, and fields that bound one (0: the path is off).
_SWITCHES = ("allow_amx", "fused_decode_step", "fused_prompt_step")
_LIMITS = {
    "amx_gemm_max_rows": "rows",
    "avx512_bf16_gemm_max_rows": "rows",
    "f32_gemm_max_rows": "rows",
    "quant_gemm_max_rows": "rows",
    "vnni_quant_gemm_max_rows": "rows",
    "one_call_max_rows": "rows",
    "avx2_prefill_max_context": "context tokens",
    "avx2_prefill_short_query": "query tokens",
}


@dataclass(frozen=True, slots=True)
class KernelPolicy:
    """Which kernels a model's ops may run, beyond what the hardware allows. The defaults are
    the measured best on the hosts named beside each; a field of 0 turns its path off."""

    backend: str = "auto"
    # Whether AMX may run where the CPU grants it: the bf16 GEMM's AMX engine (else its
    # AVX512-BF16 one), decode attention's AMX path (else its AVX512-BF16 dot path) and bf16
    # prefill's AMX kernel (else the float32-arithmetic one). Off, an AMX host runs the vector
    # paths, which is how tests check those there.
    allow_amx: bool = True
    # Row counts the bf16 GEMM's AMX engine (cpu_gemm) takes from oneDNN. Up to 96 rows it
    # streams the weights 1.1-1.9x faster; at 128-1024 rows (a serving batch's decodes plus a
    # new prompt) it computes 1.1x faster (`kvfleet bench cpu-kernels`,
    # docs/results/bench-cpu-kernels-1024.json); on a real run's steps, capped at 32 sequences,
    # the forward took a median 0.81x the time with this limit than with 96 (faster in 82 of 88
    # steps, `kvfleet bench gemm-rows`, docs/results/bench-gemm-rows-c32.json). At 2048 rows
    # oneDNN's blocking wins (1.13x, docs/results/bench-gemm-rows-offline.json): full prefill
    # steps stay there.
    amx_gemm_max_rows: int = 1024
    # Row counts the bf16 GEMM's AVX512-BF16 vector engine takes from oneDNN. On a 2-core Zen 4
    # host it streams a step's projections 2.3x faster at 1-4 rows and 1.9x at 8, and from ~16
    # rows computes near the host's bf16 peak, 1.03-1.28x oneDNN up to 1024 rows and even at
    # 2048 (`kvfleet bench cpu-kernels`). On an offline run's steps (`kvfleet bench gemm-rows
    # --candidates 0,32,256,1024,2048`, docs/results/bench-gemm-rows-avx512bf16-offline.json)
    # the forward took a median 0.755x oneDNN's time with this limit (faster in 236 of 265
    # steps: 0.45x at 1-16 rows, 0.72x at 33-64, 0.81x at 65-255); 2048 gained nothing more on
    # full prefill steps.
    avx512_bf16_gemm_max_rows: int = 1024
    # Row counts the float32 GEMM (cpu_gemm_f32) takes from F.linear. A step's projections (30
    # layers + LM head) on a 2-core AVX-512 host: 1.25-1.40x F.linear at 4-8 rows and 1.09x at
    # 16 (dot form), 1.53x at 32, 1.43x at 48, 1.39x at 64, 1.10x at 96 and 0.96x at 128 (rows
    # in lanes) (`kvfleet bench cpu-kernels`, docs/results/bench-cpu-kernels-float32.json).
    # Whole forwards of an offline run's steps (`kvfleet bench gemm-rows --dtype float32`,
    # which moves the fused decode step's limit with it): limits 3 / 64 / 96 / 128 summed
    # 70.6 / 66.7 / 65.3 / 64.5 s, 128 faster than none on 110 of the 117 steps of 65-255 rows
    # (docs/results/bench-gemm-rows-float32-offline.json). From one row up (cpu_gemm_f32's
    # MIN_ROWS says why).
    f32_gemm_max_rows: int = 128
    # Row counts a 4-bit or 8-bit weight's projection runs on the in-register kernel
    # (cpu_gemm_quant); larger steps dequantize the weight into a reused buffer and run the
    # float32 path, a pass over every weight a step. Where the kernel's dot is vpmaddwd + vpaddd
    # (AVX2; AVX-512 without VNNI): 8, past which the dequantized float32 GEMM was faster in an
    # ad-hoc timing of the bundled model's four projections (AVX2 build on a Zen 4: 16 rows
    # 1.08 against 0.90 ms, 128 rows 7.00 against 5.56 ms).
    quant_gemm_max_rows: int = 8
    # The same with AVX-512 VNNI's fused dot (vpdpwssd): faster than dequantizing at every row
    # count of `kvfleet bench cpu-kernels` (a step's projections on a 2-core Zen 4: 16 rows 17.3
    # against 54.1 ms, 128 rows 124 against 295 ms, 512 rows 490 against 992 ms;
    # docs/results/bench-cpu-kernels-quant-avx512bf16.json), so every step up to a large
    # prompt's.
    vnni_quant_gemm_max_rows: int = 8192
    # Whether decode steps may run the whole decoder stack in one C call (cpu_decode_step)
    # where it applies: the same bits as op by op, one Python call a step instead of six per
    # layer. Off, every step goes op by op (tests and `bench decode-step` compare the two).
    fused_decode_step: bool = True
    # With fused_decode_step, whether steps carrying prompt chunks (a serving step admitting a
    # request, a prefill) may run that one C call too, each chunk's attention on the prefill
    # kernel the per-op path calls: the same bits, 1.06-1.11x faster with 1-32 decodes beside a
    # 128-token chunk on the bundled model (`kvfleet bench decode-step --prompt-tokens 128`,
    # docs/results/bench-decode-step-q4-chunk128-avx512bf16.json). Off, they go op by op.
    fused_prompt_step: bool = True
    # The most sequences of a CPU decode step that goes from token ids to logits in one C call
    # (cpu_decode_logits), which keeps a float32 logits buffer of this many rows: its gain, a
    # millisecond of Python and torch calls a step, matters where steps are short (few
    # sequences); larger steps keep the two-call path and allocate their logits per step.
    one_call_max_rows: int = 16
    # The longest context a prefill takes the float32-arithmetic kernel for when the C library
    # is built for AVX2 (8 lanes, 16 registers): past it torch's SDPA is faster. Both held to
    # AVX2 on a Zen 4 host, one layer of the bundled model: 2.79 against 4.91 ms at 512 tokens,
    # 42.9 against 40.1 at 2048 (`kvfleet bench cpu-kernels`' float32 rows,
    # docs/results/bench-cpu-kernels-avx2-emulated.json); timed directly, 14.6 / 46.7 ms against
    # 17.4 / 42.4 at 1024 / 2048.
    avx2_prefill_max_context: int = 1024
    # Queries of at most this many tokens take that kernel at any context all the same (a
    # serving step's chunk late in a long prompt, a suffix after a prefix-cache hit): it splits
    # their keys over the threads, and SDPA handles a short query poorly. Held to AVX2 on the
    # Zen 4, one layer of the bundled model: 4 / 16 / 48 / 64-token chunks at 3,000 tokens of
    # context 0.38 / 1.03 / 3.15 / 4.36 ms against 0.99 / 1.61 / 3.38 / 4.51 (`kvfleet bench
    # cpu-kernels`, the same file); timed directly, 1-64-token queries at 2,048-8,192 tokens of
    # context 1.02-6.6x SDPA's speed, 128 tokens at parity (0.98-1.03x).
    avx2_prefill_short_query: int = 64

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"backend: must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        for name in _SWITCHES:
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ValueError(f"{name}: must be True or False, got {value!r}")
        for name, unit in _LIMITS.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name}: must be a whole number of {unit} >= 0, got {value!r}")


# The policy a model runs when it is given none: every default above.
DEFAULT_POLICY = KernelPolicy()
