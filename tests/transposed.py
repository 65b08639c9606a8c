"""A linear layer that stores its weight transposed, (in, out), and applies it with ``addmm`` (as GPT-2's
``Conv1D`` does), and the layer kind that teaches BNP about it (registered on import)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from lightning_bnp import LayerKind, register_layer_kind
from tests.helpers import BoringClassifier, make_mlp


class TransposedLinear(nn.Module):
    """``y = x @ weight + bias`` with ``weight`` of shape (in, out)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(in_features, out_features) / in_features**0.5)
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        rows = x.reshape(-1, x.shape[-1])
        out = rows @ self.weight if self.bias is None else torch.addmm(self.bias, rows, self.weight)
        return out.view(*x.shape[:-1], -1)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> TransposedLinear:
        layer = cls(linear.in_features, linear.out_features, bias=linear.bias is not None).to(linear.weight.dtype)
        with torch.no_grad():
            layer.weight.copy_(linear.weight.t())
            if linear.bias is not None:
                layer.bias.copy_(linear.bias)  # type: ignore[union-attr]
        return layer


class TransposedLinearKind(LayerKind):
    """Everything but the layout is a linear layer's (the defaults); ``forward(x)``."""

    name = "TransposedLinear"
    module_type = TransposedLinear
    family = "Linear"
    input_name = "x"

    def rows(self, module: nn.Module, weight: Tensor) -> Tensor:
        return weight.t()


register_layer_kind(TransposedLinearKind(), replace=True)


def transposed(model: nn.Module) -> nn.Module:
    """``model`` with every ``nn.Linear`` child replaced by the equivalent :class:`TransposedLinear`, in place."""
    for name, child in model.named_children():
        if isinstance(child, nn.Linear):
            setattr(model, name, TransposedLinear.from_linear(child))
        else:
            transposed(child)
    return model


def make_transposed_mlp(seed: int = 0) -> nn.Module:
    """:func:`tests.helpers.make_mlp` (same initial values) with :class:`TransposedLinear` layers."""
    return transposed(make_mlp(seed))


def as_linear_parameters(params: dict[str, Tensor], model: nn.Module) -> dict[str, Tensor]:
    """Parameters of a :class:`TransposedLinear` model named as the ``nn.Linear`` twin's (weights transposed)."""
    kinds = {f"{name}.weight" for name, m in model.named_modules() if isinstance(m, TransposedLinear)}
    return {k: (v.t() if k in kinds else v) for k, v in params.items()}


class TransposedClassifier(BoringClassifier):
    """``BoringClassifier`` on :func:`make_transposed_mlp`, without arguments (LightningCLI builds it)."""

    def __init__(self) -> None:
        super().__init__(make_transposed_mlp(), momentum=0.9)
