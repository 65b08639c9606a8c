"""online: batch size 1 streaming training (BNP paper, end of §4 and §5 Fig. 4 right) with BNP's online statistics.

Run: ``python -m example_projects.online fit --config example_projects/online/configs/fc_bnp.yaml``
"""

from example_projects.online.model import OnlineClassifier

__all__ = ["OnlineClassifier"]
