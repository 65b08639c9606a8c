"""lightning_bnp: Batch Normalization Preconditioning for PyTorch Lightning.

Public names: the six callbacks, the plain-torch preconditioner, and :class:`LayerKind` /
:func:`register_layer_kind` to teach BNP a new kind of layer. The methods are those of Lange,
Helfrich and Ye, *Batch Normalization Preconditioning for Neural Network Training* (JMLR 2022), and of
Saratchandran, Wang and Lucey, *Weight Conditioning for Smooth Optimization of Neural Networks*; the
README's "Papers" section lists every paper the package implements or measures.
"""

from lightning_bnp.callbacks import (
    BatchNormPreconditioning,
    ConditionNumberMonitor,
    GraphedSteps,
    TimingMonitor,
    WeightConditioning,
    ZSpaceRegularization,
)
from lightning_bnp.core import BNPPreconditioner
from lightning_bnp.core.kinds import LayerKind, register_layer_kind

__all__ = [
    "BNPPreconditioner",
    "BatchNormPreconditioning",
    "ConditionNumberMonitor",
    "GraphedSteps",
    "LayerKind",
    "TimingMonitor",
    "WeightConditioning",
    "ZSpaceRegularization",
    "register_layer_kind",
]
__version__ = "0.1.0"
