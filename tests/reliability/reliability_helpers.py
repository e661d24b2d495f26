"""Helpers for the reliability tests: subprocesses, free ports, and pieces of checkpoints on disk.

A module of its own (not ``conftest``): test files import it by this unique name.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent


def ci_share(values, keep: int) -> list:
    """``values`` as test parameters: the first ``keep`` run under ``make test`` (CI), the
    others are marked ``long`` and run under ``make test-long``."""
    return [
        v if i < keep else pytest.param(v, marks=pytest.mark.long) for i, v in enumerate(values)
    ]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(devices: int = 1, **extra: str) -> dict[str, str]:
    """Environment of a JAX child process with ``devices`` simulated CPU devices."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    env["JAX_PLATFORMS"] = "cpu"
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"  # keep XLA's start-up chatter out of the test output
    env.update(extra)
    return env


def launch_job(
    worker: str,
    cfg: dict[str, Any],
    n: int,
    *,
    devices: int,
    timeout: float,
    killed: int = -1,
    check: bool = True,
    while_running: Any = None,
) -> list[subprocess.CompletedProcess[str]]:
    """Runs ``n`` processes of the JAX job ``worker`` (a script beside this file) together.

    Each gets ``cfg`` with ``num_processes``, ``process_id`` and a free ``port``, and
    ``devices`` simulated devices. ``while_running`` is called with the processes once they are
    started. A process still running after ``timeout`` fails the test (a hang); with ``check``,
    so does one that exits non-zero (but process ``killed``, which must die of SIGKILL).
    """
    port = free_port()
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(HERE / worker),
                json.dumps({**cfg, "num_processes": n, "process_id": i, "port": port}),
            ],
            env=child_env(devices),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(n)
    ]
    done = []
    try:
        if while_running is not None:
            while_running(procs)
        for i, p in enumerate(procs):
            try:
                out, err = p.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                pytest.fail(f"{worker}: process {i} still runs after {timeout:g} s (a hang)")
            done.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    if check:
        errors = [
            f"process {i} exited {d.returncode}:\n{d.stderr[-4000:]}"
            for i, d in enumerate(done)
            if d.returncode != (-signal.SIGKILL if i == killed else 0)
        ]
        assert not errors, "\n".join(errors)
    return done


def run_script(
    script: str, cfg: dict[str, Any], *, devices: int = 1, timeout: float = 120.0
) -> subprocess.CompletedProcess[str]:
    """Runs ``tests/reliability/<script> CONFIG_JSON`` to completion and returns its result."""
    return subprocess.run(
        [sys.executable, str(HERE / script), json.dumps(cfg)],
        env=child_env(devices),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The complete JSON lines of ``path`` (a line cut by a kill is dropped)."""
    if not path.exists():
        return []
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    return [json.loads(line) for line in lines if line.endswith("\n")]


def item_dir(directory: Path | str, step: int) -> Path:
    """The ``state`` item directory of ``step`` (where its cocijax manifest lives)."""
    from cocijax.manager._directory import STATE_ITEM

    return Path(directory) / str(step) / STATE_ITEM


@dataclasses.dataclass(frozen=True)
class PieceOnDisk:
    """One piece of a committed step as the manifest names it, with its files on disk."""

    leaf: str  # the leaf's key path, as the manifest records it
    relpath: str  # the zarr array directory relative to its root
    path: Path  # the zarr array directory
    index: list[list[int]]  # [start, stop) of the region per dimension
    process: int  # the process the manifest says wrote it

    @property
    def files(self) -> list[Path]:
        return sorted(f for f in self.path.rglob("*") if f.is_file())


def pieces(item: Path) -> list[PieceOnDisk]:
    """Every piece of the item at ``item`` (raises if its manifest is unreadable)."""
    from cocijax import storage

    manifest = storage.read_manifest(item)
    return [
        PieceOnDisk(
            leaf=manifest.leaves[p.leaf].path,
            relpath=p.file,
            path=manifest.piece_path(p, item),
            index=[[a, b] for a, b in zip(p.start, p.stop, strict=True)],
            process=p.process,
        )
        for p in manifest.pieces
    ]


def two_root_manager(base: Path, **kwargs: Any) -> Any:
    """A manager on ``base/ckpt`` striping onto ``base/root0`` and ``base/root1``, saving at
    every step it is asked to (``fixed(1)``); ``kwargs`` go to the manager."""
    import cocijax as cj

    return cj.CheckpointManager(
        base / "ckpt",
        roots=[base / "root0", base / "root1"],
        policy=cj.policies.fixed(1),
        **kwargs,
    )


def orphaned_stripes(mngr: Any) -> list[Path]:
    """Stripe directories on ``mngr``'s roots that none of its listed steps references.

    Worked out from each step's manifest and a listing of the roots, not by the garbage
    collector's own function, which is what this checks.
    """
    from cocijax.storage._stripes import find_stripe_dirs, referenced_stripe_dirs

    mngr.wait_until_finished()  # removals of garbage run in a thread of their own
    referenced = {
        p.resolve()
        for step in mngr.all_steps()
        for p in referenced_stripe_dirs(mngr.item_directory(step))
    }
    on_disk = {p.resolve() for r in mngr.stripe_roots for p in find_stripe_dirs(r)}
    return sorted(on_disk - referenced)


def require_tool(name: str, why: str) -> str:
    """The path of system tool ``name``; skips the test without it, except under CI.

    ``make test`` installs the tools these tests need where it can (root and apt-get); CI runs as
    root, so there a missing tool is a failure, never a silent skip.
    """
    import shutil

    import pytest

    path = shutil.which(name)
    if path is None:
        reason = f"{name} is not installed ({why}); `make test` installs it as root with apt-get"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"CI must run this test: {reason}")
        pytest.skip(reason)
    return path
