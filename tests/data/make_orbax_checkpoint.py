"""Writes tests/data/orbax-0.12-checkpoint/: directories made by Orbax's own CheckpointManager.

Run once with orbax-checkpoint 0.12.8 as ``python tests/data/make_orbax_checkpoint.py``;
tests/manager/test_from_orbax.py checks that ``cj.CheckpointManager`` lists, restores and
continues them. Do not regenerate them with a newer Orbax: their point is to be 0.12's.

Contents, each a ``ocp.CheckpointManager`` directory as users write them:

* ``standard/``: ``save(step, args=ocp.args.StandardSave(tree))`` (the item ``default``),
  steps 10 and 20, ``max_to_keep=2``;
* ``composite/``: ``Composite(state=StandardSave(tree), config=JsonSave(cfg))``, step 30;
* ``pytree/``: ``Composite(params=PyTreeSave(tree))``, step 40.

``expected.json`` holds each step's tree as lists (the values a restore must return).
"""

import json
import shutil
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

HERE = Path(__file__).resolve().parent / "orbax-0.12-checkpoint"


def tree(step: int) -> dict:
    return {
        "params": {"w": jnp.arange(12, dtype=jnp.float32).reshape(3, 4) * step, "b": jnp.ones(4)},
        "opt": {"count": jnp.int32(step), "mu": jnp.full((3, 4), 0.25, jnp.float32)},
        "step": np.int64(step),
    }


def as_json(t: dict) -> dict:
    return {k: as_json(v) if isinstance(v, dict) else np.asarray(v).tolist() for k, v in t.items()}


def main() -> None:
    shutil.rmtree(HERE, ignore_errors=True)
    expected = {}
    options = ocp.CheckpointManagerOptions(max_to_keep=2)
    with ocp.CheckpointManager(HERE / "standard", options=options) as mngr:
        for step in (5, 10, 20):
            mngr.save(step, args=ocp.args.StandardSave(tree(step)))
            expected[f"standard/{step}"] = as_json(tree(step))
    with ocp.CheckpointManager(HERE / "composite") as mngr:
        args = ocp.args.Composite(
            state=ocp.args.StandardSave(tree(30)), config=ocp.args.JsonSave({"lr": 0.1})
        )
        mngr.save(30, args=args)
        expected["composite/30"] = as_json(tree(30))
    with ocp.CheckpointManager(HERE / "pytree") as mngr:
        mngr.save(40, args=ocp.args.Composite(params=ocp.args.PyTreeSave(tree(40))))
        expected["pytree/40"] = as_json(tree(40))
    (HERE / "expected.json").write_text(json.dumps(expected, indent=1, sort_keys=True))


if __name__ == "__main__":
    main()
