"""lightning_bnp: Batch Normalization Preconditioning for PyTorch Lightning.

Public names (DESIGN §2) are added here as they land.
"""

from lightning_bnp.callbacks import BatchNormPreconditioning, WeightConditioning, ZSpaceRegularization
from lightning_bnp.core import BNPPreconditioner

__all__ = ["BNPPreconditioner", "BatchNormPreconditioning", "WeightConditioning", "ZSpaceRegularization"]
__version__ = "0.1.0"
