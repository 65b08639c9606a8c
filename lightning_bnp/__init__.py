"""lightning_bnp: Batch Normalization Preconditioning for PyTorch Lightning.

Public names: the five callbacks and the plain-torch preconditioner. The methods are those of Lange,
Helfrich and Ye, *Batch Normalization Preconditioning for Neural Network Training* (JMLR 2022), and of
Saratchandran, Wang and Lucey, *Weight Conditioning for Smooth Optimization of Neural Networks*; the
README's "Papers" section lists every paper the package implements or measures.
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
