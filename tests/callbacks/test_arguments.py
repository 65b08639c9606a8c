"""Every public constructor checks the type and range of every argument (issue 15, item 9).

Floats accept ints and refuse bools, strings and non-finite values; ints refuse bools and non-ints; flags
refuse non-bools (the string "false" is truthy); a bare string for a pattern list is one pattern.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from torch import nn

from lightning_bnp import (
    BatchNormPreconditioning,
    ConditionNumberMonitor,
    TimingMonitor,
    WeightConditioning,
    ZSpaceRegularization,
)
from lightning_bnp.core.conditioning import apply_weight_conditioning, conditioned_layers
from lightning_bnp.core.preconditioner import BNPPreconditioner
from lightning_bnp.core.selection import DEFAULT_LAYER_TYPES
from tests.helpers import BoringClassifier, _fit, make_data, make_mlp


def _pre(**kwargs: Any) -> BNPPreconditioner:
    return BNPPreconditioner(make_mlp(), **kwargs)


def _zspace(**kwargs: Any) -> ZSpaceRegularization:
    return ZSpaceRegularization(**{"weight_decay": 0.1, **kwargs})


T, V = TypeError, ValueError
BNP_CASES = [
    ({"rho": "0.9"}, T, r"`rho` must be a finite number in \[0, 1\), got '0.9' \(str\)"),
    ({"rho": True}, T, r"`rho` must be a finite number in \[0, 1\), got True \(bool\)"),
    ({"rho": math.nan}, V, r"`rho` must be a finite number in \[0, 1\), got nan"),
    ({"eps1": math.inf}, V, r"`eps1` must be a finite number > 0, got inf"),
    ({"eps2": math.inf}, V, r"`eps2` must be a finite number > 0, got inf"),
    ({"eps2": "1e-4"}, T, r"`eps2` must be a finite number > 0, got '1e-4' \(str\)"),
    ({"statistics": None}, V, r"`statistics` must be 'running' or 'batch', got None"),
    ({"bias_correction": "false"}, T, r"`bias_correction` must be a bool \(True or False\), got 'false'"),
    ({"sync_statistics": "false"}, T, r"`sync_statistics` must be a bool \(True or False\), got 'false'"),
    ({"sync_statistics": 0}, T, r"`sync_statistics` must be a bool \(True or False\), got 0"),
    ({"layer_types": [nn.Linear]}, T, r"`layer_types` must be a string or a list of strings, got \[<class"),
    ({"include": 3}, T, r"`include` must be a string or a list of strings, got 3"),
    ({"exclude": ["fc", 3]}, T, r"`exclude` must be a string or a list of strings, got \['fc', 3\]"),
    ({"embeddings": "yes"}, T, r"`embeddings` must be a bool \(True or False\), got 'yes' \(str\)"),
    ({"conv_statistics": "x"}, V, r"`conv_statistics` must be 'channel' or 'column', got 'x'"),
]
CASES: list[tuple[Callable[..., Any], dict[str, Any], type[Exception], str]] = [
    *((BatchNormPreconditioning, kwargs, error, match) for kwargs, error, match in BNP_CASES),
    *((_pre, kwargs, error, match) for kwargs, error, match in BNP_CASES),
    (BNPPreconditioner, {"model": "net"}, T, r"`model` must be a torch.nn.Module, got str"),
    (_zspace, {"weight_decay": math.inf}, V, r"`weight_decay` must be a finite number >= 0, got inf"),
    (_zspace, {"weight_decay": "1e-4"}, T, r"`weight_decay` must be a finite number >= 0, got '1e-4' \(str\)"),
    (_zspace, {"gradient_penalty": math.nan}, V, r"`gradient_penalty` must be a finite number >= 0, got nan"),
    (_zspace, {"gradient_penalty": True}, T, r"`gradient_penalty` must be a finite number >= 0, got True"),
    (_zspace, {"fd_step": math.inf}, V, r"`fd_step` must be a finite number > 0, got inf"),
    (_zspace, {"decay_space": None}, V, r"`decay_space` must be 'z' or 'p', got None"),
    (_zspace, {"hvp": 1}, V, r"`hvp` must be 'finite_difference' or 'double_backprop', got 1"),
    (_zspace, {"exclude_bias_and_norm": "false"}, T, r"`exclude_bias_and_norm` must be a bool .*got 'false'"),
    (WeightConditioning, {"eps": True}, T, r"`eps` must be a finite number > 0, got True \(bool\)"),
    (WeightConditioning, {"eps": "1e-12"}, T, r"`eps` must be a finite number > 0, got '1e-12' \(str\)"),
    (WeightConditioning, {"mode": 1}, V, r"`mode` must be one of \['row', 'column', 'row_column'\], got 1"),
    (WeightConditioning, {"include": 3}, T, r"`include` must be a string or a list of strings, got 3"),
    (WeightConditioning, {"exclude": ["fc", 3]}, T, r"`exclude` must be a string or a list of strings"),
    (WeightConditioning, {"layer_types": [nn.Linear]}, T, r"`layer_types` must be a string or a list of strings"),
    (ConditionNumberMonitor, {"every_n_steps": 2.0}, T, r"`every_n_steps` must be an integer >= 1, got 2.0"),
    (ConditionNumberMonitor, {"every_n_steps": True}, T, r"`every_n_steps` must be an integer >= 1, got True"),
    (ConditionNumberMonitor, {"neuron": "1"}, T, r"`neuron` must be an integer >= 0, got '1'"),
    (ConditionNumberMonitor, {"max_hessian_size": 1e3}, T, r"`max_hessian_size` must be an integer >= 1"),
    (ConditionNumberMonitor, {"max_weight_kappa_size": 0}, V, r"`max_weight_kappa_size` must be an integer >= 1"),
    (ConditionNumberMonitor, {"lanczos_iters": False}, T, r"`lanczos_iters` must be an integer >= 1, got False"),
    (ConditionNumberMonitor, {"kappa_d": "false"}, T, r"`kappa_d` must be a bool \(True or False\), got 'false'"),
    (ConditionNumberMonitor, {"hessian_block": 1}, T, r"`hessian_block` must be a bool"),
    (ConditionNumberMonitor, {"weight_kappa": "no"}, T, r"`weight_kappa` must be a bool"),
    (ConditionNumberMonitor, {"effective_lr": None}, T, r"`effective_lr` must be a bool"),
    (ConditionNumberMonitor, {"lanczos": "true"}, T, r"`lanczos` must be a bool"),
    (ConditionNumberMonitor, {"landscape": 0}, T, r"`landscape` must be a bool"),
    (ConditionNumberMonitor, {"hessian_rtol": math.inf}, V, r"`hessian_rtol` must be a finite number in \(0, 1\)"),
    (ConditionNumberMonitor, {"hessian_rtol": "1e-9"}, T, r"`hessian_rtol` must be a finite number in \(0, 1\)"),
    (ConditionNumberMonitor, {"landscape_steps": 2.0}, T, r"`landscape_steps` must be a non-empty list .* got 2.0"),
    (ConditionNumberMonitor, {"landscape_steps": [1, "2"]}, T, r"`landscape_steps` must be a non-empty list"),
    (ConditionNumberMonitor, {"landscape_steps": [math.inf]}, V, r"`landscape_steps` must be a non-empty list"),
    (ConditionNumberMonitor, {"landscape_steps": []}, V, r"`landscape_steps` must be a non-empty list"),
    (ConditionNumberMonitor, {"layers": 3}, T, r"`layers` must be a string or a list of strings, got 3"),
    (ConditionNumberMonitor, {"hessian_layers": [1]}, T, r"`hessian_layers` must be a string or a list of strings"),
    (TimingMonitor, {"every_n_steps": True}, T, r"`every_n_steps` must be an integer >= 1, got True \(bool\)"),
    (TimingMonitor, {"every_n_steps": 2.5}, T, r"`every_n_steps` must be an integer >= 1, got 2.5 \(float\)"),
    (TimingMonitor, {"every_n_steps": "50"}, T, r"`every_n_steps` must be an integer >= 1, got '50' \(str\)"),
    (BatchNormPreconditioning, {"verbose": "yes"}, T, r"`verbose` must be a bool \(True or False\), got 'yes'"),
    (BatchNormPreconditioning, {"token_mask_layers": 3}, T, r"`token_mask_layers` must be a string or a list of"),
    (BatchNormPreconditioning, {"token_mask_layers": []}, V, r"`token_mask_layers` must be None or a non-empty list"),
]


@pytest.mark.parametrize(
    ("factory", "kwargs", "error", "match"),
    CASES,
    ids=[f"{getattr(f, '__name__', f)}-{next(iter(k))}-{i}" for i, (f, k, _, _) in enumerate(CASES)],
)
def test_every_public_argument_is_type_and_range_checked(
    factory: Callable[..., Any], kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        factory(**kwargs)


def test_the_callbacks_flag_for_one_graph_per_step_must_be_a_bool() -> None:
    """``compile_step`` is checked as every flag (a test of its own: mutation testing deselects the test ids that
    say "compile", as this table's would)."""
    with pytest.raises(TypeError, match=r"^`compile_step` must be a bool \(True or False\), got 'true'"):
        BatchNormPreconditioning(compile_step="true")  # type: ignore[arg-type]


def test_the_callbacks_layer_types_none_means_the_default() -> None:
    """``layer_types=None`` (``layer_types: null`` in a YAML file) is documented as the default's four types."""
    assert BatchNormPreconditioning(layer_types=None).layer_types == BatchNormPreconditioning().layer_types
    assert BatchNormPreconditioning().layer_types == list(DEFAULT_LAYER_TYPES)


def test_ints_are_accepted_where_floats_are_meant() -> None:
    assert BatchNormPreconditioning(rho=0, eps1=1, eps2=1).eps1 == 1
    assert ZSpaceRegularization(weight_decay=1).weight_decay == 1.0
    assert ConditionNumberMonitor(landscape_steps=[1, 2]).landscape_steps == [1.0, 2.0]


def test_a_bare_string_is_one_pattern_everywhere() -> None:
    model = make_mlp()  # layers "0" and "2"
    assert set(BNPPreconditioner(model, include="2").layers) == {"2"}
    assert set(BNPPreconditioner(model, exclude="2", layer_types="Linear").layers) == {"0"}
    assert set(apply_weight_conditioning(model, include="2")) == {"2"} and set(conditioned_layers(model)) == {"2"}
    bnp = BatchNormPreconditioning(include="network.0", exclude="network.2", layer_types="Linear")
    assert (bnp.include, bnp.exclude, bnp.layer_types) == (["network.0"], ["network.2"], ["Linear"])
    wc = WeightConditioning(include="network.0", exclude="network.2")
    assert (wc.include, wc.exclude) == (["network.0"], ["network.2"])
    assert WeightConditioning(include="network.0").state_key == WeightConditioning(include=["network.0"]).state_key
    monitor = ConditionNumberMonitor(layers="network.*", hessian_layers="network.2")
    assert (monitor.layers, monitor.hessian_layers) == (["network.*"], ["network.2"])


def test_a_bare_string_pattern_is_read_from_yaml_like_lightning_cli(tmp_path: Path) -> None:
    import lightning.pytorch as pl
    from jsonargparse import ArgumentParser

    parser = ArgumentParser()
    parser.add_argument("--callbacks", type=list[pl.Callback])
    config = parser.parse_string(
        """
        callbacks:
          - class_path: lightning_bnp.BatchNormPreconditioning
            init_args: {include: network.0, sync_statistics: false}
          - class_path: lightning_bnp.WeightConditioning
            init_args: {include: network.2}
        """
    )
    instantiate = getattr(parser, "instantiate", None) or parser.instantiate_classes  # renamed in jsonargparse 4.49
    bnp, wc = instantiate(config).callbacks
    assert bnp.include == ["network.0"] and bnp.sync_statistics is False and wc.include == ["network.2"]
    model = BoringClassifier(make_mlp())
    _fit(tmp_path, model, make_data(), batch_size=16, callbacks=[bnp, wc], max_steps=1)
    assert bnp.preconditioner is not None and set(bnp.preconditioner.layers) == {"network.0"}
    assert set(conditioned_layers(model)) == {"network.2"}
