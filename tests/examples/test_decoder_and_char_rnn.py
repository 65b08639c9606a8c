"""The ``autoencoder`` and ``char_rnn`` example projects: their networks and data against independent references
(explicit shapes, slices of the text, a plain-torch loss), and a tiny fit of each CLI that trains and logs to
TensorBoard (BNP managing the transposed convolutions, the recurrent layer's two blocks and the read-out)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn

from example_projects.autoencoder.__main__ import cli_main as autoencoder_main
from example_projects.char_rnn.__main__ import cli_main as char_rnn_main
from example_projects.char_rnn.model import CharTextDataModule
from example_projects.char_text import corpus
from example_projects.decoders import conv_autoencoder
from lightning_bnp import BatchNormPreconditioning

ROOT = Path(__file__).resolve().parents[2]
QUIET = ["--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false", "--trainer.accelerator=cpu"]


@pytest.fixture(autouse=True)
def _in_tmp_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["example_projects"])


def _tags(log_dir: str) -> set[str]:
    events = EventAccumulator(log_dir)
    events.Reload()
    return set(events.Tags()["scalars"]) | set(events.Tags()["images"])


def test_conv_autoencoder_upsamples_to_the_input_shape() -> None:
    for shape, maps in (((1, 28, 28), [(32, 7, 7), (16, 14, 14), (1, 28, 28)]), ((3, 32, 32), [(32, 8, 8)])):
        net = conv_autoencoder(shape, norm="bn")
        outs = _outputs(net, torch.rand(2, *shape), (nn.Unflatten, nn.ConvTranspose2d))
        seen = [tuple(out.shape[1:]) for out in outs]
        assert seen[: len(maps)] == maps and seen[-1] == shape
        assert sum(isinstance(m, nn.BatchNorm2d) for m in net.modules()) == 2
    assert not any(isinstance(m, nn.BatchNorm2d) for m in conv_autoencoder().modules())
    with pytest.raises(ValueError, match="multiples of 4, got 8×10"):
        conv_autoencoder((1, 8, 10))
    with pytest.raises(ValueError, match="`norm` must be 'none' or 'bn', got 'gn'"):
        conv_autoencoder(norm="gn")  # type: ignore[arg-type]


def _outputs(net: nn.Module, x: torch.Tensor, kinds: tuple[type[nn.Module], ...]) -> list[torch.Tensor]:
    outs: list[torch.Tensor] = []
    for m in net.modules():
        if isinstance(m, kinds):
            m.register_forward_hook(lambda _m, _a, out: outs.append(out))
    net(x)
    return outs


@pytest.mark.parametrize("config", ["bnp_b4", "bnp_col_b4"])
def test_autoencoder_fit_trains_with_bnp_on_the_transposed_convolutions_and_logs(config: str) -> None:
    args = ["fit", "--config", str(ROOT / f"example_projects/autoencoder/configs/{config}.yaml"), *QUIET]
    args += ["--data.dataset=mnist5k", "--trainer.max_steps=60", "--trainer.limit_val_batches=1"]
    args += ["--trainer.val_check_interval=60", "--data.eval_batch_size=200"]
    cli = autoencoder_main(args)
    (bnp,) = [cb for cb in cli.trainer.callbacks if isinstance(cb, BatchNormPreconditioning)]
    assert bnp.preconditioner is not None
    assert set(bnp.preconditioner.layers) == {"network.1", "network.3", "network.7", "network.10"}  # 2 Linear, 2 ConvT
    x = cli.datamodule.splits["val"][slice(0, 200)][0]  # the validation batch, as images in [0, 1]
    assert x.shape == (200, 1, 28, 28)
    with torch.no_grad():
        mse = float((cli.model.network(x) - x).square().mean())
        torch.manual_seed(0)
        start = float((conv_autoencoder()(x) - x).square().mean())  # the seed's initial network (seed_everything: 0)
    assert math.isclose(float(cli.trainer.callback_metrics["val/loss"]), mse, rel_tol=1e-5)
    assert mse < 0.8 * start  # 60 steps at batch 4 reconstruct better than the initial network
    assert {"train/loss", "val/loss", "val/reconstructions"} <= _tags(cli.trainer.log_dir)


def test_char_text_windows_are_consecutive_characters_and_the_vocabulary_reaches_the_model() -> None:
    data = CharTextDataModule(window=8, batch_size=4, eval_batch_size=3)
    text = corpus()
    chars = sorted(set(text))
    assert data.vocabulary == len(chars)
    encoded = torch.tensor([chars.index(c) for c in text])
    a, b = int(0.8 * len(text)), int(0.9 * len(text))
    assert torch.equal(torch.cat([data.splits[s] for s in ("train", "val", "test")]), encoded)
    assert len(data.splits["train"]) == a and len(data.splits["val"]) == b - a
    x, y = next(iter(data.val_dataloader()))
    assert torch.equal(x[2], encoded[a + 16 : a + 24]) and torch.equal(y[2], encoded[a + 17 : a + 25])
    cli = char_rnn_main(["--model.cell=GRU"], run=False)
    assert cli.model.network.head.out_features == len(chars) and isinstance(cli.model.network.rnn, nn.GRU)


RNN_LAYERS = ["network.rnn.ih_l0", "network.rnn.hh_l0"]
GRU_LAYERS = [f"{name}.{gates}" for name in RNN_LAYERS for gates in ("rz", "n")]  # the n-gate bias b_hn is apart


@pytest.mark.parametrize(("config", "layers"), [("lstm_bnp_b1", RNN_LAYERS), ("gru_bnp_b32", GRU_LAYERS)])
def test_char_rnn_fit_trains_with_bnp_on_the_recurrent_layer_and_logs_bits_per_character(
    config: str, layers: list[str]
) -> None:
    args = ["fit", "--config", str(ROOT / f"example_projects/char_rnn/configs/{config}.yaml"), *QUIET]
    args += ["--trainer.max_steps=40", "--trainer.val_check_interval=40", "--trainer.limit_val_batches=2"]
    cli = char_rnn_main(args)
    (bnp,) = [cb for cb in cli.trainer.callbacks if isinstance(cb, BatchNormPreconditioning)]
    assert bnp.preconditioner is not None
    assert set(bnp.preconditioner.layers) == {"network.head", *layers}
    vocabulary = cli.datamodule.vocabulary
    bpc = float(cli.trainer.callback_metrics["val/bpc"])
    assert bpc < math.log2(vocabulary)  # below the uniform guess after 40 steps
    x, y = next(iter(cli.datamodule.val_dataloader()))
    with torch.no_grad():
        nats = nn.functional.cross_entropy(cli.model(x).reshape(-1, vocabulary), y.reshape(-1))
    assert math.isclose(float(nats) / math.log(2), float(cli.trainer.callback_metrics["val/bpc"]), rel_tol=0.2)
    assert {"train/loss", "train/bpc", "val/bpc"} <= _tags(cli.trainer.log_dir)
