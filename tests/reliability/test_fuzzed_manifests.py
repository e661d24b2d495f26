"""Fuzzed manifests: a damaged manifest is a format error or a valid manifest, nothing else.

Hypothesis mutates the manifest of a real save (truncated text, a flipped byte, a field dropped
or given another type, huge numbers, NaN, deep nesting) and reads it back: ``read_manifest``
either returns or raises :class:`cocijax.storage.CheckpointFormatError`, and the manager's
notion of "committed" never raises. (Restores from mutated manifests, and a manifest digest
that would catch a changed inline value, are not covered yet.)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import orbax.checkpoint as ocp
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cocijax as cj
from cocijax import storage
from cocijax.manager._directory import is_committed

ODD_VALUES = st.sampled_from(
    [None, True, -1, 0, 2**64, 10**400, 1e308, float("nan"), float("inf"), "x", [], {}, [[[]]]]
)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    item = tmp_path_factory.mktemp("fuzz") / "item"
    state = {"w": np.arange(6.0).reshape(2, 3), "step": 3, "name": "x"}
    with ocp.Checkpointer(cj.StripedCheckpointHandler()) as ckptr:
        ckptr.save(item, args=cj.StripedSave(state))
    return item, json.loads((item / storage.MANIFEST_NAME).read_text())


def _paths(value: Any, prefix: tuple = ()) -> list[tuple]:
    out = [prefix]
    if isinstance(value, dict):
        for k, v in value.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += _paths(v, (*prefix, i))
    return out


def _set(doc: Any, path: tuple, value: Any, drop: bool) -> Any:
    if not path:
        return value
    parent = doc
    for key in path[:-1]:
        parent = parent[key]
    if drop:
        del parent[path[-1]]
    else:
        parent[path[-1]] = value
    return doc


def _text(draw: Any, doc: dict[str, Any]) -> str:
    kind = draw(st.sampled_from(["truncate", "flip", "field", "drop", "nest"]))
    text = json.dumps(doc)
    if kind == "truncate":
        return text[: draw(st.integers(0, len(text) - 1))]
    if kind == "flip":
        i = draw(st.integers(0, len(text) - 1))
        return text[:i] + chr(ord(text[i]) ^ (1 << draw(st.integers(0, 6)))) + text[i + 1 :]
    if kind == "nest":
        depth = draw(st.integers(1, 100_000))
        return text.replace('"roots":', '"roots":' + "[" * depth + "]" * depth + ",", 1)
    doc = json.loads(text)
    path = draw(st.sampled_from(_paths(doc)[1:]))
    return json.dumps(_set(doc, path, draw(ODD_VALUES), drop=kind == "drop"))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_a_mutated_manifest_is_a_format_error_or_a_manifest(saved, data, tmp_path_factory) -> None:
    doc = saved[1]
    step_dir = tmp_path_factory.mktemp("damaged", numbered=True) / "1"
    damaged = step_dir / "state"  # laid out like a manager's step
    damaged.mkdir(parents=True)
    (damaged / storage.MANIFEST_NAME).write_text(_text(data.draw, json.loads(json.dumps(doc))))
    try:
        manifest = storage.read_manifest(damaged)
    except storage.CheckpointFormatError:
        manifest = None
    # "Committed" is the same question, asked by listing: it answers, never raises.
    assert is_committed(step_dir) is (manifest is not None)
