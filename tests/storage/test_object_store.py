"""Object-storage roots: the striped handler on a real S3 server (moto on 127.0.0.1)."""

import json
import shutil

import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

import cocijax as cj
from cocijax import storage
from cocijax.storage._stripes import find_stripe_dirs, referenced_stripe_dirs


def _tree():
    return {
        "w": jnp.arange(3 * 1024 * 256, dtype=jnp.float32).reshape(3 * 1024, 256),
        "b": np.arange(7, dtype=np.int64),
        "step": 5,
    }


def test_striped_save_to_s3_and_local_roots_restores_bit_exact(s3, tmp_path):
    handler = cj.StripedCheckpointHandler(
        roots=[s3.url("ck/r0"), tmp_path / "r1"], root_options=s3.options, piece_bytes=1 << 20
    )
    tree = _tree()
    with ocp.AsyncCheckpointer(handler) as ckptr:
        ckptr.save(tmp_path / "item", args=cj.StripedSave(tree))
        ckptr.wait_until_finished()
        back = ckptr.restore(tmp_path / "item", args=cj.StripedRestore())
    np.testing.assert_array_equal(back["w"], tree["w"])
    np.testing.assert_array_equal(back["b"], tree["b"])
    assert back["step"] == 5
    manifest = storage.read_manifest(tmp_path / "item")
    assert s3.url("ck/r0") in manifest.roots  # the manifest records the URL
    s3_pieces = [p for p in manifest.pieces if manifest.roots[p.root] == s3.url("ck/r0")]
    assert s3_pieces
    keys = s3.keys("ck/r0/")
    meta = json.loads(
        s3.client.get_object(Bucket=s3.name, Key=f"ck/r0/{s3_pieces[0].file}/zarr.json")[
            "Body"
        ].read()
    )
    assert meta["zarr_format"] == 3
    assert keys and all(k.startswith("ck/r0/cocijax-stripe-") for k in keys)
    assert storage.verify(tmp_path / "item", root_options=s3.options) == []


def test_stripes_on_s3_are_collected_moved_and_verified(s3, tmp_path):
    root = s3.url("ck/r0")
    handler = cj.StripedCheckpointHandler(roots=[root], root_options=s3.options)
    with ocp.Checkpointer(handler) as ckptr:
        ckptr.save(tmp_path / "a", args=cj.StripedSave({"w": np.arange(65536.0)}))
        ckptr.save(tmp_path / "b", args=cj.StripedSave({"w": np.arange(65536.0) + 1}))
    stripes = find_stripe_dirs(root, root_options=s3.options)
    assert len(stripes) == 2 and all(str(d).startswith(root + "/cocijax-stripe-") for d in stripes)
    # A deleted item's stripe is garbage; the other item's is not.
    shutil.rmtree(tmp_path / "b")
    garbage = storage.unreferenced_stripe_dirs([root], [tmp_path / "a"], root_options=s3.options)
    assert garbage == sorted(set(stripes) - referenced_stripe_dirs(tmp_path / "a"))
    storage.remove_tree(garbage[0], root_options=s3.options)
    assert find_stripe_dirs(root, root_options=s3.options) == sorted(
        referenced_stripe_dirs(tmp_path / "a")
    )
    # Stripes copied to another prefix restore with roots=; a damaged object is named.
    for key in s3.keys("ck/r0/"):
        s3.client.copy_object(
            Bucket=s3.name, Key=key.replace("ck/r0/", "moved/"), CopySource=f"{s3.name}/{key}"
        )
    moved = cj.StripedRestore(roots=[s3.url("moved")])
    with ocp.Checkpointer(handler) as ckptr:
        back = ckptr.restore(tmp_path / "a", args=moved)
    np.testing.assert_array_equal(back["w"], np.arange(65536.0))
    chunk = next(k for k in s3.keys("moved/") if "/c." in k)
    s3.client.put_object(Bucket=s3.name, Key=chunk, Body=b"short")
    problems = storage.verify(tmp_path / "a", [s3.url("moved")], root_options=s3.options)
    assert len(problems) == 1 and problems[0].file == s3.url(chunk.rsplit("/c.", 1)[0])
    assert problems[0].leaf_path == "['w']"


def test_a_manager_with_roots_on_s3_collects_their_stripes(s3, tmp_path):
    with cj.CheckpointManager(
        tmp_path / "ckpt",
        roots=[s3.url("roots")],
        handler_options={"root_options": s3.options},
        policy=cj.policies.fixed(1),
        max_to_keep=1,
    ) as mngr:
        for step in (1, 2, 3):
            mngr.save(step, {"w": np.full(1 << 14, step, np.float32)}, loss=1.0)
            mngr.wait_until_finished()
        referenced = referenced_stripe_dirs(mngr.item_directory(3))
        assert set(find_stripe_dirs(mngr.stripe_roots[0])) == referenced
        np.testing.assert_array_equal(mngr.restore()["w"], np.full(1 << 14, 3, np.float32))
    # Everything left on S3 is step 3's, and the record of the directory owning the folder.
    left = {k.split("/")[2] for k in s3.keys("roots/")}
    assert left == {d.name for d in referenced} | {".cocijax-owner"}


@pytest.mark.parametrize(
    ("roots", "options", "error", "match"),
    [
        (["ftp://host/x"], None, ValueError, "unsupported URL scheme 'ftp'"),
        (["s3://"], None, ValueError, "no bucket"),
        (["s3://bucket/x"], {"region": "us-east-1"}, ValueError, "calls it 'aws_region'"),
        (["s3://bucket/x"], {"bucket": "other"}, ValueError, "come from the URL itself"),
        (["s3://bucket/x"], {"retries": 3}, ValueError, "TensorStore refuses the kvstore spec"),
        (["s3://bucket/x"], "http://x", TypeError, "expected a dict"),
    ],
    ids=["scheme", "no-bucket", "region", "bucket-option", "unknown-option", "not-a-dict"],
)
def test_bad_object_store_roots_are_named(roots, options, error, match):
    with pytest.raises(error, match=match):
        cj.StripedCheckpointHandler(roots=roots, root_options=options)


def test_an_object_store_root_that_cannot_be_written_fails_at_construction(s3):
    with pytest.raises(ValueError, match=r"roots\[0\]='s3://no-such-bucket-[0-9a-f]+/x' cannot"):
        cj.StripedCheckpointHandler(
            roots=[f"s3://no-such-bucket-{s3.name[-12:]}/x"], root_options=s3.options
        )
    down = s3.options_of_a_server_that_is_down()
    with pytest.raises(ValueError, match="cannot be written"):
        cj.StripedCheckpointHandler(roots=[s3.url("x")], root_options=down)
    with pytest.raises(ValueError, match=r"roots\[1\].*same directory as roots\[0\]"):
        cj.StripedCheckpointHandler(roots=[s3.url("x"), s3.url("x/")], root_options=s3.options)


def test_striped_save_to_gcs_restores_verifies_and_collects(gcs, tmp_path):
    # The GCS emulator on 127.0.0.1: the same code path as S3, TensorStore's gcs driver.
    root = gcs.url("ck/r0")
    handler = cj.StripedCheckpointHandler(roots=[root, tmp_path / "r1"], piece_bytes=1 << 20)
    tree = _tree()
    with ocp.Checkpointer(handler) as ckptr:
        ckptr.save(tmp_path / "a", args=cj.StripedSave(tree))
        ckptr.save(tmp_path / "b", args=cj.StripedSave({"w": np.ones(65536)}))
        back = ckptr.restore(tmp_path / "a", args=cj.StripedRestore())
    np.testing.assert_array_equal(back["w"], tree["w"])
    np.testing.assert_array_equal(back["b"], tree["b"])
    assert root in storage.read_manifest(tmp_path / "a").roots
    assert storage.verify(tmp_path / "a") == []
    stripes = find_stripe_dirs(root)
    assert len(stripes) == 2 and all(str(d).startswith(root + "/cocijax-stripe-") for d in stripes)
    shutil.rmtree(tmp_path / "b")
    (garbage,) = storage.unreferenced_stripe_dirs([root], [tmp_path / "a"])
    storage.remove_tree(garbage)
    # Only b's stripe is gone: a's pieces (its neighbour under the same root) still verify.
    assert find_stripe_dirs(root) == sorted(set(stripes) - {garbage})
    assert storage.verify(tmp_path / "a") == []
