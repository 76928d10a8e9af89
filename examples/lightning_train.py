"""A tiny Lightning run with Lightning's default progress bar (Rich when rich is installed,
tqdm otherwise), on the CPU with gloo. Runs unchanged under torchrun or elastic-agent::

    elastic-agent --standalone --nproc-per-node 2 examples/lightning_train.py --epochs 2

Lightning finds the launcher's environment (``TORCHELASTIC_RUN_ID``, ``RANK``,
``WORLD_SIZE``...) by itself; the loss is logged with ``prog_bar=True``, so the bar shows it.
"""

from __future__ import annotations

import argparse
import json
import os

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class History(L.Callback):
    """What Lightning itself logged, step by step: the ground truth a test compares with."""

    def __init__(self) -> None:
        self.points: list[tuple[int, float]] = []

    def on_train_batch_end(self, trainer: L.Trainer, *_: object) -> None:
        loss = trainer.callback_metrics.get("train_loss")
        if loss is not None:
            self.points.append((trainer.global_step, float(loss)))


class Regression(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], _: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, prog_bar=True)
        self.log("lr", self.optimizers().param_groups[0]["lr"], prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _bar(which: str) -> list[L.Callback]:
    if which == "tqdm":
        from lightning.pytorch.callbacks import TQDMProgressBar

        return [TQDMProgressBar()]
    if which == "rich":
        from lightning.pytorch.callbacks import RichProgressBar

        return [RichProgressBar()]
    return []


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batches", type=int, default=20, help="batches per epoch on each rank")
    p.add_argument("--step-sleep", type=float, default=0.0, help="seconds each step sleeps")
    p.add_argument("--bar", choices=("default", "tqdm", "rich"), default="default",
                   help="Lightning's progress bar: its default (Rich when rich is installed), or one")
    p.add_argument("--history-out", default="",
                   help="rank 0 writes (global step, train_loss) as Lightning saw them (JSON)")
    args = p.parse_args()
    torch.manual_seed(0)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    x = torch.randn(args.batches * 8 * world, 16)
    y = x.sum(dim=1, keepdim=True)
    data = DataLoader(TensorDataset(x, y), batch_size=8)
    model = Regression()
    if args.step_sleep:
        step = model.training_step

        def slow_step(*a: object) -> torch.Tensor:
            import time

            time.sleep(args.step_sleep)
            return step(*a)

        model.training_step = slow_step  # type: ignore[method-assign]
    trainer = L.Trainer(
        max_epochs=args.epochs, accelerator="cpu",
        devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        num_nodes=int(os.environ.get("GROUP_WORLD_SIZE", "1")),
        strategy="ddp" if world > 1 else "auto", logger=False, enable_checkpointing=False,
        log_every_n_steps=1, enable_model_summary=False, callbacks=[history := History(), *_bar(args.bar)])
    trainer.fit(model, data)
    if args.history_out and trainer.global_rank == 0:
        with open(args.history_out, "w") as f:
            json.dump(history.points, f)


if __name__ == "__main__":
    main()
