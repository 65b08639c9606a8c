"""The LightningModule of ``fsdp2``: the BNP paper's FC network (or 5-layer CNN) built in ``configure_model`` and, under
Lightning's ``ModelParallelStrategy``, sharded with FSDP2's ``fully_shard`` (README "Large models").

FSDP2 splits every weight and bias along dim 0, its rows (output units or channels), over the data-parallel ranks.
BNP's transform is row-local, so ``lightning_bnp.BatchNormPreconditioning`` transforms on each rank the rows that
rank holds, with the input statistics pooled over the ranks (one ``all_gather`` per step, as under DDP).
"""

from __future__ import annotations

from typing import Literal

from torch import nn
from torch.distributed.fsdp import fully_shard
from typing_extensions import override

from example_projects.classifier import Classifier
from example_projects.models import cnn5, fc_network


class ShardedClassifier(Classifier):
    """The 3×100 FC network or the 5-layer CNN, created in ``configure_model`` (Lightning's place for models that are
    sharded as they are built), sharded layer by layer when the strategy gives a device mesh.

    With ``ModelParallelStrategy(data_parallel_size=N, tensor_parallel_size=1)`` each layer with weights, then the whole
    network, is wrapped by ``fully_shard`` on the mesh's ``data_parallel`` dimension; under any other strategy (one
    process, DDP) the network stays whole. BNP is the ``lightning_bnp.BatchNormPreconditioning`` callback named in
    the YAML config; it attaches after ``configure_model``.

    Args:
        network: ``"fc"`` (``depth`` hidden layers of ``hidden`` units, ReLU) or ``"cnn5"`` (3 conv 32-64-32 + 2
            dense, 'valid' padding: images of at least 18×18).
        hidden: width of each hidden layer of the FC network (paper: 100).
        depth: number of hidden layers of the FC network (paper: 3).
        lr: learning rate (the paper's BNP rate on MNIST at batch 60: 0.5).
        momentum: SGD momentum (paper: plain SGD).
        input_shape: image shape (c, h, w); linked from ``data.input_shape`` by the CLI.
        num_classes: number of classes; linked from ``data.num_classes`` by the CLI.
    """

    def __init__(
        self,
        *,
        network: Literal["fc", "cnn5"] = "fc",
        hidden: int = 100,
        depth: int = 3,
        lr: float = 0.1,
        momentum: float = 0.0,
        input_shape: tuple[int, int, int] = (1, 28, 28),
        num_classes: int = 10,
    ) -> None:
        if network not in ("fc", "cnn5"):
            raise ValueError(f"`network` must be 'fc' or 'cnn5', got {network!r}")
        # no layers yet: `configure_model` builds them once the strategy (and its device mesh) is set up
        super().__init__(nn.Identity(), lr=lr, momentum=momentum, num_classes=num_classes)
        self.network_name, self.hidden, self.depth = network, hidden, depth
        self.input_shape, self.num_classes = input_shape, num_classes
        self.built = False
        self.save_hyperparameters()

    @override
    def configure_model(self) -> None:
        if self.built:  # Lightning calls it again for `validate`/`test` after `fit`
            return
        c, h, w = self.input_shape
        net = (
            fc_network(c * h * w, self.num_classes, hidden=self.hidden, depth=self.depth)
            if self.network_name == "fc"
            else cnn5(c, h, self.num_classes)
        )
        if self.device_mesh is not None:  # ModelParallelStrategy: shard every layer's rows over the data-parallel ranks
            mesh = self.device_mesh["data_parallel"]
            for module in net.modules():
                if module is not net and any(True for _ in module.parameters(recurse=False)):
                    fully_shard(module, mesh=mesh)
            fully_shard(net, mesh=mesh)
        self.network = net
        self.built = True
