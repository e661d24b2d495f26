"""Crash states of a recorded run: what a power loss can leave on disk, ALICE/CrashMonkey style.

A process is run under ``strace -f`` (see :data:`STRACE_ARGS`); :func:`parse` turns its trace into
the file-system operations below one base directory, and :class:`Replay` applies them to a model
of that directory, in the order strace printed their completion.

The model, and why it is conservative
-------------------------------------

The model holds, per inode, two versions: what the running process sees (*volatile*) and what
is on the disk (*durable*). A power loss keeps the durable version only.

* **File data** becomes durable when the file is ``fsync``'d or ``fdatasync``'d (POSIX
  ``fsync``: "all data for the open file descriptor ... transferred to the storage device"),
  and only then. Writes after the last sync are lost; a file that was never synced holds
  nothing (ext4 with delayed allocation leaves exactly such zero-length files after a crash).
  ``O_DIRECT`` writes are treated like any other: they bypass the page cache, but neither
  the file's size nor the device's write cache is durable before an ``fsync``.
* **Directory entries** (a created, renamed or removed name) become durable when the directory
  itself is ``fsync``'d, and only then. POSIX promises nothing for a directory entry until its
  directory is synced, so ``fsync`` of a new file does *not* make its name durable here (on ext4
  it does in practice). A rename touches two directories: the new name is durable when the
  target directory is synced, the removal of the old name when the source directory is; until
  both are, the file may be found under either name or both.
* Syncing a directory makes its entries durable, not their contents: a durable entry of a
  directory whose own entries were never synced is an empty directory.
* ``sync_file_range`` makes nothing durable (it does not flush metadata or the device cache);
  ``sync``/``syncfs`` would make everything durable but are refused (never seen, not modelled).

Two crash states are taken at every *boundary*, that is before each ``fsync``, ``fdatasync``
and ``rename`` the process issued on the base directory, and once at the end of the trace:

* ``posix``: only what the rules above made durable: unsynced data and unsynced directory
  entries are lost. The state a crash leaves when the file system honours POSIX and no more.
* ``journal``: every namespace operation so far survives, in program order, but file data only
  as far as it was synced. The state of a journalling file system (ext4 ``data=ordered`` with
  delayed allocation, XFS) whose metadata journal was committed but whose data blocks were not:
  the "renamed over, but zero-length" outcome that application bugs usually hit.

Both lose at least as much as ext4 would, so a program correct on them is correct on ext4 at
that point. Other orders (a later unsynced operation persisted while an earlier one was not) are
not enumerated: that is ALICE's larger search, which this does not claim.

What is refused rather than guessed: hard links and symlinks, ``copy_file_range``/``sendfile``,
``sync``/``syncfs``, ``O_TMPFILE`` and an unknown syscall touching the base directory raise
``ValueError``; and after the last operation the model's volatile state must equal the real
directory byte for byte (:meth:`Replay.check_against`), so a write the trace missed (``mmap``,
``io_uring``) fails the test instead of making its states wrong.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# The syscalls that can change files, plus ``openat`` (it also carries the run's markers).
TRACED = (
    "open,openat,creat,close,write,pwrite64,writev,pwritev,pwritev2,lseek,ftruncate,truncate,"
    "fallocate,fsync,fdatasync,sync_file_range,rename,renameat,renameat2,unlink,unlinkat,rmdir,"
    "mkdir,mkdirat,dup,dup2,dup3,fcntl,link,linkat,symlink,symlinkat,sync,syncfs,"
    "copy_file_range,sendfile"
)
# -y: paths of file descriptors; -xx: every string in hex (one parser for paths and data);
# -s: whole buffers; --seccomp-bpf: only traced syscalls stop the process (JAX opens thousands
# of files while it starts).
STRACE_ARGS = ("-f", "-qq", "--seccomp-bpf", "-y", "-xx", "-s", str(1 << 26), "-e")
MARK_PREFIX = "/.cocijax-powerloss-mark/"
"""A run marks an event by opening ``MARK_PREFIX + name`` (which fails; the trace keeps it)."""


def strace_command(trace: Path) -> list[str]:
    """The strace command line that records into ``trace``; the program follows."""
    return ["strace", *STRACE_ARGS, f"trace={TRACED}", "-o", str(trace)]


@dataclasses.dataclass(frozen=True)
class Call:
    """One syscall event: its name, arguments (parsed), return value and where it was seen.

    ``phase`` is ``"full"`` for a call strace printed on one line, else ``"start"`` (another
    thread interrupted it: ``ret`` is None) and later ``"end"`` (the same arguments, with
    ``ret``). A call takes effect somewhere between the two: see :meth:`Replay.apply`.
    """

    name: str
    args: list[Any]
    ret: int | None
    line: int
    pid: str
    phase: str


_LINE = re.compile(r"^(\d+)\s+(.*)$")
_UNFINISHED = " <unfinished ...>"
_RESUMED = re.compile(r"^<\.\.\. (\w+) resumed>(.*)$")
_CALL = re.compile(r"^(\w+)\((.*)\)\s+=\s+(-?\d+|\?)(?:<((?:\\x[0-9a-f]{2})*)>)?(.*)$")
_STARTED = re.compile(r"^(\w+)\((.*)$")


def parse(text: str) -> Iterator[Call]:
    """The syscall events of an ``strace -f -y -xx`` log, in the order strace printed them."""
    pending: dict[str, str] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        m = _LINE.match(raw)
        if not m:
            continue
        pid, body = m.groups()
        phase = "full"
        if body.endswith(_UNFINISHED):
            body = body[: -len(_UNFINISHED)]
            pending[pid] = body
            started = _STARTED.match(body)
            if started is None:
                raise ValueError(f"trace line {number}: cannot parse {raw[:200]!r}")
            yield Call(started.group(1), _split_args(started.group(2)), None, number, pid, "start")
            continue
        resumed = _RESUMED.match(body)
        if resumed:
            body = pending.pop(pid) + resumed.group(2)
            phase = "end"
        if body.startswith(("+++", "---")):
            continue  # exits and signals
        call = _CALL.match(body)
        if call is None:
            raise ValueError(f"trace line {number}: cannot parse {raw[:200]!r}")
        name, args, ret, _, _ = call.groups()
        if ret == "?":
            continue  # the process exited inside the call
        yield Call(name, _split_args(args), int(ret), number, pid, phase)


_TOKEN = re.compile(r'"((?:\\x[0-9a-f]{2})*)"(\.\.\.)?|(-?\d+)<((?:\\x[0-9a-f]{2})*)>')


def _decode(hexstr: str) -> bytes:
    return bytes.fromhex(hexstr.replace("\\x", ""))


def _split_args(text: str) -> list[Any]:
    """Top-level arguments: bytes for strings, ``(fd, path)`` for annotated fds, lists of
    iovecs as lists of bytes, anything else as its text."""
    out: list[Any] = []
    depth, start, i = 0, 0, 0
    while i < len(text):
        c = text[i]
        if c == '"':
            i = text.index('"', i + 1)
        elif c in "[{":
            depth += 1
        elif c in "]}":
            depth -= 1
        elif c == "," and depth == 0:
            out.append(_arg(text[start:i].strip()))
            start = i + 1
        i += 1
    if text[start:].strip():
        out.append(_arg(text[start:].strip()))
    return out


def _arg(text: str) -> Any:
    if text.startswith("["):
        strings = re.findall(r'iov_base="((?:\\x[0-9a-f]{2})*)"(\.\.\.)?', text)
        if any(dots for _, dots in strings):
            raise ValueError(f"a truncated buffer in the trace: {text[:80]}; raise -s")
        return [_decode(s) for s, _ in strings]
    m = _TOKEN.fullmatch(text)
    if m and m.group(1) is not None:
        if m.group(2):
            raise ValueError(f"a truncated buffer in the trace: {text[:80]}; raise -s")
        return _decode(m.group(1))
    if m:
        return (int(m.group(3)), _decode(m.group(4)).decode())
    if text.startswith("AT_FDCWD<"):
        return ("AT_FDCWD", _decode(text[len("AT_FDCWD<") : -1]).decode())
    return text


@dataclasses.dataclass(eq=False)
class Inode:
    """A file or directory: what the process sees (volatile) and what a crash keeps (durable)."""

    is_dir: bool
    data: bytearray = dataclasses.field(default_factory=bytearray)
    synced: bytes = b""
    entries: dict[str, Inode] = dataclasses.field(default_factory=dict)
    durable: dict[str, Inode] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class _Fd:
    inode: Inode
    offset: int = 0
    append: bool = False


@dataclasses.dataclass(frozen=True)
class CrashState:
    """One state a power loss can leave: relative path -> file bytes, or None for a directory.

    Attributes:
      model: ``"posix"`` or ``"journal"`` (see the module docstring).
      boundary: index of the boundary (0-based, in trace order).
      before: the syscall the crash precedes (``"end"`` after the last one), with its line.
      marks: the run's markers seen before the crash point, in order.
      files: the state itself.
    """

    model: str
    boundary: int
    before: str
    marks: tuple[str, ...]
    files: dict[str, bytes | None]

    @property
    def committed(self) -> int | None:
        """The newest step marked committed before the crash point (None before any)."""
        steps = [int(m.split("/")[1]) for m in self.marks if m.startswith("committed/")]
        return max(steps) if steps else None

    def digest(self) -> str:
        """Identifies the state and what must hold in it (two boundaries may give the same)."""
        h = hashlib.sha256(f"committed={self.committed}\0".encode())
        for path in sorted(self.files):
            content = self.files[path]
            h.update(path.encode() + b"\0" + (b"D" if content is None else b"F" + content))
            h.update(b"\0")
        return h.hexdigest()

    def build(self, base: Path) -> None:
        """Writes this state at ``base`` (which must not exist)."""
        base.mkdir(parents=True)
        for path in sorted(self.files):
            content = self.files[path]
            target = base / path
            if content is None:
                target.mkdir(exist_ok=True)
            else:
                target.write_bytes(content)


class Replay:
    """Applies traced calls under ``base`` to the model and yields crash states at boundaries.

    Args:
      base: the directory whose crash states are wanted; it must exist and be durable (empty)
        when the trace starts.
      cwd: the traced process's working directory (for relative paths).
    """

    def __init__(self, base: Path, cwd: Path):
        self.base = str(base)
        self.cwd = str(cwd)
        self.root = Inode(is_dir=True)
        self.fds: dict[int, _Fd] = {}
        self.marks: list[str] = []
        self._syncing: dict[tuple[str, int], Any] = {}  # (pid, fd) -> what an fsync covers
        self._deferred: set[str] = set()  # threads whose started call applies at its end

    # -- paths --------------------------------------------------------------------------------

    def _abs(self, path: str, dirfd: Any = None) -> str:
        if path.startswith("/"):
            return os.path.normpath(path)
        if isinstance(dirfd, tuple):
            return os.path.normpath(os.path.join(dirfd[1], path))
        return os.path.normpath(os.path.join(self.cwd, path))

    def _rel(self, path: str) -> list[str] | None:
        if path == self.base:
            return []
        if path.startswith(self.base + "/"):
            return path[len(self.base) + 1 :].split("/")
        return None

    def _lookup(self, parts: list[str]) -> Inode | None:
        node = self.root
        for part in parts:
            if not node.is_dir or part not in node.entries:
                return None
            node = node.entries[part]
        return node

    def _parent(self, parts: list[str], call: Call) -> Inode | None:
        """The directory holding ``parts``; None when a call that may have failed lacks it."""
        parent = self._lookup(parts[:-1])
        if parent is None or not parent.is_dir:
            if call.phase == "start":
                return None  # the call fails with ENOENT (its result is not known yet)
            raise ValueError(f"trace line {call.line}: {call.name} in a directory the model lacks")
        return parent

    # -- applying calls -----------------------------------------------------------------------

    def apply(self, call: Call) -> None:
        """Applies one event.

        When a call took effect is only known to lie between its start and its end (threads
        run concurrently), so: a namespace change (create, ``mkdir``, ``rename``, ``unlink``)
        and ``close`` apply at the start, since another thread may use their result before
        the call returns (applied tolerantly: a name that already exists or is already gone
        means the call failed; one whose directory does not exist yet is applied at its end,
        since the thread creating that directory got there first); data writes apply at the
        end, with the byte count returned;
        ``fsync`` covers what was written before it started and makes it durable at its end.
        """
        name, phase = call.name, call.phase
        if name in ("open", "openat", "creat") and phase != "end":
            full, _ = self._open_target(call)
            if full.startswith(MARK_PREFIX):
                self.marks.append(full[len(MARK_PREFIX) :])
                return
        if phase == "full" and call.ret is not None and call.ret < 0:
            return  # a failed call changes nothing
        opens = name in ("open", "openat", "creat")
        if opens or name in _AT_START:
            do = self._open_entry if opens else getattr(self, f"_do_{name}")
            if phase == "start":
                if not do(call):
                    self._deferred.add(call.pid)
            else:
                if phase == "full" or (call.pid in self._deferred and (call.ret or 0) >= 0):
                    do(call)
                self._deferred.discard(call.pid)
            if opens and phase != "start" and call.ret is not None and call.ret >= 0:
                self._open_fd(call)
            return
        if name in ("fsync", "fdatasync"):
            if phase != "end":
                self._sync_start(call)
            if phase != "start" and call.ret is not None and call.ret >= 0:
                self._sync_end(call)
            return
        if phase == "start" or call.ret is None or call.ret < 0:
            return
        handler = getattr(self, f"_do_{name}", None)
        if handler is None:
            if self._touches_base(call):
                raise ValueError(f"trace line {call.line}: {name} is not modelled")
            return
        handler(call)

    def is_boundary(self, call: Call) -> bool:
        """Whether a crash state is taken just before this event takes effect."""
        if call.name in ("fsync", "fdatasync"):
            return (
                call.phase != "start"
                and (call.ret or 0) >= 0
                and self._fd(call.args[0]) is not None
            )
        if call.name in ("rename", "renameat", "renameat2"):
            return call.phase != "end" and (call.ret or 0) >= 0 and self._touches_base(call)
        return False

    def _touches_base(self, call: Call) -> bool:
        for a in call.args:
            if isinstance(a, tuple) and self._rel(a[1]) is not None:
                return True
            if isinstance(a, tuple) and a[0] in self.fds:
                return True
            if isinstance(a, bytes) and self._rel(self._abs(a.decode(errors="replace"))):
                return True
        return False

    def _fd(self, arg: Any) -> _Fd | None:
        return self.fds.get(arg[0]) if isinstance(arg, tuple) else None

    def _open_target(self, call: Call) -> tuple[str, str]:
        if call.name == "openat":
            return self._abs(call.args[1].decode(), call.args[0]), call.args[2]
        flags = "O_WRONLY|O_CREAT|O_TRUNC" if call.name == "creat" else call.args[1]
        return self._abs(call.args[0].decode()), flags

    def _open_entry(self, call: Call) -> bool:
        """The namespace side of an open: creates the file, or truncates it."""
        full, flags = self._open_target(call)
        parts = self._rel(full)
        if parts is None:
            return True
        if "O_TMPFILE" in flags:
            raise ValueError(f"trace line {call.line}: O_TMPFILE is not modelled")
        node = self._lookup(parts)
        if node is None and "O_CREAT" in flags:
            parent = self._parent(parts, call)
            if parent is None:
                return False
            node = Inode(is_dir=False)
            parent.entries[parts[-1]] = node
        if node is not None and "O_TRUNC" in flags and not node.is_dir:
            del node.data[:]
        return True

    def _open_fd(self, call: Call) -> None:
        full, flags = self._open_target(call)
        parts = self._rel(full)
        if parts is None:
            return
        node = self._lookup(parts)
        if node is None:
            raise ValueError(f"trace line {call.line}: opened {full}, unknown to the model")
        self.fds[call.ret] = _Fd(node, append="O_APPEND" in flags)

    def _do_close(self, call: Call) -> bool:
        if isinstance(call.args[0], tuple):
            self.fds.pop(call.args[0][0], None)
        return True

    def _write_at(self, fd: _Fd, offset: int, data: bytes) -> None:
        buf = fd.inode.data
        if len(buf) < offset:
            buf.extend(b"\0" * (offset - len(buf)))
        buf[offset : offset + len(data)] = data

    def _do_write(self, call: Call) -> None:
        fd = self._fd(call.args[0])
        if fd is None:
            return
        offset = len(fd.inode.data) if fd.append else fd.offset
        self._write_at(fd, offset, call.args[1][: call.ret])
        fd.offset = offset + call.ret
        return

    def _do_writev(self, call: Call) -> None:
        fd = self._fd(call.args[0])
        if fd is None:
            return
        data = b"".join(call.args[1])[: call.ret]
        offset = len(fd.inode.data) if fd.append else fd.offset
        self._write_at(fd, offset, data)
        fd.offset = offset + call.ret
        return

    def _do_pwrite64(self, call: Call) -> None:
        fd = self._fd(call.args[0])
        if fd is not None:
            self._write_at(fd, int(call.args[3]), call.args[1][: call.ret])
        return

    def _do_pwritev(self, call: Call) -> None:
        fd = self._fd(call.args[0])
        if fd is not None:
            self._write_at(fd, int(call.args[3]), b"".join(call.args[1])[: call.ret])
        return

    _do_pwritev2 = _do_pwritev

    def _do_lseek(self, call: Call) -> None:
        fd = self._fd(call.args[0])
        if fd is not None:
            fd.offset = call.ret
        return

    def _do_ftruncate(self, call: Call) -> None:
        fd = self._fd(call.args[0])
        if fd is not None:
            size = int(call.args[1])
            data = fd.inode.data
            if size <= len(data):
                del data[size:]
            else:
                data.extend(b"\0" * (size - len(data)))
        return

    def _do_fallocate(self, call: Call) -> None:
        fd = self._fd(call.args[0])
        if fd is not None and "KEEP_SIZE" not in call.args[1]:
            end = int(call.args[2]) + int(call.args[3])
            if end > len(fd.inode.data):
                fd.inode.data.extend(b"\0" * (end - len(fd.inode.data)))
        return

    def _sync_start(self, call: Call) -> None:
        fd = self._fd(call.args[0])
        if fd is not None:
            node = fd.inode
            covered = dict(node.entries) if node.is_dir else bytes(node.data)
            self._syncing[(call.pid, call.args[0][0])] = covered

    def _sync_end(self, call: Call) -> None:
        fd = self._fd(call.args[0])
        covered = self._syncing.pop((call.pid, call.args[0][0]), None)
        if fd is None or covered is None:
            return
        if fd.inode.is_dir:
            fd.inode.durable = covered  # type: ignore[assignment]
        else:
            fd.inode.synced = covered  # type: ignore[assignment]

    def _do_sync_file_range(self, call: Call) -> None:
        pass  # makes nothing durable (see the module docstring)

    def _dup(self, call: Call) -> None:
        fd = self._fd(call.args[0])
        if fd is not None:
            self.fds[call.ret] = fd

    _do_dup = _do_dup2 = _do_dup3 = _dup

    def _do_fcntl(self, call: Call) -> None:
        if len(call.args) > 1 and str(call.args[1]).startswith("F_DUPFD"):
            self._dup(call)

    def _path_arg(self, call: Call, i: int, dirfd: Any = None) -> list[str] | None:
        return self._rel(self._abs(call.args[i].decode(), dirfd))

    def _do_mkdir(self, call: Call) -> bool:
        return self._mkdir(call, self._path_arg(call, 0))

    def _do_mkdirat(self, call: Call) -> bool:
        return self._mkdir(call, self._path_arg(call, 1, call.args[0]))

    def _mkdir(self, call: Call, parts: list[str] | None) -> bool:
        if not parts:
            return True
        parent = self._parent(parts, call)
        if parent is not None:
            parent.entries.setdefault(parts[-1], Inode(is_dir=True))  # exists: EEXIST
        return parent is not None

    def _do_unlink(self, call: Call) -> bool:
        return self._remove(call, self._path_arg(call, 0))

    _do_rmdir = _do_unlink

    def _do_unlinkat(self, call: Call) -> bool:
        return self._remove(call, self._path_arg(call, 1, call.args[0]))

    def _remove(self, call: Call, parts: list[str] | None) -> bool:
        if not parts:
            return True
        parent = self._parent(parts, call)
        if parent is not None:
            parent.entries.pop(parts[-1], None)  # gone already: ENOENT
        return parent is not None

    def _do_rename(self, call: Call) -> bool:
        return self._rename(call, self._path_arg(call, 0), self._path_arg(call, 1), "0")

    def _do_renameat(self, call: Call) -> bool:
        return self._rename(
            call,
            self._path_arg(call, 1, call.args[0]),
            self._path_arg(call, 3, call.args[2]),
            "0",
        )

    def _do_renameat2(self, call: Call) -> bool:
        return self._rename(
            call,
            self._path_arg(call, 1, call.args[0]),
            self._path_arg(call, 3, call.args[2]),
            call.args[4],
        )

    def _rename(self, call: Call, old: list[str] | None, new: list[str] | None, flags) -> bool:
        if old is None and new is None:
            return True
        if old is None or new is None or "RENAME_EXCHANGE" in flags:
            raise ValueError(f"trace line {call.line}: a rename across the base or an exchange")
        src, dst = self._parent(old, call), self._parent(new, call)
        if src is None or dst is None or old[-1] not in src.entries:
            if call.phase == "start":
                return False
            raise ValueError(f"trace line {call.line}: renamed a name the model lacks")
        dst.entries[new[-1]] = src.entries.pop(old[-1])
        return True

    def _refuse(self, call: Call) -> None:
        if self._touches_base(call):
            raise ValueError(f"trace line {call.line}: {call.name} is not modelled")

    def _do_sync(self, call: Call) -> None:
        raise ValueError(f"trace line {call.line}: sync is not modelled")

    _do_link = _do_linkat = _do_symlink = _do_symlinkat = _refuse
    _do_copy_file_range = _do_sendfile = _do_syncfs = _refuse

    # -- crash states -------------------------------------------------------------------------

    def state(self, model: str, boundary: int, before: str) -> CrashState:
        files: dict[str, bytes | None] = {}

        def walk(node: Inode, prefix: str) -> None:
            entries = node.durable if model == "posix" else node.entries
            for name, child in entries.items():
                path = f"{prefix}{name}"
                if child.is_dir:
                    files[path] = None
                    walk(child, path + "/")
                else:
                    files[path] = child.synced

        walk(self.root, "")
        return CrashState(model, boundary, before, tuple(self.marks), files)

    def volatile(self) -> dict[str, bytes | None]:
        """What the process saw last: every file's current bytes (None for directories)."""
        files: dict[str, bytes | None] = {}

        def walk(node: Inode, prefix: str) -> None:
            for name, child in node.entries.items():
                path = f"{prefix}{name}"
                files[path] = None if child.is_dir else bytes(child.data)
                if child.is_dir:
                    walk(child, path + "/")

        walk(self.root, "")
        return files

    def check_against(self, base: Path) -> None:
        """Raises unless the model's volatile state equals the real directory at ``base``."""
        real: dict[str, bytes | None] = {}
        for p in sorted(base.rglob("*")):
            rel = str(p.relative_to(base))
            real[rel] = None if p.is_dir() else p.read_bytes()
        model = self.volatile()
        if real != model:
            only_real = sorted(set(real) - set(model))[:5]
            only_model = sorted(set(model) - set(real))[:5]
            differ = sorted(k for k in set(real) & set(model) if real[k] != model[k])[:5]
            raise ValueError(
                "the trace does not account for the directory: only on disk "
                f"{only_real}, only in the model {only_model}, different {differ}"
            )


def crash_states(trace: str, base: Path, cwd: Path) -> tuple[list[CrashState], Replay]:
    """Every crash state of both models at every boundary of ``trace`` (see the docstring)."""
    replay = Replay(base, cwd)
    states: list[CrashState] = []
    for call in parse(trace):
        if replay.is_boundary(call):
            before = f"{call.name}@{call.line}"
            boundary = len(states) // len(MODELS)
            states.extend(replay.state(m, boundary, before) for m in MODELS)
        replay.apply(call)
    boundary = len(states) // len(MODELS)
    states.extend(replay.state(m, boundary, "end") for m in MODELS)
    return states, replay


_AT_START = frozenset(
    {"close", "mkdir", "mkdirat", "unlink", "unlinkat", "rmdir", "rename", "renameat", "renameat2"}
)
MODELS = ("posix", "journal")


def rebuild(state: CrashState, base: Path) -> None:
    """Replaces whatever is at ``base`` with ``state``."""
    if base.exists():
        shutil.rmtree(base)
    state.build(base)
