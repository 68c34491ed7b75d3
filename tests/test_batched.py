"""The accelerator path's batched reductions (ampwatch/record/batched.py) against a plain ground truth.

Real tensors through the real BatchedReducer and stats views; the truth is max |x| per slot computed
tensor by tensor with torch.amax (NaN propagates, inf stays). Covers chunk flushes, slots observed
several times in a step, NaN and inf, every floating dtype, and maxima that arrive in another dtype
than the slot's (CUDA's _foreach_norm answers half tensors in float).
"""
from __future__ import annotations

import math

import pytest
import torch

from ampwatch.record import batched
from ampwatch.record.observe import DTYPE_INDEX, DTYPES, StatsBuffer


def _truth(observed: list[tuple[torch.Tensor, int]], slots: int) -> dict[tuple[int, int], float]:
    out: dict[tuple[int, int], float] = {}
    for t, slot in observed:
        key = (DTYPE_INDEX[t.dtype], slot)
        a = float(t.detach().abs().amax().float())
        prev = out.get(key, -math.inf)
        out[key] = math.nan if math.isnan(a) or math.isnan(prev) else max(prev, a)
    return out


def _read(buffer: StatsBuffer) -> dict[tuple[int, int], tuple[float, float]]:
    return {(d, s): (float(v[s, 0].float()), float(v[s, 1].float()))
            for d, v in enumerate(buffer.views) for s in range(v.shape[0])}


def _same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == b


@pytest.mark.parametrize("chunk", [3, 64])
def test_folded_maxima_equal_per_tensor_amax(monkeypatch, chunk):
    monkeypatch.setattr(batched, "CHUNK", chunk)
    g = torch.Generator().manual_seed(0)
    slots = 12
    buffer = StatsBuffer(slots, torch.device("cpu"))
    reducer = batched.BatchedReducer(len(DTYPES))
    observed = []
    for i in range(40):
        dtype = DTYPES[i % len(DTYPES)]
        t = (torch.randn(5, 7, generator=g) * (i + 1)).to(dtype)
        if i == 9:
            t[2, 3] = float("nan")
        if i == 14:
            t[0, 0] = -float("inf")
        slot = i % slots  # every slot observed several times, some in several dtypes
        observed.append((t, slot))
        reducer.add(DTYPE_INDEX[dtype], t, slot)
    reducer.fold_into(buffer.views)
    truth, got = _truth(observed, slots), _read(buffer)
    for (d, s), (lo, hi) in got.items():
        if (d, s) in truth:
            assert _same(hi, truth[(d, s)]) and _same(lo, -truth[(d, s)]), (DTYPES[d], s, lo, hi, truth[(d, s)])
        else:  # never observed: still the empty slot
            assert (lo, hi) == (math.inf, -math.inf)
    # the NaN and the -inf are in the slots they were observed in, of their own dtype
    assert math.isnan(got[(DTYPE_INDEX[DTYPES[9 % 4]], 9)][1])
    assert got[(DTYPE_INDEX[DTYPES[14 % 4]], 14 % slots)][1] == math.inf


def test_a_second_step_combines_with_what_the_buffer_holds():
    buffer = StatsBuffer(4, torch.device("cpu"))
    reducer = batched.BatchedReducer(len(DTYPES))
    d = DTYPE_INDEX[torch.float16]
    reducer.add(d, torch.tensor([1.0, -3.0], dtype=torch.float16), 2)
    reducer.fold_into(buffer.views)  # a micro-batch ends
    reducer.add(d, torch.tensor([2.0], dtype=torch.float16), 2)
    reducer.add(d, torch.tensor([0.5], dtype=torch.float16), 1)
    reducer.fold_into(buffer.views)
    v = buffer.views[d]
    assert v[2].tolist() == [-3.0, 3.0] and v[1].tolist() == [-0.5, 0.5]


def test_maxima_in_another_dtype_are_cast_to_the_slot_dtype():
    # what CUDA's _foreach_norm gives for half tensors: float answers
    buffer = StatsBuffer(3, torch.device("cpu"))
    reducer = batched.BatchedReducer(len(DTYPES))
    d = DTYPE_INDEX[torch.float16]
    reducer._values[d].extend([torch.tensor(70000.0), torch.tensor(3.5)])
    reducer._slots[d].extend([0, 2])
    reducer.fold_into(buffer.views)
    v = buffer.views[d]
    assert v.dtype == torch.float16
    assert v[0].tolist() == [-math.inf, math.inf]  # beyond fp16's range: an overflow, as on the device
    assert v[2].tolist() == [-3.5, 3.5]


@pytest.mark.parametrize("host", [False, True])
@pytest.mark.parametrize("value", [None, 1.5, -70000.0, math.inf, -math.inf, math.nan])
def test_all_finite_agrees_with_the_decoded_slots(host, value):
    """The writer's shortcut on healthy steps (observe.all_finite over the raw bytes) says what
    decoding every slot says (origins.any_nonfinite): unwritten slots, finite values, ±inf and NaN
    in any one dtype's buffer, on the device layout and the host one."""
    from ampwatch.record import origins
    from ampwatch.record.hoststats import HostStats
    from ampwatch.record.observe import all_finite, decode
    slots = 12
    for d, dt in enumerate(DTYPES):
        if host:
            stats = HostStats(len(DTYPES), slots)
            stats.fold(0, 3, -1.0, 2.0)  # a finite slot in another dtype
            if value is not None:
                stats.fold(d, 7, value, value)
            raw = stats.tensor.view(torch.uint8)
        else:
            buffer = StatsBuffer(slots, torch.device("cpu"))
            buffer.views[0][3] = torch.tensor([-1.0, 2.0])
            if value is not None:
                buffer.views[d][7] = torch.tensor([value, value]).to(dt)  # -70000 overflows fp16 to -inf
            raw = torch.cat(buffer.as_bytes())
        truth = not origins.any_nonfinite(origins.slot_values(decode(raw, slots, host), {}, False))
        assert all_finite(raw, slots, host) is truth
        expected = value is None or math.isfinite(float(torch.tensor(value).to(torch.float64 if host else dt)))
        assert truth is expected


@pytest.mark.parametrize("copies_bytes", [None, 0])  # |x| of all at once, or one tensor's at a time
def test_max_abs_each_equals_amax_per_tensor(monkeypatch, copies_bytes):
    from ampwatch.record import torch_access
    if copies_bytes is not None:
        monkeypatch.setattr(torch_access, "_ABS_COPIES_BYTES", copies_bytes)
    g = torch.Generator().manual_seed(1)
    tensors = []
    for i, dtype in enumerate(DTYPES * 3):
        t = (torch.randn(3 + i, 4, generator=g) * 10 ** (i % 4)).to(dtype)
        if i == 2:
            t[1, 1] = float("nan")
        if i == 4:
            t[0, 2] = -float("inf")
        if i == 5:
            t[0, 0], t[0, 1] = float("inf"), float("nan")
        tensors.append(t.requires_grad_(True) if i % 2 else t)
    got = torch_access.max_abs_each(tensors)
    assert all(v.dim() == 0 and v.grad_fn is None for v in got)
    for t, v in zip(tensors, got):
        assert _same(float(v.float()), float(t.detach().float().abs().max())), (t.dtype, v)


def test_foreach_details_equal_the_per_tensor_details():
    """The accelerator path's detail rows (max |g|, -1, -1, zeros, parameter norm) against
    tensor_details' per-tensor ones, on real gradients of a small model with some zeros in them."""
    from ampwatch.record import torch_access
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(30, 8), torch.nn.Linear(8, 16), torch.nn.ReLU(),
                                torch.nn.Linear(16, 4))
    model(torch.tensor([[1, 2, 3]])).pow(2).sum().backward()  # 27 of 30 embedding rows get no gradient
    params = list(model.parameters())
    grads = [p.grad for p in params]
    fast = torch_access.tensor_details_foreach(grads, params, torch.device("cpu"), torch.float32)
    slow = torch_access.tensor_details(grads, params, torch.device("cpu"), torch.float32)
    assert fast.shape == slow.shape == (len(params), 5)
    assert float(slow[0, 3]) >= 27 * 8  # the zero counts are not trivially zero
    assert torch.equal(fast[:, 1:3], torch.full((len(params), 2), -1.0))
    for col in (0, 3, 4):
        torch.testing.assert_close(fast[:, col], slow[:, col])
