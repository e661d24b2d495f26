"""Fuzzed manifests and policy items: a damaged document is refused, never half believed.

Hypothesis mutates the JSON that cocijax writes next to the data of a real save: truncated
text, a flipped bit, a field dropped or given another type, a plausible change (a number off by
one, another dtype, a boolean negated), huge numbers, NaN, deep nesting. Then:

* ``read_manifest`` returns or raises :class:`CheckpointFormatError`; "committed" (what the
  manager lists) is the same answer and never raises.
* A restore from the mutated manifest raises ``CheckpointFormatError`` or
  ``CorruptCheckpointError``, or returns exactly the saved tree (bit for bit), with and without
  a target: the manifest's digest catches what still parses (a changed inline value, dtype or
  region). A manifest written before digests existed (the digest removed) still restores
  unchanged; mutated, it raises one of those two errors or returns a tree, never another
  exception (what it cannot catch is the reason for the digest).
* A mutated policy item never fails a manager's open or restore: the manager warns and starts
  its schedule fresh (or continues it when the change was harmless), the state restores bit
  for bit, and the next save commits.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cocijax as cj
from cocijax import storage
from cocijax.manager._directory import is_committed
from cocijax.storage._records import MANIFEST_NAME

ODD_VALUES = st.sampled_from(
    [None, True, -1, 0, 2**64, 10**400, 1e308, float("nan"), float("inf"), "x", [], {}, [[[]]]]
)
KINDS = ["truncate", "flip", "field", "drop", "plausible", "nest"]
# Examples per manifest test; the policy-item test, which opens a manager each time, runs 30 %
# of that. COCIJAX_FUZZ_EXAMPLES raises both for a long run.
EXAMPLES = int(os.environ.get("COCIJAX_FUZZ_EXAMPLES", "200"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
HANDLER = {"small_bytes": 64, "piece_bytes": 4096, "chunk_bytes": 1024}


def _tree() -> dict[str, Any]:
    """Every leaf kind the handler saves, arrays in several pieces and chunks."""
    return {
        "w": np.arange(2048, dtype=np.float32).reshape(32, 64),
        "j": jnp.arange(40, dtype=jnp.int32),
        "key": jax.random.key(7),
        "s": np.float32(2.5),
        "step": 3,
        "lr": 0.1,
        "flag": True,
        "name": "run",
        "none": None,
        "empty": {},
        "list": [np.ones(3, np.int8), 7],
    }


def _restore(item: Path, target: Any = None) -> Any:
    with ocp.Checkpointer(cj.StripedCheckpointHandler()) as ckptr:
        return ckptr.restore(item, args=cj.StripedRestore(target))


def _bits(tree: Any) -> list[tuple[str, Any]]:
    """A comparable form of a restored tree: structure, types, dtypes, shapes and bytes."""
    out = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: x is None)[0]:
        if isinstance(leaf, jax.Array) and jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            leaf = jax.random.key_data(leaf)
        if isinstance(leaf, jax.Array | np.ndarray | np.generic):
            a = np.asarray(leaf)
            value: Any = (type(leaf).__name__, a.dtype.str, a.shape, a.tobytes())
        else:
            value = (type(leaf).__name__, repr(leaf))
        out.append((jax.tree_util.keystr(path), value))
    return out


class Quiet(dict):
    """A fixture's values, with a short repr (hypothesis prints the arguments of a failure)."""

    def __repr__(self) -> str:
        return f"<{', '.join(self)}>"


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    base = tmp_path_factory.mktemp("fuzz")
    item = base / "1" / "state"  # laid out like a manager's step
    with ocp.Checkpointer(cj.StripedCheckpointHandler(roots=[base / "root"], **HANDLER)) as ck:
        ck.save(item, args=cj.StripedSave(_tree()))
    text = (item / MANIFEST_NAME).read_text()
    return Quiet(
        item=item,
        text=text,
        doc=json.loads(text),
        as_saved=_bits(_restore(item)),
        into_target=_bits(_restore(item, _tree())),
    )


def _paths(value: Any, prefix: tuple = ()) -> list[tuple]:
    out = [prefix]
    if isinstance(value, dict):
        for k, v in value.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += _paths(v, (*prefix, i))
    return out


def _get(doc: Any, path: tuple) -> Any:
    for key in path:
        doc = doc[key]
    return doc


def _set(doc: Any, path: tuple, value: Any, drop: bool) -> Any:
    if not path:
        return value
    parent = _get(doc, path[:-1])
    if drop:
        del parent[path[-1]]
    else:
        parent[path[-1]] = value
    return doc


def _plausible(value: Any) -> Any:
    """A change that still parses and type-checks: the dangerous kind."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1 if value < 2**63 else value - 1
    if isinstance(value, float):
        return value * 2 + 1
    if isinstance(value, str):
        return "int32" if value == "float32" else "float32" if value == "int32" else value + "x"
    return value


def mutate(draw: Any, doc: dict[str, Any]) -> str:
    """The text of ``doc`` after one random mutation."""
    kind = draw(st.sampled_from(KINDS))
    text = json.dumps(doc)
    if kind == "truncate":
        return text[: draw(st.integers(0, len(text) - 1))]
    if kind == "flip":
        i = draw(st.integers(0, len(text) - 1))
        return text[:i] + chr(ord(text[i]) ^ (1 << draw(st.integers(0, 6)))) + text[i + 1 :]
    if kind == "nest":
        depth = draw(st.integers(1, 100_000))
        key = draw(st.sampled_from(sorted(doc)))
        return text.replace(f'"{key}": ', f'"{key}": ' + "[" * depth + "]" * depth + ", ", 1)
    doc = json.loads(text)
    paths = _paths(doc)[1:]
    if kind == "plausible":
        paths = [p for p in paths if isinstance(_get(doc, p), bool | int | float | str)]
        path = draw(st.sampled_from(paths))
        return json.dumps(_set(doc, path, _plausible(_get(doc, path)), drop=False))
    path = draw(st.sampled_from(paths))
    return json.dumps(_set(doc, path, draw(ODD_VALUES), drop=kind == "drop"))


def _write(item: Path, text: str) -> None:
    (item / MANIFEST_NAME).write_text(text)


@FUZZ
@given(data=st.data())
def test_a_mutated_manifest_is_a_format_error_or_a_manifest(saved, data) -> None:
    item = saved["item"]
    try:
        _write(item, mutate(data.draw, json.loads(saved["text"])))
        try:
            manifest = storage.read_manifest(item)
        except storage.CheckpointFormatError:
            manifest = None
        # "Committed" is the same question, asked by listing: it answers, never raises.
        assert is_committed(item.parent) is (manifest is not None)
    finally:
        _write(item, saved["text"])


@FUZZ
@given(data=st.data())
def test_a_mutated_manifest_restores_the_saved_tree_or_is_refused(saved, data) -> None:
    item = saved["item"]
    try:
        _write(item, mutate(data.draw, json.loads(saved["text"])))
        for target, want in ((None, saved["as_saved"]), (_tree(), saved["into_target"])):
            try:
                got = _bits(_restore(item, target))
            except (storage.CheckpointFormatError, storage.CorruptCheckpointError):
                continue
            assert got == want, "a damaged manifest restored another tree"
    finally:
        _write(item, saved["text"])


@FUZZ
@given(data=st.data())
def test_a_manifest_without_digest_reads_and_damaged_fails_only_by_name(saved, data) -> None:
    """Manifests written before the digest: readable; damaged, no exception but ours."""
    item = saved["item"]
    old = {k: v for k, v in saved["doc"].items() if k != "digest"}
    try:
        _write(item, json.dumps(old))
        assert _bits(_restore(item)) == saved["as_saved"]
        _write(item, mutate(data.draw, old))
        with contextlib.suppress(storage.CheckpointFormatError, storage.CorruptCheckpointError):
            _restore(item)
    finally:
        _write(item, saved["text"])


# -- the policy item ---------------------------------------------------------------------


def _state(step: int) -> dict[str, Any]:
    return {"w": np.full((8, 8), step, np.float32), "n": np.int64(step)}


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    base = tmp_path_factory.mktemp("policy")
    # A policy that compiles fast: each example opens a manager, which compiles its update.
    policy = cj.policies.young(mtbf_s=60.0)
    with cj.CheckpointManager(base / "ckpt", policy=policy) as mngr:
        for step in (1, 2):
            mngr.save(step, _state(step), loss=1.0 / step, force=True)
        mngr.wait_until_finished()
        saved = mngr.policy_state
    assert not _same_state(saved, policy.init())  # so that the test can tell them apart
    file = base / "ckpt" / "2" / "policy" / "policy_state.json"
    return Quiet(
        base=base,
        policy=policy,
        doc=json.loads(file.read_text()),
        saved=jax.tree.map(np.asarray, saved),
        fresh=jax.tree.map(np.asarray, policy.init()),
    )


def _same_state(a: Any, b: Any) -> bool:
    return all(
        np.asarray(x).tobytes() == np.asarray(y).tobytes()
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


@settings(
    max_examples=max(1, EXAMPLES * 3 // 10),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(data=st.data())
def test_a_mutated_policy_item_never_fails_open_or_restore(run, data, tmp_path_factory) -> None:
    directory = tmp_path_factory.mktemp("damaged", numbered=True) / "ckpt"
    shutil.copytree(run["base"] / "ckpt", directory)
    (directory / "2" / "policy" / "policy_state.json").write_text(mutate(data.draw, run["doc"]))
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        with cj.CheckpointManager(directory, policy=run["policy"]) as mngr:
            state = jax.tree.map(np.asarray, mngr.policy_state)
            restored = mngr.restore(target=jax.tree.map(np.zeros_like, _state(2)))
            assert mngr.restored_step == 2 and _same_state(restored, _state(2))
            mngr.save(3, _state(3), loss=0.25, force=True)
            mngr.wait_until_finished()
            assert mngr.all_steps() == [1, 2, 3]
    # Either the saved schedule (a harmless change, such as the digest dropped) or a fresh one,
    # said in a warning: never a schedule made of damaged values.
    warned = [w for w in said if "starts its schedule fresh" in str(w.message)]
    if _same_state(state, run["saved"]):
        assert not warned
    else:
        assert warned and _same_state(state, run["fresh"]), [str(w.message) for w in said]
    assert math.isfinite(mngr.measurements.mtbf_s)
