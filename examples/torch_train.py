"""Trains a small CNN on scikit-learn's digits with cocijax deciding when to checkpoint.

    python examples/torch_train.py                  # trains, saving when the policy says
    python examples/torch_train.py --crash-at 500   # SIGKILLs itself after step 500
    python examples/torch_train.py                  # ...and resumes from the latest save
    torchrun --nproc_per_node=2 examples/torch_train.py --dir ckpt/torch_2ranks  # 2 ranks

``kill -TERM`` (what a scheduler sends before it preempts a machine; to the process, to any
rank, or to ``torchrun``, which passes it on) saves the current step at once and exits with
status 0 and one line naming the step (a ``torchrun`` that got the signal itself exits 1 after
its ranks have); the same command resumes there. A finished run has saved its last step, so
running it again trains nothing.

Needs ``pip install 'cocijax[torch]' torchdata scikit-learn``. The data set (1,797 8x8 images)
ships inside scikit-learn, so this runs offline on a CPU: about 20 s on the 2-core development
machine while other jobs shared it, 6 s of them training and the rest start-up (imports,
compiling the policy). The batches come from torchdata's ``StatefulDataLoader``, whose position
is saved with each checkpoint (``extra``), so a resumed run sees the batches an uninterrupted
one would and ends with the same parameters (the last line prints their digest). Under
``torchrun`` (gloo) the model is sharded with ``fully_shard`` and each rank saves its own
shards, data position and RNG states; a directory saved by one rank cannot resume on two (the
data position is per rank), hence its own ``--dir``. The MTBF defaults to 10 seconds, far
shorter than any real cluster's, so that the policy takes several checkpoints within a short
demo; use hours (e.g. ``--mtbf 21600``) for real jobs.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import signal
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from sklearn.datasets import load_digits
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

import cocijax as cj
import cocijax.torch as cjt

# torchdata 0.11 calls an API that recent torch marks deprecated; nothing for a user to act on.
warnings.filterwarnings("ignore", message="'set_vital' is deprecated")


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


class Batches:
    """An endless stream of training batches, epoch after epoch, that can be checkpointed.

    The loader's state is its position within the epoch; the epoch number (which reshuffles)
    is this object's.
    """

    def __init__(self, dataset, batch_size: int, rank: int, world: int):
        self.sampler = StatefulDistributedSampler(
            dataset, num_replicas=world, rank=rank, shuffle=True, seed=0, drop_last=True
        )
        # Its own generator: a loader draws a seed from it at every iter(), which a resumed run
        # calls mid-epoch; drawn from the global RNG, that would shift the dropout masks.
        self.loader = StatefulDataLoader(
            dataset,
            batch_size=batch_size,
            sampler=self.sampler,
            drop_last=True,
            generator=torch.Generator().manual_seed(rank),
        )
        self.epoch = 0
        self._it = None

    def __next__(self):
        while True:
            if self._it is None:
                self.sampler.set_epoch(self.epoch)
                self._it = iter(self.loader)
            try:
                return next(self._it)
            except StopIteration:
                self.epoch, self._it = self.epoch + 1, None

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "loader": self.loader.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self._it = state["epoch"], None
        self.loader.load_state_dict(state["loader"])


def load_data(seed: int = 0):
    digits = load_digits()
    x = torch.tensor(digits.images / 16.0, dtype=torch.float32).unsqueeze(1)
    y = torch.tensor(digits.target, dtype=torch.int64)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    x, y = x[perm], y[perm]
    n_test = 297
    return (x[n_test:], y[n_test:]), (x[:n_test], y[:n_test])


def parameter_digest(model: torch.nn.Module) -> str:
    """A digest of the full parameters (gathered from every rank's shards)."""
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    h = hashlib.sha256()
    for name in sorted(full):
        h.update(name.encode())
        h.update(full[name].detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def _ms(seconds: float) -> str:
    return "unknown" if seconds != seconds else f"{seconds * 1e3:.1f} ms"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--dir",
        default="ckpt/torch_digits",
        help="checkpoint directory (default: ckpt/torch_digits)",
    )
    parser.add_argument("--steps", type=int, default=1000, help="training steps")
    parser.add_argument("--batch", type=int, default=64, help="global batch size")
    parser.add_argument(
        "--mtbf",
        type=float,
        default=10.0,
        help="assumed mean time between failures in seconds (default 10)",
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
        help="SIGKILL this process after this step (a save in flight is lost), to try the resume",
    )
    parser.add_argument(
        "--crash-rank",
        type=int,
        default=None,
        help="with --crash-at under torchrun: only this rank dies (default: every rank)",
    )
    args = parser.parse_args(argv)

    if "RANK" in os.environ:  # launched by torchrun
        dist.init_process_group("gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    console = Console(quiet=rank != 0, soft_wrap=True)  # whole lines, also in logs
    # A 12k-parameter model gains nothing from intra-op threads, and they make every step slow
    # on a busy machine (torchrun sets one thread per rank for the same reason).
    torch.set_num_threads(1)

    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)
    (x_train, y_train), (x_test, y_test) = load_data()
    model = DigitsCNN()
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.steps)
    state = {"model": model, "optimizer": opt, "scheduler": sched}
    batches = Batches(
        torch.utils.data.TensorDataset(x_train, y_train), args.batch // world, rank, world
    )
    torch.manual_seed(1 + rank)  # each rank its own dropout masks (saved and restored per rank)

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

    # exit_on_preemption=False: this loop checks reached_preemption itself, to say so and
    # exit 0 (by default a SIGTERM ends the process with status 143 once its save commits).
    with cjt.CheckpointManager(
        args.dir, policy=policy, max_to_keep=args.max_to_keep, exit_on_preemption=False
    ) as mngr:
        start = mngr.latest_step() or 0
        if start:
            mngr.restore(target=state, extra={"batches": batches})
            console.print(f"resumed from step {start} ({Path(args.dir)}, {world} rank(s))")
        else:
            console.print(f"fresh run in {Path(args.dir)} ({world} rank(s))")
        saves, preempted = [], None
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
                x, y = next(batches)
                loss = torch.nn.functional.cross_entropy(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                sched.step()
                # The final model of a finished job is kept: coci knows total_steps and saves
                # the last step itself; the other policies here need force=True for it.
                if mngr.save(
                    step,
                    state,
                    loss=loss.detach(),
                    force=step == args.steps,
                    extra={"batches": batches},
                ):
                    saves.append(step)
                    seen = mngr.measurements
                    progress.console.print(
                        f"step {step:5d}: saved  (policy saw: step {_ms(seen.step_time_s)}, "
                        f"save cost {_ms(seen.cost_estimate_s)}, loss {seen.loss:.4f})",
                        highlight=False,
                    )
                progress.update(task, advance=1, loss=loss.item(), saves=len(saves))
                if mngr.reached_preemption:  # SIGTERM: this step is saved and committed
                    preempted = step
                    break
                if step == args.crash_at and args.crash_rank in (None, rank):
                    # No clean-up at all, like a node failure: a save still being written is
                    # lost, and the next run removes its temporary directory.
                    print(f"rank {rank}: simulated crash after step {step}", flush=True)
                    os.kill(os.getpid(), signal.SIGKILL)
        if preempted is not None:
            console.print(f"preempted: step {preempted} saved; run the same command to resume")
        else:
            mngr.wait_until_finished()
            model.eval()
            with torch.no_grad():
                acc = (model(x_test).argmax(1) == y_test).float().mean().item()
            digest = parameter_digest(model)
            console.print(
                f"done: step {args.steps}, test accuracy {acc:.3f}, {len(saves)} saves this "
                f"run, checkpoints on disk: {mngr.all_steps()}",
                highlight=False,
            )
            console.print(f"parameter digest: {digest}", highlight=False)
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
