"""The training job of the chaos benchmark: a character-level model of Python's own sources.

``benchmarks/chaos_bench.py`` starts this script, SIGKILLs it at random times and starts it
again; each start resumes from the newest committed checkpoint. It is a plain training script
otherwise, and can be run (and killed) by hand:

    python benchmarks/chaos_job.py --config coci --dir ck --log run.jsonl --steps 3000 --mtbf 30

**The model.** The next character of Python's standard-library sources (the ``*.py`` files
that ship with the interpreter: no download) is predicted from the hashes of the 1- to
6-character contexts before it, each looked up in one shared embedding table (hashed n-gram
embeddings, as in fastText), concatenated and fed to a Flax MLP. The table is large (by default
2^19 buckets of 64 floats, 128 MiB) and so are its Adam moments: with the head's parameters
the state is about 390 MiB, so a save's cost is plainly measurable. A step reads only the
table rows its batch uses, and updates only those rows and their Adam moments (optax's Adam
applied to the gathered rows, "lazy Adam"), in place (the state is donated to the step), so a
step takes tens of milliseconds on two CPU cores although the state is large. The loss falls
fast at first (character frequencies, common words) and slowly later (longer contexts).

**Deterministic.** The batch of step ``s`` is drawn from a generator seeded by ``s``, the state
is restored bit for bit and the step is one compiled XLA program, so a resumed run ends with the
state an uninterrupted one ends with; the ``done`` record carries a digest of the whole state.

**Configurations** (``--config``): ``coci``, ``young``, ``daly`` checkpoint through
``cj.CheckpointManager`` with the policy of that name, given ``--mtbf`` (and ``coci`` the job's
length), and ``--cost-prior`` if set (the save cost assumed until the first save is timed);
``orbax-fixed`` through Orbax's own ``ocp.CheckpointManager`` with
``save_interval_steps=--every``; ``no-failures`` never checkpoints. The failure mix
(``chaos_bench --mix``): ``coci-2level`` and ``young-2level`` save through
``cj.CheckpointManager`` with a memory tier (``--memory``), the local disk and a durable tier
(``--durable``) with the two-level policy of that name, given ``--mtbf`` (process failures) and
``--machine-mtbf``; ``coci-1level`` with ``coci`` (given ``--mtbf``: the MTBF of all failures),
the local disk drained to ``--durable``, no memory tier; ``orbax-fixed`` with ``--durable`` adds
an Orbax manager there, every ``--every-durable`` steps.

**The log** (``--log``, JSON lines, appended and line-buffered so that a SIGKILL loses at most
the line being written). Times are ``time.monotonic()`` seconds, one clock for every process on
the machine (CLOCK_MONOTONIC on Linux), so the supervisor's kill times compare with them:

* ``{"event": "ready", "t", "restored", ...}``: imports, restore and compilation are done;
  training starts (``restored`` is the step resumed from, or null, ``tier`` the tier that
  served it; ``state_mib`` the size of the training state). Also when each phase of the start
  ended: ``imports``, ``open`` (data, model and checkpoint manager set up),
  ``restore`` (or ``init`` in a fresh run) and ``compile``;
* ``{"step", "loss", "t"}`` after every step (the loss is read, so ``t`` is the step's end);
* ``{"event": "save", "step", "t0", "t1", ...}`` after a save that blocked from ``t0`` to ``t1``
  (``level`` 1: not persisted, 2: persisted; for the cocijax manager, with what its policy
  was told: ``mngr.measurements``);
* ``{"event": "commit", "tier", "step", "t"}`` at the end of the first step after a save
  reached the memory tier or the durable tier (``tier``);
* ``{"event": "commit", "step", "t"}`` at the end of the first step after a save's
  background write committed (asked after every step while one is writing);
* ``{"event": "done", "t", "digest"}`` after the last step.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import sysconfig
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx

import cocijax as cj

CONFIGS = ("coci", "young", "daly", "orbax-fixed", "no-failures", "coci-2level",
           "young-2level", "coci-1level")  # fmt: skip
ORDERS = (1, 2, 3, 4, 5, 6)  # context lengths hashed into the table
VOCAB = 97  # printable ASCII (95), newline, everything else
TEXT_CHARS = 4_000_000
JOB_SEED = 0  # the same job for every benchmark seed (seeds draw failure times)


def corpus() -> np.ndarray:
    """Python's standard-library sources as class ids (``int32``), the same on every run."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    raw = np.frombuffer(b"".join(f.read_bytes() for f in files)[:TEXT_CHARS], np.uint8)
    if raw.size < 10_000:
        raise SystemExit(f"chaos_job: too little text under {sysconfig.get_paths()['stdlib']}.")
    printable = (raw >= 32) & (raw < 127)
    return np.where(printable, raw - 31, np.where(raw == 10, 96, 0)).astype(np.int32)


class Head(nnx.Module):
    """The dense part: the concatenated context embeddings to next-character logits."""

    def __init__(self, *, dim: int, hidden: int, rngs: nnx.Rngs):
        self.l1 = nnx.Linear(len(ORDERS) * dim, hidden, rngs=rngs)
        self.l2 = nnx.Linear(hidden, VOCAB, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.l2(nnx.gelu(self.l1(x)))


class Job:
    """The model, its optimisers and its compiled training step."""

    def __init__(self, args: argparse.Namespace, text: np.ndarray):
        self.buckets, self.dim, self.batch = args.buckets, args.dim, args.batch
        self.hidden = args.hidden
        self.text = jnp.asarray(text)
        self.n_text = text.size
        # The module's structure only: its values come from `init` or from a checkpoint.
        self.graphdef, _ = nnx.split(nnx.eval_shape(self._head))
        lr = optax.cosine_decay_schedule(args.lr, args.steps, alpha=0.05)
        self.head_tx = optax.adamw(lr)
        # The table's rows are updated only where the batch uses them ("lazy" Adam): optax's
        # Adam runs on the gathered rows and their gathered moments.
        self.table_tx = optax.adam(lr)

    def _head(self) -> Head:
        return Head(dim=self.dim, hidden=self.hidden, rngs=nnx.Rngs(JOB_SEED))

    def init(self) -> dict:
        """A fresh state (random table and head, zero moments), computed in one compiled call."""

        @jax.jit
        def fresh():
            head = nnx.to_pure_dict(nnx.split(self._head())[1])
            key = jax.random.key(JOB_SEED)
            table = 0.02 * jax.random.normal(key, (self.buckets, self.dim), jnp.float32)
            return {
                "table": table,
                "head": head,
                "table_opt": self.table_tx.init(table),
                "head_opt": self.head_tx.init(head),
            }

        return fresh()

    def abstract(self) -> dict:
        """The state's shapes and dtypes, on the default device (a restore target)."""
        sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        return jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding),
            jax.eval_shape(self.init),
        )

    def positions(self, step: int) -> np.ndarray:
        """The batch of ``step``: positions of the characters to predict, seeded by the step."""
        rng = np.random.default_rng((JOB_SEED, step))
        return rng.integers(max(ORDERS), self.n_text, self.batch).astype(np.int32)

    def compile(self):
        """The training step, compiled ahead of time (part of the recovery, not of a step)."""
        step = jax.jit(self._step, donate_argnums=0)
        pos = jax.ShapeDtypeStruct((self.batch,), jnp.int32)
        return step.lower(self.abstract(), pos).compile()

    def _ids(self, pos: jax.Array) -> jax.Array:
        """Table rows of the contexts before ``pos``: an FNV-style hash per context length."""
        ids = []
        for k in ORDERS:
            h = jnp.full(pos.shape, (k * 0x9E3779B1) % 2**32, jnp.uint32)
            for j in range(1, k + 1):
                h = (h ^ self.text[pos - j].astype(jnp.uint32)) * jnp.uint32(0x01000193)
            ids.append((h % self.buckets).astype(jnp.int32))
        return jnp.stack(ids, -1)

    def _step(self, state: dict, pos: jax.Array):
        ids = self._ids(pos)
        # Unique rows (padded with an out-of-range id that gathers zeros and scatters nowhere):
        # the gradient of a row used twice is summed once, and each row is updated once.
        uniq, inverse = jnp.unique(
            ids.ravel(), size=ids.size, fill_value=self.buckets, return_inverse=True
        )
        rows = state["table"].at[uniq].get(mode="fill", fill_value=0)

        def loss_fn(head, rows):
            x = rows[inverse.reshape(ids.shape)].reshape(pos.shape[0], -1)
            logits = nnx.merge(self.graphdef, head)(x)
            return optax.softmax_cross_entropy_with_integer_labels(logits, self.text[pos]).mean()

        loss, (g_head, g_rows) = jax.value_and_grad(loss_fn, argnums=(0, 1))(state["head"], rows)
        u_head, head_opt = self.head_tx.update(g_head, state["head_opt"], state["head"])
        shape = state["table"].shape
        is_row_leaf = lambda a: getattr(a, "shape", None) == shape
        row_opt = jax.tree.map(
            lambda a: a.at[uniq].get(mode="fill", fill_value=0) if is_row_leaf(a) else a,
            state["table_opt"],
        )
        u_rows, row_opt = self.table_tx.update(g_rows, row_opt, rows)
        table_opt = jax.tree.map(
            lambda a, r: a.at[uniq].set(r, mode="drop") if is_row_leaf(a) else r,
            state["table_opt"],
            row_opt,
        )
        table = state["table"].at[uniq].set(optax.apply_updates(rows, u_rows), mode="drop")
        head = optax.apply_updates(state["head"], u_head)
        return {"table": table, "head": head, "table_opt": table_opt, "head_opt": head_opt}, loss


def digest(tree) -> str:
    """A short SHA-256 of every leaf's bytes."""
    h = hashlib.sha256()
    for leaf in jax.tree.leaves(tree):
        h.update(np.asarray(leaf).tobytes())
    return h.hexdigest()[:16]


class Checkpoints:
    """The configuration's checkpointing: ``latest``, ``restore``, ``save`` (None: no save).

    With ``--durable`` (the failure mix of ``chaos_bench --mix``) a machine failure deletes the
    memory folder and the local directory: the job then restores from the durable path.
    ``orbax-fixed`` gets a second Orbax manager there, saving every ``--every-durable`` steps
    (at those steps instead of the local one): Orbax's own means of surviving the machine.
    """

    def __init__(self, args: argparse.Namespace):
        self.mngr = self.durable = None
        self.pending: dict[str, set[int]] = {"memory": set(), "durable": set()}  # not committed
        self.every_durable = args.every_durable
        self.memory, self.has_durable = args.memory is not None, args.durable is not None
        if args.config == "orbax-fixed":
            self.mngr = self._orbax(args.dir, args.every, args.max_to_keep)
            if args.durable is not None:
                self.durable = self._orbax(args.durable, args.every_durable, args.max_to_keep)
        elif args.config != "no-failures":
            self.mngr = cj.CheckpointManager(
                args.dir,
                policy=policy(args),
                max_to_keep=args.max_to_keep,
                memory=args.memory,
                durable=args.durable,
                durable_max_to_keep=args.max_to_keep if args.durable is not None else None,
            )

    @staticmethod
    def _orbax(directory: Path, every: int, max_to_keep: int) -> ocp.CheckpointManager:
        options = ocp.CheckpointManagerOptions(save_interval_steps=every, max_to_keep=max_to_keep)
        return ocp.CheckpointManager(directory.absolute(), options=options)

    def latest(self) -> int:
        steps = [m.latest_step() for m in (self.mngr, self.durable) if m is not None]
        return max([s for s in steps if s is not None] or [0])

    def restore(self, step: int, abstract: dict) -> tuple[dict, str]:
        """The state of ``step`` and the tier that served it."""
        if isinstance(self.mngr, ocp.CheckpointManager):
            local = self.mngr.latest_step() == step
            mngr = self.mngr if local else self.durable
            state = mngr.restore(step, args=ocp.args.StandardRestore(abstract))
            return state, "local" if local else "durable"
        state = self.mngr.restore(step, target=abstract)
        return state, self.mngr.restored_tier

    def save(self, step: int, state: dict, loss: jax.Array) -> dict | None:
        """Offers ``step`` to the manager; returns the save record when it saved."""
        if self.mngr is None:
            return None
        t0 = time.monotonic()
        if isinstance(self.mngr, ocp.CheckpointManager):
            # With a durable manager: there (level 2) every --every-durable steps, else on the
            # local disk (level 1); without one, its local saves are all it has (level 2).
            durable = self.durable is not None and step % self.every_durable == 0
            level, local = (2 if durable or self.durable is None else 1), not durable
            mngr = self.durable if durable else self.mngr
            saved = mngr.save(step, args=ocp.args.StandardSave(state))
        else:
            saved = self.mngr.save(step, state, loss=loss)
            # A two-level policy's level-1 save goes to the memory tier only (not to Orbax's
            # manager of the disk); every save of a one-level policy is persisted.
            level = 2 if step in self.mngr.orbax.all_steps() else 1
            local = level == 2 or not self.memory
        t1 = time.monotonic()
        if not saved:
            return None
        if self.memory:
            self.pending["memory"].add(step)
        if level == 2 and self.has_durable:
            self.pending["durable"].add(step)
        # "local": whether it went to the local disk (its commit is logged as before the mix).
        record = {"event": "save", "step": step, "t0": t0, "t1": t1, "level": level, "local": local}
        if isinstance(self.mngr, cj.CheckpointManager):
            m = self.mngr.measurements
            record.update(
                step_time_s=m.step_time_s,
                cost_estimate_s=m.cost_estimate_s,
                mtbf_s=m.mtbf_s,
                recovery_s=m.recovery_s,
                failures=m.failures,
                machine_failures=m.machine_failures,
            )
        return record

    def writing(self) -> bool:
        """Whether a save to the local disk is still writing in the background."""
        return self.mngr is not None and self.mngr.is_saving_in_progress()

    def committed(self) -> list[tuple[str, int]]:
        """The saves that reached the memory tier or the durable tier since the last call."""
        done = []
        if self.pending["memory"]:
            listed = set(self.mngr.memory_steps())
            done += [("memory", s) for s in sorted(self.pending["memory"] & listed)]
        if self.pending["durable"]:
            if self.durable is not None:  # orbax-fixed: its durable manager's one save
                listed = set() if self.durable.is_saving_in_progress() else self.pending["durable"]
            else:
                listed = set(self.mngr.durable_steps())
            done += [("durable", s) for s in sorted(self.pending["durable"] & listed)]
            # A drain skips a step once a newer one has committed: it never will.
            newest = max(listed, default=0)
            self.pending["durable"] = {s for s in self.pending["durable"] if s > newest}
        self.pending["memory"] -= {s for tier, s in done if tier == "memory"}
        return done

    def close(self) -> None:
        for mngr in (self.mngr, self.durable):
            if mngr is not None:
                mngr.close()


def policy(args: argparse.Namespace) -> cj.policies.Policy:
    """The cocijax configuration's policy, told the MTBFs (and coci the job's length)."""
    kw = {} if args.cost_prior is None else {"cost_prior_s": args.cost_prior}
    if args.config in ("coci-2level", "young-2level"):
        if args.cost_prior is not None:
            kw["persist_cost_prior_s"] = args.cost_prior
        if args.config == "young-2level":
            return cj.policies.young_two_level(args.mtbf, args.machine_mtbf, **kw)
        return cj.policies.coci_two_level(
            args.mtbf, total_steps=args.steps, machine_mtbf_s=args.machine_mtbf, **kw
        )
    name = "coci" if args.config == "coci-1level" else args.config
    if name == "coci":
        kw["total_steps"] = args.steps
    return cj.policies.by_name(name, mtbf_s=args.mtbf, **kw)


class Log:
    """Appends JSON records, one a line, line-buffered (a kill loses at most one line)."""

    def __init__(self, path: Path):
        self._file = path.open("a", buffering=1)

    def write(self, record: dict) -> None:
        # NaN is not JSON: the few measured values that may be unknown become null.
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                 for k, v in record.items()}  # fmt: skip
        self._file.write(json.dumps(clean, separators=(",", ":")) + "\n")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", choices=CONFIGS, required=True)
    p.add_argument("--dir", type=Path, help="checkpoint directory (not for no-failures)")
    p.add_argument("--log", type=Path, required=True, help="JSON-lines log, appended")
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--mtbf", type=float, help="MTBF in seconds told to cocijax policies")
    p.add_argument("--cost-prior", type=float, help="cost_prior_s of cocijax policies")
    p.add_argument("--every", type=int, help="orbax-fixed: save_interval_steps")
    p.add_argument("--memory", type=Path, help="cocijax configs: the memory tier's folder")
    p.add_argument("--durable", type=Path, help="the durable tier (a path standing for one)")
    p.add_argument("--machine-mtbf", type=float, help="two-level configs: machine MTBF (s)")
    p.add_argument("--every-durable", type=int,
                   help="orbax-fixed with --durable: its durable manager's interval")  # fmt: skip
    p.add_argument("--max-to-keep", type=int, default=2)
    p.add_argument("--buckets", type=int, default=2**19, help="embedding table rows")
    p.add_argument("--dim", type=int, default=64, help="embedding width")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--lr", type=float, default=3e-3)
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error(f"--steps must be >= 1, got {args.steps}")
    if args.config != "no-failures" and args.dir is None:
        p.error(f"--dir is needed for --config {args.config}")
    if args.config in ("coci-2level", "young-2level") and not (
        args.memory and args.machine_mtbf and args.machine_mtbf > 0
    ):
        p.error(f"--memory and a positive --machine-mtbf are needed for {args.config}")
    if args.config == "orbax-fixed" and args.durable and not args.every_durable:
        p.error("--every-durable is needed for orbax-fixed with --durable")
    if args.config not in ("orbax-fixed", "no-failures") and not (
        args.mtbf is not None and math.isfinite(args.mtbf) and args.mtbf > 0
    ):
        p.error(f"--mtbf must be a positive number of seconds for {args.config}, got {args.mtbf}")
    if args.config == "orbax-fixed" and not (args.every and args.every >= 1):
        p.error(f"--every must be a positive step interval for orbax-fixed, got {args.every}")
    return args


def main(argv: list[str] | None = None) -> int:
    phases = {"imports": time.monotonic()}  # the process started, the modules are imported
    args = parse_args(argv)
    log = Log(args.log)
    job = Job(args, corpus())
    ckpt = Checkpoints(args)
    phases["open"] = time.monotonic()
    start = ckpt.latest()
    state, tier = ckpt.restore(start, job.abstract()) if start else (job.init(), None)
    phases["restore" if start else "init"] = time.monotonic()
    train_step = job.compile()
    phases["compile"] = time.monotonic()
    mib = sum(leaf.nbytes for leaf in jax.tree.leaves(state)) / 2**20
    log.write({"event": "ready", "t": phases["compile"], "restored": start or None,
               "tier": tier, "state_mib": round(mib, 1), **phases})  # fmt: skip
    writing = None  # the step whose save is still writing
    for step in range(start + 1, args.steps + 1):
        state, loss = train_step(state, jnp.asarray(job.positions(step)))
        loss_value = float(loss)  # waits for the step: `t` is its end
        log.write({"step": step, "loss": loss_value, "t": time.monotonic()})
        if writing is not None and not ckpt.writing():
            log.write({"event": "commit", "step": writing, "t": time.monotonic()})
            writing = None
        for tier, saved in ckpt.committed():
            log.write({"event": "commit", "tier": tier, "step": saved, "t": time.monotonic()})
        record = ckpt.save(step, state, loss)
        if record is not None:
            if record.pop("local"):
                if writing is not None:  # a save to the disk first waits for the previous one
                    log.write({"event": "commit", "step": writing, "t": record["t1"]})
                writing = step
            log.write(record)
    log.write({"event": "done", "t": time.monotonic(), "digest": digest(state)})
    ckpt.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
