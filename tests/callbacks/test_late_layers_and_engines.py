"""Layers made after BNP was set up, gradients that are not in ``param.grad``, and state that does not fit (issue 45,
items 3-5): adapters injected in the LightningModule's ``setup`` are managed as if built in ``__init__``; a layer
given to an optimizer mid-training is named; a step that finds statistics but no gradient says why; DeepSpeed is
refused by name in the core and in the callback; a checkpoint whose BNP state does not fit says how to resume."""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from lightning.pytorch.callbacks import LearningRateFinder, ModelCheckpoint
from lightning.pytorch.strategies import DeepSpeedStrategy, SingleDeviceStrategy
from torch import nn
from typing_extensions import override

from lightning_bnp import BatchNormPreconditioning, BNPPreconditioner
from lightning_bnp.callbacks._strategy import check_strategy
from lightning_bnp.core.late_layers import LATE_BIASES, LateLayers
from lightning_bnp.core.parts import checked_params
from lightning_bnp.core.preconditioner import BNPWarning
from lightning_bnp.core.step_warnings import StepWarnings
from tests.helpers import EXACT, BoringClassifier, _fit, make_data, make_mlp

DATA = make_data(32)


class LoRA(nn.Module):
    """A low-rank adapter around a frozen Linear, as peft injects it: base(x) + B·A·x."""

    def __init__(self, base: nn.Linear, rank: int = 2) -> None:
        super().__init__()
        torch.manual_seed(7)
        self.base = base.requires_grad_(False)
        self.lora_A = nn.Linear(base.in_features, rank, bias=False)
        self.lora_B = nn.Linear(rank, base.out_features)

    @override
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.lora_B(self.lora_A(x))


class AdaptedInSetup(BoringClassifier):
    """The adapter injected in the LightningModule's ``setup`` (Lightning calls it after every callback's)."""

    def __init__(self) -> None:
        super().__init__(make_mlp())

    @override
    def setup(self, stage: str) -> None:
        if not isinstance(self.network[2], LoRA):
            self.network[2] = LoRA(self.network[2])


def _bnp_run(tmp_path: Path, model: BoringClassifier) -> tuple[dict[str, torch.Tensor], BNPPreconditioner]:
    bnp = BatchNormPreconditioning(verbose=False)
    _fit(tmp_path, model, DATA, batch_size=8, callbacks=[bnp], max_steps=3)
    assert bnp.preconditioner is not None
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, bnp.preconditioner


def test_an_adapter_injected_in_the_modules_setup_is_managed_as_if_built_in_init(tmp_path: Path) -> None:
    """The callback attached in its own `setup`, before the module's: the adapter's layers trained as plain SGD."""
    early = BoringClassifier(make_mlp())
    early.network[2] = LoRA(early.network[2])
    reference, ref_pre = _bnp_run(tmp_path / "early", early)
    late = AdaptedInSetup()
    with warnings.catch_warnings():
        warnings.simplefilter("error", BNPWarning)
        state, pre = _bnp_run(tmp_path / "late", late)
    assert {"network.2.lora_A", "network.2.lora_B"} <= set(pre.layers) and set(pre.layers) == set(ref_pre.layers)
    assert pre.layers["network.2.lora_B"].running.steps == 3
    for name, value in state.items():
        torch.testing.assert_close(value, reference[name], msg=name, **EXACT)


class GrowsAHead(BoringClassifier):
    """A second head made at the third batch and given to the optimizer with ``add_param_group``."""

    def __init__(self) -> None:
        super().__init__(make_mlp())
        self.extra: nn.Linear | None = None

    @override
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        if batch_idx == 2 and self.extra is None:
            self.extra = nn.Linear(6, 3)
            self.optimizers().optimizer.add_param_group({"params": list(self.extra.parameters())})
        out = self(x) if self.extra is None else self(x) + self.extra(x)
        return nn.functional.cross_entropy(out, y)


def test_a_layer_given_to_the_optimizer_mid_training_is_named(tmp_path: Path) -> None:
    with pytest.warns(BNPWarning, match=r"does not manage the layers 'extra' \(Linear\).*optimizer SGD") as caught:
        _fit(tmp_path, GrowsAHead(), DATA, batch_size=8, callbacks=[BatchNormPreconditioning(verbose=False)],
             max_steps=4)  # fmt: skip
    assert sum("does not manage the layers" in str(w.message) for w in caught) == 1  # once, not at every step


def test_the_core_names_a_layer_added_after_it_and_the_second_preconditioner_it_suggests_works() -> None:
    model = make_mlp()
    pre = BNPPreconditioner(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = DATA.tensors[0][:8], DATA.tensors[1][:8]
    model.add_module("head2", nn.Linear(3, 3))
    opt.add_param_group({"params": list(model.head2.parameters())})
    nn.functional.cross_entropy(model(x), y).backward()
    with pytest.warns(BNPWarning, match=r"'head2' \(Linear\).*BNPPreconditioner\(model, include=\['head2'\]\)"):
        pre.step(opt)
    opt.step()
    opt.zero_grad()
    second = BNPPreconditioner(model, include=["head2"])  # what the warning suggests
    nn.functional.cross_entropy(model(x), y).backward()
    raw = model.head2.weight.grad.clone()  # type: ignore[union-attr]
    with warnings.catch_warnings():
        warnings.simplefilter("error", BNPWarning)  # said once
        pre.step(opt)
        second.step(opt)
    h = model[:3](x).detach().double()  # head2's input; M·g from its first step's statistics (μ = 0.01·μ_H …)
    mu, var = 0.01 * h.mean(0), 0.99 + 0.01 * h.var(0, unbiased=False)
    var_t = var + 1e-2 * var.max() + 1e-4
    q2 = max(3 / 8, 1.0)
    g_b = model.head2.bias.grad.double()  # type: ignore[union-attr]
    assert g_b is not None
    # the bias gradient after the transform is G_b/q² − Σ μ_j G_w_new: recover G_b from it to check G_w's rule
    g_w = model.head2.weight.grad.double()  # type: ignore[union-attr]
    raw_b = (g_b + g_w @ mu) * q2
    torch.testing.assert_close(g_w, (raw.double() - raw_b[:, None] * mu) / (q2 * var_t), rtol=1e-5, atol=1e-7)


def test_a_bias_registered_on_a_managed_layer_after_set_up_is_named_once() -> None:
    """A Linear set up without a bias keeps the bias-free transform (``test_robustness.py::
    test_a_bias_registered_after_set_up_is_left_as_autograd_gave_it``); once an optimizer BNP steps holds a bias
    registered on it since, that is said, once, naming the layer (a later one on another layer: for that layer); a
    bias that was there at set-up is not named."""
    model = nn.Sequential(nn.Linear(4, 3, bias=False), nn.Tanh(), nn.Linear(3, 2), nn.Linear(2, 2, bias=False))
    pre = BNPPreconditioner(model)
    model[0].bias = nn.Parameter(torch.zeros(3))
    model[2].bias = nn.Parameter(torch.zeros(2))  # replaced: the layer had one at set-up, and the step reads it
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(5, 4)
    model(x).square().sum().backward()
    with pytest.warns(BNPWarning) as caught:
        pre.step(opt)
    assert [str(w.message) for w in caught] == [LATE_BIASES.format(layers=["0"], optimizer="SGD")]
    assert "BNP layers ['0'] were set up without a bias" in str(caught[0].message)
    opt.step()
    opt.add_param_group({"params": [nn.Parameter(torch.zeros(1))]})  # the count changed: looked at again
    model(x).square().sum().backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error", BNPWarning)  # said once
        pre.step(opt)
    opt.step()
    model[3].bias = nn.Parameter(torch.zeros(2))  # another layer's, later: said for that one
    opt.add_param_group({"params": [model[3].bias]})
    model(x).square().sum().backward()
    with pytest.warns(BNPWarning) as caught:
        pre.step(opt)
    assert [str(w.message) for w in caught] == [LATE_BIASES.format(layers=["3"], optimizer="SGD")]


def test_param_groups_of_known_layers_added_later_are_not_named() -> None:
    model = make_mlp()
    pre = BNPPreconditioner(model)
    opt = torch.optim.SGD(model[0].parameters(), lr=0.1)
    x, y = DATA.tensors[0][:8], DATA.tensors[1][:8]
    for step in range(2):
        if step == 1:
            opt.add_param_group({"params": list(model[2].parameters())})
        nn.functional.cross_entropy(model(x), y).backward()
        with warnings.catch_warnings():
            warnings.simplefilter("error", BNPWarning)
            pre.step(opt)
        opt.step()
        opt.zero_grad()


# ------------------------------------------------------------------ gradients not in param.grad
def test_zero_grad_before_the_step_is_named_not_a_silent_plain_step() -> None:
    model = make_mlp()
    pre = BNPPreconditioner(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = DATA.tensors[0][:8], DATA.tensors[1][:8]
    with pytest.warns(BNPWarning, match=r"\['0', '2'\] were counted.*none of the layers stepped has a gradient.*"
                      r"`zero_grad\(\)` ran between the backward and `step\(\)`.*DeepSpeed") as caught:  # fmt: skip
        for _ in range(3):
            nn.functional.cross_entropy(model(x), y).backward()
            opt.zero_grad()
            pre.step()
            opt.step()
    assert len([w for w in caught if "none of the layers" in str(w.message)]) == 1


class DeepSpeedZeroOptimizer:  # what `engine.optimizer` is under ZeRO (deepspeed is not installed here)
    __module__ = "deepspeed.runtime.zero.stage_1_and_2"

    def __init__(self, params: list[torch.Tensor]) -> None:
        self.param_groups = [{"params": params}]


ZERO = ("DeepSpeedZeroOptimizer", "deepspeed.runtime.zero.stage_1_and_2")


def test_the_core_refuses_an_optimizer_that_is_not_a_torch_one_naming_deepspeed() -> None:
    model = make_mlp()
    pre = BNPPreconditioner(model)
    deepspeed = (
        "BNPPreconditioner.step() got a {} ({}): DeepSpeed is not supported. Its engine reduces the gradients into "
        "buffers it owns (ZeRO stages 1-3; `param.grad` is None after `engine.backward`), so BNP would transform "
        "nothing. Use DDP or FSDP2 (`fully_shard`) instead."
    )
    zero = DeepSpeedZeroOptimizer(list(model.parameters()))
    with pytest.raises(TypeError, match="^" + re.escape(deepspeed.format(*ZERO)) + "$"):
        pre.step(zero)  # type: ignore[arg-type]

    class Wrapped(DeepSpeedZeroOptimizer):  # a subclass of DeepSpeed's, in another package
        pass

    # DeepSpeed by the name of a class of its (upper case) in another package
    named = type("DeepSpeedCPUAdam", (), {"__module__": "my_project.optim", "param_groups": []})
    for optimizer, where in ((Wrapped([]), __name__), (named(), "my_project.optim")):
        message = deepspeed.format(type(optimizer).__name__, where)
        with pytest.raises(TypeError, match="^" + re.escape(message) + "$"):
            pre.step(optimizer)

    class Foreign:  # iterable, with param groups, but not a torch.optim.Optimizer
        param_groups: ClassVar[list[Any]] = []

        def __iter__(self) -> Any:
            return iter(())

    wrong = (
        "`params` must be a torch.optim.Optimizer (or a wrapper of one: Lightning's, Fabric's, Accelerate's), an "
        "iterable of parameters, or None; got a {}, which is not {}."
    )
    with pytest.raises(
        TypeError, match="^" + re.escape(wrong.format(f"Foreign ({__name__})", "a torch.optim.Optimizer")) + "$"
    ):
        pre.step(Foreign())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="^" + re.escape(wrong.format("int (builtins)", "iterable")) + "$"):
        pre.precondition(3)  # type: ignore[arg-type]
    params = list(model.parameters())  # what it takes as it is: None, a list, a tuple, any other iterable
    for given in (None, params, tuple(params), iter(params), model.parameters()):
        assert checked_params(given) is given


class DeepSpeedStrategy2(SingleDeviceStrategy):  # another package's DeepSpeed strategy on a single device
    pass


def test_the_callback_refuses_deepspeed_by_name_at_setup(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match=r"does not support DeepSpeed \(DeepSpeedStrategy\).*`param.grad` is None"):
        check_strategy(DeepSpeedStrategy.__new__(DeepSpeedStrategy))  # (its __init__ needs deepspeed installed)
    with pytest.raises(RuntimeError, match=r"does not support DeepSpeed \(DeepSpeedStrategy2\)"):
        _fit(tmp_path, BoringClassifier(make_mlp()), DATA, batch_size=8, callbacks=[BatchNormPreconditioning()],
             max_steps=1, strategy=DeepSpeedStrategy2(device=torch.device("cpu")), accelerator="cpu")  # fmt: skip


# ------------------------------------------------------------------ a checkpoint whose BNP state does not fit
def test_a_checkpoint_of_other_layers_says_how_to_resume_without_its_bnp_state(tmp_path: Path) -> None:
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    _fit(tmp_path, BoringClassifier(make_mlp()), DATA, batch_size=8, enable_checkpointing=True, max_steps=2,
         callbacks=[BatchNormPreconditioning(verbose=False), ckpt])  # fmt: skip
    path = str(tmp_path / "ckpt" / "last.ckpt")
    bnp = BatchNormPreconditioning(verbose=False, exclude="network.2")
    how = (
        " Under the Trainer, the BNP state is the checkpoint's `['callbacks']['BatchNormPreconditioning']`: delete "
        "that entry (torch.load, del, torch.save) to resume without it; the statistics then start fresh (μ = 0, "
        "σ² = 1, step 0), with a warning."
    )
    with pytest.raises(
        ValueError, match=r"unexpected \['network.2'\].*start without the BNP state\." + re.escape(how) + "$"
    ):
        _fit(tmp_path, BoringClassifier(make_mlp()), DATA, batch_size=8, callbacks=[bnp], max_steps=4, ckpt_path=path)
    checkpoint = torch.load(path, weights_only=False)
    del checkpoint["callbacks"]["BatchNormPreconditioning"]  # what the message says: the statistics start fresh
    torch.save(checkpoint, path)
    with pytest.warns(BNPWarning, match="holds no BNP state"):
        _fit(tmp_path, BoringClassifier(make_mlp()), DATA, batch_size=8, callbacks=[bnp], max_steps=4, ckpt_path=path)


def test_the_tuner_callbacks_which_run_before_bnps_fit_start_leave_the_run_as_without_them(tmp_path: Path) -> None:
    """Lightning runs the learning-rate and batch-size finders first, at their `on_fit_start`, with every other
    callback removed: BNP, set up at its own `on_fit_start` now, sees nothing of their trial steps."""

    def run(tuner: list[Any]) -> tuple[BoringClassifier, BNPPreconditioner]:
        model, bnp = BoringClassifier(make_mlp()), BatchNormPreconditioning(verbose=False)
        _fit(tmp_path, model, DATA, batch_size=8, callbacks=[bnp, *tuner], max_steps=3)
        assert bnp.preconditioner is not None
        return model, bnp.preconditioner

    (ref, ref_pre), (model, pre) = run([]), run([LearningRateFinder(num_training_steps=4, update_attr=False)])
    for name, layer in ref_pre.layers.items():
        assert pre.layers[name].running.steps == layer.running.steps == 3
        torch.testing.assert_close(pre.layers[name].running.var, layer.running.var, **EXACT)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, **EXACT)


LATE = (
    "BNP does not manage the layers {layers}: they did not exist when it was set up, and optimizer {optimizer} now "
    "holds their parameters, so their gradients get the plain optimizer step. Build every layer before BNP is set "
    "up (the BatchNormPreconditioning callback sets up at `on_fit_start`, after the LightningModule's `setup` and "
    "`configure_model`; a BNPPreconditioner at its construction), or precondition them with a second "
    "BNPPreconditioner(model, include={include}) stepped beside this one."
)


def test_late_layers_are_named_in_the_models_order_each_once_embeddings_too_when_managed() -> None:
    """The warning names every late layer BNP would manage (an embedding too, with ``embeddings=True``) in the
    model's order, with the optimizer's class and the ``include`` of the second preconditioner that would manage
    them; a layer named once is not named again when another comes later, and parameters that are no layer's weight
    (a bias alone, a plain parameter) name nothing."""
    model = make_mlp()
    pre = BNPPreconditioner(model, embeddings=True)
    model.add_module("late_b", nn.Linear(3, 3))
    model.add_module("late_a", nn.Embedding(4, 3))
    model.register_parameter("scale", nn.Parameter(torch.ones(3)))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    x, y = DATA.tensors[0][:8], DATA.tensors[1][:8]
    message = LATE.format(
        layers="'late_b' (Linear), 'late_a' (Embedding)", optimizer="Adam", include="['late_b', 'late_a']"
    )
    nn.functional.cross_entropy(model[:3](x), y).backward()  # (the late layers are not in it)
    with pytest.warns(BNPWarning) as caught:
        pre.step(opt)
    assert [str(w.message) for w in caught] == [message]
    model.add_module("late_c", nn.Conv1d(2, 2, 1))
    opt.add_param_group({"params": list(model.late_c.parameters())})
    nn.functional.cross_entropy(model[:3](x), y).backward()
    with pytest.warns(BNPWarning) as caught:
        pre.step(opt)
    message = LATE.format(layers="'late_c' (Conv1d)", optimizer="Adam", include="['late_c']")
    assert [str(w.message) for w in caught] == [message]
    opt.add_param_group({"params": [nn.Parameter(torch.ones(2))]})  # no layer's: nothing to say
    nn.functional.cross_entropy(model[:3](x), y).backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error", BNPWarning)
        pre.step(opt)


def test_late_layers_are_named_by_the_preconditioners_selection() -> None:
    """Only the late layers that the preconditioner's own selection would manage are named: not one outside
    ``include``, nor one inside it that ``exclude`` leaves out, nor an embedding when it has ``embeddings=False``."""
    model = make_mlp()
    model.add_module("keep", nn.Linear(3, 3))
    model.add_module("drop", nn.Linear(3, 3))
    pre = BNPPreconditioner(model, include=["0", "2", "keep*", "drop*"], exclude=["drop*"])
    assert list(pre.layers) == ["0", "2", "keep"]
    for name in ("keep2", "drop2", "other"):
        model.add_module(name, nn.Linear(3, 3))
    model.add_module("keep_embedding", nn.Embedding(4, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = DATA.tensors[0][:8], DATA.tensors[1][:8]
    nn.functional.cross_entropy(model[:3](x), y).backward()
    with pytest.warns(BNPWarning) as caught:
        pre.step(opt)
    message = LATE.format(layers="'keep2' (Linear)", optimizer="SGD", include="['keep2']")
    assert [str(w.message) for w in caught] == [message]


def test_late_layers_leave_embeddings_out_unless_told() -> None:
    """``LateLayers`` on its own (the selection of a preconditioner built without ``embeddings=True``): a late
    ``nn.Embedding`` is not named; a late Linear is."""
    model = make_mlp()
    late = LateLayers(model, ["Linear", "Conv2d"], None, None, StepWarnings(running=True))
    model.add_module("table", nn.Embedding(4, 3))
    model.add_module("head", nn.Linear(3, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.warns(BNPWarning) as caught:
        late.check(opt, [p for group in opt.param_groups for p in group["params"]])
    assert [str(w.message) for w in caught] == [
        LATE.format(layers="'head' (Linear)", optimizer="SGD", include="['head']")
    ]


class CountedLookups(dict):
    """The preconditioner's table of known parameters, counting its look-ups."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.lookups = 0

    def get(self, *args: Any) -> Any:
        self.lookups += 1
        return super().get(*args)


def test_late_layers_are_looked_for_only_when_an_optimizer_is_new_or_its_parameter_count_changed() -> None:
    """The look-up of an optimizer's parameters among the model's (one per parameter) runs at its first step and
    after its count changes; the steps between cost one ``len``."""
    model = make_mlp()
    pre = BNPPreconditioner(model)
    assert pre._late is not None
    known = pre._late.known = CountedLookups(pre._late.known)
    opt = torch.optim.SGD(model[0].parameters(), lr=0.1)
    x, y = DATA.tensors[0][:8], DATA.tensors[1][:8]
    seen: list[int] = []
    for step in range(4):
        if step == 2:
            opt.add_param_group({"params": list(model[2].parameters())})
        nn.functional.cross_entropy(model(x), y).backward()
        pre.step(opt)
        opt.step()
        opt.zero_grad()
        seen.append(known.lookups)
    assert seen == [2, 2, 6, 6]
