"""lightning_bnp: Batch Normalization Preconditioning for PyTorch Lightning.

Public names (DESIGN §2): the five callbacks and the plain-torch preconditioner.
"""

from lightning_bnp.callbacks import (
    BatchNormPreconditioning,
    ConditionNumberMonitor,
    TimingMonitor,
    WeightConditioning,
    ZSpaceRegularization,
)
from lightning_bnp.core import BNPPreconditioner

__all__ = [
    "BNPPreconditioner",
    "BatchNormPreconditioning",
    "ConditionNumberMonitor",
    "TimingMonitor",
    "WeightConditioning",
    "ZSpaceRegularization",
]
__version__ = "0.1.0"
