"""A multi-layer ``nn.RNN``/``nn.LSTM``/``nn.GRU`` as one-layer modules one after another, holding the very same
parameters, so that BNP sees every layer (issue 44).

A multi-layer recurrent module runs its layers inside one fused kernel: a forward hook sees the first layer's input
and the last layer's outputs, never the inputs of layers ≥ 1 nor any layer's h_{t−1}, so BNP leaves such a module
alone and names it (:mod:`~lightning_bnp.core.recurrent`). :func:`split_recurrent` replaces it by a
:class:`StackedRecurrent`: the same computation written as one one-layer module per layer (dropout between layers in
training, as the fused module applies it), whose hooks see each layer's input, ``hx`` and output. Its parameters are
the original ``Parameter`` objects (an optimizer built before the split keeps working), in the original order, and
its ``state_dict`` has the original keys (``weight_ih_l1``, ``bias_hh_l0_reverse`` …): checkpoints written before or
after the split load into either form.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence

__all__ = ["StackedRecurrent", "split_recurrent"]


class StackedRecurrent(nn.Module):
    """``module`` (a multi-layer ``nn.RNN``, ``nn.LSTM`` or ``nn.GRU``) as ``layers``, one one-layer module of the same
    class per layer, sharing its parameters; called as ``module`` is (``input``, ``hx``) and returning what it returns.

    Args:
        module: the module to split (left as it is; the split holds its parameters).
    """

    def __init__(self, module: nn.RNNBase) -> None:
        super().__init__()
        if not isinstance(module, (nn.RNN, nn.LSTM, nn.GRU)):
            raise TypeError(f"`module` must be an nn.RNN, nn.LSTM or nn.GRU, got {type(module).__name__}")
        self.mode, self.num_layers, self.dropout = module.mode, module.num_layers, float(module.dropout)
        self.input_size, self.hidden_size, self.proj_size = module.input_size, module.hidden_size, module.proj_size
        self.bidirectional, self.batch_first, self.bias = module.bidirectional, module.batch_first, module.bias
        directions = 2 if module.bidirectional else 1
        options: dict[str, Any] = {"bias": module.bias, "batch_first": module.batch_first}
        options["bidirectional"] = module.bidirectional
        if isinstance(module, nn.LSTM):
            options["proj_size"] = module.proj_size
        if isinstance(module, nn.RNN):
            options["nonlinearity"] = module.nonlinearity
        width = module.proj_size or module.hidden_size
        self.layers = nn.ModuleList()
        for index in range(module.num_layers):
            size = module.input_size if index == 0 else directions * width
            layer = type(module)(size, module.hidden_size, device="meta", **options)
            for name in layer._flat_weights_names:  # weight_ih_l0, …, bias_hh_l0_reverse: the original's of this layer
                setattr(layer, name, getattr(module, name.replace("_l0", f"_l{index}", 1)))
            self.layers.append(layer)
        self.register_state_dict_post_hook(_original_keys)
        self.register_load_state_dict_pre_hook(_split_keys)

    def forward(self, input: Tensor | PackedSequence, hx: Any = None) -> tuple[Any, Any]:
        directions = 2 if self.bidirectional else 1
        finals: list[Any] = []
        x = input
        for index, layer in enumerate(self.layers):
            part = slice(index * directions, (index + 1) * directions)
            if hx is None:
                state = None
            else:
                state = (hx[0][part], hx[1][part]) if self.mode == "LSTM" else hx[part]
            x, final = layer(x, state)
            finals.append(final)
            if self.dropout > 0 and self.training and index < self.num_layers - 1:
                x = _dropout(x, self.dropout)
        if self.mode == "LSTM":
            return x, (torch.cat([f[0] for f in finals]), torch.cat([f[1] for f in finals]))
        return x, torch.cat(finals)

    def extra_repr(self) -> str:
        return f"{self.mode}, {self.num_layers} layers"


def _dropout(x: Tensor | PackedSequence, p: float) -> Tensor | PackedSequence:
    if isinstance(x, PackedSequence):
        return PackedSequence(F.dropout(x.data, p, True), x.batch_sizes, x.sorted_indices, x.unsorted_indices)
    return F.dropout(x, p, True)


def _key_pairs(module: StackedRecurrent) -> list[tuple[str, str]]:
    """(split key, original key) of every parameter, relative to the module, in the original order."""
    return [
        (f"layers.{index}.{name}", name.replace("_l0", f"_l{index}", 1))
        for index, layer in enumerate(module.layers)
        for name in layer._flat_weights_names  # type: ignore[union-attr]
    ]


def _original_keys(module: nn.Module, state: dict[str, Any], prefix: str, metadata: Any) -> None:
    assert isinstance(module, StackedRecurrent)
    for split, original in _key_pairs(module):  # (the module's keys are the last saved so far: the order stays)
        if prefix + split in state:
            state[prefix + original] = state.pop(prefix + split)


def _split_keys(module: nn.Module, state: dict[str, Any], prefix: str, *args: Any) -> None:
    assert isinstance(module, StackedRecurrent)
    for split, original in _key_pairs(module):
        if prefix + original in state:
            state[prefix + split] = state.pop(prefix + original)


def split_recurrent(model: nn.Module) -> nn.Module:
    """Replace every multi-layer ``nn.RNN``/``nn.LSTM``/``nn.GRU`` of ``model`` by its :class:`StackedRecurrent`, in
    place; returns ``model`` (or the split, when ``model`` itself is such a module). Call it before building BNP;
    the layers are then named ``<module>.layers.<i>.ih_l0`` and so on.

    Example::

        model = split_recurrent(nn.LSTM(8, 16, num_layers=2))
        pre = BNPPreconditioner(model)  # layers.0.ih_l0, layers.0.hh_l0, layers.1.ih_l0, layers.1.hh_l0
    """
    if _splits(model):
        return StackedRecurrent(model)  # type: ignore[arg-type]
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if _splits(child):
                setattr(parent, name, StackedRecurrent(child))  # type: ignore[arg-type]
    return model


def _splits(module: nn.Module) -> bool:
    return isinstance(module, (nn.RNN, nn.LSTM, nn.GRU)) and module.num_layers > 1
