"""The example projects under LightningCLI: every YAML config parses, round-trips through ``--print_config`` and
runs ``fast_dev_run``; callbacks can be appended on the command line.

The CLIs run in-process (``cli_main([...])``) from inside ``tmp_path``, on the offline 28×28 MNIST digits (the
configs' ``auto`` falls back to them there; the tests also force ``--data.dataset=mnist5k``). New configs are picked
up by the glob. A config that names several devices (``fsdp2``: 2 CPU processes) runs its ``fast_dev_run`` as the
user's command does, in a subprocess from which Lightning starts the other rank (``tests/ddp/cli_worker.py``).
"""

from __future__ import annotations

import importlib
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch._dynamo
import yaml
from lightning.pytorch.callbacks import LearningRateMonitor

from example_projects.cli import ProjectCLI
from lightning_bnp import BatchNormPreconditioning
from tests.ddp.launch import run_worker
from tests.helpers import ACCELERATOR

ROOT = Path(__file__).resolve().parents[2]
PROJECTS = (
    "fc_mnist",
    "cnn_cifar",
    "resnet_gn",
    "resnet_imagenet",
    "online",
    "weight_conditioning",
    "fsdp2",
    "transformer",
    "autoencoder",
    "char_rnn",
)
CONFIGS = sorted(ROOT.glob("example_projects/*/configs/*.yaml"))
# fast_dev_run only: CIFAR ResNet configs run at depth 8 (their own depth, 20 or 110, is checked by the print test),
# ResNet-18 at batch 8 without loader processes (its batch 256 and 8 workers are for ImageNet on a GPU)
FAST_OVERRIDES = {
    "resnet_gn": ["--model.depth=8", "--data.batch_size=16"],
    "resnet_imagenet": ["--data.batch_size=8", "--data.eval_batch_size=8", "--data.num_workers=0"],
}
QUIET = ["--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false"]


def _project(config: Path) -> str:
    return config.parent.parent.name


def _devices(config: Path) -> int:
    """The config's ``trainer.devices`` (1 when it names none)."""
    return int(yaml.safe_load(config.read_text())["trainer"].get("devices", 1))


def _config_params() -> list[Any]:
    params = []
    for config in CONFIGS:
        marks = [pytest.mark.slow] if _devices(config) > 1 else []  # several processes: a subprocess, seconds more
        params.append(pytest.param(config, id=f"{_project(config)}/{config.stem}", marks=marks))
    return params


def _cli_main(project: str) -> Callable[..., ProjectCLI]:
    return importlib.import_module(f"example_projects.{project}.__main__").cli_main


def _data_args(args: tuple[str, ...]) -> list[str]:
    """The offline digits and a 50-image validation batch (fast_dev_run's one batch: 50 images, not 500); for the
    transformer project's character-level LM (its data names no ``dataset``) the first 200 kB of its corpus; for
    ``char_rnn``'s text (no ``dataset`` either) a 50-window validation batch."""
    config = Path(args[args.index("--config") + 1]) if "--config" in args else None
    data = yaml.safe_load(config.read_text()).get("data", {}) if config else {}
    if str(data.get("class_path", "")).endswith("CorpusDataModule"):
        return ["--data.eval_batch_size=50", "--data.max_bytes=200000"]
    if config is not None and _project(config) == "char_rnn":
        return ["--data.eval_batch_size=50"]
    return ["--data.dataset=mnist5k", "--data.eval_batch_size=50"]


def _fast_dev_run(project: str, tmp_path: Path, *args: str) -> ProjectCLI:
    return _cli_main(project)(
        [
            "fit",
            *args,
            "--trainer.fast_dev_run=true",
            f"--trainer.accelerator={ACCELERATOR}",
            f"--trainer.default_root_dir={tmp_path}",
            *_data_args(args),
            *QUIET,
        ]
    )


def _print_config(project: str, config: Path, capsys: pytest.CaptureFixture[str]) -> str:
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        _cli_main(project)(["fit", "--config", str(config), "--print_config"])
    assert exit_info.value.code in (0, None)
    return capsys.readouterr().out


@pytest.fixture(autouse=True)
def _in_tmp_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Relative paths in the configs (``runs``, ``data``) resolve in ``tmp_path``; pytest's argv is not the CLI's."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["example_projects"])


def test_every_project_has_configs() -> None:
    assert {_project(config) for config in CONFIGS} == set(PROJECTS)
    for project in PROJECTS:
        for name in ("__init__.py", "__main__.py"):
            assert (ROOT / "example_projects" / project / name).is_file()


def _fast_dev_run_processes(project: str, config: Path, tmp_path: Path) -> list[dict[str, Any]]:
    """``fast_dev_run`` of a several-device config on CPU processes (gloo), run in ``tmp_path``; each rank's state."""
    args = ["fit", "--config", str(config), "--trainer.fast_dev_run=true", "--trainer.accelerator=cpu"]
    args += [f"--trainer.default_root_dir={tmp_path}", "--data.dataset=mnist5k", "--data.eval_batch_size=50", *QUIET]
    return run_worker("cli_worker", tmp_path / "ranks", "--project", project, *args, cwd=tmp_path)


def _assert_row_sharded(states: list[dict[str, Any]], devices: int) -> None:
    """Every rank finished one step with BNP on every layer, and each parameter's rows are split over the ranks."""
    assert len(states) == devices
    for state in states:
        assert state["finished"] and state["global_step"] == 1 and state["world_size"] == devices
        assert state["strategy"] == "lightning.pytorch.strategies.model_parallel.ModelParallelStrategy"
        assert state["bnp_layers"] == states[0]["bnp_layers"] and state["bnp_layers"]
    for name, (kind, _, rows) in states[0]["rows"].items():
        assert kind == "DTensor", name
        assert sum(state["rows"][name][1] for state in states) == rows, name  # FSDP2: dim 0 split, nothing repeated
        assert all(0 < state["rows"][name][1] < rows for state in states), name


@pytest.mark.parametrize("config", _config_params())
def test_config_runs_fast_dev_run(config: Path, tmp_path: Path) -> None:
    project = _project(config)
    named = [entry["class_path"] for entry in yaml.safe_load(config.read_text())["trainer"].get("callbacks") or []]
    if _devices(config) > 1:
        states = _fast_dev_run_processes(project, config, tmp_path)
        _assert_row_sharded(states, _devices(config))
        for state in states:  # every callback the YAML names is on every rank's trainer
            assert {path.rpartition(".")[2] for path in named} <= set(state["callbacks"]), state["callbacks"]
        return
    cli = _fast_dev_run(project, tmp_path, "--config", str(config), *FAST_OVERRIDES.get(project, []))
    assert cli.trainer.state.finished
    assert cli.trainer.global_step == 1
    # every callback the YAML names is on the trainer
    for class_path in named:
        module, _, name = class_path.rpartition(".")
        kind = getattr(importlib.import_module(module), name)
        assert any(isinstance(cb, kind) for cb in cli.trainer.callbacks), class_path


@pytest.mark.parametrize("config", _config_params())
def test_print_config_round_trips(config: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    project = _project(config)
    printed = _print_config(project, config, capsys)
    assert "class_path: lightning.pytorch.loggers.TensorBoardLogger" in printed
    (tmp_path / "printed.yaml").write_text(printed)
    assert _print_config(project, tmp_path / "printed.yaml", capsys) == printed
    # the printed config keeps the YAML's values
    original, again = yaml.safe_load(config.read_text()), yaml.safe_load(printed)
    for section in ("model", "data"):
        _assert_kept(original[section], again[section], section)


def _assert_kept(original: dict[str, Any], printed: dict[str, Any], where: str) -> None:
    """Every value of ``original`` is in ``printed`` (``class_path``/``init_args`` configs: recursively)."""
    for key, value in original.items():
        if isinstance(value, dict):
            _assert_kept(value, printed[key], f"{where}.{key}")
        else:
            assert printed[key] == (list(value) if isinstance(value, tuple) else value), (where, key)


@pytest.mark.parametrize(
    "config",
    [
        pytest.param(ROOT / "example_projects/fc_mnist/configs/bnp.yaml", id="fc_mnist/bnp"),
        pytest.param(ROOT / "example_projects/resnet_gn/configs/bnp_gn_20.yaml", id="resnet_gn/bnp_gn_20"),
    ],
)
def test_printed_config_runs(config: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    project = _project(config)
    (tmp_path / "printed.yaml").write_text(_print_config(project, config, capsys))
    cli = _fast_dev_run(project, tmp_path, "--config", str(tmp_path / "printed.yaml"), *FAST_OVERRIDES.get(project, []))
    assert cli.trainer.state.finished
    assert any(isinstance(cb, BatchNormPreconditioning) for cb in cli.trainer.callbacks)


def test_callback_appended_on_command_line(tmp_path: Path) -> None:
    config = ROOT / "example_projects/fc_mnist/configs/vanilla.yaml"
    cli = _fast_dev_run(
        "fc_mnist",
        tmp_path,
        "--config",
        str(config),
        "--trainer.callbacks+=lightning_bnp.BatchNormPreconditioning",
        "--trainer.callbacks.rho=0.9",
    )
    bnp = [cb for cb in cli.trainer.callbacks if isinstance(cb, BatchNormPreconditioning)]
    assert len(bnp) == 1 and bnp[0].rho == 0.9
    assert bnp[0].preconditioner is not None and len(bnp[0].preconditioner.layers) == 4


def test_callback_appended_to_the_configs_callbacks(tmp_path: Path) -> None:
    config = ROOT / "example_projects/online/configs/fc_bnp.yaml"
    cli = _fast_dev_run(
        "online",
        tmp_path,
        "--config",
        str(config),
        "--trainer.callbacks+=lightning.pytorch.callbacks.LearningRateMonitor",
    )
    kinds = [type(cb) for cb in cli.trainer.callbacks]
    assert BatchNormPreconditioning in kinds and LearningRateMonitor in kinds


def test_callback_appended_without_config(tmp_path: Path) -> None:
    cli = _fast_dev_run("cnn_cifar", tmp_path, "--trainer.callbacks+=lightning_bnp.BatchNormPreconditioning")
    assert any(isinstance(cb, BatchNormPreconditioning) for cb in cli.trainer.callbacks)


def test_weight_conditioning_appended_on_command_line(tmp_path: Path) -> None:
    config = ROOT / "example_projects/weight_conditioning/configs/cnn_bn.yaml"
    cli = _fast_dev_run(
        "weight_conditioning",
        tmp_path,
        "--config",
        str(config),
        "--trainer.callbacks+=lightning_bnp.WeightConditioning",
        "--trainer.callbacks.layers=first_and_last",
    )
    assert any(type(cb).__name__ == "WeightConditioning" for cb in cli.trainer.callbacks)


def test_default_logger_is_tensorboard_under_runs(tmp_path: Path) -> None:
    cli = _cli_main("fc_mnist")(["--data.dataset=mnist5k"], run=False)
    logger = cli.trainer.logger
    assert type(logger).__name__ == "TensorBoardLogger"
    assert Path(logger.save_dir) == Path("runs") and logger.name == "fc_mnist"


def test_data_shape_is_linked_into_the_model(tmp_path: Path) -> None:
    cli = _cli_main("cnn_cifar")(["--data.dataset=mnist5k"], run=False)
    assert cli.model.hparams["input_shape"] == (1, 28, 28)
    assert cli.model.hparams["num_classes"] == 10


@pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None, reason="inductor needs a C++ compiler")
def test_compile_option_trains_like_eager(tmp_path: Path) -> None:
    """``--model.compile=true`` (issue 16's fast path) with the BNP callback: same weights and statistics as eager."""
    config = ROOT / "example_projects/fc_mnist/configs/bnp.yaml"
    runs = {}
    for compiled in (False, True):
        torch._dynamo.reset()
        cli = _cli_main("fc_mnist")(
            [
                "fit",
                "--config",
                str(config),
                f"--model.compile={str(compiled).lower()}",
                "--trainer.max_steps=3",
                "--trainer.limit_val_batches=0",
                "--trainer.logger=false",
                "--trainer.enable_checkpointing=false",
                f"--trainer.accelerator={ACCELERATOR}",
                f"--trainer.default_root_dir={tmp_path / str(compiled)}",
                "--data.dataset=mnist5k",
                "--seed_everything=3",
                *QUIET,
            ]
        )
        bnp = next(cb for cb in cli.trainer.callbacks if isinstance(cb, BatchNormPreconditioning))
        assert bnp.preconditioner is not None
        runs[compiled] = (cli.model.network.state_dict(), bnp.preconditioner.state_dict()["layers"])
    (eager_weights, eager_stats), (compiled_weights, compiled_stats) = runs[False], runs[True]
    assert set(compiled_weights) == set(eager_weights)  # the compiled module adds no names
    for name, value in eager_weights.items():
        torch.testing.assert_close(compiled_weights[name], value, rtol=1e-4, atol=1e-5, msg=name)
    for name, state in eager_stats.items():
        assert compiled_stats[name]["steps"] == state["steps"] == 3
        torch.testing.assert_close(compiled_stats[name]["var_acc"], state["var_acc"], rtol=1e-4, atol=1e-6, msg=name)


def test_print_config_shows_the_real_layer_types_default(capsys: pytest.CaptureFixture[str]) -> None:
    printed = yaml.safe_load(_print_config("fc_mnist", ROOT / "example_projects/fc_mnist/configs/bnp.yaml", capsys))
    (bnp,) = [cb for cb in printed["trainer"]["callbacks"] if cb["class_path"].endswith("BatchNormPreconditioning")]
    assert bnp["init_args"]["layer_types"] == ["Linear", "Conv1d", "Conv2d", "Conv3d"]


def test_callbacks_append_by_short_name(tmp_path: Path) -> None:
    """Issue 17 item 8: ``+=BatchNormPreconditioning`` resolves like ``+=LearningRateMonitor``. In a fresh
    interpreter: this test module has imported ``lightning_bnp`` already, which is what makes short names work."""
    names = ["BatchNormPreconditioning", "TimingMonitor", "ConditionNumberMonitor"]
    config = ROOT / "example_projects/fc_mnist/configs/vanilla.yaml"
    args = [f"--trainer.callbacks+={name}" for name in names]
    done = subprocess.run(
        [sys.executable, "-m", "example_projects.fc_mnist", "fit", "--config", str(config), *args, "--print_config"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    printed = yaml.safe_load(done.stdout)
    paths = [cb["class_path"] for cb in printed["trainer"]["callbacks"]]
    assert [p for p in paths if p.startswith("lightning_bnp.")] == [f"lightning_bnp.{name}" for name in names]


def test_logged_hyperparameters_say_which_dataset_really_ran(tmp_path: Path) -> None:
    """Issue 17 item 7: a `cnn_cifar` run that fell back to the offline digits says so in its hparams.yaml."""
    config = ROOT / "example_projects/cnn_cifar/configs/bnp_b128.yaml"
    cli = _cli_main("cnn_cifar")(
        ["fit", "--config", str(config), "--trainer.max_steps=1", "--trainer.limit_val_batches=0", *QUIET]
    )
    assert cli.datamodule.hparams["dataset"] == "auto"  # what the config asked for ...
    saved = yaml.load((Path(cli.trainer.log_dir) / "hparams.yaml").read_text(), Loader=yaml.UnsafeLoader)  # tuples
    assert saved["dataset_used"] == "mnist5k"  # ... and what ran (no CIFAR-10 files in the test's data/)
