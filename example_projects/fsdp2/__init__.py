"""fsdp2: BNP on a model sharded with FSDP2 — the paper's FC network built in ``configure_model`` and sharded by
Lightning's ``ModelParallelStrategy`` (data-parallel 2, tensor-parallel 1), 2 CPU processes with gloo.

Run: ``python -m example_projects.fsdp2 fit --config example_projects/fsdp2/configs/fc_bnp.yaml --trainer.devices 2``
"""

from example_projects.fsdp2.model import ShardedClassifier

__all__ = ["ShardedClassifier"]
