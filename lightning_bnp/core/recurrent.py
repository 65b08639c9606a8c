"""Recurrent layers: one-layer ``nn.RNN``, ``nn.LSTM``, ``nn.GRU`` and the cells ``nn.RNNCell``, ``nn.LSTMCell``,
``nn.GRUCell`` as layer kinds (issue 44; docs/recurrent_layers.md has the derivation).

One time step of a recurrent layer is one linear layer on the stacked input z_t = [x_t ; h_{t−1}]:

.. math::
    a_t = W_{ih} x_t + b_{ih} + W_{hh} h_{t-1} + b_{hh} = [W_{ih} \\mid W_{hh}]\\, z_t + (b_{ih} + b_{hh}),

its weight shared over time, so each real step of each sequence is one row of its input (N = the real steps of the
batch). Its columns are two blocks with their own statistics: W_ih's of the layer's input x_t, W_hh's of h_{t−1} —
h_0 (given, or zeros) and then every output but the last of each sequence (the reverse direction: every output but
its first, which the reverse direction computes last). Each block is a layer kind (``<module>.ih_l0``,
``<module>.hh_l0``, ``…_reverse``), named a column block of the one layer (:meth:`~lightning_bnp.core.kinds.
LayerKind.column_block`): the step takes σ̃²'s floor ε1·max σ² over both blocks, q² = max((n_x + n_h)/N, 1) with
the one layer's fan-in, and — since ``b_ih`` and ``b_hh`` are one bias b = b_ih + b_hh whose gradient G_b each of
them receives — each bias update is G_b/(2q²) − Σ_j μ_j·G_w_new[i, j] over its own block's columns: the two sum to
eq. 15's G_b/q² − Σ_j μ_j·G_w_new[i, j] over all columns, the one layer's update of b (each block's map is
(1/q²)·P·Pᵀ with the bias entry of P scaled by 1/√2: symmetric and positive definite).

GRU. Its r and z rows are such a layer; its n rows are not: n_t = tanh(W_in x_t + b_in + r_t ⊙ (W_hn h_{t−1} +
b_hn)) puts b_hn inside the product with r_t, so W_in with b_in is a linear layer on x_t and W_hn with b_hn another
on h_{t−1}. Four kinds: ``.ih_l0.rz`` and ``.hh_l0.rz`` (column blocks of one layer), ``.ih_l0.n`` and ``.hh_l0.n``
(layers on their own, q² from their own fan-in).

Inputs. A forward hook on the module sees its input, ``hx`` and output: padded (``batch_first`` either way),
unbatched, or a ``PackedSequence``, which holds no padding (the rows of the previous states are then read from the
packed output with its ``batch_sizes``). A padded batch takes a token mask (``BNPPreconditioner.token_mask``, the
input's leading dimensions): the forward direction then counts exactly the packed rows; the reverse direction of a
padded batch reads the padding first, so a bidirectional layer needs packed input (a mask is refused there). The
statistics count once the backward reaches the output sequence or a final state. A cell is called once per step:
each call is one row per sample, pooled over the calls of the step like any layer called several times.

Left alone, and named in the coverage report: a module with ``num_layers > 1`` (the inputs of its layers ≥ 1 and
every layer's h_{t−1} stay inside the fused kernel, where no hook sees them: write it as one-layer modules, one
after another: :func:`~lightning_bnp.core.stacked_recurrent.split_recurrent` does it, the parameters and state
dict keys unchanged) and an LSTM's ``weight_hr`` (``proj_size``: it multiplies o_t ⊙ tanh(c_t), which is not exposed;
W_ih and W_hh are transformed, h_t being the projection's output).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence

from lightning_bnp.core.kinds import LINEAR_FAMILY, LayerKind

__all__ = ["GRUGateKind", "RecurrentKind", "previous_states", "recurrent_kinds"]


def _width(module: nn.Module) -> int:
    """The width of h: ``proj_size`` when an LSTM projects, else ``hidden_size``."""
    return int(getattr(module, "proj_size", 0) or module.hidden_size)  # type: ignore[arg-type]


class RecurrentKind(LayerKind):
    """The ``block`` (``"ih"``: W_ih on x_t, or ``"hh"``: W_hh on h_{t−1}) of one direction of a one-layer recurrent
    module of ``module_type``, or of a cell; column block 0 or 1 of the one linear layer on [x_t ; h_{t−1}]."""

    family = LINEAR_FAMILY

    def __init__(self, module_type: type[nn.Module], block: str, *, reverse: bool = False, gate: str = "") -> None:
        self.cell = issubclass(module_type, nn.RNNCellBase)
        tail = ("" if self.cell else "_l0") + ("_reverse" if reverse else "")
        self.module_type = module_type  # type: ignore[misc]
        self.block, self.reverse, self.gate = block, reverse, gate
        self.weight_name = f"weight_{block}{tail}"  # type: ignore[misc]
        self.bias_name = f"bias_{block}{tail}"  # type: ignore[misc]
        self.suffix = f".{block}{tail}" + (f".{gate}" if gate else "")  # type: ignore[misc]
        self.name = f"{module_type.__name__}{self.suffix}"  # type: ignore[misc]

    def present(self, module: nn.Module) -> bool:
        """A cell, or a one-layer module (its reverse direction when bidirectional)."""
        return self.cell or (int(module.num_layers) == 1 and (bool(module.bidirectional) or not self.reverse))  # type: ignore[arg-type]

    def left_alone(self, module: nn.Module, attribute: str) -> str | None:
        if self.cell:
            return None
        if attribute.startswith("weight_hr"):
            return (
                "the projection of an LSTM with proj_size: it multiplies o_t ⊙ tanh(c_t), which the module does not "
                "expose; left to the optimizer (weight_ih and weight_hh are transformed)"
            )
        if int(module.num_layers) > 1 and attribute.startswith("weight_"):  # type: ignore[arg-type]
            return (
                f"{type(module).__name__} with num_layers={module.num_layers}: the inputs of its layers ≥ 1 and "
                "every layer's h_(t−1) stay inside the fused kernel, where no hook sees them; split it into one-layer "
                "modules sharing its parameters and state dict keys (lightning_bnp.core.stacked_recurrent."
                "split_recurrent) to have BNP precondition it"
            )
        return None

    def column_block(self, module: nn.Module) -> tuple[int, int] | None:
        return (0 if self.block == "ih" else 1, 2)

    def features(self, module: nn.Module) -> int:
        return int(module.input_size) if self.block == "ih" else _width(module)  # type: ignore[arg-type]

    def fan_in(self, module: nn.Module) -> int:
        """The one layer's: n_x + n_h (q² = max((n_x + n_h)/N, 1), the same for both blocks)."""
        return int(module.input_size) + _width(module)  # type: ignore[arg-type]

    def calls(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
    ) -> list[tuple[Any, Any]]:
        """``[(rows, outputs)]``: the block's input — x (a packed input's ``data``) or the previous states
        (:func:`previous_states`) — and the tensors of the output (any one reached counts the statistics)."""
        x = args[0] if args else kwargs.get("input")
        hx = args[1] if len(args) > 1 else kwargs.get("hx")
        outputs = _output_tensors(output)
        if self.block == "ih":
            return [(x.data if isinstance(x, PackedSequence) else x, outputs)]
        if self.cell:
            return [(_cell_previous(module, x, hx), outputs)]
        return [(previous_states(module, x, hx, output, reverse=self.reverse), outputs)]

    def token_rows(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], h: Tensor, mask: Tensor
    ) -> Tensor | None:
        """The mask itself, in the input's layout ((B, T) with ``batch_first``, else (T, B)): the previous states
        are laid out as the input, h_{t−1} at step t.

        Raises:
            ValueError: the input is packed (no padding: leave the layer out of the mask), or the layer is the
                reverse direction, which reads a padded batch's padding first (pack the batch).
        """
        x = args[0] if args else kwargs.get("input")
        if isinstance(x, PackedSequence):
            raise ValueError(
                f"{self.name}: the {type(module).__name__} got a PackedSequence while a token mask is set: a packed "
                "batch holds no padding; leave this layer out of the mask with `token_mask(mask, layers=...)`"
            )
        if self.reverse:
            raise ValueError(
                f"{self.name}: the reverse direction of a bidirectional {type(module).__name__} reads a padded "
                "batch's padding before its real steps, so no mask makes it the padding-free layer: pack the batch "
                "(torch.nn.utils.rnn.pack_padded_sequence) instead of masking it"
            )
        return mask if mask.shape == h.shape[:-1] else None


class GRUGateKind(RecurrentKind):
    """A GRU's rows of one gate group: ``gate="rz"`` (rows [0, 2H): column block of the one layer on
    [x_t ; h_{t−1}]) or ``gate="n"`` (rows [2H, 3H): W_in with b_in a layer on x_t, W_hn with b_hn one on h_{t−1})."""

    def _span(self, module: nn.Module) -> slice:
        hidden = int(module.hidden_size)  # type: ignore[arg-type]
        return slice(0, 2 * hidden) if self.gate == "rz" else slice(2 * hidden, 3 * hidden)

    def rows(self, module: nn.Module, weight: Tensor) -> Tensor:
        return weight[self._span(module)]

    def bias_rows(self, module: nn.Module, bias: Tensor) -> Tensor:
        return bias[self._span(module)]

    def column_block(self, module: nn.Module) -> tuple[int, int] | None:
        return super().column_block(module) if self.gate == "rz" else None

    def fan_in(self, module: nn.Module) -> int:
        return super().fan_in(module) if self.gate == "rz" else self.features(module)


def _output_tensors(output: Any) -> tuple[Tensor, ...]:
    """Every tensor of a recurrent module's or cell's output (a packed sequence's ``data``)."""
    found: list[Tensor] = []
    stack = [output]
    while stack:
        item = stack.pop()
        if isinstance(item, PackedSequence):
            found.append(item.data)
        elif isinstance(item, Tensor):
            found.append(item)
        elif isinstance(item, (tuple, list)):
            stack.extend(item)
    return tuple(found)


def _cell_previous(module: nn.Module, x: Any, hx: Any) -> Any:
    """A cell's h_{t−1}: ``hx`` (an LSTMCell's h of ``(h, c)``), or the zeros the cell starts from."""
    h = hx[0] if isinstance(hx, (tuple, list)) else hx
    if h is None and isinstance(x, Tensor):
        return x.new_zeros(*x.shape[:-1], int(module.hidden_size))  # type: ignore[arg-type]
    return h


def previous_states(module: nn.Module, x: Any, hx: Any, output: Any, *, reverse: bool = False) -> Tensor | None:
    """h_{t−1} of every step of one forward call of a one-layer recurrent ``module`` (one direction), laid out as
    its input: at step t of a padded (T, B, ·) or (B, T, ·) input, h_{t−1} — h_0 (``hx``, or zeros) at the first
    step, then the output of the step before (reverse: of the step after, h_0 at the last step). For a
    ``PackedSequence`` the rows (Σ lengths, ·) in another order, the same rows: h_0 of each sequence and every output
    but each sequence's last (reverse: its first). Detached (statistics only); ``None`` for an input of another type.
    """
    if not isinstance(x, (Tensor, PackedSequence)):
        return None
    width, direction = _width(module), int(reverse)
    h0 = hx[0] if isinstance(hx, (tuple, list)) else hx  # an LSTM's (h_0, c_0)
    h0 = h0.detach()[direction] if isinstance(h0, Tensor) else None
    sequence = output[0]
    with torch.no_grad():
        if isinstance(x, PackedSequence):
            states = sequence.data.detach().narrow(-1, direction * width, width)
            batch = int(x.batch_sizes[0])
            first = states.new_zeros(batch, width) if h0 is None else h0.to(states.dtype)
            if reverse:  # every output but each sequence's first (time 0: the first `batch` rows)
                rest = states[batch:]
            else:  # every output but each sequence's last
                rest = states.index_select(0, _kept_rows(tuple(x.batch_sizes.tolist()), states.device))
            return torch.cat([first, rest])
        states = sequence.detach().narrow(-1, direction * width, width)
        time = 1 if x.dim() == 3 and module.batch_first else 0
        steps = states.shape[time]
        shifted = states.narrow(time, 1 if reverse else 0, steps - 1)
        if h0 is None:  # zeros before the first step (reverse: after the last): one pad
            before_time = [0, 0] * (states.dim() - 1 - time)
            return F.pad(shifted, [*before_time, *((0, 1) if reverse else (1, 0))])
        first = h0.to(states.dtype).unsqueeze(time)
        return torch.cat([shifted, first] if reverse else [first, shifted], time)


@functools.lru_cache(maxsize=64)
def _kept_rows(batch_sizes: tuple[int, ...], device: torch.device) -> Tensor:
    """Indices of the rows of packed data (time-major, ``batch_sizes`` per step) that are not their sequence's last
    step: at step t the first ``batch_sizes[t + 1]`` rows (the sequences still running). Host arithmetic, cached."""
    index: list[int] = []
    start = 0
    for t, size in enumerate(batch_sizes):
        running = batch_sizes[t + 1] if t + 1 < len(batch_sizes) else 0
        index.extend(range(start, start + running))
        start += size
    return torch.tensor(index, dtype=torch.int64).to(device)


def recurrent_kinds() -> list[LayerKind]:
    """The built-in recurrent kinds, in the order their layers are stepped (the two column blocks of one layer next
    to each other; a GRU's two x_t blocks next to each other, so that one reduction of x_t serves both)."""
    kinds: list[LayerKind] = []
    for reverse in (False, True):
        for module_type in (nn.RNN, nn.LSTM):
            kinds += [
                RecurrentKind(module_type, "ih", reverse=reverse),
                RecurrentKind(module_type, "hh", reverse=reverse),
            ]
        kinds += [GRUGateKind(nn.GRU, block, reverse=reverse, gate=gate) for block, gate in _GRU_ORDER]
    for cell in (nn.RNNCell, nn.LSTMCell):
        kinds += [RecurrentKind(cell, "ih"), RecurrentKind(cell, "hh")]
    kinds += [GRUGateKind(nn.GRUCell, block, gate=gate) for block, gate in _GRU_ORDER]
    return kinds


_GRU_ORDER = (("ih", "n"), ("ih", "rz"), ("hh", "rz"), ("hh", "n"))
