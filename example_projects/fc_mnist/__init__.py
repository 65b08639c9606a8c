"""fc_mnist: the BNP paper's fully connected network (3×100, ReLU; §5, Table 2) on MNIST — vanilla, BN, LN, BNP.

Run: ``python -m example_projects.fc_mnist fit --config example_projects/fc_mnist/configs/bnp.yaml``
"""

from example_projects.fc_mnist.model import FCClassifier

__all__ = ["FCClassifier"]
