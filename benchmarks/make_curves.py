"""Trains small real models here and records their per-step training loss: validation curves.

The policy benchmark must not judge ``coci`` only on the ten shared curves it was developed on.
This script trains small models on CPU on data that ships offline (scikit-learn's bundled data
sets, Python's own standard-library source as text, and synthetic tasks) with a spread of
models, optimizers, learning-rate schedules and batch sizes, and writes each run's minibatch
loss at every step, as a trainer logs it, to ``benchmarks/curves/<name>.csv`` (``step,loss``).

Every run is seeded, so the files regenerate identically on the same software. The split into
``tune`` and ``holdout`` (``index.csv``) is drawn from a seeded generator over the run names
before any curve exists: no choice in this project looked at the holdout curves.

Run: ``nice -n 10 python benchmarks/make_curves.py [--only NAME ...] [--force]`` (about half an
hour on 2 cores); ``SOURCES.md`` lists every run.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import math
import sysconfig
import time
from collections.abc import Callable
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from rich.console import Console
from sklearn import datasets

OUT = Path(__file__).resolve().parent / "curves"
SPLIT_SEED = 20261124
HOLDOUT_SHARE = 0.4


@dataclasses.dataclass(frozen=True)
class Run:
    name: str
    data: str  # digits | wine | breast_cancer | diabetes | text | teacher | parity
    model: str  # logreg | mlp | cnn | autoencoder | gru | transformer
    optimizer: str
    schedule: str
    lr: float
    batch: int
    steps: int
    width: int = 64
    depth: int = 2
    seed: int = 0

    def describe(self) -> str:
        return (
            f"{self.model} (width {self.width}, depth {self.depth}) on {self.data}, "
            f"{self.optimizer} lr {self.lr:g} with {self.schedule} schedule, batch {self.batch}, "
            f"{self.steps} steps, seed {self.seed}"
        )


# One run a line, as a table.
# fmt: off
RUNS = [
    Run("digits_logreg_sgd_const", "digits", "logreg", "sgd", "constant", 0.05, 32, 3000),
    Run("digits_mlp_adam_const_b8", "digits", "mlp", "adam", "constant", 1e-3, 8, 4000),
    Run("digits_mlp_sgd_step", "digits", "mlp", "momentum", "step", 0.05, 64, 6000, 128),
    Run("digits_mlp_adamw_cosine", "digits", "mlp", "adamw", "cosine", 3e-3, 32, 5000, 256, 3),
    Run("digits_cnn_adam_warmcos", "digits", "cnn", "adam", "warmup_cosine", 2e-3, 64, 3000, 32),
    Run("digits_cnn_nesterov_exp", "digits", "cnn", "nesterov", "exponential", 0.05, 32, 2500, 16),
    Run("digits_ae_rmsprop_const", "digits", "autoencoder", "rmsprop", "constant", 1e-3, 32, 6000),
    Run("digits_ae_adam_linear", "digits", "autoencoder", "adam", "linear", 3e-3, 128, 4000, 128),
    Run("digits_mlp_adagrad_const", "digits", "mlp", "adagrad", "constant", 0.05, 16, 5000, 64, 4),
    Run("digits_mlp_sgd_onecycle", "digits", "mlp", "sgd", "onecycle", 0.2, 128, 3000, 128),
    Run("wine_mlp_adam_const", "wine", "mlp", "adam", "constant", 1e-3, 16, 3000, 32),
    Run("wine_logreg_sgd_step", "wine", "logreg", "momentum", "step", 0.01, 8, 2000),
    Run("cancer_mlp_adamw_cosine", "breast_cancer", "mlp", "adamw", "cosine", 1e-3, 32, 2500),
    Run("cancer_logreg_adagrad", "breast_cancer", "logreg", "adagrad", "constant", 0.1, 64, 1500),
    Run("diabetes_mlp_adam_step", "diabetes", "mlp", "adam", "step", 3e-3, 32, 4000, 64),
    Run("diabetes_mlp_sgd_const", "diabetes", "mlp", "sgd", "constant", 1e-2, 16, 5000, 32, 3),
    Run("teacher_mlp_adam_const", "teacher", "mlp", "adam", "constant", 1e-3, 64, 8000, 128, 3),
    Run("teacher_mlp_sgd_cosine", "teacher", "mlp", "momentum", "cosine", 0.02, 32, 6000, 64),
    Run("teacher_mlp_adam_warmlin", "teacher", "mlp", "adam", "warmup_linear", 2e-3, 256, 4000),
    Run("teacher_deep_rmsprop_exp", "teacher", "mlp", "rmsprop", "exponential", 1e-3, 32, 5000,
        64, 5),
    Run("parity_gru_adam_const", "parity", "gru", "adam", "constant", 3e-3, 64, 4000, 64),
    Run("parity_mlp_adamw_cosine", "parity", "mlp", "adamw", "cosine", 1e-3, 128, 5000, 256),
    Run("text_gru_adam_const", "text", "gru", "adam", "constant", 3e-3, 32, 6000, 128),
    Run("text_gru_adamw_cosine", "text", "gru", "adamw", "warmup_cosine", 5e-3, 32, 8000, 128),
    Run("text_gru_sgd_step", "text", "gru", "momentum", "step", 0.5, 16, 6000, 96),
    Run("text_tfm_adamw_warmcos", "text", "transformer", "adamw", "warmup_cosine", 1e-3, 16, 8000,
        64, 2),
    Run("text_tfm_adam_const", "text", "transformer", "adam", "constant", 3e-4, 32, 6000, 64, 2),
    Run("text_tfm_adam_linear", "text", "transformer", "adam", "warmup_linear", 2e-3, 16, 5000,
        48, 1),
    Run("text_mlp_bigram_sgd", "text", "mlp", "sgd", "exponential", 1.0, 64, 4000, 128, 1),
    Run("digits_mlp_adam_tinylr", "digits", "mlp", "adam", "constant", 5e-5, 32, 8000, 64),
    Run("digits_mlp_adam_hilr", "digits", "mlp", "adam", "step", 2e-2, 16, 4000, 256, 3),
    Run("teacher_mlp_sgd_b4_noisy", "teacher", "mlp", "sgd", "constant", 5e-3, 4, 10000, 64),
]
# Trained after every parameter of `coci` was fixed (2026-11-27), with seeds none of the runs
# above used: the `fresh` split, which no choice in this project has seen.
FRESH = [
    Run("digits_cnn_momentum_step", "digits", "cnn", "momentum", "step", 0.05, 32, 4000, 32,
        seed=1),
    Run("digits_ae_momentum_cosine", "digits", "autoencoder", "momentum", "cosine", 0.05, 64,
        5000, seed=1),
    Run("digits_logreg_adam_b4", "digits", "logreg", "adam", "constant", 1e-3, 4, 6000, seed=1),
    Run("wine_mlp_rmsprop_cosine", "wine", "mlp", "rmsprop", "cosine", 1e-3, 16, 3000, 64,
        seed=1),
    Run("cancer_mlp_sgd_onecycle", "breast_cancer", "mlp", "sgd", "onecycle", 0.1, 32, 3000, 128,
        seed=1),
    Run("diabetes_mlp_adamw_warmcos", "diabetes", "mlp", "adamw", "warmup_cosine", 3e-3, 16,
        5000, 64, seed=1),
    Run("teacher_mlp_nesterov_step", "teacher", "mlp", "nesterov", "step", 0.02, 16, 6000, 128,
        3, seed=1),
    Run("teacher_mlp_adagrad_linear", "teacher", "mlp", "adagrad", "linear", 0.05, 64, 5000,
        seed=1),
    Run("parity_gru_rmsprop_const", "parity", "gru", "rmsprop", "constant", 3e-3, 64, 4000, 64,
        seed=1),
    Run("text_tfm_adamw_const", "text", "transformer", "adamw", "constant", 1e-3, 64, 5000, 64,
        2, seed=1),
    Run("text_gru_adam_exp", "text", "gru", "adam", "exponential", 3e-3, 32, 5000, 96, seed=1),
]
# fmt: on


def split_of() -> dict[str, str]:
    """Seeded split over the run names, drawn before any curve exists; ``FRESH`` is its own."""
    rng = np.random.default_rng(SPLIT_SEED)
    names = sorted(r.name for r in RUNS)
    holdout = set(rng.choice(names, size=math.ceil(HOLDOUT_SHARE * len(names)), replace=False))
    split = {n: "holdout" if n in holdout else "tune" for n in names}
    return split | {r.name: "fresh" for r in FRESH}


# ----------------------------------------------------------------------------------- data


def _text(seq: int = 64) -> tuple[np.ndarray, int]:
    root = Path(sysconfig.get_paths()["stdlib"])
    chars = []
    for name in ("textwrap.py", "argparse.py", "json/__init__.py", "collections/__init__.py"):
        path = root / name
        if path.is_file():
            chars.append(path.read_text(errors="ignore"))
    text = "\n".join(chars)
    vocab = sorted(set(text))
    ids = np.asarray([vocab.index(c) for c in text], np.int32)
    n = (ids.size - 1) // seq
    return ids[: n * seq + 1], len(vocab)


def make_data(run: Run) -> tuple[Callable[[np.random.Generator], tuple], dict]:
    """A batch sampler and the task's sizes."""
    rng = np.random.default_rng(1000 + run.seed)
    if run.data in ("digits", "wine", "breast_cancer", "diabetes"):
        loader = getattr(datasets, f"load_{run.data}")
        x, y = loader(return_X_y=True)
        x = ((x - x.mean(0)) / (x.std(0) + 1e-8)).astype(np.float32)
        regression = run.data == "diabetes"
        y = ((y - y.mean()) / y.std()).astype(np.float32) if regression else y.astype(np.int32)
        info = dict(inputs=x.shape[1], classes=1 if regression else int(y.max()) + 1)
    elif run.data == "teacher":
        w1 = rng.standard_normal((20, 32)) / math.sqrt(20)
        w2 = rng.standard_normal((32, 1)) / math.sqrt(32)
        x = rng.standard_normal((4096, 20)).astype(np.float32)
        y = (np.tanh(x @ w1) @ w2).ravel().astype(np.float32)
        y += 0.05 * rng.standard_normal(y.shape).astype(np.float32)
        info = dict(inputs=20, classes=1)
    elif run.data == "parity":
        x = rng.integers(0, 2, (8192, 12)).astype(np.float32)
        y = (x[:, :5].sum(1) % 2).astype(np.int32)
        info = dict(inputs=12, classes=2)
    else:  # text
        ids, vocab = _text()
        seq = 64

        def sample_text(g: np.random.Generator):
            starts = g.integers(0, ids.size - seq - 1, run.batch)
            xs = np.stack([ids[s : s + seq] for s in starts])
            ys = np.stack([ids[s + 1 : s + seq + 1] for s in starts])
            return xs, ys

        return sample_text, dict(vocab=vocab, seq=seq, classes=vocab)

    def sample(g: np.random.Generator):
        idx = g.integers(0, x.shape[0], run.batch)
        noise = 0.1 * g.standard_normal(x[idx].shape).astype(np.float32)
        return x[idx] + noise, y[idx]

    return sample, info


# --------------------------------------------------------------------------------- models


class MLP(nn.Module):
    width: int
    depth: int
    out: int

    @nn.compact
    def __call__(self, x):
        for _ in range(self.depth):
            x = nn.relu(nn.Dense(self.width)(x))
        return nn.Dense(self.out)(x)


class CNN(nn.Module):
    width: int
    out: int

    @nn.compact
    def __call__(self, x):
        x = x.reshape((-1, 8, 8, 1))
        x = nn.relu(nn.Conv(self.width, (3, 3))(x))
        x = nn.relu(nn.Conv(2 * self.width, (3, 3), strides=2)(x))
        return nn.Dense(self.out)(x.reshape((x.shape[0], -1)))


class Autoencoder(nn.Module):
    width: int
    inputs: int

    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.Dense(self.width)(x))
        z = nn.Dense(8)(h)
        return nn.Dense(self.inputs)(nn.relu(nn.Dense(self.width)(z)))


class GRU(nn.Module):
    width: int
    vocab: int

    @nn.compact
    def __call__(self, ids):
        x = nn.Embed(self.vocab, self.width)(ids)
        x = nn.RNN(nn.GRUCell(self.width))(x)
        return nn.Dense(self.vocab)(x)


class Transformer(nn.Module):
    width: int
    depth: int
    vocab: int
    seq: int

    @nn.compact
    def __call__(self, ids):
        x = nn.Embed(self.vocab, self.width)(ids)
        x = x + self.param("pos", nn.initializers.normal(0.02), (self.seq, self.width))
        mask = nn.make_causal_mask(ids)
        for _ in range(self.depth):
            h = nn.LayerNorm()(x)
            x = x + nn.SelfAttention(num_heads=4, qkv_features=self.width)(h, mask=mask)
            h = nn.LayerNorm()(x)
            x = x + nn.Dense(self.width)(nn.gelu(nn.Dense(4 * self.width)(h)))
        return nn.Dense(self.vocab)(nn.LayerNorm()(x))


def make_model(run: Run, info: dict) -> nn.Module:
    if run.model == "logreg":
        return nn.Dense(info["classes"])
    if run.model == "mlp" and run.data == "text":
        return nn.Sequential([nn.Embed(info["vocab"], run.width), MLP(run.width, 1, info["vocab"])])
    if run.model == "mlp":
        return MLP(run.width, run.depth, info["classes"])
    if run.model == "cnn":
        return CNN(run.width, info["classes"])
    if run.model == "autoencoder":
        return Autoencoder(run.width, info["inputs"])
    if run.model == "gru":
        if run.data == "text":
            return GRU(run.width, info["vocab"])
        return nn.Sequential([lambda x: x[..., None], nn.RNN(nn.GRUCell(run.width)),
                              lambda h: h[:, -1], nn.Dense(info["classes"])])  # fmt: skip
    return Transformer(run.width, run.depth, info["vocab"], info["seq"])


# ------------------------------------------------------------------------ optimizers, loss


def schedule(run: Run) -> optax.Schedule:
    n, lr = run.steps, run.lr
    return {
        "constant": optax.constant_schedule(lr),
        "step": optax.piecewise_constant_schedule(lr, {int(n * 0.5): 0.1, int(n * 0.75): 0.1}),
        "exponential": optax.exponential_decay(lr, n, 0.02),
        "cosine": optax.cosine_decay_schedule(lr, n),
        "warmup_cosine": optax.warmup_cosine_decay_schedule(0.0, lr, n // 20, n),
        "linear": optax.linear_schedule(lr, 0.0, n),
        "warmup_linear": optax.join_schedules(
            [optax.linear_schedule(0.0, lr, n // 10), optax.linear_schedule(lr, 0.0, n - n // 10)],
            [n // 10],
        ),
        "onecycle": optax.cosine_onecycle_schedule(n, lr),
    }[run.schedule]


def optimizer(run: Run) -> optax.GradientTransformation:
    s = schedule(run)
    return {
        "sgd": lambda: optax.sgd(s),
        "momentum": lambda: optax.sgd(s, momentum=0.9),
        "nesterov": lambda: optax.sgd(s, momentum=0.9, nesterov=True),
        "adam": lambda: optax.adam(s),
        "adamw": lambda: optax.adamw(s, weight_decay=1e-2),
        "rmsprop": lambda: optax.rmsprop(s),
        "adagrad": lambda: optax.adagrad(s),
    }[run.optimizer]()


def loss_fn(run: Run, model: nn.Module, info: dict):
    def fn(params, x, y):
        out = model.apply(params, x)
        if run.model == "autoencoder":
            return jnp.mean((out - x) ** 2)
        if info["classes"] == 1:
            return jnp.mean((out.ravel() - y) ** 2)
        return optax.softmax_cross_entropy_with_integer_labels(out, y).mean()

    return fn


def train(run: Run) -> np.ndarray:
    sample, info = make_data(run)
    model = make_model(run, info)
    g = np.random.default_rng(run.seed)
    x0, _ = sample(g)
    params = model.init(jax.random.key(run.seed), x0)
    opt = optimizer(run)
    opt_state = opt.init(params)
    fn = loss_fn(run, model, info)

    @jax.jit
    def step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(fn)(params, x, y)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    losses = np.empty(run.steps, np.float64)
    for i in range(run.steps):
        x, y = sample(g)
        params, opt_state, loss = step(params, opt_state, x, y)
        losses[i] = float(loss)
    return losses


def write_csv(path: Path, losses: np.ndarray) -> None:
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step", "loss"])
        for i, v in enumerate(losses, start=1):
            w.writerow([i, f"{v:.6g}"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", help="run names to (re)generate")
    ap.add_argument("--force", action="store_true", help="regenerate existing curves")
    args = ap.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    split = split_of()
    console = Console()
    runs = [r for r in RUNS + FRESH if not args.only or r.name in args.only]
    for run in runs:
        path = OUT / f"{run.name}.csv"
        if path.exists() and not args.force:
            continue
        t0 = time.perf_counter()
        losses = train(run)
        write_csv(path, losses)
        console.print(
            f"{run.name}: {run.steps} steps in {time.perf_counter() - t0:.0f} s, loss "
            f"{losses[:10].mean():.3g} -> {losses[-100:].mean():.3g}",
            highlight=False,
        )
    with (OUT / "index.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["name", "split", "description"])
        for run in RUNS + FRESH:
            if (OUT / f"{run.name}.csv").exists():
                w.writerow([run.name, split[run.name], run.describe()])
    lines = [
        "# Curves trained here (`benchmarks/make_curves.py`)",
        "",
        "Each CSV is the per-step minibatch training loss of one run, as a trainer logs it",
        "(`step,loss`, 6 significant digits, nothing smoothed). Data ships offline: scikit-learn's",
        "bundled sets (digits, wine, breast_cancer, diabetes), Python's standard-library source as",
        "text for character models, and synthetic tasks (a random teacher network, 5-bit parity).",
        "Inputs get small Gaussian noise per batch. Regenerate with `nice -n 10 python",
        "benchmarks/make_curves.py --force` (same software, same numbers).",
        "",
        f"Split: `index.csv`; {HOLDOUT_SHARE:.0%} of the run names are `holdout`, drawn by",
        f"`numpy.random.default_rng({SPLIT_SEED})` over the sorted names before any curve existed;",
        "no choice in this project was made looking at the holdout curves. The `fresh` runs were",
        "trained after every parameter of `coci` had been fixed, with their own seeds: no choice",
        "(not even `coci`'s horizon range, made seeing the others) has seen them.",
        "",
        "| name | split | run |",
        "|---|---|---|",
        *[f"| {r.name} | {split[r.name]} | {r.describe()} |" for r in RUNS + FRESH],
    ]
    (OUT / "SOURCES.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
