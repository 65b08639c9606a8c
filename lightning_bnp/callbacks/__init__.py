"""Lightning callbacks: thin adapters that decide when the pure-torch core runs."""

from lightning_bnp.callbacks.bnp import BatchNormPreconditioning
from lightning_bnp.callbacks.regularization import ZSpaceRegularization
from lightning_bnp.callbacks.weight_conditioning import WeightConditioning

__all__ = ["BatchNormPreconditioning", "WeightConditioning", "ZSpaceRegularization"]
