"""Lightning callbacks: thin adapters that decide when the pure-torch core runs."""

from lightning_bnp.callbacks.bnp import BatchNormPreconditioning

__all__ = ["BatchNormPreconditioning"]
