"""Train a Flax MLP on the digits data set with cocijax deciding when to checkpoint.

    python examples/flax_train.py                      # ./cocijax_demo, 5000 steps
    python examples/flax_train.py --roots /ssd0/ck /ssd1/ck --mtbf 600

Kill it at any moment (Ctrl-C, ``kill -9``) and run the same command again: it resumes from the
newest committed checkpoint, and the policy continues its schedule instead of starting over.
``kill -TERM`` (what a scheduler sends before it preempts a machine) saves the current step at
once and exits with status 0; the same command resumes there. A finished run has saved its last
step, so running it again trains nothing.

The data is the 8x8 handwritten digits set that ships inside scikit-learn (1,797 images, no
download), fed by a Grain dataset: each epoch a new shuffle, batches, and pixel noise. The Grain
iterator's position is saved with every checkpoint (``extra=``) and restored with it, so a
resumed run sees the batches the uninterrupted run would have seen and ends with the same
parameters (the last line prints their digest).

The default ``--mtbf`` is ten seconds, absurdly short for a real cluster (hours), on purpose: the
COCI policy then takes several saves within a run of half a minute or so. The policy starts
from a guess of the save cost (``cost_prior_s=0.05``) until the first save has been timed.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import math
import os
import signal
import sys
from pathlib import Path

import grain
import jax
import numpy as np
import optax
from flax import nnx
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

import cocijax as cj


class MLP(nnx.Module):
    """Two hidden layers; about 85k parameters."""

    def __init__(self, *, hidden: int, rngs: nnx.Rngs):
        self.l1 = nnx.Linear(64, hidden, rngs=rngs)
        self.l2 = nnx.Linear(hidden, hidden, rngs=rngs)
        self.out = nnx.Linear(hidden, 10, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.out(nnx.relu(self.l2(nnx.relu(self.l1(x)))))


def load_digits(seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Returns (x_train, y_train, x_test, y_test), pixels scaled to [0, 1]."""
    from sklearn.datasets import load_digits as sk_load_digits

    data = sk_load_digits()
    x = (data.data / 16.0).astype(np.float32)
    y = data.target.astype(np.int32)
    order = np.random.default_rng(seed).permutation(len(x))
    x, y = x[order], y[order]
    return x[:1500], y[:1500], x[1500:], y[1500:]


def batches(x: np.ndarray, y: np.ndarray, args: argparse.Namespace) -> grain.MapDataset:
    """Noisy, shuffled ``(x, y)`` batches, forever: a Grain dataset (its iterator is checkpointed).

    Each epoch is a new permutation of the examples (one NumPy permutation per epoch inside a
    Grain ``map_with_index``: Grain's per-example ``shuffle`` and ``batch`` took 4 to 7 ms per
    batch of 128 in Python on the development machine, several times this model's training
    step; this pipeline takes about 0.3 ms); the pixel noise comes from
    Grain's ``random_map``, seeded per batch. Batch ``i`` is the same whatever happened before,
    so an iterator restored to position ``i`` continues exactly.
    """
    per_epoch = len(x) // args.batch

    @functools.lru_cache(maxsize=2)
    def order(epoch: int) -> np.ndarray:
        return np.random.default_rng((args.seed, epoch)).permutation(len(x))

    def examples(i: int, _: int) -> np.ndarray:
        epoch, j = divmod(i, per_epoch)
        return order(epoch)[j * args.batch : (j + 1) * args.batch]

    def add_noise(idx: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        # Pixel noise keeps the task from being memorised in a few hundred steps.
        noise = rng.normal(0.0, args.noise, (len(idx), x.shape[1])).astype(np.float32)
        return x[idx] + noise, y[idx]

    return (
        grain.MapDataset.range(per_epoch)
        .repeat()  # batch numbers 0, 1, 2, ... for ever
        .map_with_index(examples)
        .random_map(add_noise, seed=args.seed)
    )


def build(args: argparse.Namespace):
    """Returns (state, graphdef, train_step, evaluate) for a fresh model."""
    model = MLP(hidden=args.hidden, rngs=nnx.Rngs(args.seed))
    graphdef, params = nnx.split(model)
    # The checkpoint holds plain dicts of arrays: what any Orbax/cocijax handler round-trips.
    params = nnx.to_pure_dict(params)
    tx = optax.adamw(optax.cosine_decay_schedule(args.lr, args.steps, alpha=0.05))
    state = {"params": params, "opt_state": tx.init(params)}

    def loss_fn(params, x, y):
        logits = nnx.merge(graphdef, params)(x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    @jax.jit
    def train_step(state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(state["params"], x, y)
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        return {"params": params, "opt_state": opt_state}, loss

    @jax.jit
    def accuracy(params, x, y):
        return (nnx.merge(graphdef, params)(x).argmax(-1) == y).mean()

    return state, train_step, accuracy


def ms(seconds: float, digits: int = 0) -> str:
    """Milliseconds for display; "unknown" before anything was measured (NaN)."""
    return "unknown" if math.isnan(seconds) else f"{seconds * 1e3:.{digits}f} ms"


def digest(tree) -> str:
    """A short SHA-256 of every leaf's bytes."""
    h = hashlib.sha256()
    for leaf in jax.tree.leaves(tree):
        h.update(np.asarray(leaf).tobytes())
    return h.hexdigest()[:16]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--dir",
        type=Path,
        default=Path("cocijax_demo"),
        help="checkpoint directory (default: ./cocijax_demo)",
    )
    p.add_argument("--steps", type=int, default=5000, help="total training steps")
    p.add_argument(
        "--roots",
        type=Path,
        nargs="*",
        default=None,
        help="storage roots to stripe each checkpoint over (default: inside --dir)",
    )
    p.add_argument(
        "--mtbf",
        type=float,
        default=10.0,
        help="mean time between failures in seconds told to the policy "
        "(default 10: short on purpose, see the module docstring)",
    )
    p.add_argument("--max-to-keep", type=int, default=3)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--noise", type=float, default=0.5, help="std of the pixel noise")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--kill-at",
        type=int,
        default=None,
        metavar="STEP",
        help="after STEP, wait for the saves in flight to commit, then SIGKILL "
        "this process (a crash with a known newest checkpoint; for tests)",
    )
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error(f"--steps must be >= 1, got {args.steps}")
    if not (math.isfinite(args.mtbf) and args.mtbf > 0):
        p.error(f"--mtbf must be a positive number of seconds, got {args.mtbf}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    console = Console(soft_wrap=True)  # long lines stay whole when piped to a file
    x_train, y_train, x_test, y_test = load_digits(args.seed)
    # No prefetch threads: a batch costs ~0.3 ms to make, and the order stays plain to follow.
    data = iter(
        batches(x_train, y_train, args).to_iter_dataset(
            grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)
        )
    )
    state, train_step, accuracy = build(args)
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), state)
    # cost_prior_s: a first guess of what a save of this small model costs; the manager measures
    # the real cost at the first save and the policy uses that from then on. total_steps also
    # makes the manager save the last step, so a finished run keeps its final model.
    policy = cj.policies.coci(mtbf_s=args.mtbf, total_steps=args.steps, cost_prior_s=0.05)
    # The iterator's position, saved with every checkpoint: read when a step saves, not before.
    extra = {"data": grain.checkpoint.CheckpointSave(data)}

    # exit_on_preemption=False: this loop checks reached_preemption itself, to say so and
    # exit 0 (by default a SIGTERM ends the process with status 143 once its save commits).
    with cj.CheckpointManager(
        args.dir,
        roots=args.roots,
        policy=policy,
        max_to_keep=args.max_to_keep,
        exit_on_preemption=False,
    ) as mngr:
        start = mngr.latest_step() or 0
        if start:
            restore = {"data": grain.checkpoint.CheckpointRestore(data)}
            state, _ = mngr.restore(target=abstract, extra=restore)
            console.print(f"[bold]resumed from step {start}[/bold] ({args.dir})")
        else:
            console.print(f"fresh run in {args.dir}")
        if start >= args.steps:
            console.print(f"already trained to step {start} (--steps {args.steps}); nothing to do")
            console.print(f"parameter digest: {digest(state['params'])}")
            return 0
        saves = 0
        preempted = None
        columns = (
            TextColumn("[progress.description]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.fields[info]}"),
        )
        with Progress(*columns, console=console) as progress:
            task = progress.add_task("training", total=args.steps, completed=start, info="")
            for step in range(start + 1, args.steps + 1):
                x, y = next(data)
                state, loss = train_step(state, x, y)
                saved = mngr.save(step, state, loss=loss, extra=extra)
                saves += saved
                # At each save too, redrawn before its line is printed (the bar is drawn again
                # below it as it was last drawn): the bar counts the "saved" lines above it.
                if saved or step % 50 == 0 or step == args.steps:
                    info = f"loss {float(loss):.4f}  saves {saves}"
                    progress.update(task, completed=step, info=info, refresh=saved)
                if saved:
                    m = mngr.measurements
                    progress.console.print(
                        f"step {step:>6}: saved  (policy saw: step {ms(m.step_time_s, 1)},"
                        f" save cost {ms(m.cost_estimate_s)}, loss "
                        f"{'unknown' if math.isnan(m.loss) else f'{m.loss:.4f}'}; "
                        f"this save blocked {ms(m.last_save_s)})"
                    )
                if mngr.reached_preemption:  # SIGTERM: this step is saved and committed
                    preempted = step
                    break
                if step == args.kill_at:
                    # Let the saves in flight commit, so the run dies with a known newest step.
                    mngr.wait_until_finished()
                    console.file.flush()
                    os.kill(os.getpid(), signal.SIGKILL)
        if preempted is not None:
            console.print(f"preempted: step {preempted} saved; run the same command to resume")
            return 0
        mngr.wait_until_finished()
        acc = float(accuracy(state["params"], x_test, y_test))
        console.print(
            f"done: step {args.steps}, test accuracy {acc:.3f}, {saves} saves this run, "
            f"checkpoints on disk: {mngr.all_steps()}"
        )
        # A resumed run ends with the same parameters as an uninterrupted one: compare digests.
        console.print(f"parameter digest: {digest(state['params'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
