"""StripedCheckpointHandler: an async Orbax handler striping zarr v3 pieces over roots.

Only the device-to-host snapshot blocks ``save``: ``async_save`` copies every replica-0 shard
to page-aligned host memory exactly once and returns an Orbax commit future that, once Orbax has
created the item directory, writes the pieces (all roots in parallel), fsyncs them and their
directories, and then writes the manifest (with several processes, this process's part of it).
TensorStore writes compressed pieces; uncompressed chunk files are written with ``O_DIRECT`` by
``_direct``, beside the ``zarr.json`` TensorStore made for them. ``finalize`` (primary process,
after every process committed) merges the parts into the manifest. By itself the handler is not
atomic: Orbax's temporary-directory rename makes the item appear, and the manifest marks it
complete.

Each save writes under a fresh ``cocijax-stripe-<uuid4>`` directory on every root, so saves (and
processes) never share or overwrite a file. Design after FastPersist (Wang et al., 2024,
"FastPersist: Accelerating Model Checkpointing in Deep Learning", arXiv:2406.13768): direct
writes from aligned host buffers, in parallel over several devices, overlapped with training.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath
from orbax.checkpoint import checkpoint_args
from orbax.checkpoint import options as options_lib

from cocijax._orbax_compat import TreeMetadata
from cocijax.storage import _commit, _io, _metadata, _options, _parts, _restore, _snapshot, _write
from cocijax.storage._kvpath import KvPath

_MiB = 1 << 20


class StripedCheckpointHandler(ocp.AsyncCheckpointHandler):
    """Saves a pytree of arrays as zarr v3 pieces striped over several storage roots.

    Use with ``ocp.Checkpointer``, ``ocp.AsyncCheckpointer`` or ``ocp.CheckpointManager`` (via a
    handler registry), with :class:`StripedSave` / :class:`StripedRestore` args. Registering
    those args also registers the class by its ``typestr`` with Orbax, so an
    ``ocp.CheckpointManager`` opened without handlers restores a striped item too (reading the
    roots recorded in its manifest).

    Example:
      >>> import tempfile, jax.numpy as jnp, orbax.checkpoint as ocp
      >>> tmp = pathlib.Path(tempfile.mkdtemp())
      >>> handler = StripedCheckpointHandler(roots=[tmp / "r0", tmp / "r1"])
      >>> with ocp.AsyncCheckpointer(handler) as ckptr:
      ...     ckptr.save(tmp / "ckpt", args=StripedSave({"w": jnp.ones(4)}))
      ...     ckptr.wait_until_finished()
      ...     ckptr.restore(tmp / "ckpt", args=StripedRestore())
      {'w': Array([1., 1., 1., 1.], dtype=float32)}
    """

    def __init__(
        self,
        roots: Sequence[os.PathLike | str] = (),
        *,
        root_options: Mapping[str, Any] | None = None,
        concurrency: int = 32,
        chunk_bytes: int = 16 * _MiB,
        piece_bytes: int = 64 * _MiB,
        small_bytes: int = 8 * _MiB,
        compression: str | None = None,
        compression_level: int = 3,
        checksums: bool = True,
        direct_writes: bool = True,
        reuse_host_buffers: bool = True,
        write_while_copying: bool = False,
        multiprocessing_options: options_lib.MultiprocessingOptions | None = None,
        store_timeout_s: float | None = 30.0,
        host_local: bool = False,
    ):
        """Creates the handler and checks that every root can be written.

        Args:
          roots: where to stripe the pieces: local directories (plain paths or ``file://``
            URLs, created if missing; each usually on its own device) and object-store
            prefixes (``s3://bucket/prefix``, ``gs://bucket/prefix``). Empty means the Orbax
            item directory itself.
          root_options: TensorStore kvstore spec members for the object-store roots, e.g.
            ``{"endpoint": "http://127.0.0.1:9000", "aws_region": "us-east-1"}`` for an
            S3-compatible server, ``aws_credentials`` (``{"type": "profile", "profile":
            "ci"}``; the default is TensorStore's chain: environment, profile, instance
            metadata), ``requester_pays``, or ``context`` (e.g. ``s3_request_retries``).
            Used for reading too (restore, metadata-free verify); never written to a manifest.
          concurrency: TensorStore ``file_io_concurrency``: file operations in flight.
          chunk_bytes: approximate size of one zarr chunk (one file) inside a piece.
          piece_bytes: largest piece (one zarr array); large arrays are split to this size.
          small_bytes: regions below this size are packed, per dtype, into shared flat arrays
            (each piece costs a directory, a ``zarr.json`` and the fsyncs of all three, besides
            its bytes). A partial restore reads every pack holding a leaf it asks for whole.
          compression: ``None`` or ``"zstd"`` (zarr3 codec).
          compression_level: zstd level.
          checksums: record xxh3_64 checksums at save and verify them at restore.
          direct_writes: write the chunk files of uncompressed pieces directly, with
            ``O_DIRECT`` where the file system allows it, instead of through TensorStore's
            buffered writes (the files are the same).
          reuse_host_buffers: keep the host copy's buffers after a save (until :meth:`close`)
            and copy the next save of the same shapes into them, memory already faulted in.
            The handler then holds one host copy of this process's share of the last tree
            between saves; ``False`` frees it after each save.
          write_while_copying: start writing a piece of at least one chunk on a local root as
            soon as its host copy is done, while ``save`` still copies the rest. The writes
            share the memory bandwidth with the copy that blocks the caller, so ``save`` blocks
            longer, and on few cores the commit comes no sooner (``write_bench``'s
            ``cocijax-1-overlap`` case). ``False`` (the default) keeps the blocking part to the
            copy alone, as Orbax's handlers do.
          multiprocessing_options: Orbax options; ``primary_host`` writes numpy leaves and the
            manifest.
          store_timeout_s: the longest the probe of an object-store root may wait for an
            answer (``None``: no bound but TensorStore's retries). An unreachable endpoint, a
            missing bucket or missing credentials fail within it, naming the root and the
            cause.
          host_local: with several processes, each process saves its own copy of what its
            devices hold (every region once, replicated leaves and numpy leaves included) as
            a whole item of its own, its manifest marked with its process index (``holder``):
            for item directories and roots only this process sees (see
            ``cocijax.CheckpointManager(host_local=True)``). Such a copy restores on the
            devices it was saved from. ``False``: the processes write the replica-0 shards
            of one shared item, and the primary process merges their manifest parts.

        Raises:
          TypeError: ``roots`` is a single string or path instead of a sequence, or
            ``root_options`` is not a dict.
          ValueError: two roots are the same directory, a root cannot be created or written
            (on an object store: a probe object cannot be written and deleted within
            ``store_timeout_s``), an unsupported URL scheme, options TensorStore refuses, or
            an option is out of range.
        """
        self._roots = _options.resolve_roots(roots, root_options, store_timeout_s)
        self._options = _options.Options(
            root_options=root_options,
            concurrency=concurrency,
            encoding=_write.Encoding(chunk_bytes, compression, compression_level),
            piece_bytes=piece_bytes,
            small_bytes=small_bytes,
            checksums=checksums,
            direct_writes=direct_writes,
            reuse_host_buffers=reuse_host_buffers,
            write_while_copying=write_while_copying,
            primary_host=(
                multiprocessing_options or options_lib.MultiprocessingOptions()
            ).primary_host,
            host_local=host_local,
        )
        self._buffers = _io.HostBuffers()
        self._last_layout: _snapshot.SaveLayout | None = None  # of the last save
        self._direct_ok: dict[int, bool] = {}  # per root index: O_DIRECT works there
        self._context = _io.make_context(concurrency)
        self._io_executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None

    @property
    def _pool(self) -> concurrent.futures.ThreadPoolExecutor:
        # Created on demand: Orbax closes handlers with their checkpointer, yet the same handler
        # object may be used again (e.g. registered in a new CheckpointManager).
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(
                max(2, os.cpu_count() or 1), thread_name_prefix="cocijax-storage"
            )
        return self._executor

    @property
    def _io_pool(self) -> concurrent.futures.ThreadPoolExecutor:
        # Blocking write+fsync calls release the GIL: `concurrency` files are in flight.
        if self._io_executor is None:
            self._io_executor = concurrent.futures.ThreadPoolExecutor(
                self._options.concurrency, thread_name_prefix="cocijax-write"
            )
        return self._io_executor

    @property
    def roots(self) -> tuple[pathlib.Path | KvPath, ...]:
        """The resolved roots (``KvPath`` on object stores); empty: inside the item directory."""
        return tuple(r for r in self._roots if r is not None)

    @classmethod
    def typestr(cls) -> str:
        # Stable: Orbax keys its registry on this, so moving the class must not change it.
        return "cocijax.storage.StripedCheckpointHandler"

    # ----------------------------------------------------------------------------- saving

    async def async_save(
        self, directory: epath.Path, args: StripedSave | None = None, *, item: Any = None
    ) -> list[ocp.future.Future] | None:
        """Snapshots the item to host memory and returns the commit future that writes it.

        Args:
          directory: the item directory; it may not exist yet (Orbax creates it in the
            background and signals the commit future when it does).
          args: :class:`StripedSave`. The older calling style of Orbax's handlers, the tree
            itself (``save(directory, tree)`` or ``save(directory, item=tree)``), is accepted.

        Returns:
          One commit future; it writes the pieces, fsyncs them and writes the manifest (this
          process's part of it, with several processes).

        Raises:
          UnsupportedLeafError: a leaf type or dtype is unsupported (names the key path; a
            ``ValueError`` and a ``TypeError``).
          ValueError: no item, args of another handler, or ``custom_metadata`` not JSON.
        """
        args = _save_args(args, item)
        writer = self._writer()
        snapshot = self._snapshot(args.item, writer)
        snapshot.custom_metadata = args.custom_metadata
        return [
            ocp.future.CommitFutureAwaitingContractedSignals(
                writer.commit(pathlib.Path(directory), snapshot), name="cocijax_striped_save"
            )
        ]

    def save(
        self, directory: epath.Path, args: StripedSave | None = None, *, item: Any = None
    ) -> None:
        """Saves synchronously (snapshot and commit); Orbax calls ``finalize`` afterwards."""

        async def run():
            for f in await self.async_save(directory, args, item=item) or []:
                f.result()

        _io.run_sync(run())

    def _writer(self) -> _commit.Writer:
        # Made in the caller's thread: the pools are created here, not racing inside the copy
        # threads.
        return _commit.Writer(
            self._roots,
            self._options,
            self._context,
            self._pool,
            self._io_pool,
            self._buffers,
            self._direct_ok,
        )

    def _snapshot(self, item: Any, writer: _commit.Writer) -> _snapshot.Snapshot:
        with _io.pause_gc():
            snapshot = _snapshot.take(
                item,
                self._roots,
                piece_bytes=self._options.piece_bytes,
                small_bytes=self._options.small_bytes,
                chunk_bytes=self._options.encoding.chunk_bytes,
                write_numpy=self._options.host_local
                or jax.process_index() == (self._options.primary_host or 0),
                pool=self._pool,
                start_raw=writer.start_raw if self._options.write_while_copying else None,
                buffers=self._buffers,
                last=self._last_layout,
                host_local=self._options.host_local,
            )
        self._last_layout = snapshot.layout
        return snapshot

    def finalize(self, directory: epath.Path) -> None:
        """Merges every process's manifest part into the manifest (primary process only).

        Orbax calls this once, after all processes' commit futures completed. A single process
        wrote the whole manifest in its commit: nothing is left to merge.

        Raises:
          CheckpointFormatError: the parts disagree or do not cover every leaf.
        """
        _parts.merge_parts(pathlib.Path(directory))

    # ---------------------------------------------------------------------------- restoring

    def restore(
        self, directory: epath.Path, args: StripedRestore | None = None, *, item: Any = None
    ) -> Any:
        """Restores the tree saved in ``directory``.

        Args:
          directory: the item directory.
          args: :class:`StripedRestore`; None restores as saved. Its ``item`` is a target tree
            (see :class:`StripedRestore`); its ``roots`` reads stripes that were moved since
            the save. The older calling style, the target itself (``restore(directory,
            target)`` or ``restore(directory, item=target)``), is accepted.

        Returns:
          The restored tree, with the target's structure when a target is given; without one,
          nested dicts and lists (see :class:`StripedRestore`).

        Raises:
          CheckpointFormatError: the manifest is missing or invalid.
          ValueError: the target's structure, shapes or dtypes differ from the saved tree
            (names the leaf; with ``partial``, a target leaf that was never saved), a 64-bit
            leaf would be narrowed on the sharding the target asks for (``jax_enable_x64``
            off), ``roots`` has the wrong length, ``partial`` has no target, or ``args``
            belong to another handler.
          CorruptCheckpointError: a piece is missing, truncated or fails its checksum (names
            the leaf and the file).
        """
        args = _restore_args(args, item)
        with _io.pause_gc():
            return _restore.restore_tree(
                pathlib.Path(directory),
                args.item,
                self._context,
                self._pool,
                verify=self._options.checksums,
                io_pool=self._io_pool,
                roots=args.roots,
                partial=args.partial,
                root_options=self._options.root_options,
            )

    def metadata(self, directory: epath.Path) -> TreeMetadata:
        """The saved tree as Orbax's tree metadata, read from the manifest without data.

        What ``ocp.StandardCheckpointHandler.metadata`` returns, so that
        ``mngr.item_metadata(step)`` and ``mngr.metadata(step).item_metadata.tree`` work in an
        ``ocp.CheckpointManager``: the tree a restore without a target returns, with
        ``ocp.metadata.ArrayMetadata`` (shape, dtype, saved sharding), ``ScalarMetadata`` and
        ``StringMetadata`` leaves, and ``custom_metadata``. It is a valid restore target
        (restoring as saved). The cocijax manifest (pieces, roots, checksums) is
        :func:`cocijax.storage.read_manifest`.

        Raises:
          CheckpointFormatError: the manifest is missing or invalid.
        """
        return _metadata.tree_metadata_of(pathlib.Path(directory))

    def close(self) -> None:
        """Stops the handler's threads and frees its kept host buffers (both come back if the
        handler is used again)."""
        for pool in (self._executor, self._io_executor):
            if pool is not None:
                pool.shutdown(wait=True)
        self._executor = self._io_executor = None
        self._buffers.clear()


def _either_style(args: Any, item: Any, expected: type, verb: str, what: str) -> Any:
    """``expected`` args from either calling style: ``args=Expected(x)`` or the old ``item=x``."""
    name = expected.__name__
    if isinstance(args, expected) and item is None:
        return args
    if isinstance(args, checkpoint_args.CheckpointArgs):
        raise ValueError(
            f"StripedCheckpointHandler {verb}s with cocijax.{name} args, got "
            f"{type(args).__name__}; write args=cocijax.{name}({what})."
        )
    if args is not None and item is not None:
        raise ValueError(f"{verb}: pass the {what} once, as args={name}({what}) or as item=.")
    return expected(item if args is None else args)


def _save_args(args: Any, item: Any) -> StripedSave:
    """:class:`StripedSave` from either calling style."""
    if args is None and item is None:
        raise ValueError("save: nothing to save; pass args=cocijax.StripedSave(tree).")
    save = _either_style(args, item, StripedSave, "save", "tree")
    try:
        json.dumps(save.custom_metadata)
    except (TypeError, ValueError) as e:
        raise ValueError(f"StripedSave.custom_metadata must be JSON-serialisable: {e}.") from e
    return save


def _restore_args(args: Any, item: Any) -> StripedRestore:
    """:class:`StripedRestore` from either calling style."""
    return _either_style(args, item, StripedRestore, "restore", "target")


@checkpoint_args.register_with_handler(StripedCheckpointHandler, for_save=True)
@dataclasses.dataclass
class StripedSave(checkpoint_args.CheckpointArgs):
    """Save args for :class:`StripedCheckpointHandler`.

    Attributes:
      item: the pytree to save: jax arrays (typed PRNG keys included), numpy arrays and
        scalars, Python scalars and strings, None and empty nodes (optax and Flax states
        included).
      custom_metadata: a JSON-serialisable value kept in the manifest and returned as
        ``metadata(directory).custom_metadata`` (as ``ocp.args.StandardSave`` has it).
    """

    item: Any
    custom_metadata: Any = None


@checkpoint_args.register_with_handler(StripedCheckpointHandler, for_restore=True)
@dataclasses.dataclass
class StripedRestore(checkpoint_args.CheckpointArgs):
    """Restore args for :class:`StripedCheckpointHandler`.

    Attributes:
      item: the target tree, or ``None`` to restore as saved. Without a target, saved
        ``jax.Array`` leaves come back as ``jax.Array`` on their saved sharding (on the default
        device when this job lacks those devices; as numpy when ``jax_enable_x64`` is off and
        the dtype is 64-bit), numpy leaves as numpy, Python scalars and strings as themselves,
        in nested dicts and lists (tuples too, except an empty one), empty nodes as Orbax
        returns them. Target leaves: ``jax.ShapeDtypeStruct`` or ``jax.Array`` (placed on its
        sharding; without one, as saved), numpy arrays or scalars (numpy), Python scalars and
        strings, ``ocp.PLACEHOLDER`` (leaf not read, returned as the placeholder),
        ``optax.MaskedNode`` (not read), or what :meth:`StripedCheckpointHandler.metadata`
        returns (as saved).
      roots: where the stripes are now, one directory (or object-store URL) per root recorded
        at save time (in the same order), when they were moved; ``None`` reads the recorded
        roots. Object stores are read with the handler's ``root_options``.
      partial: the target (required) may be any sub-tree of the saved tree, e.g. only
        ``{"params": ...}`` of a saved ``{"params": ..., "opt_state": ...}``: leaves it omits
        are not read, and the result has the target's structure (Orbax's
        ``PyTreeRestore(partial_restore=True)``). A target leaf that was never saved still
        raises ``ValueError`` naming it. Without ``partial``, an omitted leaf is an error
        (skip single leaves with ``ocp.PLACEHOLDER``).

    Example:
      >>> import tempfile, numpy as np, orbax.checkpoint as ocp
      >>> path = pathlib.Path(tempfile.mkdtemp()) / "ckpt"
      >>> with ocp.Checkpointer(StripedCheckpointHandler()) as ckptr:
      ...     ckptr.save(path, args=StripedSave({"params": np.ones(2), "opt": np.zeros(9)}))
      ...     ckptr.restore(path, args=StripedRestore({"params": np.empty(2)}, partial=True))
      {'params': array([1., 1.])}
    """

    item: Any = None
    roots: Sequence[os.PathLike | str | None] | None = None
    partial: bool = False
