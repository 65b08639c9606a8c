"""Lightning callbacks: thin adapters that decide when the pure-torch core runs."""

from lightning_bnp.callbacks.bnp import BatchNormPreconditioning
from lightning_bnp.callbacks.regularization import ZSpaceRegularization

__all__ = ["BatchNormPreconditioning", "ZSpaceRegularization"]
