"""Pure-torch core of lightning_bnp; never imports Lightning."""

import lightning_bnp.core.builtin_kinds  # noqa: F401  (registers the built-in layer kinds)
from lightning_bnp.core.cuda_graph import GraphedTrainingStep
from lightning_bnp.core.kinds import LayerKind, register_layer_kind
from lightning_bnp.core.preconditioner import BNPPreconditioner, BNPWarning, PendingUpdate
from lightning_bnp.core.statistics import Moments, RunningStatistics
from lightning_bnp.core.transform import precondition_, q_squared, var_tilde

__all__ = [
    "BNPPreconditioner",
    "BNPWarning",
    "GraphedTrainingStep",
    "LayerKind",
    "Moments",
    "PendingUpdate",
    "RunningStatistics",
    "precondition_",
    "q_squared",
    "register_layer_kind",
    "var_tilde",
]
