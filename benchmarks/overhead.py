"""Per-step cost of BNP against the same network without it and with BatchNorm, side by side (issue 16).

Rows (the issue's table): a tiny FC 16-16×3 at batch 4 (host work only); the paper's FC 784-100×3 (Table 1) at batch
1, 16, 60, 256, 512; FC 784-1000×3 at 1024; the 5-layer CNN on 3×32×32 at 2 and 128; the CIFAR ResNet-20 and
ResNet-110 at 128 and torchvision's ResNet-50 on 3×64×64 at 64, each with GroupNorm (the baseline), BatchNorm, and
BNP + GroupNorm; four pre-LayerNorm MLP blocks (d = 512, 4d hidden) on (32, 64, 512) tokens; issue 24's two
Transformers of ``benchmarks.transformers`` (every projection preconditioned): the ViT without normalization (7×7
patches, d = 64, 2 blocks) at batch 60 and the byte-level causal LM (d = 128, 2 blocks, LayerNorm, context 64) at
batch 32, whose loss is per token (no Lightning loop). Inputs are random: cost does not depend on the data.

Every (row, variant, mode, precision, loop) is timed in one process, round-robin over repeats with
the order rotated each repeat, so that load from other processes lands on all alike; the median per
step is reported and every ratio compares entries of the same mode, precision and loop:

* mode ``eager``, ``compiled`` (``torch.compile(model)`` after BNP registered its hooks, and BNP's step compiled)
  ``graphed`` (CUDA only: the whole step captured in a CUDA graph and replayed, ``GraphedTrainingStep`` in the
  plain loop, the ``GraphedSteps`` callback in the Lightning loop) or ``compiled+graphed`` (both: the compiled
  network and step, captured; plain loop only);
* precision ``fp32`` or ``bf16`` (``torch.autocast``);
* loop ``plain`` (zero_grad, forward, backward, ``pre.step()``, SGD step) or ``lightning`` (the same
  network in a LightningModule with the ``BatchNormPreconditioning`` callback, timed from batch start to
  batch end by a callback, so Trainer start-up is not counted).

It also prints the calls BNP adds per step for each row's network (``benchmarks.op_count``) and the
device. Writes ``benchmarks/out/overhead[_<device>].md`` and ``.png``.

Run: ``python -m benchmarks.overhead [--device cuda] [--rows fc,cnn,...|all] [--modes eager,compiled]
[--precisions fp32,bf16] [--loops plain,lightning] [--repeats 15] [--threads 2] [--quick]``. Without
``--rows``: every row on a GPU; on a CPU the rows that take well under a second per step (FC, CNN, MLP).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch._dynamo
from torch import Tensor, nn

from benchmarks.op_count import added_cost
from example_projects.models import cifar_resnet, cnn5, fc_network
from example_projects.transformers import VOCAB, CharLM, ViT
from lightning_bnp import BatchNormPreconditioning, GraphedSteps
from lightning_bnp.core import BNPPreconditioner, BNPWarning, GraphedTrainingStep

OUT = Path(__file__).parent / "out"
Step = Callable[[], None]
Sampler = Callable[[int], float]  # runs n training steps, returns seconds per step


class PreLNBlocks(nn.Module):
    """``blocks`` pre-LayerNorm MLP blocks (x + W2·GELU(W1·LN(x))), mean-pooled tokens and a dense head."""

    def __init__(self, d: int = 512, blocks: int = 4, classes: int = 10) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)) for _ in range(blocks)
        )
        self.head = nn.Linear(d, classes)

    def forward(self, x: Tensor) -> Tensor:
        for block in self.blocks:
            x = x + block(x)
        return self.head(x.mean(1))


def resnet50(norm: str) -> nn.Module:
    import torchvision

    layer: Callable[[int], nn.Module] = nn.BatchNorm2d if norm == "bn" else (lambda c: nn.GroupNorm(32, c))
    return torchvision.models.resnet50(num_classes=10, norm_layer=layer)


@dataclass(frozen=True)
class Row:
    """One model of the table: ``make(norm)`` builds it with ``"none"`` (or ``"gn"``) or ``"bn"``."""

    key: str
    name: str
    batches: tuple[int, ...]
    shape: tuple[int, ...]  # one input sample
    make: Callable[[Any], nn.Module]  # norm -> network
    base: str  # the normalization of the baseline and of BNP's network: "none" or "gn"
    bn: bool = True  # a BatchNorm variant exists
    cpu: bool = True  # in the default CPU set
    tokens: int = 0  # > 0: inputs are token ids in [0, tokens) and targets one per token (a language model)


ROWS = (
    # host-bound by construction: width 16, batch 4, kernel time nil, every microsecond is host work
    Row("tinyfc", "FC 16-16×3 (tiny)", (4,), (16,), lambda n: fc_network(16, hidden=16, norm=n), "none"),
    Row("fc", "FC 784-100×3", (1, 16, 60, 256, 512), (784,), lambda n: fc_network(784, hidden=100, norm=n), "none"),
    Row("fc1000", "FC 784-1000×3", (1024,), (784,), lambda n: fc_network(784, hidden=1000, norm=n), "none"),
    Row("cnn", "CNN 3×32×32", (2, 128), (3, 32, 32), lambda n: cnn5(3, 32, norm=n), "none"),
    Row("resnet20", "ResNet-20", (128,), (3, 32, 32), lambda n: cifar_resnet(20, 3, norm=n), "gn", cpu=False),
    Row("resnet110", "ResNet-110", (128,), (3, 32, 32), lambda n: cifar_resnet(110, 3, norm=n), "gn", cpu=False),
    Row("resnet50", "ResNet-50 64×64", (64,), (3, 64, 64), resnet50, "gn", cpu=False),
    Row("mlp", "pre-LN MLP ×4, d=512, 64 tokens", (32,), (64, 512), lambda n: PreLNBlocks(), "none", bn=False),
    Row("vit", "ViT d=64 ×2, no norm, 28×28", (60,), (1, 28, 28), lambda n: ViT(norm="none"), "none", bn=False),
    Row("charlm", "char-LM d=128 ×2 + LN, 64 tokens", (32,), (64,), lambda n: CharLM(), "none", bn=False, tokens=VOCAB),
)


def variants(row: Row) -> tuple[str, ...]:
    base = "vanilla" if row.base == "none" else "GN"
    return (base, "BN", "BNP") if row.bn else (base, "BNP")


def norm_of(row: Row, variant: str) -> str:
    return "bn" if variant == "BN" else row.base


@dataclass(frozen=True)
class Key:
    row: str
    batch: int
    variant: str
    mode: str
    precision: str
    loop: str

    def same_setting(self, variant: str) -> Key:
        return Key(self.row, self.batch, variant, self.mode, self.precision, self.loop)


def clock(device: torch.device) -> float:
    """Host time after every queued kernel has finished (a bare host clock would time the launches only)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager[Any]:
    if precision == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def batches(row: Row, batch: int, device: torch.device, pool: int = 4) -> list[tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(batch)
    if row.tokens:
        return [
            (
                torch.randint(row.tokens, (batch, *row.shape), generator=g).to(device),
                torch.randint(row.tokens, (batch, *row.shape), generator=g).to(device),
            )
            for _ in range(pool)
        ]
    return [
        (torch.randn(batch, *row.shape, generator=g).to(device), torch.randint(10, (batch,), generator=g).to(device))
        for _ in range(pool)
    ]


def plain_step(row: Row, batch: int, key: Key, device: torch.device) -> Step:
    """One optimizer step of a plain torch loop."""
    torch.manual_seed(0)
    model = row.make(norm_of(row, key.variant)).to(device).train()
    pre = BNPPreconditioner(model) if key.variant == "BNP" else None
    compiled = key.mode in ("compiled", "compiled+graphed")
    forward = torch.compile(model) if compiled else model
    if pre is not None and compiled:  # the step's tensor work compiled too (issue 28)
        pre.compile_step()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    data = batches(row, batch, device)
    count = iter(range(1 << 62))
    if key.mode in ("graphed", "compiled+graphed"):  # the whole step captured in a CUDA graph and replayed

        def loss_of(x: Tensor, y: Tensor) -> Tensor:
            with autocast(device, key.precision):
                return nn.functional.cross_entropy(forward(x).flatten(0, -2), y.flatten())

        graphed = GraphedTrainingStep(loss_of, opt, pre)

        def replay() -> None:
            graphed(*data[next(count) % len(data)])

        return replay

    def step() -> None:
        x, y = data[next(count) % len(data)]
        opt.zero_grad(set_to_none=True)
        with autocast(device, key.precision):
            out = forward(x)  # (N, classes), or (N, T, vocab) with (N, T) targets
            loss = nn.functional.cross_entropy(out.flatten(0, -2), y.flatten())
        loss.backward()
        if pre is not None:
            pre.step()
        opt.step()

    return step


def plain_sampler(step: Step, device: torch.device) -> Sampler:
    def sample(n: int) -> float:
        t0 = clock(device)
        for _ in range(n):
            step()
        return (clock(device) - t0) / n

    return sample


def lightning_sampler(row: Row, batch: int, key: Key, device: torch.device) -> Sampler:
    """A fresh ``Trainer.fit`` of n steps per sample; the median time from batch start to batch end (Trainer
    start-up is not counted). BNP is the ``BatchNormPreconditioning`` callback; mode ``graphed`` adds the
    ``GraphedSteps`` callback (its warm-up steps and capture are among the n)."""
    import lightning.pytorch as pl

    from example_projects.classifier import Classifier

    torch.manual_seed(0)
    module = Classifier(row.make(norm_of(row, key.variant)), lr=1e-3, compile=key.mode == "compiled")
    data = batches(row, batch, torch.device("cpu"))
    times: list[float] = []

    class Timer(pl.Callback):
        def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
            self.t0 = clock(device)

        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            times.append(clock(device) - self.t0)

    def sample(n: int) -> float:
        callbacks: list[pl.Callback] = [Timer()]
        if key.variant == "BNP":
            callbacks.append(BatchNormPreconditioning())
        if key.mode == "graphed":
            callbacks.append(GraphedSteps())
        trainer = pl.Trainer(
            max_steps=n,
            accelerator=device.type,
            devices=1,
            precision="bf16-mixed" if key.precision == "bf16" else "32-true",
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=callbacks,
            limit_val_batches=0,
        )
        times.clear()
        trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(_Repeat(data, n), batch_size=None))
        return statistics.median(times)

    return sample


class _Repeat(torch.utils.data.Dataset[tuple[Tensor, Tensor]]):
    def __init__(self, data: list[tuple[Tensor, Tensor]], length: int) -> None:
        self.data, self.length = data, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        return self.data[i % len(self.data)]


def time_steps(samplers: dict[Any, Sampler], repeats: int, warmup: int, target_s: float) -> dict[Any, float]:
    """Median seconds per step of every entry, interleaved: each repeat visits every entry once, in an
    order rotated per repeat, so a burst of load from other processes lands on all entries alike."""
    inner = {}
    for key, sample in samplers.items():
        sample(warmup)  # compiles, warms caches
        inner[key] = max(1, round(target_s / sample(3)))
    samples: dict[Any, list[float]] = {key: [] for key in samplers}
    keys = list(samplers)
    for r in range(repeats):
        for key in keys[r % len(keys) :] + keys[: r % len(keys)]:
            samples[key].append(samplers[key](inner[key]))
    return {key: statistics.median(s) for key, s in samples.items()}


def op_counts(rows: list[Row]) -> dict[str, tuple[int, int]]:
    """(calls BNP adds per step, managed layers) per row, counted on CPU at batch 2 (``benchmarks.op_count``)."""
    counts = {}
    for row in rows:
        x, y = (
            (torch.randint(row.tokens, (2, *row.shape)), torch.randint(row.tokens, (2, *row.shape)))
            if row.tokens
            else (torch.randn(2, *row.shape), torch.randint(10, (2,)))
        )
        added, layers = added_cost(lambda row=row: row.make(row.base), x, y)  # type: ignore[misc]
        counts[row.key] = (added.calls, layers)
    return counts


def report(
    rows: list[Row], med: dict[Key, float], counts: dict[str, tuple[int, int]], header: str, elapsed: float
) -> list[str]:
    lines = [f"# {header}\n"]
    settings = sorted({(k.mode, k.precision, k.loop) for k in med})
    for mode, precision, loop in settings:
        lines += [
            f"\n## {mode}, {precision}, {loop} loop (median ms per step)\n",
            "| model | batch | baseline ms | BN ms | BNP ms | BNP/baseline | BNP/BN |",
            "|---|---|---|---|---|---|---|",
        ]
        for row in rows:
            base = variants(row)[0]
            for batch in row.batches:
                key = Key(row.key, batch, "BNP", mode, precision, loop)
                if key not in med:
                    continue
                base_s, bnp_s, bn_s = med[key.same_setting(base)], med[key], med.get(key.same_setting("BN"))
                bn_ms = "n/a" if bn_s is None else f"{bn_s * 1e3:.3f}"
                bnp_bn = "n/a" if bn_s is None else f"{bnp_s / bn_s:.2f}"
                lines.append(
                    f"| {row.name} ({base}) | {batch} | {base_s * 1e3:.3f} | {bn_ms} | {bnp_s * 1e3:.3f} | "
                    f"{bnp_s / base_s:.2f} | {bnp_bn} |"
                )
    lines += [
        "\n## calls BNP adds per step (as a GPU launches them: nested calls seen, a foreach fallback per tensor, views "
        "and allocations apart; the test's bound 5·L + 14)\n",
        "| model | managed layers L | added calls | 5·L + 14 |",
        "|---|---|---|---|",
    ]
    for row in rows:
        added, layers = counts[row.key]
        lines.append(f"| {row.name} | {layers} | {added} | {5 * layers + 14} |")
    lines.append(f"\nMeasuring took {elapsed:.0f} s.")
    return lines


def plot(rows: list[Row], med: dict[Key, float], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings = sorted({(k.mode, k.precision, k.loop) for k in med})
    labels = [f"{row.key}\n{b}" for row in rows for b in row.batches if Key(row.key, b, "BNP", *settings[0]) in med]
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(labels) + 2), 4))
    width = 0.8 / len(settings)
    for k, setting in enumerate(settings):
        ratios = []
        for row in rows:
            for b in row.batches:
                key = Key(row.key, b, "BNP", *setting)
                if Key(row.key, b, "BNP", *settings[0]) in med:
                    ratios.append(med[key] / med[key.same_setting(variants(row)[0])] if key in med else 0.0)
        ax.bar(
            [i + (k - (len(settings) - 1) / 2) * width for i in range(len(ratios))],
            ratios,
            width,
            label=", ".join(setting),
        )
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(range(len(labels)), labels, fontsize=7)
    ax.set_ylabel("BNP / baseline step time")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU, {torch.get_num_threads()} threads"


def choose_rows(spec: str | None, device: torch.device) -> list[Row]:
    if spec is None:
        return [row for row in ROWS if device.type != "cpu" or row.cpu]
    if spec == "all":
        return list(ROWS)
    keys = spec.split(",")
    unknown = set(keys) - {row.key for row in ROWS}
    if unknown:
        raise SystemExit(f"--rows: unknown {sorted(unknown)}; choose from {[row.key for row in ROWS]} or 'all'")
    return [row for row in ROWS if row.key in keys]


@contextlib.contextmanager
def tf32_off() -> Iterator[None]:
    """fp32 means fp32: TF32 matmuls would make the fp32 rows a third precision."""
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu or cuda[:i]")
    parser.add_argument("--rows", default=None, help="comma-separated row keys, or 'all' (see ROWS)")
    parser.add_argument("--batches", default=None, help="comma-separated batch sizes to keep (default: each row's)")
    parser.add_argument("--modes", default="eager", help="eager,compiled,graphed,compiled+graphed (graphed: CUDA only)")
    parser.add_argument("--precisions", default="fp32", help="fp32,bf16")
    parser.add_argument("--loops", default="plain", help="plain,lightning")
    parser.add_argument("--repeats", type=int, default=15, help="timed samples per entry (the median is reported)")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: leave as is)")
    parser.add_argument("--quick", action="store_true", help="tiny repeats: a smoke test")
    parser.add_argument("--tag", default="", help="appended to the output files' names")
    args = parser.parse_args()
    device = torch.device(args.device)
    # every entry compiles its own model of a shared class: Dynamo must tell them apart by their hooks (by
    # default it does not guard hooks and would run a BNP model through a vanilla model's graph, README "Cost")
    torch._dynamo.config.skip_nnmodule_hook_guards = False
    torch._dynamo.config.recompile_limit = 256
    warnings.simplefilter("error", BNPWarning)  # a BNP entry whose hooks did not run is an error, not a time
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    rows = choose_rows(args.rows, device)
    if args.batches:
        keep = {int(b) for b in args.batches.split(",")}
        rows = [Row(**{**row.__dict__, "batches": tuple(b for b in row.batches if b in keep)}) for row in rows]
        rows = [row for row in rows if row.batches]
    repeats, warmup, target_s = (2, 2, 1e-3) if args.quick else (args.repeats, 5, 30e-3)

    start = time.perf_counter()
    samplers: dict[Key, Sampler] = {}
    for row in rows:
        for batch in row.batches:
            for variant in variants(row):
                if variant == "BN" and batch == 1:
                    continue  # BatchNorm cannot train on a single row
                for mode in args.modes.split(","):
                    for precision in args.precisions.split(","):
                        for loop in args.loops.split(","):
                            key = Key(row.key, batch, variant, mode, precision, loop)
                            if loop == "lightning" and row.tokens:
                                print(f"{row.key}: no Lightning loop (per-token loss), plain loop only")
                                continue
                            if loop == "lightning" and mode == "compiled+graphed":
                                print("compiled+graphed: plain loop only")
                                continue
                            if loop == "lightning":
                                samplers[key] = lightning_sampler(row, batch, key, device)
                            else:
                                samplers[key] = plain_sampler(plain_step(row, batch, key, device), device)
    with tf32_off():
        med = time_steps(samplers, repeats, warmup, target_s)
    counts = op_counts(rows)
    elapsed = time.perf_counter() - start

    setup = f"{device_name(device)}, torch {torch.__version__}, {repeats} interleaved repeats"
    lines = report(rows, med, counts, f"BNP cost per training step ({setup})", elapsed)
    print("\n".join(lines))
    OUT.mkdir(exist_ok=True)
    tag = ("_quick" if args.quick else "") + ("" if device.type == "cpu" else f"_{device.type}") + args.tag
    (OUT / f"overhead{tag}.md").write_text("\n".join(lines) + "\n")
    plot(rows, med, OUT / f"overhead{tag}.png", setup)
    print(f"wrote {OUT / f'overhead{tag}.md'} and {OUT / f'overhead{tag}.png'}")


if __name__ == "__main__":
    main()
