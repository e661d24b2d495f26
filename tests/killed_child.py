"""A training job in a child process, killed mid-run: the memory tier's tests of both managers.

The child trains with a two-level policy of its own (level 1 at every step, level 2 at every
4th), saving ``{"w": <size> float32 values, all equal to the step>}`` at each step; it restores
the latest step first if there is one and prints ``restored <step> <tier>``, then ``step <n>``
after each save.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

__all__ = ["run_until_killed"]

_CHILD = textwrap.dedent(
    """
    import sys
    import numpy as np
    import jax, jax.numpy as jnp
    import cocijax as cj

    backend, directory, memory, size = sys.argv[1:4] + [int(sys.argv[4])]

    def update(state, *, step, **_):
        return jnp.where(step % 4 == 0, 2, 1), state

    init = lambda: {"n": jnp.zeros((), jnp.int32)}  # the state of the tests' alternating()
    policy = cj.policies.Policy(init, jax.jit(update), levels=2)
    if backend == "torch":
        import torch
        import cocijax.torch as cjt

        mngr = cjt.CheckpointManager(directory, policy=policy, memory=memory)
        state = lambda step: {"w": torch.full((size,), float(step))}
        restore = lambda: mngr.restore(target={"w": torch.zeros(size)})
    else:
        mngr = cj.CheckpointManager(directory, policy=policy, memory=memory)
        state = lambda step: {"w": np.full(size, step, np.float32)}
        restore = mngr.restore
    step = mngr.latest_step() or 0
    if step:
        restore()
        print("restored", step, mngr.restored_tier, flush=True)
    while True:
        step += 1
        mngr.save(step, state(step), loss=1.0)
        print("step", step, flush=True)
    """
)


def run_until_killed(backend: str, directory, memory, size: int, lines: int) -> list[str]:
    """Runs the child job (``backend``: ``"jax"`` or ``"torch"``), reads ``lines`` lines of its
    output, then SIGKILLs it (at most two minutes of reading: a hang fails the test).

    Returns:
      The lines read.
    """
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, backend, str(directory), str(memory), str(size)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    out = []
    try:
        deadline = time.monotonic() + 120
        while len(out) < lines and time.monotonic() < deadline:
            out.append(child.stdout.readline().strip())
        assert len(out) == lines, out
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=60)
        child.stdout.close()
    return out
