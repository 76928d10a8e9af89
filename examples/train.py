"""Elastic DDP training on a synthetic regression task: checkpoints, resume, optional crash.

Runs under any torchrun-compatible launcher (torchrun, elastic-agent)::

    torchrun --standalone --nproc-per-node 2 examples/train.py --steps 30
    torchrun --standalone --nproc-per-node 2 --max-restarts 1 examples/train.py \\
        --crash-rank 1 --crash-step 3          # crashes once, restarts, resumes, exits 0

Every rank builds the same model and data from fixed seeds; each step every rank takes its own
slice of a step-seeded permutation, so a run resumed from a checkpoint follows exactly the path
an uninterrupted run would have taken. Rank 0 writes a checkpoint every ``--checkpoint-every``
steps and after the last one (temp file, then ``os.replace``) and all ranks meet at a barrier;
on start every rank loads the latest checkpoint if there is one and prints ``resumed from step S``.

``--crash-rank R --crash-step S`` makes rank R raise at step S on the first attempt only
(``TORCHELASTIC_RESTART_COUNT == 0``); ``--crash-step S0,S1,...`` at step ``S<n>`` on attempt
``n`` (the same step every time: a job that never gets past it). ``main`` is wrapped in
torch's ``@record``, so the launcher's error file carries the traceback. ``--dump-params PATH``
makes every rank write ``PATH.rank{RANK}`` (JSON: a SHA-256 of the flattened parameters,
their sum, whether and from which step it resumed) so a test can check that all ranks ended identical.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel

DATA_SEED = 1234
MODEL_SEED = 0
SAMPLES = 4096
FEATURES = 16
HIDDEN = 64


class InjectedCrash(RuntimeError):
    """Raised on purpose by ``--crash-rank``/``--crash-step``."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Elastic DDP training example (synthetic data).")
    p.add_argument("--steps", type=int, default=30, help="total optimisation steps")
    p.add_argument("--batch-size", type=int, default=64, help="per-rank batch size")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--checkpoint-dir", default=None,
                   help="default: $TMPDIR/elastic-examples/<TORCHELASTIC_RUN_ID>")
    p.add_argument("--checkpoint-every", type=int, default=2, metavar="K",
                   help="checkpoint after every K steps (0: never)")
    p.add_argument("--sleep", type=float, default=0.0, help="seconds to sleep per step")
    p.add_argument("--crash-rank", type=int, default=None, metavar="R",
                   help="this rank raises at --crash-step, on the first attempt only")
    p.add_argument("--crash-step", type=_steps, default=None, metavar="S[,S...]",
                   help="the step of the crash; one step per attempt when several")
    p.add_argument("--plain-init", action="store_true",
                   help="plain init_process_group(), without the per-attempt store prefix")
    p.add_argument("--dump-params", default=None, metavar="PATH",
                   help="each rank writes a parameter checksum to PATH.rank{RANK} at the end")
    return p.parse_args(argv)


def _steps(text: str) -> list[int]:
    return [int(s) for s in text.split(",")]


def env_int(name: str, default: int) -> int:
    value = os.environ.get(name, "")
    return int(value) if value.strip() else default


def default_checkpoint_dir() -> str:
    run_id = os.environ.get("TORCHELASTIC_RUN_ID") or "local"
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in run_id)
    return os.path.join(tempfile.gettempdir(), "elastic-examples", safe)


def make_data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(DATA_SEED)
    x = torch.randn(SAMPLES, FEATURES, generator=g)
    w = torch.randn(FEATURES, 1, generator=g)
    y = torch.tanh(x @ w) + 0.05 * torch.randn(SAMPLES, 1, generator=g)
    return x, y


def make_model() -> nn.Module:
    torch.manual_seed(MODEL_SEED)
    return nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, 1))


def batch_indices(step: int, rank: int, world_size: int, batch_size: int) -> torch.Tensor:
    """This rank's slice of a permutation seeded by the step: same on every attempt."""
    g = torch.Generator().manual_seed(DATA_SEED * 1_000_003 + step)
    perm = torch.randperm(SAMPLES, generator=g)
    return perm.roll(-(rank * batch_size) % SAMPLES)[:batch_size]


def checkpoint_path(directory: str) -> str:
    return os.path.join(directory, "checkpoint.pt")


def save_checkpoint(directory: str, step: int, model: nn.Module, opt: torch.optim.Optimizer,
                    world_size: int) -> None:
    os.makedirs(directory, exist_ok=True)
    final = checkpoint_path(directory)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".checkpoint.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save({"step": step, "model": model.state_dict(),
                        "optimizer": opt.state_dict(), "world_size": world_size}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def init_distributed(backend: str, rank: int, world_size: int, attempt: int,
                     plain: bool) -> None:
    """``init_process_group``, with the store keys of each attempt kept apart.

    torch 2.13's c10d rendezvous shares the agent's TCPStore with the workers
    (``TORCHELASTIC_USE_AGENT_STORE=True``) and keeps it across restarts, but the workers' side
    (``_create_c10d_store``) no longer prefixes keys per attempt. After a restart a fast rank
    can read the previous attempt's gloo/NCCL address of a slower peer and fail with "Connection
    refused" (pytorch#135712). So on an agent store we add the prefix ourselves. The restart
    count is per agent, so this is exact for one node; ``--plain-init`` turns it off.
    """
    if plain or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        dist.init_process_group(backend)
        return
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          world_size, is_master=False, timeout=timedelta(minutes=10))
    dist.init_process_group(backend, store=dist.PrefixStore(f"train/attempt_{attempt}", store),
                            rank=rank, world_size=world_size)


def say(line: str) -> None:
    """One write per line, so lines of ranks sharing a stdout pipe do not interleave."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def param_digest(model: nn.Module) -> tuple[str, float]:
    flat = torch.cat([p.detach().reshape(-1).to(torch.float64).cpu()
                      for p in model.parameters()])
    raw = bytes(flat.view(torch.uint8).tolist())  # no numpy needed
    return hashlib.sha256(raw).hexdigest(), float(flat.sum())


@record
def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    rank = env_int("RANK", 0)
    world_size = env_int("WORLD_SIZE", 1)
    local_rank = env_int("LOCAL_RANK", 0)
    restart_count = env_int("TORCHELASTIC_RESTART_COUNT", 0)
    ckpt_dir = args.checkpoint_dir or default_checkpoint_dir()

    use_cuda = torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    init_distributed("nccl" if use_cuda else "gloo", rank, world_size, restart_count,
                     args.plain_init)
    say(f"rank {rank}/{world_size} local_rank {local_rank} attempt {restart_count} "
        f"backend {dist.get_backend()}")

    model = make_model().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    start_step = 0
    resumed_from: int | None = None
    path = checkpoint_path(ckpt_dir)
    if os.path.exists(path):
        state = torch.load(path, map_location=device, weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        start_step = resumed_from = int(state["step"])
        say(f"resumed from step {start_step}")
    ddp = DistributedDataParallel(model, device_ids=[local_rank] if use_cuda else None)

    x, y = make_data()
    x, y = x.to(device), y.to(device)
    loss_fn = nn.MSELoss()
    loss = torch.zeros(())
    crash_at = (args.crash_step[restart_count]
                if args.crash_step and restart_count < len(args.crash_step) else None)
    for step in range(start_step, args.steps):
        if args.crash_rank == rank and crash_at == step:
            raise InjectedCrash(f"injected crash: rank {rank} at step {step} "
                                f"(attempt {restart_count})")
        idx = batch_indices(step, rank, world_size, args.batch_size).to(device)
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(ddp(x[idx]), y[idx])
        loss.backward()
        opt.step()
        say(f"step {step} loss {loss.item():.4f}")
        if args.sleep > 0:
            time.sleep(args.sleep)
        done = step + 1
        if args.checkpoint_every > 0 and (done % args.checkpoint_every == 0 or done == args.steps):
            if rank == 0:
                save_checkpoint(ckpt_dir, done, model, opt, world_size)
            dist.barrier()

    digest, total = param_digest(model)
    say(f"done: {args.steps} steps, final loss {loss.item():.4f}, params {digest[:12]}")
    if args.dump_params:
        record_ = {"rank": rank, "world_size": world_size, "steps": args.steps,
                   "sha256": digest, "sum": total, "resumed": resumed_from is not None,
                   "resumed_from": resumed_from, "attempt": restart_count,
                   "final_loss": float(loss.item())}
        out = f"{args.dump_params}.rank{rank}"
        with open(out + ".tmp", "w") as f:
            json.dump(record_, f)
        os.replace(out + ".tmp", out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
