"""Damaged checkpoints: a flipped byte, a truncated or deleted piece, a bad manifest.

Every case damages one committed step on disk (real files, no mocks) and checks the three ways a
user meets it: ``cocijax verify`` exits 1 naming the leaf and the file, ``restore(step)`` raises
an error naming them, and ``restore(fallback=True)`` returns the newest intact step and says
which one it skipped. A manifest that is missing or not JSON makes its step uncommitted: never
listed, never restored as an empty tree.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
from reliability_helpers import item_dir, pieces

import cocijax as cj
from cocijax import cli, storage
from cocijax.storage._records import MANIFEST_NAME
from cocijax.storage._stripes import referenced_stripe_dirs

pytestmark = pytest.mark.xdist_group("reliability-corruption")


def _state(step: int) -> dict[str, Any]:
    """A tree that depends on ``step``: one 2 MiB leaf (pieces of its own), small ones packed."""
    rng = np.random.default_rng(step)
    return {
        "params": {
            "w": rng.standard_normal((1024, 512)).astype(np.float32),
            "b": rng.standard_normal((64,)).astype(np.float32),
        },
        "count": np.asarray(step, np.int32),
    }


def _abstract() -> Any:
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), _state(0))


def _assert_equal(tree: Any, want: Any) -> None:
    got_leaves, got_def = jax.tree.flatten(tree)
    want_leaves, want_def = jax.tree.flatten(want)
    assert got_def == want_def
    for g, w in zip(got_leaves, want_leaves, strict=True):
        np.testing.assert_array_equal(np.asarray(g), w)


@pytest.fixture
def three_steps(tmp_path: Path) -> tuple[Path, list[str]]:
    """A directory with committed steps 1, 2, 3 over two roots; returns (directory, roots)."""
    directory = tmp_path / "ckpt"
    roots = [str(tmp_path / "r0"), str(tmp_path / "r1")]
    with cj.CheckpointManager(directory, roots=roots, policy=cj.policies.fixed(1)) as mngr:
        for step in (1, 2, 3):
            assert mngr.save(step, _state(step), loss=1.0, force=True)
        mngr.wait_until_finished()
        assert list(mngr.all_steps()) == [1, 2, 3]
    return directory, roots


def _data_file(directory: Path, step: int) -> tuple[str, Path, Path]:
    """(leaf path, largest chunk file, piece dir) of the largest single-leaf piece of ``step``."""
    by_path: dict[Path, set[str]] = {}
    for p in pieces(item_dir(directory, step)):
        by_path.setdefault(p.path, set()).add(p.leaf)
    single = [path for path, leaves in by_path.items() if len(leaves) == 1]
    assert single, f"every piece of step {step} packs several leaves"
    path = max(single, key=lambda d: sum(f.stat().st_size for f in d.rglob("*") if f.is_file()))
    chunks = [f for f in path.rglob("*") if f.is_file() and f.name != "zarr.json"]
    assert chunks, f"piece {path} has no chunk files"
    return next(iter(by_path[path])), max(chunks, key=lambda f: f.stat().st_size), path


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 2)


def _flip_metadata(path: Path) -> None:
    meta = path.parent
    while not (meta / "zarr.json").exists():
        meta = meta.parent
    _flip(meta / "zarr.json")


# kind -> (damage applied to the chunk file, whether messages name the chunk or the piece dir:
# a flipped byte fails the checksum of the piece's region, which names the piece)
DAMAGE = {
    "flip": (_flip, "piece"),
    "truncate": (_truncate, "chunk"),
    "delete": (Path.unlink, "chunk"),
    "flip-zarr-metadata": (_flip_metadata, "piece"),
    "delete-piece": (lambda f: None, "piece"),
}


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_damaged_piece_is_named_by_verify_restore_and_fallback(
    three_steps, kind: str, capsys
) -> None:
    directory, roots = three_steps
    leaf, chunk, piece_dir = _data_file(directory, 3)
    damage, named = DAMAGE[kind]
    if kind == "delete-piece":
        shutil.rmtree(piece_dir)
    else:
        damage(chunk)
    victim = chunk if named == "chunk" else piece_dir

    assert cli.main(["verify", str(directory)]) == 1
    out = capsys.readouterr()
    text = out.out + out.err
    assert leaf in text and victim.name in text, text
    assert "Traceback" not in text

    # The intact steps still verify on their own.
    assert cli.main(["verify", str(directory), "--step", "2"]) == 0
    capsys.readouterr()

    with cj.CheckpointManager(directory, roots=roots, policy=cj.policies.fixed(1)) as mngr:
        with pytest.raises(storage.CorruptCheckpointError) as info:
            mngr.restore(3, target=_abstract())
        message = str(info.value)
        assert leaf in message and victim.name in message, message

        with pytest.warns(RuntimeWarning) as warned:
            restored = mngr.restore(target=_abstract(), fallback=True)
        _assert_equal(restored, _state(2))
        assert mngr.restored_step == 2
        said = " ".join(str(w.message) for w in warned)
        assert "step 3" in said and leaf in said and victim.name in said, said


@pytest.mark.parametrize("damage", ["missing", "not_json", "empty", "truncated_json"])
def test_bad_manifest_means_uncommitted_never_an_empty_tree(three_steps, damage: str) -> None:
    directory, roots = three_steps
    manifest = item_dir(directory, 3) / MANIFEST_NAME
    text = manifest.read_text()
    if damage == "missing":
        manifest.unlink()
    elif damage == "not_json":
        manifest.write_text("this is not json {")
    elif damage == "empty":
        manifest.write_text("")
    else:
        manifest.write_text(text[: len(text) // 2])

    with pytest.raises(storage.CheckpointFormatError):
        storage.read_manifest(item_dir(directory, 3))
    assert cli.main(["verify", str(directory), "--step", "3"]) == 1

    with cj.CheckpointManager(directory, roots=roots, policy=cj.policies.fixed(1)) as mngr:
        assert 3 not in list(mngr.all_steps())
        assert mngr.latest_step() == 2
        _assert_equal(mngr.restore(target=_abstract()), _state(2))
        with pytest.raises(FileNotFoundError, match="step 3 is not a committed step"):
            mngr.restore(3, target=_abstract())
        # Saving continues after the uncommitted step.
        assert mngr.save(4, _state(4), loss=1.0, force=True)
        mngr.wait_until_finished()
        _assert_equal(mngr.restore(4, target=_abstract()), _state(4))


def test_deleted_stripe_directory_of_one_root(three_steps, capsys) -> None:
    directory, roots = three_steps
    stripe_dirs = sorted(referenced_stripe_dirs(item_dir(directory, 3)))
    assert len(stripe_dirs) >= 2, "two roots should each hold a stripe of step 3"
    shutil.rmtree(stripe_dirs[-1])
    assert cli.main(["verify", str(directory), "--step", "3"]) == 1
    assert str(stripe_dirs[-1].name) in capsys.readouterr().out
    with cj.CheckpointManager(directory, roots=roots, policy=cj.policies.fixed(1)) as mngr:
        with pytest.raises(storage.CorruptCheckpointError, match=stripe_dirs[-1].name):
            mngr.restore(3, target=_abstract())
        with pytest.warns(RuntimeWarning, match="step 3"):
            _assert_equal(mngr.restore(target=_abstract(), fallback=True), _state(2))
