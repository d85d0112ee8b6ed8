"""Weights and KV cache in transparent huge pages (kestrel/ops/huge_pages.py): the memory moves, nothing
else changes (values, identity, views, tied weights, outputs)."""

from __future__ import annotations

import pytest
import torch

from kestrel.attention.kv_cache import new_kv_caches
from kestrel.ops import huge_pages
from kestrel.ops.huge_pages import HUGE_PAGE, move_to_huge_pages, zeroed, zeroed_bytes

needs_thp = pytest.mark.skipif(not huge_pages.huge_pages_available(),
                               reason="needs Linux's transparent huge pages (turned off here)")


def advised_for_huge_pages(address: int) -> bool:
    """Whether the mapping holding `address` is advised for huge pages (VmFlags `hg` in smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= address < end
            elif inside and head == "VmFlags:":
                return "hg" in line.split()[1:]
    return False


class Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(2048, 512, dtype=torch.bfloat16)
        self.proj = torch.nn.Linear(512, 512, dtype=torch.bfloat16)
        self.head = torch.nn.Linear(512, 2048, bias=False, dtype=torch.bfloat16)
        self.head.weight = self.embed.weight  # tied, as in the default model
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 512, dtype=torch.bfloat16))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.proj(self.embed(ids)) * self.scale)


@needs_thp
def test_zeroed_bytes_are_zero_aligned_and_advised():
    t = zeroed_bytes(3 * HUGE_PAGE + 100)
    assert t.dtype == torch.uint8 and t.numel() == 3 * HUGE_PAGE + 100
    assert t.data_ptr() % HUGE_PAGE == 0
    assert advised_for_huge_pages(t.data_ptr()) and advised_for_huge_pages(t.data_ptr() + t.numel() - 1)
    assert int(t.count_nonzero()) == 0
    t.fill_(7)  # writable, and held alive by the tensor (no reference to the mapping is kept here)
    assert int(t[-1]) == 7


def test_zeroed_has_the_shapes_and_dtypes_asked_apart():
    specs = [((600, 3, 64), torch.bfloat16), ((5,), torch.float32), ((1024, 1024), torch.int8), ((3,), torch.int8)]
    tensors = zeroed(specs)
    for t, (shape, dtype) in zip(tensors, specs):
        assert t.shape == shape and t.dtype == dtype and t.is_contiguous() and t.data_ptr() % 64 == 0
        assert int(t.count_nonzero()) == 0
    for t in tensors:
        t.fill_(1)
    assert [int(t.count_nonzero()) for t in tensors] == [t.numel() for t in tensors]  # none overlap


@needs_thp
def test_move_keeps_values_identity_tying_and_outputs():
    torch.manual_seed(0)
    model = Tied()
    ids = torch.tensor([3, 1000, 2047])
    before = model(ids)
    params = dict(model.named_parameters(remove_duplicate=False))
    values = {name: p.detach().clone() for name, p in params.items()}
    old_addresses = {p.data_ptr() for p in params.values()}

    moved = move_to_huge_pages(model)

    assert moved >= sum(p.numel() * p.element_size() for p in model.parameters())
    assert dict(model.named_parameters(remove_duplicate=False)) == params  # the same Parameter objects
    for name, p in params.items():
        assert torch.equal(p, values[name]), name
        assert p.data_ptr() not in old_addresses and advised_for_huge_pages(p.data_ptr()), name
    assert model.head.weight is model.embed.weight
    assert advised_for_huge_pages(model.scale.data_ptr())
    assert all(p.data_ptr() % 64 == 0 for p in model.parameters())
    assert torch.equal(model(ids), before)
    model.embed.weight.data[0, 0] = 1.0  # still one storage for the tied pair
    assert float(model.head.weight.detach()[0, 0]) == 1.0


@needs_thp
def test_move_keeps_views_of_one_storage():
    class Views(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            whole = torch.arange(4096 * 600, dtype=torch.float32).view(4096, 600)
            self.top = torch.nn.Parameter(whole[:2048], requires_grad=False)
            self.bottom_t = torch.nn.Parameter(whole[2048:].t(), requires_grad=False)

    model = Views()
    expected_top, expected_bottom = model.top.clone(), model.bottom_t.clone()
    move_to_huge_pages(model)
    assert torch.equal(model.top, expected_top) and torch.equal(model.bottom_t, expected_bottom)
    assert model.bottom_t.stride() == (1, 600)
    assert model.top.untyped_storage().data_ptr() == model.bottom_t.untyped_storage().data_ptr()


def test_disabled_moves_nothing(monkeypatch):
    monkeypatch.setenv("KESTREL_DISABLE_HUGE_PAGES", "1")
    model = Tied()
    addresses = [p.data_ptr() for p in model.parameters()]
    assert move_to_huge_pages(model) == 0
    assert [p.data_ptr() for p in model.parameters()] == addresses
    # numpy advises the 2 MiB-aligned inside of its own large arrays for huge pages, so every part of
    # the buffer is looked at, not its first byte alone (which an unaligned start leaves outside).
    for _ in range(4):
        t = zeroed_bytes(4 * HUGE_PAGE)
        assert not any(advised_for_huge_pages(t.data_ptr() + offset)
                       for offset in range(0, t.numel(), HUGE_PAGE // 2)), hex(t.data_ptr())


@needs_thp
def test_kv_cache_is_zero_and_in_huge_pages():
    caches = new_kv_caches(2, 512, 16, 3, 64, torch.bfloat16, False, torch.device("cpu"))
    for k, v in caches:
        assert k.shape == v.shape == (512 * 16, 3, 64)
        assert int(k.count_nonzero()) == int(v.count_nonzero()) == 0
        assert advised_for_huge_pages(k.data_ptr()) and advised_for_huge_pages(v.data_ptr())


@needs_thp
@pytest.mark.slow
def test_engine_weights_are_in_huge_pages():
    from kestrel import LLM, SamplingParams
    llm = LLM(max_model_len=256, kv_cache_memory="64MiB")
    runner = llm.llm_engine.engine_core.executor.driver_worker.runner
    assert all(advised_for_huge_pages(p.data_ptr()) for p in runner.model.parameters())
    assert all(advised_for_huge_pages(t.data_ptr()) for cache in runner.kv_caches for t in cache)
    out = llm.generate(["Hello"], SamplingParams(max_tokens=4, temperature=0.0))
    assert len(out[0].outputs[0].token_ids) == 4


@needs_thp
def test_move_frees_each_old_copy_as_it_goes():
    """The RSS peaks near the weights plus one storage, not at twice the weights."""
    from kestrel.worker.memory import _peak_rss_bytes, _reset_peak_rss, _rss_bytes
    weights = torch.nn.ParameterList(torch.nn.Parameter(torch.full((1024, 4096), float(i), dtype=torch.bfloat16),
                                                        requires_grad=False) for i in range(48))
    size = sum(p.numel() * p.element_size() for p in weights)  # 384 MiB
    before = _rss_bytes()
    if not _reset_peak_rss():
        pytest.skip("needs Linux's /proc/self/clear_refs (to reset the peak RSS)")
    move_to_huge_pages(weights)
    assert _peak_rss_bytes() - before < size // 4
    assert all(float(p[0, 0]) == i and advised_for_huge_pages(p.data_ptr()) for i, p in enumerate(weights))
