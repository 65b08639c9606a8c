"""What the experiments run: networks, batch sizes, epochs, learning-rate grids and seeds."""

from __future__ import annotations

from dataclasses import dataclass, replace

TRAIN_ROWS = 1197  # digits training split (example_projects.digits.load_digits_splits)


@dataclass(frozen=True)
class Setting:
    """One panel of an experiment: a network, a batch size, the methods compared and their grid."""

    model: str  # "FC" (3×100), "FC2" (2×100) or "CNN" (cnn5 on 1×8×8)
    batch: int
    epochs: int
    lrs: tuple[float, ...]
    methods: tuple[str, ...]
    paper: str  # which of the paper's figures / Appendix B rows this mirrors
    target: float  # test accuracy for "steps to target"
    evals: int = 40  # evaluations over the run (curves, steps to target)
    max_steps: int = 0  # > 0: stop after this many steps (``--quick``)
    kappa: bool = False  # also measure the output neuron's Hessian κ at every evaluation (experiment 2)

    @property
    def name(self) -> str:
        net = {"FC": "FC 3×100", "FC2": "FC 2×100"}.get(self.model, "CNN-5")
        return f"{net}, batch {self.batch}"

    @property
    def steps(self) -> int:
        """Optimizer steps of one run."""
        total = self.epochs * -(-TRAIN_ROWS // self.batch)
        return min(total, self.max_steps) if self.max_steps > 0 else total


# The paper's Appendix B learning rates come from the half-decade grid {…, 5e-4, 1e-3, 5e-3, …, 5e-1};
# each setting keeps a window of it around the paper's best values (Tables 2 and 3), widened where a
# method's best rate here sat at an end of the window in a trial run.
FC_METHODS = ("vanilla", "BN", "LN", "BNP")
CNN_METHODS = ("vanilla", "BN", "GN", "BNP", "BNP+GN")
CONVERGENCE = (
    Setting("FC", 60, 30, (1e-2, 5e-2, 1e-1, 5e-1, 1.0), FC_METHODS, "Fig. 3, Table 2 (batch 60)", 0.95),
    Setting("FC", 6, 20, (1e-3, 5e-3, 1e-2, 5e-2, 1e-1, 5e-1), FC_METHODS, "Fig. 4 left, Table 2 (batch 6)", 0.95),
    Setting(
        "FC", 1, 8, (5e-4, 1e-3, 5e-3, 1e-2, 5e-2, 1e-1, 5e-1), ("vanilla", "LN", "BNP"), "Fig. 4 right (batch 1)", 0.95
    ),
    Setting(
        "CNN", 128, 60, (1e-3, 5e-3, 1e-2, 5e-2, 1e-1, 5e-1, 1.0), CNN_METHODS, "Fig. 5 left, Table 3 (batch 128)", 0.95
    ),
    Setting("CNN", 2, 8, (1e-3, 5e-3, 1e-2, 5e-2, 1e-1, 5e-1), CNN_METHODS, "Fig. 5 right, Table 3 (batch 2)", 0.95),
)
KAPPA = Setting("FC2", 60, 20, (1e-2, 5e-2, 1e-1, 5e-1), ("vanilla", "BNP"), "§5.1, Fig. 8", 0.95, kappa=True)
WC = Setting("CNN", 128, 30, (0.1, 0.5, 1.0, 2.0, 5.0), ("BN", "BN+WC"), "004 Fig. 1", 0.95)
SEEDS, QUICK_SEEDS = 5, 2
QUICK_STEPS = 40


def quick(s: Setting) -> Setting:
    """The ``--quick`` variant: two learning rates, 40 steps, 4 evaluations."""
    return replace(s, epochs=1, lrs=s.lrs[-3:-1], evals=4, max_steps=QUICK_STEPS)
