"""Our Llama-family model gives the same logits as transformers, however the tokens of a prompt
are split across steps and batched with others, reading earlier tokens from a paged KV cache
whose blocks are scattered (a shuffled block table)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from bf16_engines import bf16_engine
from kvfleet.kernels.cpu import cpu_gemm, cpu_linear
from kvfleet.kernels.metadata import AttentionMetadata
from kvfleet.kernels.policy import KernelPolicy
from kvfleet.runtime.models.llama import LlamaModel
from kvfleet.runtime.models.loader import load_model
from tiny_models import make_tiny_model

ATOL = 1e-4


class PagedRun:
    """Drives the model as an engine would: per step, a batch of (sequence, new tokens) chunks,
    decodes first; blocks handed out from a shuffled pool so no table is contiguous."""

    def __init__(self, net: LlamaModel, block_size: int, num_blocks: int = 96, seed: int = 0):
        cfg = net.config
        shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        self.net, self.block_size = net, block_size
        self.kv = [
            (torch.zeros(shape, dtype=net.dtype), torch.zeros(shape, dtype=net.dtype))
            for _ in range(cfg.num_layers)
        ]
        gen = torch.Generator().manual_seed(seed)
        self.free = torch.randperm(num_blocks, generator=gen).tolist()
        self.tables: dict[str, list[int]] = {}
        self.lens: dict[str, int] = {}

    def step(self, chunks: list[tuple[str, list[int]]]) -> list[torch.Tensor]:
        """Run one forward over all chunks; the logits of every new token, per chunk."""
        ids, positions, slots, q_lens, seq_lens = [], [], [], [], []
        for sid, tokens in chunks:
            start = self.lens.get(sid, 0)
            end = start + len(tokens)
            table = self.tables.setdefault(sid, [])
            while len(table) * self.block_size < end:
                table.append(self.free.pop())
            for pos in range(start, end):
                slots.append(
                    table[pos // self.block_size] * self.block_size + pos % self.block_size
                )
            ids += tokens
            positions += range(start, end)
            q_lens.append(len(tokens))
            seq_lens.append(end)
            self.lens[sid] = end
        num_decodes = 0
        while num_decodes < len(q_lens) and q_lens[num_decodes] == 1:
            num_decodes += 1
        width = max(len(self.tables[sid]) for sid, _ in chunks)
        tables = torch.zeros(len(chunks), width, dtype=torch.int32)
        for row, (sid, _) in enumerate(chunks):
            tables[row, : len(self.tables[sid])] = torch.tensor(self.tables[sid])
        starts = torch.tensor([0, *q_lens], dtype=torch.int32).cumsum(0).to(torch.int32)
        meta = AttentionMetadata(
            query_start_loc=starts,
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_tables=tables,
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            num_decodes=num_decodes,
            max_query_len=max(q_lens),
            max_seq_len=max(seq_lens),
            query_lens_host=q_lens,
            seq_lens_host=seq_lens,
        )
        with torch.no_grad():
            hidden = self.net(torch.tensor(ids), torch.tensor(positions), self.kv, meta)
            logits = self.net.compute_logits(hidden)
        assert logits.dtype == torch.float32
        return list(logits.split(q_lens))


def prompts(n: int, lengths: tuple[int, ...] = (7, 19, 37)) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1234)
    return [torch.randint(0, n, (length,), generator=gen).tolist() for length in lengths]


def hf_logits(folder: Path, tokens: list[list[int]]) -> list[torch.Tensor]:
    """transformers' own float32 forward logits for each prompt."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        return [hf(torch.tensor([t])).logits[0] for t in tokens]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model_case(request, tiny_llama_dir: Path, tiny_qwen2_dir: Path):
    """(our float32 model, transformers' logits per prompt, prompts) for each architecture."""
    folder = tiny_llama_dir if request.param == "llama" else tiny_qwen2_dir
    net, cfg, _ = load_model(str(folder), torch.float32, torch.device("cpu"))
    ps = prompts(cfg.vocab_size)
    return net, hf_logits(folder, ps), ps


@pytest.mark.parametrize("block_size", [8, 16])
def test_one_prefill_matches_transformers(model_case, block_size: int) -> None:
    net, refs, ps = model_case
    for i, p in enumerate(ps):
        run = PagedRun(net, block_size, seed=i)
        (logits,) = run.step([("a", p)])
        torch.testing.assert_close(logits, refs[i], atol=ATOL, rtol=0)


@pytest.mark.parametrize("block_size", [8, 16])
def test_two_chunks_read_the_first_from_the_cache(model_case, block_size: int) -> None:
    net, refs, ps = model_case
    p, ref = ps[2], refs[2]
    run = PagedRun(net, block_size, seed=3)
    # A split inside a block: the second chunk appends to a half-filled block.
    first = run.step([("a", p[:13])])[0]
    second = run.step([("a", p[13:])])[0]
    torch.testing.assert_close(torch.cat([first, second]), ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize("block_size", [8, 16])
def test_token_by_token_decodes_match(model_case, block_size: int) -> None:
    net, refs, ps = model_case
    p, ref = ps[1], refs[1]
    run = PagedRun(net, block_size, seed=5)
    out = [run.step([("a", [t])])[0] for t in p]
    torch.testing.assert_close(torch.cat(out), ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize("block_size", [8, 16])
def test_sequences_of_different_lengths_in_one_batch(model_case, block_size: int) -> None:
    net, refs, ps = model_case
    a, b, c = ps
    run = PagedRun(net, block_size, seed=7)
    got: dict[str, list[torch.Tensor]] = {"a": [], "b": [], "c": []}
    # Step 1: three prefills of different lengths. Step 2: two decodes then a prefill chunk.
    # Step 3: three decodes. Steps after: c's remaining prompt as one chunk behind a decode.
    steps = [
        [("a", a[:5]), ("b", b[:11]), ("c", c[:20])],
        [("a", a[5:6]), ("b", b[11:12]), ("c", c[20:30])],
        [("a", a[6:7]), ("b", b[12:13]), ("c", c[30:31])],
        [("b", b[13:14]), ("c", c[31:])],
    ]
    for chunks in steps:
        for (sid, _), logits in zip(chunks, run.step(chunks), strict=True):
            got[sid].append(logits)
    torch.testing.assert_close(torch.cat(got["a"]), refs[0], atol=ATOL, rtol=0)
    torch.testing.assert_close(torch.cat(got["b"]), refs[1][:14], atol=ATOL, rtol=0)
    torch.testing.assert_close(torch.cat(got["c"]), refs[2], atol=ATOL, rtol=0)


@pytest.mark.parametrize(
    "rope_scaling",
    [
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 256,
        },
        {"rope_type": "linear", "factor": 4.0},
    ],
    ids=["llama3", "linear"],
)
def test_rope_scaling_matches_transformers(tmp_path: Path, rope_scaling: dict) -> None:
    # head_dim 16 with theta 10000 spans wavelengths 6..20000, so with an original context of
    # 256 the llama3 rule keeps, blends and slows different frequencies; 300 tokens reach past it.
    folder = make_tiny_model(tmp_path / "m", "llama", rope_scaling=rope_scaling, seed=3)
    net, cfg, _ = load_model(str(folder), torch.float32, torch.device("cpu"))
    assert cfg.rope_type == rope_scaling["rope_type"]
    (p,) = prompts(cfg.vocab_size, (300,))
    (logits,) = PagedRun(net, 16, num_blocks=32).step([("a", p)])
    torch.testing.assert_close(logits, hf_logits(folder, [p])[0], atol=ATOL, rtol=0)
    # The comparison can fail: the same weights with unscaled RoPE give logits far off it.
    plain_dir = make_tiny_model(tmp_path / "p", "llama", seed=3)
    plain, _, _ = load_model(str(plain_dir), torch.float32, "cpu")
    (unscaled,) = PagedRun(plain, 16, num_blocks=32).step([("a", p)])
    assert (unscaled[-50:] - logits[-50:]).abs().max() > 100 * ATOL


def test_bfloat16_forward_is_close_to_float32(tiny_llama_dir: Path) -> None:
    net32, cfg, _ = load_model(str(tiny_llama_dir), torch.float32, "cpu")
    net16, _, _ = load_model(str(tiny_llama_dir), torch.bfloat16, "cpu")
    assert net16.embed_tokens.dtype == torch.bfloat16
    assert net16.cos_sin_cache.dtype == torch.float32
    a, _, c = prompts(cfg.vocab_size)
    run32, run16 = PagedRun(net32, 16), PagedRun(net16, 16)
    # A prefill step, then a decode step that reads the bfloat16 cache.
    for chunks in ([("a", a), ("c", c)], [("a", [5]), ("c", [6])]):
        for got, ref in zip(run16.step(chunks), run32.step(chunks), strict=True):
            assert got.dtype == torch.float32
            assert (got - ref).abs().max() < 0.05 * ref.abs().max()
            assert (got[-1].argmax() == ref[-1].argmax()) or (
                ref[-1].max() - ref[-1][got[-1].argmax()] < 0.02 * ref[-1].abs().max()
            )
    assert run16.kv[0][0].dtype == torch.bfloat16


@pytest.mark.skipif(not cpu_linear._packs_bf16(), reason="no native oneDNN bf16 GEMM here")
@pytest.mark.parametrize("gemm", ["onednn", "AMX", "AVX512-BF16"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # untied; tied with q/k/v biases
def test_prepacked_bfloat16_model_gives_the_same_logits(
    arch: str, gemm: str, tiny_llama_dir: Path, tiny_qwen2_dir: Path, monkeypatch
) -> None:
    """oneDNN on its prepacked weight computes F.linear's numbers to the bit. cpu_gemm's engines
    (decode-sized steps) sum in another order: the same logits up to bf16 rounding."""
    monkeypatch.delenv("KVFLEET_CPU_KERNELS", raising=False)
    if gemm == "onednn":
        policy = KernelPolicy(amx_gemm_max_rows=0, avx512_bf16_gemm_max_rows=0)
    else:
        policy = bf16_engine(monkeypatch, gemm).policy
    folder = tiny_llama_dir if arch == "llama" else tiny_qwen2_dir
    plain, cfg, _ = load_model(str(folder), torch.bfloat16, "cpu", policy=policy)
    packed, _, _ = load_model(str(folder), torch.bfloat16, "cpu", policy=policy)
    packed.prepack()
    names = {name for name, _ in packed.named_parameters()}
    # The packed weights replaced the parameters (their plain copies are freed); the
    # embedding table stays, since token lookup reads it.
    assert not any(n.endswith(("qkv_proj", "o_proj", "gate_up_proj", "down_proj")) for n in names)
    assert "embed_tokens" in names and "lm_head" not in names
    for weight in (packed.layers[0].qkv_proj, packed.lm_head):
        assert weight.onednn.is_mkldnn and (weight.tiles is not None) == cpu_gemm.available()
    a, b, c = prompts(cfg.vocab_size)
    run_plain, run_packed = PagedRun(plain, 16), PagedRun(packed, 16)
    for chunks in ([("a", a), ("c", c)], [("a", [5]), ("c", [6]), ("b", b)]):
        for got, want in zip(run_packed.step(chunks), run_plain.step(chunks), strict=True):
            if gemm == "onednn":
                assert torch.equal(got, want)
            else:
                assert (got - want).abs().max() < 0.02 * want.abs().max()
