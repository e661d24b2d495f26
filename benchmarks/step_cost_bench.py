"""What a training step that does not save costs: cocijax against Orbax, side by side.

A real loop calls ``save`` after every step, and most steps do not save, so the cost of those
calls is paid at every step. Measured here, in one run and interleaved (blocks of steps taking
turns, medians of the per-call times):

* ``ocp.CheckpointManager.save`` on steps its ``save_interval_steps`` skips (the baseline);
* ``cj.CheckpointManager.save`` with ``fixed``, ``young`` and ``coci`` policies, on steps they
  do not save (policies set up so that none saves during the measurement), and with ``coci``
  given ``extra`` (a JSON config's save args, built at every call) and ``metrics`` at every
  call, as a real loop passes them; for scale, building an ``ocp.args.StandardSave`` of the
  state (Orbax's constructor walks the tree: build such args once, outside the loop);
* the loop of the README over a policy alone: ``cj.policies.Runner.update``, and, for
  comparison, ``policy.update`` called directly and branched on (``bool(save)``).

Every call gets the step's loss as an unfinished ``jax.Array``, as a training loop has it.

Run: ``python benchmarks/step_cost_bench.py [--steps 3000] [--write]``.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from _report import cpu_and_ram, write_section
from rich.console import Console
from rich.table import Table

import cocijax as cj

SECTION = "step_cost_bench"
NEVER_S = 1e12  # an MTBF so long that no policy saves during the measurement
BLOCK = 100


def policies() -> dict[str, cj.policies.Policy]:
    return {
        "fixed": cj.policies.fixed(10**9),
        "young": cj.policies.young(NEVER_S, cost_prior_s=1.0),
        "coci": cj.policies.coci(NEVER_S, 0.0, cost_prior_s=1.0),
    }


def contenders(root: Path, state) -> dict[str, Callable[[int, jax.Array], object]]:
    """Name -> a function called once per training step."""
    out = {}
    orbax = ocp.CheckpointManager(
        root / "orbax", options=ocp.CheckpointManagerOptions(save_interval_steps=10**9)
    )
    orbax.save(0, args=ocp.args.StandardSave(state))  # step 0 is saved: the rest are skipped
    orbax.wait_until_finished()
    out["orbax CheckpointManager.save"] = lambda s, loss: orbax.save(
        s, args=ocp.args.StandardSave(state)
    )
    for name, policy in policies().items():
        mngr = cj.CheckpointManager(root / name, policy=policy)
        out[f"cj.CheckpointManager.save ({name})"] = lambda s, loss, m=mngr: m.save(
            s, state, loss=loss
        )
    coci = cj.CheckpointManager(root / "coci-extra", policy=policies()["coci"])
    config = {"lr": 1e-3, "layers": [256, 256]}

    def with_extra(s, loss, m=coci):
        # What a loop builds at every step: new args objects, a metrics dict.
        extra = {"config": ocp.args.JsonSave(config)}
        return m.save(s, state, loss=loss, extra=extra, metrics={"eval_acc": 0.5})

    out["cj.CheckpointManager.save (coci, extra+metrics)"] = with_extra
    out["ocp.args.StandardSave(state), built"] = lambda s, loss: not ocp.args.StandardSave(state)
    for name, policy in policies().items():
        runner = cj.policies.Runner(policy)
        runner.compile()
        out[f"Runner.update ({name})"] = lambda s, loss, r=runner: r.update(
            s, loss=loss, step_time_s=1.0, checkpoint_cost_s=1.0
        )
    coci = policies()["coci"]
    box = [coci.init()]

    def direct(s, loss):
        save, box[0] = coci.update(
            box[0], step=s, loss=loss, step_time_s=1.0, checkpoint_cost_s=1.0
        )
        return bool(save)

    out["policy.update + bool() (coci)"] = direct
    return out


def measure(steps: int) -> dict[str, list[float]]:
    state = {"w": jnp.ones((256, 256)), "b": jnp.zeros(256), "step": jnp.int32(0)}
    make_loss = jax.jit(lambda x: jnp.sum(x) * 1e-6)
    with tempfile.TemporaryDirectory() as tmp:
        calls = contenders(Path(tmp), state)
        times: dict[str, list[float]] = {name: [] for name in calls}
        step = {name: 0 for name in calls}
        for _ in range(2):  # warm-up: compilation, first calls
            for name, call in calls.items():
                step[name] += 1
                call(step[name], make_loss(state["w"]))
        for _ in range(steps // BLOCK):
            for name, call in calls.items():  # interleaved blocks
                for _ in range(BLOCK):
                    step[name] += 1
                    loss = make_loss(state["w"])  # an unfinished array, as after a train step
                    t0 = time.perf_counter()
                    saved = call(step[name], loss)
                    times[name].append(time.perf_counter() - t0)
                    assert not saved, f"{name} saved at step {step[name]}: the setup is wrong"
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3000, help="measured calls per contender")
    ap.add_argument("--write", action="store_true", help="record the table in BENCHMARKS.md")
    args = ap.parse_args()
    times = measure(args.steps)
    base = statistics.median(times["orbax CheckpointManager.save"])
    table = Table(title=f"cost of a step that does not save ({args.steps} calls each, interleaved)")
    for col in ("call", "median µs", "mean µs", "p90 µs", "vs Orbax (median)"):
        table.add_column(col, justify="left" if col == "call" else "right")
    rows = []
    for name, t in times.items():
        med, p90 = statistics.median(t) * 1e6, float(np.quantile(t, 0.9)) * 1e6
        mean = statistics.fmean(t) * 1e6  # includes the rare check steps' dispatches
        rows.append((name, f"{med:.1f}", f"{mean:.1f}", f"{p90:.1f}", f"{med / (base * 1e6):.2f}x"))
        table.add_row(*rows[-1])
    console = Console(width=120)
    console.print(table)
    if not args.write:
        return
    lines = [
        "## Cost of a step that does not save (`benchmarks/step_cost_bench.py`)",
        "",
        f"Machine: {cpu_and_ram()}; {datetime.date.today().isoformat()}; jax {jax.__version__}, "
        f"orbax-checkpoint {ocp.__version__}.",
        f"Command: `python benchmarks/step_cost_bench.py --steps {args.steps} --write`; "
        f"interleaved blocks of {BLOCK} calls, the loss an unfinished `jax.Array` each time.",
        "",
        "| call | median µs | mean µs | p90 µs | vs Orbax (median) |",
        "|---|---|---|---|---|",
        *[f"| {' | '.join(r)} |" for r in rows],
    ]
    write_section(SECTION, "\n".join(lines))


if __name__ == "__main__":
    main()
