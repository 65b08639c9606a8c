"""fc_mnist: the BNP paper's fully connected network (3×100, ReLU; §5, Table 2) on MNIST and CIFAR-10 — vanilla, BN,
LN, BNP, Batch Renorm — and the 2×100 network of §5.1's condition-number experiment.

Run: ``python -m example_projects.fc_mnist fit --config example_projects/fc_mnist/configs/bnp.yaml``
"""

from example_projects.fc_mnist.model import FCClassifier

__all__ = ["FCClassifier"]
