"""Fault injection: SIGKILL a Flax training process at random instants and in every save phase.

Each trial is one run of ``_trainer.py`` on the same checkpoint directory (two roots, async
saves, a save every 2 steps, ``max_to_keep=3`` so garbage collection runs too). A run first
checks what the previous, killed run left (see the trainer's docstring), proves that training
continues and saves again, then arms its fault and is killed. The run after the last trial only
checks. A trial passes when its kill landed and the check after it found no problem, and the
newest step after the kill is at least the newest step the killed run had seen committed.

Phases, hit deterministically by wrapping a function in the trainer's own process (``at``-th call,
kill ``delay_s`` after the call started, so mid-way through it):

* ``train``: in a training step, while the previous async save may still be writing;
* ``d2h``: the device-to-host snapshot that ``save`` blocks on (one array copy of several);
* ``write``: TensorStore writes of the pieces (up to 10 ms into a piece's write);
* ``fsync``: the fsync of a stripe directory, after the writes;
* ``manifest``: the durable write (tmp file, fsync, rename) of a manifest part or the manifest;
* ``merge``: the merge of the manifest parts into the manifest (the handler's ``finalize``);
* ``finalize``: Orbax's commit, the rename of the temporary step directory;
* ``gc``: the removal of the manager's garbage (old steps' stripes, trash), file by file;
* ``random``: the parent kills at a uniformly random instant in the first 1.5 s of an armed
  run that would train much longer (so every kill lands, mostly while saves are in flight).

``COCIJAX_CRASH_TRIALS`` sets the number of trials (default 30, split over two chains that
xdist can run in parallel); ``COCIJAX_CRASH_SEED`` the seed. ``make test`` runs the first chain
(15 trials: every aimed phase once, and 7 random instants), ``make test-long`` the second.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from reliability_helpers import HERE, child_env, ci_share, item_dir, pieces, read_jsonl

TRIALS = int(os.environ.get("COCIJAX_CRASH_TRIALS", "30"))
SEED = int(os.environ.get("COCIJAX_CRASH_SEED", "20261122"))
CHAINS = 2
RANDOM_WINDOW_S = 1.5

# phase -> (function wrapped in the trainer, range of the call that kills, delay range in s).
PHASES: dict[str, tuple[str | list[str], tuple[int, int], tuple[float, float]] | None] = {
    "train": ("__main__:pause", (1, 8), (0.0, 0.01)),
    "d2h": (
        # The snapshot's two host-copy helpers (private functions: every name must exist, or
        # the trainer refuses to run, so a renamed helper fails this test instead of skipping).
        ["cocijax.storage._snapshot:_copy_source", "cocijax.storage._snapshot:_pack_into"],
        (1, 6),
        (0.0, 0.0),
    ),
    # TensorStore writes (compressed pieces) or direct writes of single chunk files.
    "write": (
        ["cocijax.storage._write:write_piece", "cocijax.storage._direct:write_file"],
        (1, 8),
        (0.0, 0.01),
    ),
    # The fsyncs of the piece files, then of their directories.
    "fsync": (
        ["cocijax._files:fsync_file", "cocijax._files:fsync_dir"],
        (1, 6),
        (0.0, 0.002),
    ),
    # One manifest per save (a single process writes it whole): at most 6 saves a run.
    "manifest": ("cocijax.storage._manifest_io:replace_bytes", (1, 4), (0.0, 0.001)),
    "merge": ("cocijax.storage._parts:merge_parts", (1, 4), (0.0, 0.001)),
    "finalize": (
        "orbax.checkpoint._src.path.atomicity:AtomicRenameTemporaryPath.finalize",
        (1, 4),
        (0.0, 0.0),
    ),
    "gc": ("cocijax.manager._gc:_remove_local", (1, 3), (0.0, 0.002)),
    "random": None,
}


def _fault(phase: str, rng: random.Random) -> dict[str, Any] | None:
    spec = PHASES[phase]
    if spec is None:
        return None
    target, (lo, hi), (dlo, dhi) = spec
    return {"target": target, "at": rng.randint(lo, hi), "delay_s": rng.uniform(dlo, dhi)}


def _run(cfg: dict[str, Any], *, kill_after_armed: float | None, timeout: float = 120.0):
    """Runs one trainer; returns (exit status, seconds from ARMED to exit, stderr tail)."""
    proc = subprocess.Popen(
        [sys.executable, str(HERE / "_trainer.py"), json.dumps(cfg)],
        cwd=HERE,
        env=child_env(1, PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    armed_at = None
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.strip() == "ARMED":
                armed_at = time.monotonic()
                if kill_after_armed is not None:
                    time.sleep(kill_after_armed)
                    proc.send_signal(signal.SIGKILL)
                break
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
        raise
    ran = time.monotonic() - armed_at if armed_at is not None else float("nan")
    return proc.returncode, ran, err[-3000:]


@pytest.mark.parametrize("chain", ci_share(range(CHAINS), 1))
def test_sigkill_at_random_instants_loses_nothing_committed(tmp_path: Path, chain: int) -> None:
    rng = random.Random(SEED * 1000 + chain)
    n = TRIALS // CHAINS + (1 if chain < TRIALS % CHAINS else 0)
    phases = list(PHASES)
    # Every targeted phase once per round, interleaved with as many random-instant kills.
    targeted = [p for p in phases if PHASES[p] is not None]
    schedule = [q for p in targeted for q in (p, "random")]
    schedule = schedule[2 * chain :] + schedule[: 2 * chain]
    cfg: dict[str, Any] = {
        "directory": str(tmp_path / "ckpt"),
        "roots": [str(tmp_path / "root0"), str(tmp_path / "root1")],
        "digests": str(tmp_path / "digests.jsonl"),
        "results": str(tmp_path / "results.jsonl"),
        "seed": 7 + chain,
        "width": 512,  # the 512x512 kernels (1 MiB) get pieces of their own, the rest is packed
        "every": 2,
        "max_to_keep": 3,
        "steps": 12,
        "step_sleep_s": 0.01,
        "compilation_cache": str(tmp_path / "jax-cache"),
    }
    trials: list[dict[str, Any]] = []
    committed = 0  # the newest step the previous run saw committed before it was killed
    for i in range(n):
        phase = schedule[i % len(schedule)]
        fault = _fault(phase, rng)
        run = {**cfg, "fault": fault}
        delay = None
        if fault is None:
            # A random instant in the first RANDOM_WINDOW_S of the armed run, which trains for
            # much longer than that, so the kill always lands (while saves are running).
            delay = rng.uniform(0.0, RANDOM_WINDOW_S)
            run["steps"] = 1000
        before = len(read_jsonl(Path(cfg["results"])))
        status, _, err = _run(run, kill_after_armed=delay)
        records = read_jsonl(Path(cfg["results"]))[before:]
        assert records and records[0]["kind"] == "check", f"trial {i} ({phase}): no check: {err}"
        trials.append({"phase": phase, "fault": fault, "delay": delay, "status": status})
        # The check of this run covers the previous trial's kill.
        assert records[0]["problems"] == [], (trials[-2:], records[0])
        assert (records[0]["latest"] or 0) >= committed, (
            f"trial {i}: step {committed} was committed before the kill, but the newest step "
            f"after it is {records[0]['latest']}: {trials[-2:]}"
        )
        committed = max([0] + [r["step"] for r in records if r["kind"] == "committed"])
        resumed = [r for r in records if r["kind"] == "resumed"]
        assert resumed and resumed[0]["listed"], (
            f"trial {i}: training did not continue and save again after the kill: {err}"
        )
        assert status == -signal.SIGKILL, (
            f"trial {i}: phase {phase!r} ({fault}, delay {delay}) was never reached "
            f"(exit {status}): {err}"
        )
    final, _, err = _run(cfg, kill_after_armed=None)
    assert final == 0, err
    last_checks = [r for r in read_jsonl(Path(cfg["results"])) if r["kind"] == "check"]
    assert last_checks[-1]["problems"] == [], last_checks[-1]
    assert (last_checks[-1]["latest"] or 0) >= committed
    assert last_checks[-1]["bit_exact"] is True
    killed = sum(t["status"] == -signal.SIGKILL for t in trials)
    by_phase = {p: sum(t["phase"] == p for t in trials) for p in phases}
    bit_exact = sum(bool(r.get("bit_exact")) for r in last_checks)
    print(
        f"\ncrash consistency chain {chain}: {len(trials)} trials, {killed} killed by SIGKILL, "
        f"per phase {by_phase}; {len(last_checks)} checks, 0 problems, "
        f"{bit_exact} bit-exact restores"
    )


@pytest.mark.long  # a control of the checker, not of cocijax: CI runs the sweep it controls
def test_the_checker_reports_damage(tmp_path: Path) -> None:
    """The trainer's check is what every trial relies on: show that it does find problems."""
    cfg: dict[str, Any] = {
        "directory": str(tmp_path / "ckpt"),
        "roots": [str(tmp_path / "root0"), str(tmp_path / "root1")],
        "digests": str(tmp_path / "digests.jsonl"),
        "results": str(tmp_path / "results.jsonl"),
        "seed": 3,
        "width": 64,
        "every": 2,
        "max_to_keep": 3,
        "steps": 4,
        "compilation_cache": str(tmp_path / "jax-cache"),
    }
    status, _, err = _run(cfg, kill_after_armed=None)
    assert status == 0, err
    # A wrong recorded digest for the newest step, and a deleted piece of an older one.
    with open(cfg["digests"], "a", encoding="utf-8") as f:
        f.write(json.dumps({"step": 4, "digest": "0" * 64}) + "\n")
    older = item_dir(Path(cfg["directory"]), 2)
    victim = pieces(older)[0].path
    shutil.rmtree(victim)
    status, _, err = _run(cfg, kill_after_armed=None)
    assert status == 0, err
    check = [r for r in read_jsonl(Path(cfg["results"])) if r["kind"] == "check"][-1]
    text = "\n".join(check["problems"])
    assert check["bit_exact"] is False and "step 4 restored with digest" in text, text
    assert "step 2 listed but does not verify" in text and victim.name in text, text
