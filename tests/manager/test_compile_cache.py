"""``compilation_cache=``: a restarted job loads its compiled training step from a folder kept
beside the checkpoint (JAX's persistent compilation cache), in real separate processes.

The suite sets a compilation cache of its own for every process (tests/conftest.py); the
children here run without it, as a user's job would.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

import cocijax as cj
from cocijax.cli._inspect import find_steps

# One run of a job: open the manager, restore, compile and run the training step, save, close.
# Prints JAX's cache lookups for the step (its log), the cache folder in use, the warnings.
_JOB = textwrap.dedent(
    """
    import json, logging, sys, warnings
    import jax, jax.numpy as jnp
    import cocijax as cj

    directory, cache = sys.argv[1], json.loads(sys.argv[2])

    class Found(logging.Handler):  # JAX logs each lookup of its cache (at DEBUG level)
        lookups = []

        def emit(self, record):
            message = record.getMessage()
            if "'jit_train_step'" in message and "compilation cache" in message.lower():
                self.lookups.append("hit" if " hit " in message else "miss")

    compiler_log = logging.getLogger("jax._src.compiler")
    compiler_log.setLevel(logging.DEBUG)
    compiler_log.addHandler(Found())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mngr = cj.CheckpointManager(
            directory, policy=cj.policies.fixed(1), compilation_cache=cache
        )
    # Placed as a restore places it: an uncommitted array compiles to another program.
    state = jax.device_put({"w": jnp.arange(8.0), "b": jnp.ones(3)}, jax.devices()[0])
    if mngr.latest_step() is not None:
        state = mngr.restore()

    @jax.jit
    def train_step(params):
        loss, grads = jax.value_and_grad(
            lambda p: sum(jnp.sum(x**2) for x in jax.tree.leaves(p))
        )(params)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), loss

    compiled = train_step.lower(state).compile()
    state, loss = compiled(state)
    step = (mngr.latest_step() or 0) + 1
    mngr.save(step, state, loss=float(loss))
    mngr.close()
    print(json.dumps({
        "lookups": Found.lookups,
        "cache_dir": jax.config.jax_compilation_cache_dir,
        "warnings": [str(w.message) for w in caught],
        "steps": mngr.all_steps(),
    }))
    """
)


def _run(directory, cache, **env):
    """One run of the job in a fresh process, without the suite's compilation cache."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("JAX_PERSISTENT_CACHE")}
    clean.pop("JAX_COMPILATION_CACHE_DIR", None)
    proc = subprocess.run(
        [sys.executable, "-c", _JOB, str(directory), json.dumps(cache)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**clean, **env},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("where", ["beside", "folder"])
def test_a_restart_loads_its_compiled_training_step_from_the_cache(tmp_path, where):
    directory = tmp_path / "ckpt"
    folder = directory / ".cocijax-compile-cache" if where == "beside" else tmp_path / "cache"
    cache = True if where == "beside" else str(folder)
    first = _run(directory, cache)
    assert first["cache_dir"] == str(folder)
    assert first["lookups"] == ["miss"]  # compiled, then written
    assert any(folder.iterdir())
    second = _run(directory, cache)
    assert second["lookups"] == ["hit"]  # loaded, not compiled
    # The cache folder is not a step: not listed, not a foreign entry for the CLI.
    assert second["steps"] == [1, 2]
    assert [s.step for s in find_steps(directory)] == [1, 2]
    with cj.CheckpointManager(directory, policy=cj.policies.fixed(1)) as mngr:
        assert mngr.all_steps() == [1, 2]


def test_a_cache_folder_the_user_set_is_kept_with_a_warning(tmp_path):
    theirs = tmp_path / "theirs"
    run = _run(tmp_path / "ckpt", True, JAX_COMPILATION_CACHE_DIR=str(theirs))
    assert run["cache_dir"] == str(theirs)
    assert any("set already" in w and str(theirs) in w for w in run["warnings"]), run
    assert any(theirs.iterdir())
    assert not (tmp_path / "ckpt" / ".cocijax-compile-cache").exists()


def test_without_the_option_the_manager_sets_no_cache(tmp_path):
    run = _run(tmp_path / "ckpt", None)
    assert run["cache_dir"] is None
    assert [p.name for p in (tmp_path / "ckpt").iterdir() if "compile" in p.name] == []


def test_a_compilation_cache_of_the_wrong_type_is_refused_before_anything_is_made(tmp_path):
    with pytest.raises(TypeError, match="compilation_cache: expected True, a folder"):
        cj.CheckpointManager(tmp_path / "ckpt", compilation_cache=3)
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize("inside", [".", "xla"])
def test_a_cache_folder_that_is_the_directory_or_inside_it_is_refused(tmp_path, inside):
    # Found by the dataloss review: JAX's files there made the directory's next opening refuse
    # it ("not written by cocijax"), so the job could not restart from its steps.
    with pytest.raises(ValueError, match=r"compilation_cache=.* lies inside it.*=True"):
        cj.CheckpointManager(tmp_path / "ckpt", compilation_cache=tmp_path / "ckpt" / inside)
