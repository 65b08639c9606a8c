"""resnet_imagenet: ResNet-18 on ImageNet (BNP paper §5 "Residual Networks", Fig. 7) with BN, GN and BNP+GN.

Run: ``python -m example_projects.resnet_imagenet fit --config example_projects/resnet_imagenet/configs/bnp_gn.yaml``
"""

from example_projects.resnet_imagenet.model import ResNet18Classifier

__all__ = ["ResNet18Classifier"]
