"""Object-storage roots: the striped handler on a real S3 server (moto on 127.0.0.1)."""

import json

import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

import cocijax as cj
from cocijax import storage


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
    assert all(k.startswith("ck/r0/cocijax-stripe-") for k in keys)
    assert storage.verify(tmp_path / "item", root_options=s3.options) == []
