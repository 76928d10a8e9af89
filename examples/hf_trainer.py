"""A tiny Hugging Face ``Trainer`` run: a GPT-2 built from a config (random weights, no
download) on random tokens, on the CPU with gloo. Runs unchanged under torchrun or
elastic-agent::

    elastic-agent --standalone --nproc-per-node 2 examples/hf_trainer.py --steps 40

Rank 0 prints the Trainer's own per-step dicts (``{'loss': '4.709', ...}``) and its tqdm bar;
nothing here is written for the launcher: the console reads the Trainer's output as it is.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import torch
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
from transformers.utils import logging as hf_logging


class RandomTokens(Dataset):
    """Fixed random token sequences (the same on every rank: the sampler splits them)."""

    def __init__(self, n: int, length: int, vocab: int) -> None:
        g = torch.Generator().manual_seed(1234)
        self.data = torch.randint(0, vocab, (n, length), generator=g)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.data[i], "labels": self.data[i]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--logging-steps", type=int, default=5)
    p.add_argument("--output-dir", default="")
    p.add_argument("--history-out", default="",
                   help="rank 0 writes the Trainer's own log history (JSON) here at the end")
    args = p.parse_args()
    hf_logging.set_verbosity_warning()
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=128, n_positions=32, n_embd=32, n_layer=2, n_head=2)
    model = GPT2LMHeadModel(config)
    out = args.output_dir or tempfile.mkdtemp(prefix="hf-trainer-")
    training = TrainingArguments(
        output_dir=out, max_steps=args.steps, per_device_train_batch_size=4,
        logging_steps=args.logging_steps, learning_rate=1e-3, report_to=[], save_strategy="no",
        use_cpu=True, dataloader_num_workers=0, seed=0,
        ddp_backend="gloo" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else None)
    trainer = Trainer(model=model, args=training,
                      train_dataset=RandomTokens(512, 32, config.vocab_size))
    trainer.train()
    if args.history_out and trainer.is_world_process_zero():
        with open(args.history_out, "w") as f:
            json.dump(trainer.state.log_history, f)


if __name__ == "__main__":
    main()
