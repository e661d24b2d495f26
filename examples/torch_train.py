"""Trains a small CNN on scikit-learn's digits with cocijax deciding when to checkpoint.

    python examples/torch_train.py                      # trains, saving when the policy says
    python examples/torch_train.py --crash-at 500       # dies at step 500 (like a node failure)
    python examples/torch_train.py                      # ...and resumes from the latest save

The data set (1,797 8x8 images) ships inside scikit-learn, so this runs offline on a CPU in
about a minute (2 cores). The MTBF defaults to two minutes, far shorter than any real
cluster's, so that the policy takes several checkpoints within a short demo.
"""

from __future__ import annotations

import argparse
import os
import random
from pathlib import Path

import numpy as np
import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from sklearn.datasets import load_digits

import cocijax as cj
import cocijax.torch as cjt


class DigitsCNN(torch.nn.Module):
    """Two 3x3 convolutions and a linear classifier: about 12k parameters."""

    def __init__(self):
        super().__init__()
        self.features = torch.nn.Sequential(
            torch.nn.Conv2d(1, 16, 3, padding=1),
            torch.nn.ReLU(),
            torch.nn.Conv2d(16, 32, 3, padding=1),
            torch.nn.ReLU(),
            torch.nn.MaxPool2d(2),
        )
        self.head = torch.nn.Sequential(torch.nn.Dropout(0.2), torch.nn.Linear(32 * 4 * 4, 10))

    def forward(self, x):
        return self.head(self.features(x).flatten(1))


def load_data(seed: int = 0):
    digits = load_digits()
    x = torch.tensor(digits.images / 16.0, dtype=torch.float32).unsqueeze(1)
    y = torch.tensor(digits.target, dtype=torch.int64)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    x, y = x[perm], y[perm]
    n_test = 297
    return (x[n_test:], y[n_test:]), (x[:n_test], y[:n_test])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--dir",
        default="ckpt/torch_digits",
        help="checkpoint directory (default: ckpt/torch_digits)",
    )
    parser.add_argument("--steps", type=int, default=1000, help="training steps")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument(
        "--mtbf",
        type=float,
        default=120.0,
        help="assumed mean time between failures in seconds (default 120)",
    )
    parser.add_argument(
        "--policy",
        default="coci",
        choices=["coci", "coci_paper", "young", "daly", "checkfreq", "fixed"],
    )
    parser.add_argument("--every", type=int, default=100, help="interval of --policy fixed")
    parser.add_argument("--max-to-keep", type=int, default=3)
    parser.add_argument(
        "--crash-at",
        type=int,
        default=None,
        help="exit abruptly after this step, to try the resume",
    )
    args = parser.parse_args(argv)
    console = Console()

    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)
    (x_train, y_train), (x_test, y_test) = load_data()
    model = DigitsCNN()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.steps)
    state = {"model": model, "optimizer": opt, "scheduler": sched}

    # Until the first save is timed a policy assumes a cost prior (10 s by default, sensible for
    # a large model); this model saves in milliseconds, so the demo says so up front.
    kw = {"cost_prior_s": 0.05}
    if args.policy not in ("checkfreq", "fixed"):
        kw["mtbf_s"] = args.mtbf
    if args.policy == "coci":
        kw["total_steps"] = args.steps  # the LR schedule fixes the job's length
    if args.policy == "fixed":
        kw = {"every": args.every}
    policy = getattr(cj.policies, args.policy)(**kw)

    with cjt.CheckpointManager(args.dir, policy=policy, max_to_keep=args.max_to_keep) as mngr:
        start = mngr.latest_step() or 0
        if start:
            mngr.restore(target=state)
            console.print(f"resumed from step {start} in {Path(args.dir)}")
        saves = []
        progress = Progress(
            TextColumn("[bold]train"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]:.3f}  saves {task.fields[saves]}"),
            TimeElapsedColumn(),
            console=console,
        )
        with progress:
            task = progress.add_task(
                "train", total=args.steps, completed=start, loss=float("nan"), saves=0
            )
            for step in range(start + 1, args.steps + 1):
                model.train()
                idx = torch.randint(0, len(y_train), (args.batch,))
                loss = torch.nn.functional.cross_entropy(model(x_train[idx]), y_train[idx])
                opt.zero_grad()
                loss.backward()
                opt.step()
                sched.step()
                # The last step is always saved, so a finished job is never recomputed.
                if mngr.save(step, state, loss=loss.detach(), force=step == args.steps):
                    saves.append(step)
                progress.update(task, advance=1, loss=loss.item(), saves=len(saves))
                if step == args.crash_at:
                    # No clean-up at all, like a node failure: a save still being written is
                    # lost, and the next run removes its temporary directory.
                    console.print(f"simulated crash after step {step}")
                    os._exit(17)
        mngr.wait_until_finished()
        model.eval()
        with torch.no_grad():
            acc = (model(x_test).argmax(1) == y_test).float().mean().item()
        console.print(
            f"saved after steps {saves} (measured stall {mngr.checkpoint_cost_s * 1e3:.0f} ms"
            f" per save); kept {mngr.all_steps()}; test accuracy {acc:.1%}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
