"""One optimizer step as the training thread hands it over, and its conversion to table rows.

The training thread concatenates every device value of a step into one flat byte tensor (the
step's scalars in the pack dtype, then the module stats buffer): one transfer, made non-blocking on
CUDA. The writer thread waits for it and turns it into rows here, so no per-value ``.item()`` ever
runs on the training thread.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from . import observe

from . import origins
from .healthy import HealthyRows, slot_amax
from .spikes import SpikeWatch
from ..store.rows import Rows
from ..store.schema import LAYER_NAN_BITS, STEP_NAN_BITS

log = logging.getLogger("ampwatch")


@dataclass
class StepPack:
    step: int
    time: float
    duration_s: float
    lr: Optional[float]
    micro_batches: int
    skipped: Optional[bool]            # known on the host (GradScaler skipped optimizer.step()), else None
    flat: Optional[torch.Tensor]       # every device value of the step as bytes, on the CPU (maybe in flight)
    ready: Any = None                  # CUDA event to wait on before reading ``flat``
    layout: dict[str, tuple[int, int]] = field(default_factory=dict)  # segment -> (offset, length)
    host_metrics: dict[str, float] = field(default_factory=dict)
    norm_ids: list[int] = field(default_factory=list)     # parameter ids of the 'norms' segment
    detail_ids: list[int] = field(default_factory=list)   # parameter ids of the 'detail' segment
    param_numel: dict[int, int] = field(default_factory=dict)
    loc: Optional[dict] = None         # the observer's structure for this step (ModuleObserver.take)
    scalar_bytes: int = 0              # flat[:scalar_bytes] holds the scalars, the rest the module stats
    pack_dtype: torch.dtype = torch.float64
    exact_counts: bool = True          # module NaN/inf counts were paid for (free host reads)
    host_stats: bool = False           # the module stats are hoststats.HostStats' doubles (free reads)
    scalars: Optional[list[float]] = None  # free reads: the scalars as read (then flat holds only the stats)
    fp8: Any = None                    # fp8.Fp8Values of a layer_every step of a run with fp8 layers
    # an observed step's kept root inputs, ``(micro_batch, args, kwargs)`` references, where the host
    # could not tell without a read whether its forward went bad: the module values tell here
    inputs: Optional[list] = None


def _nullable(x: Optional[float]) -> Optional[float]:
    return None if x is None or math.isnan(x) else x


def _clean(values: list) -> list:
    """NaN -> None (SQLite would store NULL anyway; the nan_mask column remembers it was NaN)."""
    return [None if v is None or v != v else v for v in values]


def _kind(nan: float, inf: float, value: float = 0.0) -> str:
    if nan and inf:
        return "nan+inf"
    if nan or (not inf and math.isnan(value)):
        return "nan"
    return "inf"


class PackReader:
    """Turns packs into rows. Holds the run's name tables (parameter and module ids)."""

    def __init__(self, param_names: list[str], param_dtypes: list[str],
                 module_ids: list[int], module_names: list[str], layer_every: int,
                 tied: Optional[dict[int, list[tuple[int, str]]]] = None,
                 scaler_checked: frozenset = frozenset()) -> None:
        self.param_names = param_names
        # parameters whose gradients the GradScaler checks element by element (the optimizer's):
        # a step it did not skip had every element of them finite
        self.scaler_checked = scaler_checked
        self.tied = tied or {}  # parameter id -> [(owning module index, name there)] (runinfo.tied_owners)
        self.param_dtypes = param_dtypes
        self.module_ids = module_ids
        self.module_names = module_names
        self.layer_every = layer_every
        self._healthy = HealthyRows(len(module_names))
        self._spikes = SpikeWatch()  # healthy steps whose gradient norm or loss spiked get layer rows
        self.batch_saver: Any = None  # batches.BatchSaver, shared with the training thread (locked)
        self._root = module_names.index("<model>") if "<model>" in module_names else None

    def rows(self, pack: StepPack) -> Rows:
        if pack.ready is not None:
            pack.ready.synchronize()  # waits in the writer thread, never in training
        if pack.flat is not None and pack.flat.dtype != torch.uint8:
            # the step's scalars alone, in their dtype (record/step.py): seen as bytes here, off the
            # training thread
            pack.flat = pack.flat.view(torch.uint8)
        values: list[float] = []
        if pack.scalars is not None:
            values = pack.scalars
        elif pack.flat is not None:
            values = pack.flat[:pack.scalar_bytes].view(pack.pack_dtype).tolist()

        def seg(name: str) -> list[float]:
            off, n = pack.layout.get(name, (0, 0))
            return values[off:off + n]

        out = Rows()
        loss = (seg("loss") or [None])[0]
        scale = (seg("scale") or [None])[0]
        found_inf = (seg("found_inf") or [None])[0]
        skipped = pack.skipped if pack.skipped is not None else bool(found_inf)
        norms = seg("norms")
        # one C call for the usual finite step (math.hypot); non-finite norms take the sum, whose
        # NaN wins over inf as the step's NaN bit expects. Every step passes here on the writer
        # thread, and its Python holds the GIL that the training thread waits for
        grad_norm = math.hypot(*norms) if norms else None
        finite = grad_norm is None or math.isfinite(grad_norm)
        if not finite:
            grad_norm = math.sqrt(sum(n * n for n in norms))
        nan_mask = 0
        if loss is not None and math.isnan(loss):
            nan_mask |= STEP_NAN_BITS["loss"]
        if grad_norm is not None and math.isnan(grad_norm):
            nan_mask |= STEP_NAN_BITS["grad_norm"]
        out.steps.append((pack.step, pack.time, pack.duration_s, _nullable(loss), scale, int(skipped),
                          _nullable(grad_norm), (seg("lr") or [pack.lr])[0], pack.micro_batches, nan_mask))

        for key, v in pack.host_metrics.items():
            out.metrics.append((key, pack.step, _nullable(v)))
        for key, (off, n) in pack.layout.items():
            if key.startswith("metric:") and n:
                out.metrics.append((key[7:], pack.step, _nullable(values[off])))

        bad_params = [] if finite else [i for i, n in zip(pack.norm_ids, norms) if not math.isfinite(n)]
        detail = self._details(pack, seg("detail"))
        overflowed = self._overflowed(pack, bad_params, norms, detail, scale is not None and not skipped)
        spiked = not skipped and finite and self._spikes.spiked(grad_norm, loss)
        if (pack.step % self.layer_every == 0 or skipped or bad_params or spiked) and norms:
            out.layers.extend(self._layer_rows(pack, norms, detail, overflowed))
        if overflowed:
            bad_params = [pid for pid in bad_params if pid not in overflowed]
        analysis = _Analysis(self, pack)
        for pid in bad_params:
            amax, nan, inf = detail.get(pid, (None, None, None, None, None))[:3]
            n = norms[pack.norm_ids.index(pid)]
            if nan is None or nan < 0:  # counts not paid for (accelerator, not a known-bad step)
                count, kind = None, "nan" if math.isnan(n) or (amax is not None and math.isnan(amax)) else "inf"
            else:
                count, kind = int(nan + inf), _kind(nan, inf, n)
            out.events.append((pack.step, "param_grad", self._grad_name(analysis, pid), kind, count,
                               _nullable(amax), self.param_dtypes[pid], 0, None, None, None, None, None, None))
        if loss is not None and not math.isfinite(loss):
            out.events.append((pack.step, "loss", "loss", _kind(0, 0, loss), None, None, None, 0,
                               None, None, None, None, None, None))
        if pack.loc is not None:
            self._localization_rows(pack, analysis, out)
        if pack.inputs is not None:
            calls, pack.inputs = pack.inputs, None  # the references go with this step
            self._brought_inputs(pack.step, analysis, calls, out)
        if pack.fp8 is not None:
            out.fp8_layers.extend(pack.fp8.rows())
        return out

    def _brought_inputs(self, step: int, analysis: "_Analysis", calls: list, out: Rows) -> None:
        """Save the kept micro-batch whose forward the module values say went non-finite: the
        model's input held NaN/+inf, or its output did. Only a step whose analysis already ran (it
        had non-finite module values) is looked at: a healthy step costs nothing here."""
        found = analysis.computed
        if found is None or self._root is None or self.batch_saver is None:
            return
        _, stats, _ = found
        bad = stats.get((self._root, origins.INPUT)) or stats.get((self._root, origins.FORWARD))
        if bad is None or not bad.nonfinite:
            return
        picked = [call for call in calls if call[0] == (bad.micro_batch or 0)]
        try:
            out.batches.extend(self.batch_saver.rows(step, picked))
        except Exception as exc:  # an input that cannot be copied to the host: the step's rows stay
            log.warning("ampwatch: the inputs of step %d were not saved: %s: %s", step, type(exc).__name__, exc)

    def _grad_name(self, analysis: "_Analysis", pid: int) -> str:
        """The name of a parameter with a non-finite gradient; for a tied one, the name under the
        module whose backward produced it when the module hooks tell (nanoGPT's ``lm_head.weight``
        when the head's weight gradient overflows; ``transformer.wte.weight`` when the embedding was
        handed a non-finite gradient), ``one of: a, b`` when they cannot tell. Without module
        values at all, the parameter's own (first) name."""
        owners = self.tied.get(pid)
        if not owners:
            return self.param_names[pid]
        found = analysis.get(force=True)
        if found is None:
            return self.param_names[pid]
        values, stats, _ = found
        received = origins.grads_received(values, self._pack_aliases(analysis), [m for m, _ in owners],
                                          len(self.module_names))
        return attribute_grad(owners, stats, received) or "one of: " + ", ".join(sorted(n for _, n in owners))

    @staticmethod
    def _pack_aliases(analysis: "_Analysis") -> dict:
        loc = analysis.loc
        return loc["aliases"] if loc else {}

    def _overflowed(self, pack: StepPack, bad_params: list[int], norms: list[float], detail: dict[int, tuple],
                    scaler_stepped: bool) -> frozenset:
        """Parameters among ``bad_params`` whose norm is inf though every element of their gradient
        is finite: a float32 norm squares and sums in float32, and overflows on elements above
        ~1.8e19 (where the norm is measured on the device, it is not measured again). Known from the
        step's detail (counted: no NaN, no inf, a finite max) or from the GradScaler, which checked
        every element of the optimizer's gradients and stepped (``scaler_stepped``). Not a NaN/Inf
        gradient: its layer row says inf with no non-finite element, and no event is written."""
        if not bad_params:
            return frozenset()
        found = set()
        for pid in bad_params:
            if norms[pack.norm_ids.index(pid)] != math.inf:  # a NaN norm has a NaN element
                continue
            amax, nan, inf = detail.get(pid, (None, -1.0, -1.0))[:3]
            if nan is not None and nan >= 0:  # counted (-1: not counted, on the device path)
                if nan + inf == 0 and amax is not None and math.isfinite(amax):
                    found.add(pid)
            elif scaler_stepped and pid in self.scaler_checked:
                found.add(pid)
        return frozenset(found)

    def _details(self, pack: StepPack, flat: list[float]) -> dict[int, tuple]:
        return {pid: tuple(flat[5 * i:5 * i + 5]) for i, pid in enumerate(pack.detail_ids)}

    def _layer_rows(self, pack: StepPack, norms: list[float], detail: dict[int, tuple],
                    overflowed: frozenset = frozenset()) -> list[tuple]:
        """Column-wise with comprehensions: this loop is most of the writer's time (bench/storage.py)."""
        ids, step = pack.norm_ids, pack.step
        if detail and len(detail) == len(ids):
            cols = list(zip(*(detail[pid] for pid in ids)))
            amax, nan, inf, zero, pnorm = (list(c) for c in cols)
            # -1: not counted (foreach detail on an accelerator); a finite norm means none
            nonfinite = [int(a + b) if a >= 0 else (0 if math.isfinite(n) else None)
                         for a, b, n in zip(nan, inf, norms)]
            zero_frac = [z / (pack.param_numel.get(pid) or 1) for z, pid in zip(zero, ids)]
        else:
            amax = pnorm = zero_frac = [None] * len(ids)  # type: ignore[assignment]
            nonfinite = [None] * len(ids)
        if overflowed:  # an inf norm of finite elements (_overflowed): none non-finite
            nonfinite = [0 if pid in overflowed else v for pid, v in zip(ids, nonfinite)]
        bits = LAYER_NAN_BITS
        mask = [(bits["grad_norm"] if n != n else 0) | (bits["grad_amax"] if a is not None and a != a else 0)
                | (bits["param_norm"] if p is not None and p != p else 0)
                for n, a, p in zip(norms, amax, pnorm)]
        return list(zip(ids, [step] * len(ids), _clean(norms), _clean(amax), _clean(pnorm),
                        nonfinite, zero_frac, mask))

    def _localization_rows(self, pack: StepPack, analysis: "_Analysis", out: Rows) -> None:
        # Most steps are healthy and not detail steps: nothing to write, so the analysis is skipped;
        # a healthy detail step writes its module maxima, computed without the per-slot analysis
        amax = analysis.healthy_amax() if pack.step % self.layer_every == 0 else None
        if amax is not None:
            loc = pack.loc
            forward, backward = self._healthy.module_amax(amax, loc["aliases"], loc.get("changed", frozenset()))
            step, ids = pack.step, self.module_ids
            for m, (f, b) in enumerate(zip(forward, backward)):
                if f > -math.inf:
                    out.modules.append((ids[m], 0, step, f, 0))
                if b > -math.inf:
                    out.modules.append((ids[m], 1, step, b, 0))
            return
        found = analysis.get(force=False)
        if found is None:
            return
        values, stats, where = found
        loc = pack.loc
        has_events = any(s.nonfinite for s in stats.values())
        into = origins.flows_into(values, loc["aliases"], loc["order"], self.module_names, where) \
            if has_events else {}
        fp32_amax = loc.get("fp32") or {}
        lowp_amax = loc.get("lowp") or {}
        for (module, phase), s in stats.items():
            if s.nonfinite:
                count = None if s.nan is None else int(s.nan + s.inf)  # type: ignore[operator]
                kind = _kind(s.nan, s.inf) if s.nan is not None else ("nan" if s.kind_nan else "inf")
                origin = where[phase] == module
                fp32 = fp32_amax.get(module) if origin and phase == origins.FORWARD else None
                lowp = lowp_amax.get(module) if origin and phase == origins.FORWARD else None
                out.events.append((pack.step, phase, self.module_names[module], kind, count,
                                   _nullable(s.amax), s.dtype, int(origin), s.micro_batch,
                                   _nullable(fp32), None if fp32 is None else int(math.isnan(fp32)),
                                   into.get(phase) if origin else None,
                                   _nullable(lowp), None if lowp is None else int(math.isnan(lowp))))
            if phase != origins.INPUT and (has_events or pack.step % self.layer_every == 0):
                out.modules.append((self.module_ids[module], 0 if phase == origins.FORWARD else 1,
                                    pack.step, _nullable(s.amax), int(s.nonfinite)))


class _Analysis:
    """One step's module values and origin analysis, computed at most once and only when needed."""

    def __init__(self, reader: PackReader, pack: StepPack) -> None:
        self._reader, self._pack = reader, pack
        self.loc = pack.loc
        self._values: Optional[dict] = None
        self._result: Optional[tuple] = None

    @property
    def computed(self) -> Optional[tuple]:
        """(slot values, stats, origins) where the analysis ran (a step with non-finite module
        values, or a tied gradient's owner asked), else None; never computes it."""
        return self._result

    def _raw(self) -> tuple[torch.Tensor, int, int]:
        """The stats' bytes (then the micro-batch marks), the number of slots and the stats' size."""
        pack = self._pack
        slots = observe.ROLES * len(self._reader.module_names)
        raw = pack.flat if pack.scalars is not None else pack.flat[pack.scalar_bytes:]
        if pack.scalar_bytes % 8:
            # an odd count of float32 scalars: the stats' float64 rows need a copy of their own to be
            # viewed (a view of another dtype must start at a multiple of its size)
            raw = raw.clone()
        return raw, slots, observe.stats_bytes(slots, pack.host_stats)

    def healthy_amax(self) -> Optional[torch.Tensor]:
        """Per slot max |x| (float64, -inf where unwritten) when modules were observed and every
        slot is finite; None otherwise (nothing observed, or the full analysis is needed)."""
        loc = self.loc
        if not loc or not loc["observed"] or self._pack.flat is None:
            return None
        raw, slots, size = self._raw()
        return slot_amax(raw[:size], slots, self._pack.host_stats)

    def get(self, force: bool) -> Optional[tuple[dict, dict, dict]]:
        """(slot values, stats, origins), or None: nothing observed, or (unless ``force``) a
        healthy step that is not a detail step."""
        pack, reader = self._pack, self._reader
        loc = pack.loc
        if not loc or not loc["observed"] or pack.flat is None:
            return None
        if self._result is not None:
            return self._result
        if self._values is None:
            raw, slots, size = self._raw()
            if not force and pack.step % reader.layer_every and observe.all_finite(raw[:size], slots, pack.host_stats):
                return None  # a healthy step that writes no module rows: nothing to decode
            first = raw[size:].view(torch.float32).tolist() if loc.get("first") else None
            self._values = origins.slot_values(observe.decode(raw, slots, pack.host_stats), loc["counts"], pack.exact_counts,
                                               first, loc.get("micro_batches", 1))
        if not force and pack.step % reader.layer_every and not origins.any_nonfinite(self._values):
            return None
        stats, found = origins.analyse(self._values, loc["aliases"], loc["order"], reader.module_names,
                                       loc.get("changed", frozenset()))
        self._result = (self._values, stats, found)
        return self._result


_LOW_PRECISION = ("float16", "bfloat16")


def attribute_grad(owners: list[tuple[int, str]], stats: dict,
                   received: Optional[dict[int, Optional[bool]]] = None) -> Optional[str]:
    """Which owner of a tied parameter made its gradient non-finite, from one step's module stats.

    A module's weight gradient is computed from the gradient it received (w.r.t. its output) and its
    input: an owner handed a non-finite gradient produces a non-finite weight gradient whatever its
    precision (an embedding in fp32 included), so the only such owner is the one. When none was
    handed one, the weight gradient itself overflowed: only a computation in fp16/bf16 does that
    from finite values, so the only owner that ran in low precision. ``received``: per owner
    module, whether its received gradient was non-finite (None: not observed). None if unclear
    (several owners qualify, or one was not observed)."""
    ran = [(m, name) for m, name in owners if (m, origins.FORWARD) in stats]
    if ran and len(ran) < len(owners):  # an owner not called this step produced nothing
        owners = ran
        if len(owners) == 1:
            return owners[0][1]
    if received is not None:
        if any(received.get(m) is None for m, _ in owners):
            return None
        bad = [name for m, name in owners if received[m]]
        if len(bad) == 1:
            return bad[0]
        if bad:
            return None
    else:  # older callers: the owners whose input gradient went non-finite
        bad = [name for m, name in owners
               if (s := stats.get((m, origins.BACKWARD))) is not None and s.nonfinite]
        if len(bad) == 1:
            return bad[0]
    low = [name for m, name in owners
           if (s := stats.get((m, origins.FORWARD))) is not None and s.dtype in _LOW_PRECISION]
    return low[0] if len(low) == 1 else None
