"""FP8 layers: which modules compute in fp8, with which recipe, and what their casts lose.

A *recogniser* (:data:`RECOGNISERS`) looks at one module and, when it is an fp8 layer it knows,
describes it as an :class:`Fp8Layer`: its casts (which tensor, fp8 dtype, scaling granularity, and
the function that derives the scale exactly as the recipe does) and how to compute the same output
in high precision. torchao's ``Float8Linear`` is the one known today; another fp8 layer type is
one more function in that list.

On ``layer_every`` steps only, :class:`Fp8Recorder` registers a forward hook on each fp8 layer
(removed when the step ends: the other steps run no hook and no op of ours). For the first call of
each layer in such a step it measures, for each cast, the amax, the scale the recipe derives from it,
the share of nonzero values the cast flushes to zero, the share that saturates and the 99th
percentile of |value| (for the outlier ratio amax / p99); for the
output, the relative error of the layer's fp8 output against the same linear in the layer's high
precision dtype on the same inputs. The output gradient is measured by a hook on the output tensor,
registered in that forward hook. Everything runs under ``torch.no_grad`` with no RNG draw and no
buffer changed, so training computes the same numbers with or without it.

The values of a step stay device tensors until the step ends, then move to the host in one copy
(non-blocking on CUDA; the writer thread waits on its event): no sync in training.
"""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from .copies import ours

# One row per (layer, cast) or (layer, "output"): the values below, in this order.
STATS = ("amax", "scale", "p99", "nonzero", "flushed", "saturated", "numel", "nonfinite", "rel_err")
OUTPUT = "output"
P99_SAMPLE = 16384


@dataclass(frozen=True)
class Cast:
    """One fp8 cast of a layer, as its recipe does it.

    :param role: ``input``, ``weight``, ``grad_output``, or, where the recipe casts the same tensor a
        second way for another matmul, ``input_for_grad_weight``, ``weight_for_grad_input``,
        ``grad_output_for_grad_weight`` (torchao's names).
    :param tensor: which tensor it casts (``input``, ``weight`` or ``grad_output``).
    :param dtype: the fp8 dtype.
    :param scaling: ``tensorwise`` or ``rowwise`` (torchao's axiswise).
    :param prepare: the tensor as the recipe hands it to the cast (transposed, reshaped).
    :param scale: the scale the recipe derives from that tensor (a scalar, or one per row).
    """
    role: str
    tensor: str
    dtype: torch.dtype
    scaling: str
    prepare: Callable[[torch.Tensor], torch.Tensor]
    scale: Callable[[torch.Tensor], torch.Tensor]


@dataclass
class Fp8Layer:
    name: str
    module: torch.nn.Module
    kind: str                         # e.g. torchao.Float8Linear
    recipe: str                       # tensorwise | rowwise | rowwise_with_gw_hp | custom
    casts: list[Cast]
    reference: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor]  # the output in high precision
    hp_input: Callable[[torch.Tensor], torch.Tensor] = lambda x: x     # the input the layer computes on


def _dtype_name(dtype: torch.dtype) -> str:
    return {torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}.get(dtype, str(dtype).replace("torch.", ""))


def _torchao_float8_linear(name: str, module: torch.nn.Module) -> Optional[Fp8Layer]:
    """torchao's ``Float8Linear`` (``convert_to_float8_training``). torchao is never imported here:
    a model holding such a layer has imported it already."""
    linear = sys.modules.get("torchao.float8.float8_linear")
    if linear is None or not isinstance(module, linear.Float8Linear):
        return None
    from torchao.float8.config import Float8LinearConfig, Float8LinearRecipeName, ScalingGranularity, ScalingType
    from torchao.float8.float8_scaling_utils import get_maybe_axiswise_dim
    from torchao.float8.float8_utils import tensor_to_scale

    c = module.config
    recipe = next((r.value for r in Float8LinearRecipeName if Float8LinearConfig.from_recipe_name(r) == c), "custom")

    def rows(x: torch.Tensor) -> torch.Tensor:
        return x.reshape(-1, x.shape[-1])

    def transposed(w: torch.Tensor) -> torch.Tensor:
        return w.t()

    # (role, tensor, config, axis for rowwise, how float8_linear.py hands the tensor to the cast)
    plan = [("input", "input", c.cast_config_input, -1, lambda x: x),
            ("weight", "weight", c.cast_config_weight, 0, transposed),
            ("grad_output", "grad_output", c.cast_config_grad_output, -1, rows),
            ("input_for_grad_weight", "input", c.cast_config_input_for_grad_weight, 0, rows),
            ("weight_for_grad_input", "weight", c.cast_config_weight_for_grad_input, -1, transposed),
            ("grad_output_for_grad_weight", "grad_output", c.cast_config_grad_output_for_grad_weight, 0, rows)]
    casts: list[Cast] = []
    primary: dict[str, tuple] = {}
    for role, tensor, cc, axis, prepare in plan:
        if cc.scaling_type is ScalingType.DISABLED:
            continue
        dim = get_maybe_axiswise_dim(axis, cc.scaling_granularity)
        key = (cc.target_dtype, cc.scaling_granularity, dim)
        if primary.get(tensor) == key:
            continue  # the second matmul casts this tensor the same way: the same values
        primary.setdefault(tensor, key)
        rowwise = cc.scaling_granularity is ScalingGranularity.AXISWISE

        def scale(x: torch.Tensor, cc: Any = cc, dim: Optional[int] = dim) -> torch.Tensor:
            return tensor_to_scale(x, cc.target_dtype, False, None, cc.scaling_granularity, dim,
                                   c.round_scales_to_power_of_2)
        casts.append(Cast(role, tensor, cc.target_dtype, "rowwise" if rowwise else "tensorwise", prepare, scale))

    def reference(mod: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        # what the layer gives in its own dtype (fp32 accumulation, rounded to x's dtype), computed
        # in fp32: a CPU without bf16 instructions does a bf16 matmul 5x slower
        bias = None if mod.bias is None else mod.bias.to(x.dtype).float()
        return torch.nn.functional.linear(x.float(), mod.weight.to(x.dtype).float(), bias).to(x.dtype)

    def hp_input(x: torch.Tensor) -> torch.Tensor:
        # Float8Linear.forward casts its input to autocast's GPU dtype when autocast is on
        return x.to(torch.get_autocast_gpu_dtype()) if torch.is_autocast_enabled() else x

    return Fp8Layer(name, module, "torchao.Float8Linear", recipe, casts, reference, hp_input)


# Recognisers, tried in order: (qualified name, module) -> Fp8Layer or None.
RECOGNISERS: list[Callable[[str, torch.nn.Module], Optional[Fp8Layer]]] = [_torchao_float8_linear]


def find_layers(model: torch.nn.Module) -> list[Fp8Layer]:
    """The fp8 layers of ``model``, in ``named_modules`` order (a shared module once)."""
    layers = []
    for name, module in model.named_modules():
        for recognise in RECOGNISERS:
            layer = recognise(name or "<model>", module)
            if layer is not None:
                layers.append(layer)
                break
    return layers


def describe(layers: list[Fp8Layer]) -> dict[str, Any]:
    """The run row's fp8 fields: ``amp_dtype``, ``fp8_recipe``, ``fp8_casts`` (JSON), ``fp8_layers``."""
    if not layers:
        return {}
    recipes = {layer.recipe for layer in layers}
    casts: dict[str, str] = {}
    mixed = False
    for layer in layers:
        for cast in layer.casts:
            text = f"{_dtype_name(cast.dtype)} {cast.scaling}"
            mixed = mixed or casts.setdefault(cast.role, text) != text
    return {"amp_dtype": "float8", "fp8_recipe": recipes.pop() if len(recipes) == 1 else "mixed",
            "fp8_casts": json.dumps(casts) if not mixed else json.dumps({"mixed": True, **casts}),
            "fp8_layers": len(layers)}


@torch.no_grad()
def cast_stats(x: torch.Tensor, cast: Cast) -> torch.Tensor:
    """What ``cast`` does to ``x``: the :data:`STATS` values as one float64 tensor (no sync).

    ``scale``: the smallest of the recipe's scales (rowwise: the row holding the amax), i.e. the one
    that the amax sets; ``flushed``: nonzero values that become 0 in fp8; ``saturated``: values
    whose scaled magnitude exceeds the fp8 maximum (clamped to it); ``rel_err``: NaN (the output's
    error is measured instead: a cast's relative rounding error does not depend on its scale)."""
    x = cast.prepare(x.detach())
    scale = cast.scale(x)
    fmax = torch.finfo(cast.dtype).max
    xf = x.float()
    scaled = (xf * scale).abs_()
    a = xf.abs_().flatten()
    numel = a.numel()
    zeros = numel - torch.count_nonzero(a)
    # round to nearest even flushes exactly what lies at or below half the smallest subnormal: the
    # count torchao's cast gives, without converting to fp8 and back (8 ms for a 256k tensor on a CPU)
    flushed = torch.count_nonzero(scaled <= _smallest_subnormal(cast.dtype) / 2) - zeros
    # beyond the fp32 rounding of scale * amax (dynamic scaling puts the amax at the maximum itself)
    saturated = torch.count_nonzero(scaled > fmax * (1 + 1e-6))
    amax = a.max() if numel else a.new_zeros(())
    nonfinite = numel - torch.count_nonzero(torch.isfinite(a))
    return torch.stack([amax.double(), scale.min().double(), _p99(a).double(), (numel - zeros).double(),
                        flushed.double(), saturated.double(), a.new_tensor(numel, dtype=torch.float64),
                        nonfinite.double(), a.new_tensor(float("nan"), dtype=torch.float64)])


def _smallest_subnormal(dtype: torch.dtype) -> float:
    return torch.tensor(1, dtype=torch.uint8).view(dtype).item()  # the bit pattern 0x01


def _p99(a: torch.Tensor) -> torch.Tensor:
    """99th percentile of ``a`` (flat), from at most P99_SAMPLE evenly spaced elements: exact for
    smaller tensors, an estimate for larger ones (kthvalue on all of a 256k weight costs 8 ms on one
    CPU thread, on 16k elements 0.1 ms). kthvalue: no RNG, and quantile refuses > 16M elements."""
    if not a.numel():
        return a.new_zeros(())
    sample = a[::-(-a.numel() // P99_SAMPLE)]
    return sample.kthvalue(max(1, int(0.99 * sample.numel()))).values


@torch.no_grad()
def output_stats(y: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """The fp8 output ``y`` against ``ref`` (the same linear in high precision): STATS with amax
    (of ``ref``) and rel_err ||y - ref|| / ||ref||; the cast columns are NaN (not a cast)."""
    y, ref = y.detach().float(), ref.float()
    err = torch.linalg.vector_norm(y - ref) / torch.linalg.vector_norm(ref)
    nan = torch.full((), float("nan"), dtype=torch.float64, device=y.device)
    return torch.stack([ref.abs().max().double(), nan, nan, nan, nan, nan,
                        y.new_tensor(y.numel(), dtype=torch.float64),
                        (~torch.isfinite(y)).sum().double(), err.double()])


@dataclass
class Fp8Values:
    """One step's measurements: (layer, role, fp8 dtype or None, scaling or None) per row of
    ``values`` (float64, STATS columns), on the host once ``ready`` (a CUDA event) has passed."""
    step: int
    keys: list[tuple[str, str, Optional[str], Optional[str]]]
    values: torch.Tensor
    ready: Any = None

    def rows(self) -> list[tuple]:
        """Rows for the ``fp8_layers`` table (the writer thread calls this: it may wait on ``ready``)."""
        if self.ready is not None:
            self.ready.synchronize()  # in the writer thread, never in training
        out = []
        for (module, role, dtype, scaling), v in zip(self.keys, self.values.tolist()):
            amax, scale, p99, nonzero, flushed, saturated, numel, nonfinite, rel_err = v
            is_cast = role != OUTPUT
            out.append((self.step, module, role, dtype, scaling, _num(amax), _num(scale), _num(p99),
                        _num(flushed / nonzero) if is_cast and nonzero else (0.0 if is_cast else None),
                        _num(saturated / numel) if is_cast and numel else None,
                        _num(rel_err), int(numel), int(nonfinite)))
        return out


def _num(x: float) -> Optional[float]:
    return None if x != x else x  # NaN is stored as NULL (nonfinite says when it was a NaN)


@dataclass
class Fp8Recorder:
    """Hooks fp8 layers on ``layer_every`` steps. ``guard`` wraps each hook (a recorder failure
    warns once and stops recording, never reaches training)."""
    layers: list[Fp8Layer]
    guard: Callable[[Callable], Callable]
    _handles: list[Any] = field(default_factory=list)
    _pending: list[tuple[tuple, torch.Tensor]] = field(default_factory=list)
    _seen: set[str] = field(default_factory=set)

    @property
    def armed(self) -> bool:
        return bool(self._handles)

    def arm(self) -> None:
        """Hook every fp8 layer for the coming step (a ``layer_every`` step)."""
        if self._handles:
            return
        for layer in self.layers:
            self._handles.append(layer.module.register_forward_hook(ours(self.guard(self._forward_hook(layer)))))

    def disarm(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._seen.clear()

    def take(self, step: int) -> Optional[Fp8Values]:
        """This step's values (None if nothing was measured); disarms. One copy to the host."""
        self.disarm()
        pending, self._pending = self._pending, []
        if not pending:
            return None
        values = torch.stack([v.to(pending[0][1].device) for _, v in pending])
        ready = None
        if values.device.type == "cuda":
            values = values.to("cpu", non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
        elif values.device.type != "cpu":
            values = values.cpu()  # sync point: other accelerators have no event API we rely on
        return Fp8Values(step, [k for k, _ in pending], values, ready)

    def _add(self, layer: Fp8Layer, role: str, cast: Optional[Cast], stats: torch.Tensor) -> None:
        key = (layer.name, role, _dtype_name(cast.dtype) if cast else None, cast.scaling if cast else None)
        self._pending.append((key, stats))

    def _forward_hook(self, layer: Fp8Layer) -> Callable:
        def hook(module: torch.nn.Module, args: tuple, output: Any) -> None:
            if layer.name in self._seen or not args or not isinstance(output, torch.Tensor):
                return
            self._seen.add(layer.name)  # the first call of the step (micro-batches: the first one)
            x = layer.hp_input(args[0])
            with torch.no_grad():
                tensors = {"input": x, "weight": module.weight}
                for cast in layer.casts:
                    if cast.tensor in tensors:
                        self._add(layer, cast.role, cast, cast_stats(tensors[cast.tensor], cast))
                self._add(layer, OUTPUT, None, output_stats(output, layer.reference(module, x)))
            if output.requires_grad:
                grad_casts = [c for c in layer.casts if c.tensor == "grad_output"]
                self._handles.append(output.register_hook(self.guard(self._grad_hook(layer, grad_casts))))
        return hook

    def _grad_hook(self, layer: Fp8Layer, casts: list[Cast]) -> Callable:
        def hook(grad: torch.Tensor) -> None:
            for cast in casts:
                self._add(layer, cast.role, cast, cast_stats(grad, cast))
        return hook
