"""Aimed libfiu faults, each at the one call that decides something irreversible.

Run by ``test_io_errors.py`` under ``fiu-run -x``; prints one JSON line per scenario. Each was
found by the random trials (``_fiu_worker.py``) as a listed step that lost its data or a step
Orbax counted although it had no manifest; here the fault is certain, so a regression cannot
hide behind the odds:

* ``gc-open-enoent``: every ``open`` fails with ENOENT while garbage collection asks which
  stripes the committed steps reference. A manifest that exists but cannot be opened is
  "unknown", never "not committed": nothing may be collected.
* ``merge-opendir-eacces``: every ``opendir`` fails with EACCES while the handler's finalize
  merges the manifest parts. ``Path.glob`` answers "no parts" to that; the merge must raise
  instead, or Orbax commits the step without a manifest.
"""

from __future__ import annotations

import errno
import json
import shutil
import sys
import traceback
from pathlib import Path
from typing import Any

import orbax.checkpoint as ocp
from _fiu_worker import Fiu, exit_after, open_manager, state

import cocijax as cj
from cocijax import storage
from cocijax.storage import _parts
from cocijax.storage._records import MANIFEST_NAME


def gc_open_enoent(base: Path, fiu: Fiu) -> dict[str, Any]:
    with open_manager(base) as mngr:
        for step in (1, 2):
            mngr.save(step, state(step), loss=1.0, force=True)
        mngr.wait_until_finished()
        items = [mngr.item_directory(s) for s in mngr.all_steps()]
        stripe_roots = mngr.stripe_roots
    fiu.fail("posix/io/oc/open", errno.ENOENT)
    try:
        garbage = storage.unreferenced_stripe_dirs(stripe_roots, items)
    finally:
        fiu.disable(("posix/io/oc/open",))
    return {
        "garbage": None if garbage is None else [str(p) for p in garbage],
        "intact": [storage.verify(item) == [] for item in items],
    }


def merge_opendir_eacces(base: Path, fiu: Fiu) -> dict[str, Any]:
    item = base / "item"
    with ocp.Checkpointer(cj.StripedCheckpointHandler(roots=[base / "root"])) as ckptr:
        ckptr.save(item, args=cj.StripedSave(state(1)))
    # The state of an item between the commit future and finalize: one part, no manifest.
    (item / MANIFEST_NAME).rename(_parts.part_path(item, 0))
    out: dict[str, Any] = {}
    fiu.fail("posix/io/dir/opendir", errno.EACCES)
    try:
        _parts.merge_parts(item)
        out["merge"] = "returned"
    except Exception as e:
        out["merge"] = f"{type(e).__name__}: {e}"
    finally:
        fiu.disable(("posix/io/dir/opendir",))
    out["manifest_after_fault"] = (item / MANIFEST_NAME).exists()
    _parts.merge_parts(item)  # faults off: the merge the failed finalize did not do
    out["verifies_after_merge"] = storage.verify(item) == []
    shutil.rmtree(item)
    return out


def main() -> int:
    top = Path(sys.argv[1])
    fiu = Fiu()
    for name, scenario in (
        ("gc-open-enoent", gc_open_enoent),
        ("merge-opendir-eacces", merge_opendir_eacces),
    ):
        base = top / name
        base.mkdir()
        try:
            record = {"scenario": name, **scenario(base, fiu)}
        except Exception as e:
            record = {"scenario": name, "crashed": "".join(traceback.format_exception(e))[-3000:]}
        print(json.dumps(record), flush=True)
    return 0


if __name__ == "__main__":
    exit_after(main)
