"""resnet_gn: a CIFAR ResNet (depth 20 for quick runs, 110 as in the BNP paper §5) with BN, GN, BNP+GN and BNP alone;
the pre-activation ResNet-110 on CIFAR-100.

Run: ``python -m example_projects.resnet_gn fit --config example_projects/resnet_gn/configs/bnp_gn_20.yaml``
"""

from example_projects.resnet_gn.model import ResNetClassifier

__all__ = ["ResNetClassifier"]
