"""The model's linear layers on oneDNN with weights packed once, on CPUs.

A decode step multiplies a few rows by every weight of the model, so on a CPU it is bound by the linear layers;
their weights are reordered once into oneDNN's blocked layout, which runs these small products faster than
``F.linear`` (MKL's GEMM, whose kernel choice is erratic in the row count). ``benchmarks/decode_step.py --no-pack``
measures the difference (BENCHMARKS.md, "The decode step"). This is what ``torch.compile``'s CPU freezing does for
linear layers; doing it here keeps eager mode: no compile time, no shape
specialisation. Results differ from ``F.linear`` by floating-point reassociation only.
"""

from __future__ import annotations

import torch
from torch import nn


class PackedLinear(nn.Module):
    """``nn.Linear`` whose weight lives in oneDNN's blocked layout; forward only (inference)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def can_pack(model: nn.Module) -> bool:
    """oneDNN packing helps only CPU float32/bfloat16 weights, and needs a torch built with oneDNN."""
    param = next(model.parameters())
    return (
        param.device.type == "cpu"
        and param.dtype in (torch.float32, torch.bfloat16)
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


def pack_linears(model: nn.Module) -> int:
    """Replace every ``nn.Linear`` of ``model`` (LM head included) by a ``PackedLinear``, in place; returns how many
    were replaced. Idempotent: engines that share one loaded model pack it once. A tied LM head keeps the embedding
    table for lookups and gets its own packed copy (the vocabulary's weight once more in memory)."""
    if not can_pack(model):
        return 0
    targets = [(name, mod) for name, mod in model.named_modules() if type(mod) is nn.Linear]
    for name, mod in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, PackedLinear(mod))
    return len(targets)
