"""A training process for the crash-consistency tests: it checks, trains, saves and gets killed.

Run as ``python _trainer.py CONFIG_JSON``. One run does, in order:

1. opens a :class:`cocijax.CheckpointManager` on the directory a previous (killed) run left and
   checks it: every listed step has a valid manifest and verifies clean, the newest step restores
   bit-exact to the digest recorded before it was saved, and no stripe directory is left that no
   listed step references. The findings go to the results file as one JSON line (fsync'd, so a
   later kill cannot lose them);
2. trains from the restored state, saving with the manager's policy, until one new save is
   committed (``wait_until_finished``), and records that it resumed;
3. arms the fault (see below), prints ``ARMED`` and keeps training and saving until it is killed
   or reaches its last step.

Before every ``save`` the digest of the state (sha256 over every leaf's dtype, shape and bytes in
tree order) is appended to the digests file and fsync'd, keyed by step: the checker can then
compare a restored step bit for bit whatever instant the kill hit. After every ``save`` call the
newest committed step is recorded when it changed, so the test can tell whether a kill lost a
committed step.

Faults (``cfg["fault"]``) make a kill land in a chosen phase deterministically: the named
function (``"module:Attr.attr"``) is wrapped in this process only, and on its ``at``-th call the
process SIGKILLs itself, ``delay_s`` seconds after the call started (from a timer thread, so the
original function is mid-way) or before calling it when ``delay_s`` is 0. Random-instant kills
come from the parent test instead.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import inspect
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any


def _append_line(path: str, record: dict[str, Any]) -> None:
    """Appends one JSON line and fsyncs it: a SIGKILL right after must not lose the record."""
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _resolve(target: str) -> tuple[Any, str]:
    """``"pkg.mod:Cls.meth"`` -> (owner object, attribute name)."""
    module_name, _, qualname = target.partition(":")
    owner: Any = importlib.import_module(module_name)
    *parents, attr = qualname.split(".")
    for name in parents:
        owner = getattr(owner, name)
    return owner, attr


def arm_fault(fault: dict[str, Any]) -> None:
    """Wraps the fault's targets so that their ``at``-th call (counted together) kills us.

    ``fault["target"]`` is one ``"module:Attr.attr"`` or a list of them; targets that do not
    exist are skipped (a refactoring may rename one), but at least one must exist.
    """
    targets = fault["target"] if isinstance(fault["target"], list) else [fault["target"]]
    at = int(fault["at"])
    delay_s = float(fault.get("delay_s", 0.0))
    calls = [0]
    lock = threading.Lock()

    def die() -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    def maybe_kill() -> None:
        with lock:
            calls[0] += 1
            hit = calls[0] == at
        if not hit:
            return
        if delay_s <= 0:
            die()
        timer = threading.Timer(delay_s, die)
        timer.daemon = True
        timer.start()

    for target in targets:
        try:
            owner, attr = _resolve(target)
            original = getattr(owner, attr)
        except (ImportError, AttributeError) as e:
            # Every target must exist: a kill aimed at a renamed function would never land.
            raise AttributeError(f"fault: {target} does not exist ({e})") from e
        setattr(owner, attr, _wrap(original, maybe_kill))


def _wrap(original: Any, before: Any) -> Any:
    if inspect.iscoroutinefunction(original):

        @functools.wraps(original)
        async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
            before()
            return await original(*args, **kwargs)

        return async_wrapper

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        before()
        return original(*args, **kwargs)

    return wrapper


def tree_digest(tree: Any) -> str:
    """sha256 over the tree structure and every leaf's dtype, shape and bytes, in tree order."""
    import jax
    import numpy as np

    leaves, treedef = jax.tree.flatten(tree)
    h = hashlib.sha256(str(treedef).encode())
    for leaf in leaves:
        a = np.asarray(leaf)
        h.update(f"{a.dtype.str}{a.shape}".encode())
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def recorded_digests(path: str) -> dict[int, str]:
    """Step -> the digest recorded last for it (a rerun of a step after a kill overrides)."""
    out: dict[int, str] = {}
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            for line in f:
                if line.endswith("\n"):  # a line cut by the kill was never fsync'd: skip it
                    rec = json.loads(line)
                    out[int(rec["step"])] = rec["digest"]
    return out


def build(seed: int, width: int):
    """A small Flax MLP with Adam: returns (initial state, jitted train step, batch function)."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import optax

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.relu(nn.Dense(width)(x))
            x = nn.relu(nn.Dense(width)(x))
            return nn.Dense(10)(x)

    model = MLP()
    tx = optax.adam(1e-3)

    @jax.jit
    def init():
        # One jitted init compiles once (and hits the persistent cache in later runs) instead
        # of compiling every initializer op eagerly.
        params = model.init(jax.random.key(seed), jnp.zeros((1, 64), jnp.float32))
        return {"params": params, "opt_state": tx.init(params), "step": jnp.zeros((), jnp.int32)}

    state = init()

    def batch(step: int):
        # Data depends on the step only, so a rerun after a restore sees the same batches.
        kx, ky = jax.random.split(jax.random.fold_in(jax.random.key(seed + 1), step))
        return jax.random.normal(kx, (32, 64)), jax.random.randint(ky, (32,), 0, 10)

    @jax.jit
    def train_step(state, x, y):
        def loss_fn(p):
            logits = model.apply(p, x)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        loss, grads = jax.value_and_grad(loss_fn)(state["params"])
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        return {"params": params, "opt_state": opt_state, "step": state["step"] + 1}, loss

    return state, train_step, batch


def newest_committed_on_disk(mngr: Any) -> int:
    """The newest step whose final directory holds a valid manifest (0 if none).

    Read from disk: ``latest_step()`` already lists a step whose async save is still running.
    """
    from cocijax import storage

    for step in sorted(mngr.all_steps(), reverse=True):
        try:
            storage.read_manifest(mngr.item_directory(step))
        except (ValueError, OSError):
            continue
        return step
    return 0


def pause(seconds: float) -> None:
    """Stands for the rest of a training step (data loading, logging); a fault target."""
    time.sleep(seconds)


def check(mngr: Any, cfg: dict[str, Any], abstract: Any) -> tuple[dict[str, Any], Any]:
    """The invariants a crash must not break; returns (findings, restored state or None)."""
    from cocijax import storage
    from cocijax.storage._records import STRIPE_PREFIX
    from cocijax.storage._stripes import referenced_stripe_dirs

    # The opening found the garbage; its removal runs in a thread of its own: wait for it.
    mngr.wait_until_finished()
    steps = list(mngr.all_steps())
    latest = mngr.latest_step()
    findings: dict[str, Any] = {"kind": "check", "steps": steps, "latest": latest, "problems": []}
    problems = findings["problems"]
    referenced: set[Path] = set()
    for step in steps:
        item = mngr.item_directory(step)
        try:
            storage.read_manifest(item)
        except ValueError as e:
            problems.append(f"step {step} listed but its manifest is unreadable: {e}")
            continue
        bad = storage.verify(item)
        if bad:
            problems.append(f"step {step} listed but does not verify: {bad}")
        referenced |= {p.resolve() for p in referenced_stripe_dirs(item)}
    on_disk = {
        p.resolve()
        for root in cfg["roots"]
        for p in Path(root).rglob(f"{STRIPE_PREFIX}*")
        if p.is_dir()
    }
    orphans = sorted(str(p) for p in on_disk - referenced)
    missing = sorted(str(p) for p in referenced - on_disk)
    if orphans:
        problems.append(f"stripe directories no listed step references: {orphans}")
    if missing:
        problems.append(f"stripe directories referenced but absent: {missing}")
    findings["stripe_dirs"] = len(on_disk)
    restored = None
    if latest is not None:
        restored = mngr.restore(latest, target=abstract)
        want = recorded_digests(cfg["digests"]).get(latest)
        got = tree_digest(restored)
        findings["bit_exact"] = want == got
        if want != got:
            problems.append(f"step {latest} restored with digest {got}, recorded {want}")
    return findings, restored


def main() -> int:
    cfg = json.loads(sys.argv[1])
    import jax

    if cfg.get("compilation_cache"):
        # Trials are separate processes: a shared on-disk cache saves recompiling every run.
        jax.config.update("jax_compilation_cache_dir", cfg["compilation_cache"])
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

    import cocijax as cj

    state, train_step, batch = build(cfg["seed"], cfg["width"])
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), state)
    mngr = cj.CheckpointManager(
        cfg["directory"],
        roots=cfg["roots"],
        policy=cj.policies.fixed(cfg["every"]),
        max_to_keep=cfg["max_to_keep"],
        # Leaves of 1 MiB and more get pieces of their own, as the test's width intends: with
        # the default (packs up to 8 MiB) this state is two packs and nothing else, and no kill
        # would land in the writes of an unpacked piece.
        handler_options={"small_bytes": 1 << 20},
    )
    findings, restored = check(mngr, cfg, abstract)
    findings["pid"] = os.getpid()
    _append_line(cfg["results"], findings)
    if restored is not None:
        state = restored
    start = int(findings["latest"] or 0)
    armed = False
    resumed_at = None
    newest_seen = start
    for step in range(start + 1, start + 1 + cfg["steps"]):
        x, y = batch(step)
        state, loss = train_step(state, x, y)
        pause(cfg.get("step_sleep_s", 0.0))
        _append_line(cfg["digests"], {"step": step, "digest": tree_digest(state)})
        saved = mngr.save(step, state, loss=loss)
        if saved and not armed and resumed_at is None:
            # The first save after a restart must commit before any fault is armed: this is the
            # "training continues and saves again" check of the previous kill.
            mngr.wait_until_finished()
            resumed_at = step
            _append_line(
                cfg["results"],
                {"kind": "resumed", "step": step, "listed": step in mngr.all_steps()},
            )
            if cfg.get("fault"):
                arm_fault(cfg["fault"])
            armed = True
            print("ARMED", flush=True)
        newest = newest_committed_on_disk(mngr)
        if newest > newest_seen:
            # Committed now: no later crash may lose it (the next run's check compares).
            newest_seen = newest
            _append_line(cfg["results"], {"kind": "committed", "step": newest})
    mngr.wait_until_finished()
    mngr.close()
    _append_line(cfg["results"], {"kind": "done", "last_step": start + cfg["steps"]})
    print("DONE", flush=True)
    return 0


if __name__ == "__main__":
    status = main()
    sys.stdout.flush()
    # Everything that matters is closed and fsync'd; skip the ~1 s interpreter teardown.
    os._exit(status)
