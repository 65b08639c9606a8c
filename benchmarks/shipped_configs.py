"""Train every shipped BNP config exactly as stated, on the data that is really there, and say whether it diverged.

``python -m benchmarks.shipped_configs [--max-epochs N] [--only PATTERN]`` runs each example-project YAML that
names ``lightning_bnp.BatchNormPreconditioning`` through its project's LightningCLI (the user's command,
``python -m example_projects.<project> fit --config <yaml>``), in a scratch folder so that nothing is written
into the repository, and prints a Markdown table (also written to ``benchmarks/out/shipped_configs.md``): the
data that ran, epochs and steps, the last training loss, the last validation accuracy and a verdict. A run
*diverged* when its training loss is not finite or exceeds 1e3, or its final validation accuracy is at chance
(≤ 15%; a language model, which logs no accuracy: its validation loss is no better than the uniform guess,
ln 256, or its bits per character no better than log2 of its vocabulary; an autoencoder: its validation
reconstruction error is no better than an all-zero output's). ``--max-epochs`` caps a config's
``trainer.max_epochs`` (for the 164-epoch ResNets on a CPU); every capped row says so. A config on several devices
(``fsdp2``: 2 CPU processes) is fitted by this module run again in a subprocess on that one config (``--one``),
since Lightning starts the other ranks by running the same command again.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from fnmatch import fnmatchcase
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
CHANCE_LIMIT = 0.15
LM_CHANCE_LOSS = math.log(256)  # nats per byte of the uniform guess over the 256 byte values


def bnp_configs() -> list[Path]:
    """Every example config that names the BNP callback."""
    configs = sorted((ROOT / "example_projects").glob("*/configs/*.yaml"))
    return [
        c
        for c in configs
        if any(
            cb.get("class_path") == "lightning_bnp.BatchNormPreconditioning"
            for cb in (yaml.safe_load(c.read_text())["trainer"].get("callbacks") or [])
        )
    ]


def devices(config: Path) -> int:
    """The config's ``trainer.devices`` (1 when it names none)."""
    return int(yaml.safe_load(config.read_text())["trainer"].get("devices", 1))


def run_processes(config: Path, max_epochs: int | None) -> dict[str, object]:
    """:func:`run` for a config on several devices: ``python -m benchmarks.shipped_configs --one <config>`` in this
    working directory, whose rank 0 writes the row as JSON."""
    result = Path.cwd() / f"{config.parent.parent.name}_{config.stem}.json"
    cmd = [sys.executable, "-m", "benchmarks.shipped_configs", "--one", str(config), "--result", str(result)]
    cmd += ["--max-epochs", str(max_epochs)] if max_epochs else []
    subprocess.run(cmd, check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    return dict(json.loads(result.read_text()))


def run(config: Path, max_epochs: int | None) -> dict[str, object]:
    """Fit one config with its own settings (``max_epochs`` capped if asked) and read back its last metrics (rank 0's
    training loss, the validation accuracy over every rank)."""
    project = config.parent.parent.name
    stated = int(yaml.safe_load(config.read_text())["trainer"].get("max_epochs", 1000))
    epochs = min(stated, max_epochs) if max_epochs else stated
    main = importlib.import_module(f"example_projects.{project}.__main__").cli_main
    args = ["fit", "--config", str(config), "--trainer.enable_progress_bar=false"]
    if epochs != stated:
        args.append(f"--trainer.max_epochs={epochs}")
    start = time.perf_counter()
    cli = main(args)
    seconds = time.perf_counter() - start
    metrics = {k: float(v) for k, v in cli.trainer.callback_metrics.items()}
    loss = metrics.get("train/loss", metrics.get("train/loss_epoch", math.nan))
    if "val/bpc" in metrics:  # char_rnn: bits per character against the uniform guess over its characters
        val = metrics["val/bpc"]
        chance = not val < math.log2(cli.datamodule.vocabulary)
    elif project == "autoencoder":  # reconstruction error against an all-zero output, mean x² of the validation images
        val = metrics.get("val/loss", math.nan)
        images = cli.datamodule.splits["val"]
        chance = not val < sum(float(images[i][0].square().mean()) for i in range(len(images))) / len(images)
    elif "val/acc" in metrics or "val/loss" not in metrics:
        val = metrics.get("val/acc", math.nan)
        chance = not val > CHANCE_LIMIT
    else:  # a language model (the transformer project's char-LM): validation loss against the uniform guess
        val = metrics["val/loss"]
        chance = not val < LM_CHANCE_LOSS
    diverged = not math.isfinite(loss) or loss > 1e3 or chance
    return {
        "config": f"{project}/{config.stem}",
        "data": getattr(cli.datamodule, "dataset", type(cli.datamodule).__name__),
        "epochs": f"{epochs} of {stated}" if epochs != stated else str(epochs),
        "steps": cli.trainer.global_step,
        "loss": loss,
        "val": val,
        "verdict": "**diverged**" if diverged else "trains",
        "minutes": seconds / 60,
        "rank": cli.trainer.global_rank,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.shipped_configs", description=__doc__)
    parser.add_argument("--max-epochs", type=int, default=None, help="cap every config's trainer.max_epochs")
    parser.add_argument("--only", default="*", help="glob on '<project>/<config stem>' (default: all)")
    parser.add_argument("--one", type=Path, default=None, help=argparse.SUPPRESS)  # run_processes: this config only
    parser.add_argument("--result", type=Path, default=None, help=argparse.SUPPRESS)  # ... its row as JSON (rank 0)
    args = parser.parse_args(argv)
    if args.max_epochs is not None and args.max_epochs < 1:
        parser.error(f"--max-epochs must be a positive integer, got {args.max_epochs}")
    if args.one is not None:
        row = run(args.one, args.max_epochs)
        if row.pop("rank") == 0:
            args.result.write_text(json.dumps(row))
        return
    configs = [c for c in bnp_configs() if fnmatchcase(f"{c.parent.parent.name}/{c.stem}", args.only)]
    if not configs:
        parser.error(f"--only {args.only!r} matches no BNP config")
    rows = []
    here = Path.cwd()
    with tempfile.TemporaryDirectory() as scratch:
        os.chdir(scratch)  # the configs' relative `runs` and `data` land in the scratch folder
        try:
            for config in configs:
                rows.append((run_processes if devices(config) > 1 else run)(config, args.max_epochs))
                rows[-1].pop("rank", None)
                print(rows[-1], flush=True)
        finally:
            os.chdir(here)
    lines = [
        "| config | data | epochs | steps | last train loss | last val acc (LM: val loss or bpc; AE: MSE) | verdict | "
        "minutes |",
        "|---|---|---|---|---|---|---|---|",
        *(
            f"| {r['config']} | {r['data']} | {r['epochs']} | {r['steps']} | {r['loss']:.3g} | {r['val']:.3f} | "
            f"{r['verdict']} | {r['minutes']:.1f} |"
            for r in rows
        ),
    ]
    out = ROOT / "benchmarks" / "out" / "shipped_configs.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
