"""The C argmax behind greedy sampling against torch.argmax: the same index in every case,
ties and NaN included."""

import pytest
import torch
from kvfleet.kernels import dispatch
from kvfleet.kernels.cpu import cpu_argmax, cpu_library

pytestmark = pytest.mark.usefixtures("cpu_kernels_enabled")


# 49152 is the bundled model's vocabulary (rows x cols past the threshold that wakes the OpenMP
# team at 2+ rows); 17 and 5 leave tails shorter than a vector.
@pytest.mark.parametrize("rows,cols", [(1, 49152), (64, 49152), (9, 17), (3, 5), (2, 1)])
def test_argmax_matches_torch_on_random_logits(rows, cols):
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows * cols))
    assert torch.equal(cpu_argmax.argmax(x), x.argmax(dim=-1))


def test_ties_go_to_the_first_index_as_in_torch():
    # bf16 logits widened to float32 tie often: 8 bits of mantissa.
    x = torch.randn(32, 1000).to(torch.bfloat16).float()
    x[0, [3, 500, 999]] = 100.0  # a three-way tie for the maximum
    x[1, :] = 7.0  # all equal
    x[2, [20, 21]] = 50.0  # neighbours inside one vector
    got = cpu_argmax.argmax(x)
    assert torch.equal(got, x.argmax(dim=-1))
    assert got[:3].tolist() == [3, 0, 20]


def test_nan_counts_as_largest_and_all_minus_inf_gives_zero_as_in_torch():
    x = torch.randn(4, 100)
    x[0, 40] = float("nan")
    x[0, 60] = float("nan")
    x[1, 99] = float("nan")  # in the tail: 100 = 6 * 16 + 4
    x[2, :] = float("-inf")
    x[3, 10] = float("inf")
    got = cpu_argmax.argmax(x)
    assert torch.equal(got, x.argmax(dim=-1))
    assert got.tolist() == [40, 99, 0, 10]


def test_rows_of_a_wider_tensor():
    wide = torch.randn(6, 300)
    x = wide[:, 50:250]  # row stride 300
    assert cpu_argmax.argmax(x).tolist() == x.argmax(dim=-1).tolist()


def test_what_the_kernel_does_not_take_goes_to_torch(monkeypatch):
    bf16 = torch.randn(3, 40).to(torch.bfloat16)
    assert not cpu_argmax.supports(bf16)
    assert torch.equal(dispatch.argmax(bf16), bf16.argmax(dim=-1))
    columns = torch.randn(40, 3).t()  # stride(1) != 1
    assert not cpu_argmax.supports(columns)
    assert torch.equal(dispatch.argmax(columns), columns.argmax(dim=-1))
    monkeypatch.setenv("KVFLEET_CPU_KERNELS", "0")
    x = torch.randn(3, 40)
    assert torch.equal(dispatch.argmax(x), x.argmax(dim=-1))


def test_greedy_sampling_runs_the_kernel(monkeypatch):
    from kvfleet.runtime.engine.request import Request
    from kvfleet.runtime.engine.sampler import Sampler
    from kvfleet.runtime.engine.sampling_params import SamplingParams

    lib = cpu_library.library()
    real = lib.kvfleet_argmax_f32
    calls = []
    monkeypatch.setattr(lib, "kvfleet_argmax_f32", lambda *a: calls.append(a[2]) or real(*a))
    logits = torch.randn(3, 500)
    requests = [
        Request(
            request_id=str(i),
            prompt_token_ids=[1],
            params=SamplingParams(temperature=0.0),
            eos_token_ids=frozenset(),
            max_tokens=4,
        )
        for i in range(3)
    ]
    tokens, _ = Sampler()(logits, requests)
    assert tokens == logits.argmax(dim=-1).tolist()
    assert calls == [3]  # one call for the whole batch
