"""One writer per durable prefix: a lease object with an expiry, renewed by its holder.

Two jobs may write one durable tier at once without meaning to: a preempted job still draining
its last save while its replacement starts elsewhere. Each would take the other's drain in
progress for the debris of a crash, and delete it. So the writer of a durable tier holds a
*lease*: the object ``<durable>/cocijax_lease.json`` names its owner (host, process, local
directory) and when the lease expires (wall-clock time). The holder renews it from a thread
of its own; a writer that finds it held by another waits, up to a bound, for it to be released
or to expire (a holder on the same host whose process is gone has released it), then takes it
with a conditional write (``if_equal`` the generation it read) and reads it back.

TensorStore's ``file`` and ``gcs`` kvstores check a conditional write atomically. Its ``s3``
driver (0.1.86) checks it with a HEAD request before an unconditional PUT, so two writers can
both pass the check: on S3 a taker reads the lease back after a short delay, and every commit
of a drain reads it again first (:meth:`Lease.check`). The lease assumes the writers' clocks
agree to well within its duration.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from cocijax import storage

__all__ = ["LEASE_KEY", "Lease", "LeaseError", "owner_id"]

log = logging.getLogger(__name__)

LEASE_KEY = "cocijax_lease.json"
_FORMAT = "cocijax-durable-lease"
# The owners in this process whose lease may still be in use (held, or left to expire by a
# writer whose requests may still land): any other owner of this process has released it.
_LIVE: set[str] = set()
# How often a writer waiting for the lease reads it again (one GET).
_POLL_S = 0.5


class LeaseError(RuntimeError):
    """The lease is held by another writer, or this writer lost it (names the owner)."""


def owner_id() -> str:
    """A name for this process as a writer, unique across hosts and runs."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


class Lease:
    """The lease of one durable prefix, as one writer sees and holds it.

    Args:
      root: the durable tier (its waits bounded by its ``timeout_s``).
      owner: this writer's name (:func:`owner_id`).
      directory: the writer's local directory, recorded for whoever waits for the lease.
      duration_s: a lease not renewed for this long expires; renewed every quarter of it.
      settle_s: on S3, how long a taker waits before it reads the lease back.
      clock: wall-clock seconds (expiries are compared across machines).
    """

    def __init__(
        self,
        root: storage.KvPath,
        *,
        owner: str,
        directory: str,
        duration_s: float,
        settle_s: float = 0.2,
        clock: Callable[[], float] = time.time,
    ):
        self._key = root / LEASE_KEY
        self.owner = owner
        self._directory = directory
        self._duration = duration_s
        self._settle = settle_s if root.driver == "s3" else 0.0
        self._clock = clock
        self._lock = threading.Lock()
        self._generation: bytes | None = None  # ours while held
        self._expires = 0.0
        self._lost: str | None = None  # why it was lost, while held
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None

    @property
    def held(self) -> bool:
        with self._lock:
            return self._generation is not None and self._lost is None

    @property
    def url(self) -> str:
        return self._key.url

    def _record(self) -> bytes:
        return json.dumps(
            {
                "format": _FORMAT,
                "owner": self.owner,
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "directory": self._directory,
                "expires_unix": self._clock() + self._duration,
            }
        ).encode()

    def acquire(self, wait_s: float, *, waiting: Callable[[str], None] | None = None) -> None:
        """Takes the lease (renewed from then on), waiting up to ``wait_s`` for its holder.

        Args:
          wait_s: how long to wait for another holder to release it or let it expire.
          waiting: called once with a description of the holder when this has to wait.

        Raises:
          LeaseError: another writer held it for all of ``wait_s`` (names it).
          ValueError, OSError: the store failed (``StoreTimeoutError`` past its deadline).
        """
        if self.held:
            return
        deadline = time.monotonic() + wait_s
        said = False
        while True:
            data, generation = self._key.read_stamped()
            holder = _parse(data)
            if holder is None or self._free(holder):
                if self._take(data, generation):
                    return
                continue  # another writer took it first: look again
            if time.monotonic() >= deadline:
                raise LeaseError(
                    f"{self._key.url} is held by another writer, {describe(holder)}, for all "
                    f"of the {wait_s:g} s waited: two jobs write this durable tier. Stop the "
                    "other job, or give this one its own durable prefix."
                )
            if not said and waiting is not None:
                waiting(describe(holder))
                said = True
            left = deadline - time.monotonic()
            time.sleep(max(0.0, min(_POLL_S, left, _expires_in(holder, self._clock))))

    def _free(self, holder: dict[str, Any]) -> bool:
        if holder.get("owner") == self.owner or _expires_in(holder, self._clock) <= 0:
            return True
        # A holder on this host whose process is gone (or, in this process, whose manager is
        # closed) will never release it.
        if holder.get("host") != socket.gethostname():
            return False
        if holder.get("pid") == os.getpid():
            return holder.get("owner") not in _LIVE
        return not _alive(holder.get("pid"))

    def _take(self, seen: bytes | None, generation: bytes) -> bool:
        started = self._clock()
        record = self._record()
        if self._key.write_if(record, generation) is None:
            if self._key.read_bytes() != seen:
                return False  # another writer changed it since it was read
            # Unchanged, yet the condition failed: a store that cannot match the generations
            # it gives (a GCS emulator). Write, then rely on the read back below.
            self._key.write_bytes(record)
        if self._settle:
            time.sleep(self._settle)
        data, now_generation = self._key.read_stamped()
        holder = _parse(data)
        if holder is None or holder.get("owner") != self.owner:
            return False  # S3: a writer that passed the same check wrote after us
        with self._lock:
            self._generation, self._lost = now_generation, None
            self._expires = started + self._duration
        _LIVE.add(self.owner)
        self._stop.clear()
        self._heartbeat = threading.Thread(
            target=self._renew_until_stopped, name="cocijax-lease", daemon=True
        )
        self._heartbeat.start()
        log.info("%s: lease taken by %s", self._key.url, self.owner)
        return True

    def _renew_until_stopped(self) -> None:
        while not self._stop.wait(self._duration / 4):
            try:
                self._renew()
            except (ValueError, OSError) as e:  # said; the next beat tries again
                log.warning("%s: cannot renew the lease (%s)", self._key.url, e)
            if not self.held:
                return

    def _renew(self) -> None:
        with self._lock:
            generation = self._generation
        if generation is None:
            return
        started = self._clock()
        record = self._record()
        written = self._key.write_if(record, generation) is not None
        # Read back, whatever the condition said: on S3 it is not atomic, and some servers
        # (a GCS emulator) give generations they do not match later.
        data, new = self._key.read_stamped()
        holder = _parse(data)
        if holder is None or holder.get("owner") != self.owner:
            self._lose(f"taken by {describe(holder) if holder else 'nobody (deleted)'}")
            return
        if not written:  # still ours, but its generation did not match: renew all the same
            self._key.write_bytes(record)
            new = self._key.read_stamped()[1]
        with self._lock:
            self._generation, self._expires = new, started + self._duration

    def _lose(self, why: str) -> None:
        with self._lock:
            self._lost = why
        log.error("%s: lease lost (%s): this writer commits nothing more", self._key.url, why)

    def check(self, margin_s: float) -> None:
        """Before a commit: the lease is still this writer's, for at least ``margin_s`` more.

        Raises:
          LeaseError: not held, lost, or too close to its expiry (names the lease).
          ValueError, OSError: the lease cannot be read.
        """
        with self._lock:
            lost, generation, expires = self._lost, self._generation, self._expires
        if generation is None or lost is not None:
            raise LeaseError(f"{self._key.url}: this writer does not hold the lease ({lost}).")
        if self._clock() + margin_s > expires:
            raise LeaseError(
                f"{self._key.url}: the lease expires in less than {margin_s:g} s (not renewed: "
                "the store did not answer); nothing is committed without it."
            )
        holder = _parse(self._key.read_stamped()[0])
        if holder is None or holder.get("owner") != self.owner:
            self._lose(f"taken by {describe(holder) if holder else 'nobody (deleted)'}")
            raise LeaseError(f"{self._key.url}: lease lost ({self._lost}).")

    def release(self, *, delete: bool = True) -> None:
        """Stops renewing and, with ``delete``, deletes the lease if it is still this writer's
        (without, it expires by itself: for a writer whose requests may still land)."""
        self._stop.set()
        if self._heartbeat is not None:
            self._heartbeat.join()
            self._heartbeat = None
        with self._lock:
            generation, lost = self._generation, self._lost
            self._generation = None
        if delete and generation is not None and lost is None:
            with contextlib.suppress(ValueError, OSError):  # it expires by itself
                if self._key.write_if(None, generation) is None:
                    holder = _parse(self._key.read_stamped()[0])
                    if holder is not None and holder.get("owner") == self.owner:
                        self._key.delete()
                log.info("%s: lease released by %s", self._key.url, self.owner)
        if delete:
            _LIVE.discard(self.owner)


def _parse(data: bytes | None) -> dict[str, Any] | None:
    """The lease record, or ``None`` when there is none or it is not one (then it is free)."""
    if data is None:
        return None
    try:
        record = json.loads(data)
    except ValueError:
        return None
    if not isinstance(record, dict) or record.get("format") != _FORMAT:
        return None
    return record


def _expires_in(holder: dict[str, Any], clock: Callable[[], float]) -> float:
    expires = holder.get("expires_unix")
    if not isinstance(expires, int | float):
        return 0.0
    return expires - clock()


def describe(holder: dict[str, Any]) -> str:
    """The holder of a lease, for messages: owner, directory and when it expires."""
    expires = holder.get("expires_unix")
    when = time.strftime("%H:%M:%S", time.localtime(expires)) if expires else "?"
    return (
        f"{holder.get('owner', '?')} (local directory {holder.get('directory', '?')}; lease "
        f"expires at {when} unless renewed)"
    )


def _alive(pid: Any) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return True  # unknown: wait for the expiry
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
