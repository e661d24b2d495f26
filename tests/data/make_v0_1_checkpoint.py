"""Writes tests/data/v0.1-checkpoint/: a checkpoint directory made by cocijax 0.1.0.

It was run once, with the code of main before the package split of issue 9 (commit 2e9fdc2),
as ``python tests/data/make_v0_1_checkpoint.py``; tests/manager/test_compat.py checks that the
current code lists, restores and continues it bit-exact. Do not regenerate it with newer code:
its point is to be old.

Contents: ``managed/`` (a ``cj.CheckpointManager`` directory, data inside the step directories,
a coci policy item, steps 4 and 8) and ``striped/`` (one item saved by the handler over two
roots, ``striped/r0`` and ``striped/r1``, recorded as ``/tmp/cocijax-v0.1/r0`` and ``.../r1``
in its manifest: a restore must be given the roots where they are now).
"""

import shutil
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

import cocijax as cj

HERE = Path(__file__).resolve().parent / "v0.1-checkpoint"
TMP = Path("/tmp/cocijax-v0.1")


def tree(step: int) -> dict:
    return {
        "params": {"w": jnp.arange(24, dtype=jnp.float32).reshape(4, 6) * step, "b": jnp.ones(6)},
        "opt": {"count": jnp.int32(step), "mu": jnp.full((4, 6), 0.5, jnp.bfloat16)},
        "numpy": np.arange(5, dtype=np.int16),
        "meta": {"lr": 0.1, "name": 3, "empty": {}},
    }


def main() -> None:
    shutil.rmtree(HERE, ignore_errors=True)
    shutil.rmtree(TMP, ignore_errors=True)
    policy = cj.policies.coci(mtbf_s=60.0, recovery_s=0.0, total_steps=100)
    with cj.CheckpointManager(HERE / "managed", policy=policy) as mngr:
        for step in range(1, 9):
            mngr.save(step, tree(step), loss=3.0 / step, force=step in (4, 8))
    handler = cj.StripedCheckpointHandler([TMP / "r0", TMP / "r1"], small_bytes=64)
    with ocp.Checkpointer(handler) as ckptr:
        ckptr.save(TMP / "item", args=cj.StripedSave(tree(5)))
    shutil.copytree(TMP, HERE / "striped")
    shutil.rmtree(TMP)


if __name__ == "__main__":
    main()
