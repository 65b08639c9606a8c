"""Lightning callbacks: thin adapters that decide when the pure-torch core runs."""

from lightning_bnp.callbacks.bnp import BatchNormPreconditioning
from lightning_bnp.callbacks.condition_monitor import ConditionNumberMonitor
from lightning_bnp.callbacks.graphed_steps import GraphedSteps
from lightning_bnp.callbacks.regularization import ZSpaceRegularization
from lightning_bnp.callbacks.timing_monitor import TimingMonitor
from lightning_bnp.callbacks.weight_conditioning import WeightConditioning

__all__ = [
    "BatchNormPreconditioning",
    "ConditionNumberMonitor",
    "GraphedSteps",
    "TimingMonitor",
    "WeightConditioning",
    "ZSpaceRegularization",
]
