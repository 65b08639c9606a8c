"""cnn_cifar: the BNP paper's 5-layer CNN (§5, Table 3) on CIFAR-10 — vanilla, BN, GN, BNP at batch 128 and 2; Batch
Renorm and "BN with 4 things" baselines.

Run: ``python -m example_projects.cnn_cifar fit --config example_projects/cnn_cifar/configs/bnp_b2.yaml``
"""

from example_projects.cnn_cifar.model import CNNClassifier

__all__ = ["CNNClassifier"]
