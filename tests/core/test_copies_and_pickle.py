"""Copies and pickles of a model with BNP attached (issue 25, items 2 and 3).

A copy of the model alone (``copy.deepcopy``: EMA / teacher copies, ``AveragedModel``; ``pickle``) carries no
BNP hook and never feeds the original's statistics; ``BNPPreconditioner(copy)`` manages it on its own. A
preconditioner copied or pickled together with its model goes on exactly as the original.
"""

from __future__ import annotations

import copy
import io
import pickle
import re
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.optim.swa_utils import AveragedModel

from lightning_bnp.core import BNPPreconditioner, BNPWarning
from tests.helpers import bnp_train as train
from tests.helpers import make_cnn, make_mlp, record_compiles
from tests.helpers import seeded_batch as batch


def running(pre: BNPPreconditioner) -> dict[str, Tensor]:
    return {
        f"{n}.{k}": v
        for n, layer in pre.layers.items()
        for k, v in layer.running.state_dict().items()
        if isinstance(v, Tensor)
    }


def via_torch_save(obj: Any) -> Any:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


COPIES: dict[str, Callable[[nn.Module], nn.Module]] = {
    "deepcopy": copy.deepcopy,
    "pickle": lambda m: pickle.loads(pickle.dumps(m)),
    "torch.save": via_torch_save,
    "AveragedModel": lambda m: AveragedModel(m).module,  # SWA / EMA: a deepcopy inside
}


@pytest.mark.parametrize("how", list(COPIES))
def test_a_copy_of_the_model_never_feeds_the_originals_statistics(how: str) -> None:
    model = make_mlp()
    pre = BNPPreconditioner(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    train(model, pre, opt, range(2))
    twin = COPIES[how](model)
    state = {k: v.clone() for k, v in running(pre).items()}
    x, y = batch(7)
    F.cross_entropy(twin(x * 100), y).backward()  # a teacher/EMA forward and backward through the copy
    assert all(layer.moments is None for layer in pre.layers.values())
    train(model, pre, opt, range(2, 3))  # the original's next step sees only its own batch
    reference = make_mlp()
    ref_pre = BNPPreconditioner(reference)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    train(reference, ref_pre, ref_opt, range(3))
    for k, v in running(ref_pre).items():
        torch.testing.assert_close(running(pre)[k], v, rtol=0, atol=0)
    assert state  # (statistics had been updated before the copy)


def test_a_copy_is_managed_on_its_own() -> None:
    model = make_mlp()
    pre = BNPPreconditioner(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    train(model, pre, opt, range(2))
    twin = copy.deepcopy(model)
    twin_pre = BNPPreconditioner(twin)  # not refused as "already managed", and the copy's old hooks are gone
    assert all(len(m._forward_hooks) == 1 for m in (twin[0], twin[2]))
    twin_opt = torch.optim.SGD(twin.parameters(), lr=0.1)
    train(twin, twin_pre, twin_opt, range(2, 4))
    assert all(layer.running.steps == 2 for layer in twin_pre.layers.values())
    assert all(layer.running.steps == 2 for layer in pre.layers.values())  # the original: untouched


def pair_copies() -> dict[str, Callable[[Any], Any]]:
    return {
        "deepcopy": copy.deepcopy,
        "pickle": lambda pair: pickle.loads(pickle.dumps(pair)),
        "torch.save": via_torch_save,
    }


@pytest.mark.parametrize("order", ["model first", "preconditioner first"])
@pytest.mark.parametrize("how", list(pair_copies()))
@pytest.mark.parametrize("make", [make_mlp, make_cnn], ids=["mlp", "cnn"])
def test_a_copied_model_and_preconditioner_go_on_exactly_as_the_original(how: str, order: str, make: Any) -> None:
    model = make()
    pre = BNPPreconditioner(model, conv_statistics="column")
    shape = (2, 5, 5) if make is make_cnn else (6,)

    def steps(m: nn.Module, p: BNPPreconditioner, o: torch.optim.Optimizer, seeds: range) -> None:
        for seed in seeds:
            g = torch.Generator().manual_seed(seed)
            x = torch.randn(4, *shape, generator=g) + 0.5
            o.zero_grad()
            F.cross_entropy(m(x), torch.randint(0, 3, (4,), generator=g)).backward()
            p.step(o)
            o.step()

    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    steps(model, pre, opt, range(3))
    pair = (model, pre, opt) if order == "model first" else (pre, model, opt)
    copied = pair_copies()[how](pair)
    model2, pre2, opt2 = (
        (copied[0], copied[1], copied[2]) if order == "model first" else (copied[1], copied[0], copied[2])
    )
    assert pre2.attached and all(layer.module in set(model2.modules()) for layer in pre2.layers.values())
    steps(model, pre, opt, range(3, 6))
    steps(model2, pre2, opt2, range(3, 6))
    for (n, p), (_, p2) in zip(model.named_parameters(), model2.named_parameters()):
        torch.testing.assert_close(p2, p, rtol=0, atol=0, msg=n)
    for k, v in running(pre).items():
        torch.testing.assert_close(running(pre2)[k], v, rtol=0, atol=0, msg=k)


def test_preconditioner_alone_pickles_and_deepcopies_before_and_after_steps() -> None:
    model = make_mlp()
    pre = BNPPreconditioner(model)
    for obj in (pre, copy.deepcopy(pre)):
        pickle.loads(pickle.dumps(obj))
    train(model, pre, torch.optim.SGD(model.parameters(), lr=0.1), range(2))
    clone = copy.deepcopy(pre)
    assert clone.attached and running(clone).keys() == running(pre).keys()
    pickle.loads(pickle.dumps(pre))
    pre.detach()
    assert not pickle.loads(pickle.dumps(pre)).attached


def test_a_preconditioner_with_an_explicit_process_group_refuses_to_be_copied() -> None:
    pre = BNPPreconditioner(make_mlp(), process_group=object())
    message = (
        "a BNPPreconditioner with an explicit `process_group` cannot be pickled or copied (a process group is bound "
        "to this process); build a new one in the other process"
    )
    for how in (copy.deepcopy, pickle.dumps):
        with pytest.raises(TypeError, match="^" + re.escape(message) + "$"):
            how(pre)


def test_a_copy_leaves_the_optimizers_hooks_mask_and_owed_warnings_behind() -> None:
    """The optimizer's commit hook (and with it every other hook of that optimizer: here one that does not
    pickle), the token mask set on the original, and the warnings that the original's steps still owe are the
    original's: the copy neither carries nor raises them."""
    model = make_mlp()
    pre = BNPPreconditioner(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt.register_step_post_hook(lambda *args: None)  # a lambda: pickling it fails
    x, y = batch(0)
    x[2, 1] = float("nan")
    F.cross_entropy(model(x), y).backward()
    pre.step(opt)  # its non-finite statistics are reported by the next step (or flush_warnings)
    pre.set_token_mask(torch.ones(8, dtype=torch.bool))
    for clone in (copy.deepcopy(pre), pickle.loads(pickle.dumps(pre))):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            clone.flush_warnings()
        first = clone.layers["0"]
        assert first.module is not model[0]
        first.module(batch(1, n=5)[0]).sum().backward()  # 5 rows: the original's mask (8 rows) would not fit
        assert first.moments is not None and first.moments.rows == 5
    with pytest.warns(BNPWarning, match="not finite"):
        pre.flush_warnings()


def test_a_pickle_from_before_the_attached_flag_loads_detached() -> None:
    """``__getstate__`` records whether the preconditioner was attached; a state without that entry (pickled by an
    older version) comes back detached."""
    pre = BNPPreconditioner(make_mlp())
    state = pre.__getstate__()
    del state["_was_attached"]
    clone = BNPPreconditioner.__new__(BNPPreconditioner)
    clone.__setstate__(copy.deepcopy(state))
    assert not clone.attached and pre.attached


def test_copy_safe_hooks_pass_every_argument_and_a_copy_drops_its_stale_pre_hooks() -> None:
    """Issue 27: the hook wrappers hand the module's arguments and output to the wrapped function unchanged; a
    copy's inert pre-hook (here one registered with keyword arguments) is forgotten in every table of the copy."""
    from lightning_bnp.core.copies import CopySafeHook, inert_hook, register_forward_hook, register_forward_pre_hook

    seen: list[tuple[Any, ...]] = []
    assert CopySafeHook(lambda *a, **k: (a, k))(1, 2, key=3) == ((1, 2), {"key": 3})
    module, x = nn.Linear(3, 2), torch.randn(4, 3)
    register_forward_pre_hook(module, lambda m, args: seen.append(("pre", m, args)))
    register_forward_hook(module, lambda m, args, out: seen.append(("post", m, args, out)))
    out = module(x)
    assert [s[0] for s in seen] == ["pre", "post"] and all(s[1] is module for s in seen)
    assert seen[0][2][0] is x and seen[1][2][0] is x and seen[1][3] is out

    source = nn.Linear(3, 2)
    source.register_forward_pre_hook(CopySafeHook(lambda m, args, kwargs: None), with_kwargs=True)
    clone = copy.deepcopy(source)
    (key,) = clone._forward_pre_hooks
    assert clone._forward_pre_hooks[key] is inert_hook and key in clone._forward_pre_hooks_with_kwargs
    register_forward_pre_hook(clone, lambda m, args: None)
    assert key not in clone._forward_pre_hooks and key not in clone._forward_pre_hooks_with_kwargs
    assert len(clone._forward_pre_hooks) == 1


def test_a_copy_drops_its_stale_forward_hooks_from_every_table() -> None:
    """Issue 27 (`make mutate` survivors): the inert forward hooks of a copy (one plain, one registered with keyword
    arguments and ``always_call``) are forgotten in all three of the copy's hook tables when a new hook is
    registered on it; the new hook is the only one left, and the only one called."""
    from lightning_bnp.core.copies import CopySafeHook, inert_hook, register_forward_hook

    source = nn.Linear(3, 2)
    source.register_forward_hook(CopySafeHook(lambda m, args, out: None))
    source.register_forward_hook(CopySafeHook(lambda m, args, kwargs, out: None), with_kwargs=True, always_call=True)
    clone = copy.deepcopy(source)
    plain, keyed = clone._forward_hooks
    assert clone._forward_hooks[plain] is inert_hook and clone._forward_hooks[keyed] is inert_hook
    assert plain not in clone._forward_hooks_with_kwargs and keyed in clone._forward_hooks_with_kwargs
    assert keyed in clone._forward_hooks_always_called
    seen: list[Tensor] = []
    handle = register_forward_hook(clone, lambda m, args, out: seen.append(out))
    assert list(clone._forward_hooks) == [handle.id]
    assert not clone._forward_hooks_with_kwargs and not clone._forward_hooks_always_called
    out = clone(torch.randn(4, 3))
    assert len(seen) == 1 and seen[0] is out


def test_a_preconditioner_pickled_by_version_0_1_0_loads_and_steps_as_one_built_now() -> None:
    """A pickle written by the release before the preconditioner was split into parts (``data/``: a 3-4-2 MLP after
    two steps at ρ = 0.5) loads attached, keeps its running statistics, and its next step equals the step of a
    preconditioner with the same statistics built now."""
    import pickle
    from pathlib import Path

    with open(Path(__file__).parent / "data" / "preconditioner_0.1.0.pkl", "rb") as f:
        saved = pickle.load(f)
    model, pre = saved["model"], saved["pre"]
    assert pre.attached and pre.layers["0"].running.steps == 2
    torch.testing.assert_close(
        pre.layers["0"].running.mean_acc, torch.tensor([0.2640, 0.2224, 0.4647]), atol=1e-4, rtol=0
    )
    twin = copy.deepcopy(model)
    ref = BNPPreconditioner(twin, rho=0.5)
    ref.load_state_dict(pre.state_dict())
    x = torch.randn(8, 3)
    for net, p in ((model, pre), (twin, ref)):
        net(x).sum().backward()
        p.step()
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0)
    torch.testing.assert_close(pre.layers["2"].running.var_acc, ref.layers["2"].running.var_acc, rtol=0, atol=0)


def test_a_pickle_from_before_the_parts_with_a_compiled_step_compiles_its_new_step_with_the_same_options(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A preconditioner pickled before it was split into parts kept ``compile_step``'s options as
    ``_compile_options`` and no parts: its parts are built on load, and its step is compiled again with those
    options (``torch.compile`` replaced by a recorder: mutation testing's selection compiles nothing), so that its
    later steps run through the compiled function and transform as an eager twin's do."""
    given, runs = record_compiles(monkeypatch)
    model = make_mlp()
    pre = BNPPreconditioner(model)
    train(model, pre, torch.optim.SGD(model.parameters(), lr=0.1), range(2))
    state = pre.__getstate__()
    for part in ("_warnings", "_masks", "_collection", "_commits", "_step", "_late"):
        del state[part]  # what 0.1.0 had not
    state["_compile_options"] = {"backend": "eager", "dynamic": False}
    old_model, old_state = copy.deepcopy((model, state))  # the state's layers are those of the model copied with it
    old = BNPPreconditioner.__new__(BNPPreconditioner)
    old.__setstate__(old_state)
    assert old.attached and old.step_compiled and not pre.step_compiled
    assert given == [{"fullgraph": True, "backend": "eager", "dynamic": False}]
    train(old_model, old, torch.optim.SGD(old_model.parameters(), lr=0.1), range(2, 4))
    train(model, pre, torch.optim.SGD(model.parameters(), lr=0.1), range(2, 4))
    assert len(runs) == 2
    for p, q in zip(model.parameters(), old_model.parameters(), strict=True):
        torch.testing.assert_close(q, p, rtol=0, atol=0)
