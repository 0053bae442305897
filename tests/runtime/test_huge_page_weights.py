"""A CPU model's streamed weights and its KV caches live on huge-page memory (`dispatch.memory_arena`):
the same values, tied weights still one tensor."""

import pytest
import torch
from kvfleet.kernels import dispatch
from kvfleet.kernels.cpu import huge_pages
from kvfleet.runtime.engine.model_runner import allocate_kv_caches
from kvfleet.runtime.models.loader import load_model

pytestmark = pytest.mark.skipif(
    not huge_pages.enabled(), reason="no transparent huge pages on this kernel"
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("folder", ["tiny_llama_dir", "tiny_qwen2_dir"])  # untied, tied LM head
def test_a_prepacked_cpu_model_streams_weights_from_huge_pages(dtype, folder, request):
    net, cfg, _ = load_model(str(request.getfixturevalue(folder)), dtype, "cpu")
    plain = {name: w.detach().clone() for name, w in net.layers[0].named_parameters()}
    embed = net.embed_tokens.detach().clone()
    net.prepack()
    layer = net.layers[0]
    for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
        weight = getattr(layer, name)
        tiles = getattr(weight, "tiles", None)
        if tiles is not None:  # kvfleet's bf16 GEMM reads these, the same values moved
            assert huge_pages.on_huge_pages(tiles)
        elif isinstance(weight, torch.Tensor):
            assert huge_pages.on_huge_pages(weight) and torch.equal(weight, plain[name])
    assert torch.equal(net.embed_tokens, embed)
    if dtype == torch.float32 and cfg.tie_word_embeddings:
        assert net.lm_head is net.embed_tokens  # still one tensor, not a copy per name


def test_cpu_kv_caches_are_zeroed_on_huge_pages(tiny_llama_dir):
    net, cfg, _ = load_model(str(tiny_llama_dir), torch.float32, "cpu")
    caches = allocate_kv_caches(
        cfg, cfg.num_kv_heads, 8, 16, torch.bfloat16, torch.device("cpu"), net.kernels
    )
    assert len(caches) == cfg.num_layers
    for k, v in caches:
        assert k.shape == (8, 16, cfg.num_kv_heads, cfg.head_dim)
        assert not k.any() and not v.any()
        assert huge_pages.on_huge_pages(k) and huge_pages.on_huge_pages(v)
    assert dispatch.memory_arena("meta") is None  # other devices keep their own allocator
