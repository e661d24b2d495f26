"""The run whose crash states ``test_power_loss.py`` checks; it runs under ``strace -f``.

``python _powerloss_writer.py BASE`` opens a :class:`cocijax.CheckpointManager` on ``BASE/ckpt``
with two external roots (``BASE/root0``, ``BASE/root1``) and ``max_to_keep=2``, and saves
:func:`state` at steps 1 to 5: step 1 alone, steps 2 and 3 back to back (the second waits for
the first inside ``save``), steps 4 and 5 alone, then closes. Garbage collection deletes steps
1, 2 and 3 on the way, each followed by a save. After ``wait_until_finished`` returns, the steps
it committed are marked in the trace (``committed/<step>``, see ``crash_states.MARK_PREFIX``):
from that point on the library promises they survive.
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
from reliability_helpers import two_root_manager

STEPS = ((1,), (2, 3), (4,), (5,))
MAX_TO_KEEP = 2
# Small pieces and chunks, so a few hundred KiB make several pieces per root, several chunk
# files per piece, and a packed piece for the small leaves.
HANDLER_OPTIONS = {"small_bytes": 4096, "chunk_bytes": 32 * 1024, "piece_bytes": 64 * 1024}


def state(step: int) -> dict[str, Any]:
    """Five leaves, three of them large enough for pieces of their own, all set by ``step``."""
    rng = np.random.default_rng(step)
    return {
        "params": {
            "kernel": rng.standard_normal((64, 256)).astype(np.float32),
            "bias": rng.standard_normal((256,)).astype(np.float32),
        },
        "opt": {
            "mu": rng.standard_normal((64, 256)).astype(np.float32),
            "nu": rng.random((32, 256)).astype(np.float32),
        },
        "step": np.int64(step),
    }


def open_manager(base: Path) -> Any:
    return two_root_manager(base, max_to_keep=MAX_TO_KEEP, handler_options=HANDLER_OPTIONS)


def mark(name: str) -> None:
    from crash_states import MARK_PREFIX

    with contextlib.suppress(FileNotFoundError):  # it fails: only the trace sees it
        os.close(os.open(MARK_PREFIX + name, os.O_RDONLY))


def main() -> int:
    base = Path(sys.argv[1])
    mngr = open_manager(base)
    mark("opened")
    for group in STEPS:
        for step in group:
            assert mngr.save(step, state(step), loss=1.0, force=True)
        mngr.wait_until_finished()
        for step in group:
            mark(f"committed/{step}")
    mngr.close()
    mark("closed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
