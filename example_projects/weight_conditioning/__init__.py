"""weight_conditioning: BN vs BN + Weight Conditioning on a CNN (paper 004 §6.1), and WC on an MLP.

Run from the repository root, with ``CONFIG`` = ``example_projects/weight_conditioning/configs/cnn_bn_wc.yaml``:
``python -m example_projects.weight_conditioning fit --config CONFIG``
"""

from example_projects.weight_conditioning.model import WCClassifier

__all__ = ["WCClassifier"]
