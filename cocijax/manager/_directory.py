"""The checkpoint directory of :class:`cocijax.CheckpointManager`: layout, items, options.

What a cocijax directory may hold: step directories (``<step>/state`` written by the striped
handler, ``<step>/policy`` the policy state, ``<step>/metrics`` the step's metrics in Orbax's
own format, and the user's extra items), Orbax's temporary directories, the trash Orbax
renames dropped steps into, the writer's lock file, and (when the directory is also a storage
root) its hidden stripe folder. A step is *committed* when its ``state`` manifest is present
and valid.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import datetime
import os
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import orbax.checkpoint as ocp
from etils import epath

from cocijax.manager._durable import DurableRenameTemporaryPath
from cocijax.manager._orbax_steps import OrbaxStep, find_orbax_step
from cocijax.storage._manifest_io import check_committed

__all__ = [
    "METRICS_ITEM",
    "POLICY_ITEM",
    "RESERVED_ITEMS",
    "STATE_ITEM",
    "STEP_RE",
    "TRASH_DIR",
    "CommittedStepFormat",
    "Layout",
    "check_layout",
    "check_steps",
    "checked_once",
    "is_committed",
    "merge_options",
    "split_best",
]

STATE_ITEM = "state"
POLICY_ITEM = "policy"
# Orbax's CheckpointManager keeps a step's metrics in this item (a JSON file named so), which
# its ``metrics(step)`` and ``metadata(step).metrics`` read.
METRICS_ITEM = "metrics"
RESERVED_ITEMS = (STATE_ITEM, POLICY_ITEM, METRICS_ITEM)
TRASH_DIR = ".cocijax-deleted"
STEP_RE = re.compile(r"^\d+$")
TMP_MARK = ".orbax-checkpoint-tmp"


# What is_committed found of each step directory it checked inside a checked_once() block:
# None (committed), or the error that says why not.
_checked: contextvars.ContextVar[dict[Path, Exception | None] | None] = contextvars.ContextVar(
    "cocijax_checked_steps", default=None
)
# Errors that say what a step holds (a file where a directory belongs, or the reverse): damage.
# Any other OSError says only that the storage did not answer (EIO, EACCES, ESTALE, EMFILE).
_DAMAGE_ERRORS = (FileNotFoundError, NotADirectoryError, IsADirectoryError)


def is_committed(step_dir: Path) -> bool:
    """A step is committed when its ``state`` manifest is present and valid.

    Inside :func:`checked_once`, each step directory is read and checked once.
    """
    return _manifest_problem(step_dir) is None


def _manifest_problem(step_dir: Path) -> str | None:
    """Why ``step_dir`` has no valid manifest (None: it has one); once per checked_once block."""
    error = _manifest_error(step_dir)
    return None if error is None else f"no valid manifest: {error}"


def _manifest_error(step_dir: Path) -> Exception | None:
    checked = _checked.get()
    if checked is not None and step_dir in checked:
        return checked[step_dir]
    try:
        check_committed(step_dir / STATE_ITEM)
        error = None
    except (ValueError, OSError, KeyError, TypeError) as e:
        error = e
    if checked is not None:
        checked[step_dir] = error
    return error


def _unreadable(step_dir: Path, error: OSError) -> OSError:
    """The error of opening a directory whose step ``step_dir`` cannot be read now."""
    return OSError(
        error.errno,
        f"directory: step {step_dir} cannot be read ({error}). An I/O error is not proof of "
        "damage, so the step is neither skipped nor set aside: open the directory again once "
        f"the storage answers; if the step is lost for good, move it out of {step_dir.parent}.",
    )


@contextlib.contextmanager
def checked_once() -> Iterator[None]:
    """Inside the block (in this thread), :func:`is_committed` reads each manifest once.

    Also a decorator: each call of the function decorated is one block.

    One restore asks Orbax for the step's items twice (the state, the policy state), and Orbax
    looks each step up twice per restore; opening a manager lists the steps several times,
    and each lookup reads and checks the whole manifest. A block spans one opening or one read
    of a step, during which a committed manifest does not change (a writer renames a step away
    whole; a restore's own read of the manifest then fails).

    Example:
      >>> with checked_once():
      ...     is_committed(Path("no-such-step"))
      False
    """
    # A lookup reading the whole manifest cost ~20 ms for 1024 leaves.
    token = _checked.set({})
    try:
        yield
    finally:
        _checked.reset(token)


def list_committed(directory: Path, known: frozenset[int] = frozenset()) -> list[int]:
    """The committed steps of ``directory``, listed while a writer may be changing it.

    A writer commits a new step (renames it into place) before it renames an old one away, but
    a listing is taken first and checked after: a step that vanishes in between may hide a
    newer one the listing predates. So when a listed step vanishes, the directory is listed
    again (a few times at most). ``known`` steps are committed already: their existence is
    checked, not their manifest.
    """
    steps: list[int] = []
    for _ in range(8):
        names = [name for name in os.listdir(directory) if STEP_RE.match(name)]
        steps, vanished = [], False
        for name in names:
            path = directory / name
            if path.exists() if int(name) in known else is_committed(path):
                steps.append(int(name))
            elif not path.exists():
                vanished = True
        if not vanished:
            break
    return sorted(steps)


@dataclasses.dataclass(frozen=True)
class CommittedStepFormat:
    """Orbax ``NameFormat`` that lists only steps with a valid cocijax manifest.

    Orbax lists every directory named like a step; a step whose manifest is missing or invalid
    (corruption, a foreign tool) must not be listed, restored or counted by ``max_to_keep``.

    Attributes:
      inner: Orbax's own format of step names.
      checked: the steps :func:`check_layout` found committed, with their commit times: Orbax's
        first listing (the manager's opening) takes them from here instead of reading each
        step again, and later listings read them afresh.
      deferred: step directories an opening left unread (``Layout.deferred``): not listed
        until their check is done (:func:`check_steps`) and the set emptied.
    """

    inner: Any = dataclasses.field(default_factory=ocp.path.step.standard_name_format)
    checked: dict[Path, datetime.datetime] = dataclasses.field(default_factory=dict)
    deferred: set[Path] = dataclasses.field(default_factory=set)

    def build_name(self, step: int) -> str:
        return self.inner.build_name(step)

    def find_all(self, base_path: Any) -> Iterator[Any]:
        # Listed here, not by Orbax's format, which builds each step's metadata in a thread
        # pool of its own: step names are plain numbers (merge_options) and a temporary
        # directory's name is not one.
        base = Path(base_path)
        for name in os.listdir(base):
            if not STEP_RE.match(name):
                continue
            path = base / name
            if path in self.deferred:
                continue
            committed_at = self.checked.pop(path, None)
            if committed_at is None:
                committed_at = _commit_time(path)
            if committed_at is not None:
                yield _ListedStep(int(name), epath.Path(path), committed_at)

    def find_step(self, base_path: Any, step: int) -> Any:
        # Looked up here, not by Orbax's format, which checks that the name is not a temporary
        # one through an event loop and threads of its own (twice per restore): a plain
        # number is never a temporary directory's name.
        path = Path(base_path) / self.build_name(step)
        if not path.is_dir():
            raise _NoSuchStep(
                f"No step path found with name={self.build_name(step)} under {base_path} "
                "(deleted, or never committed)"
            )
        if not is_committed(path):
            raise _NoSuchStep(f"{path}: step {step} has no valid cocijax manifest.")
        return ocp.path.step.Metadata(step=step, path=epath.Path(path))


@dataclasses.dataclass(frozen=True)
class _ListedStep(ocp.path.step.Metadata):
    """A step as listed, with its commit time read while it was there.

    Orbax's own metadata reads the commit time when asked (the step directory's mtime when its
    metadata file has none), and a reader opening while the writer deletes a step it has just
    listed failed with ``FileNotFoundError``.
    """

    committed_at: datetime.datetime

    @property
    def commit_timestamp(self) -> datetime.datetime:
        return self.committed_at


def _commit_time(step_dir: Path) -> datetime.datetime | None:
    """The commit time of a listed step, or None when it is not a committed cocijax step."""
    if not is_committed(step_dir):
        return None
    try:
        # Read now: Orbax reads it later, when a writer may have deleted the step.
        return ocp.path.step.Metadata(int(step_dir.name), epath.Path(step_dir)).commit_timestamp
    except (FileNotFoundError, NotADirectoryError):
        # Deleted since it was listed. Orbax checks that the step exists, then that it is a
        # directory: a step removed in between is "not a directory" to it.
        if step_dir.is_dir():
            raise
        return None
    except Exception:  # damaged Orbax metadata: not listed (a writer sets it aside)
        return None


class _NoSuchStep(FileNotFoundError, ValueError):
    """No committed step of that number: Orbax's ``find_step`` raises a ``ValueError``.

    Also a ``FileNotFoundError``, which is what Orbax's metrics reader expects of a missing
    step: a read-only manager that opens while the writer deletes a step it has just listed
    then opens without that step's metrics, instead of failing with the ``ValueError``.
    """


@dataclasses.dataclass(frozen=True)
class Layout:
    """What :func:`check_layout` found besides committed cocijax steps.

    Attributes:
      damaged: ``(step directory, what is wrong)`` for each cocijax step that cannot be listed:
        no valid manifest (never committed, or damaged since), or unreadable Orbax metadata.
      orbax: steps written by Orbax's own ``CheckpointManager``, by step number.
      committed: the committed cocijax steps, with their commit times (see
        :class:`CommittedStepFormat`).
      deferred: with ``check_layout(lazy=True)``, the cocijax step directories older than the
        newest committed one, not read yet (see :func:`check_steps`).
    """

    damaged: list[tuple[Path, str]]
    orbax: dict[int, OrbaxStep]
    committed: dict[Path, datetime.datetime]
    deferred: set[Path] = dataclasses.field(default_factory=set)


def check_layout(directory: Path, *, lazy: bool = False) -> Layout:
    """Raises if ``directory`` holds something cocijax cannot read; says what else it holds.

    Allowed: cocijax step directories, steps written by Orbax's ``CheckpointManager`` (see
    ``_orbax_steps``), Orbax temporary directories, and hidden entries (our lock, identity,
    trash, quarantine and, when ``directory`` is also a root, its stripe folder). An entry that
    vanishes while it is looked at was deleted by a writer: it is skipped.

    Args:
      directory: the checkpoint directory.
      lazy: read the steps newest first, and only down to the newest committed cocijax step
        (what ``latest_step`` needs); the older ones that have a ``state`` item are left in
        ``Layout.deferred``, for :func:`check_steps` to read when all of them are needed.

    Raises:
      ValueError: an entry neither cocijax nor Orbax wrote (names it).
      OSError: a step cannot be read (an I/O error, named with the step): it is not taken for
        damage, which a writer would set aside.
    """
    steps = []
    for entry in directory.iterdir():
        name = entry.name
        if name.startswith(".") or TMP_MARK in name:
            continue
        if STEP_RE.match(name) and entry.is_dir():
            steps.append(entry)
        elif os.path.lexists(entry):
            raise ValueError(
                f"directory: {entry} was not written by cocijax (expected only step "
                "directories). Use an empty, cocijax or Orbax CheckpointManager directory."
            )
    if not lazy:
        return check_steps(steps)
    layout = check_steps([])
    for entry in sorted(steps, key=lambda entry: int(entry.name), reverse=True):
        if layout.committed and (entry / STATE_ITEM).is_dir():
            layout.deferred.add(entry)  # older than the newest committed step: not read now
        else:
            _check_step(entry, layout)
    layout.damaged.reverse()  # oldest first, as check_steps
    return layout


def check_steps(step_dirs: Iterable[Path]) -> Layout:
    """What :func:`check_layout` finds of these step directories (none deferred).

    Raises:
      ValueError, OSError: as :func:`check_layout`.
    """
    layout = Layout(damaged=[], orbax={}, committed={})
    for entry in sorted(step_dirs, key=lambda entry: int(entry.name)):
        _check_step(entry, layout)
    return layout


def _check_step(entry: Path, layout: Layout) -> None:
    """Reads the step directory ``entry`` into ``layout`` (see :func:`check_layout`)."""
    committed_at, problem = _read_step(entry)
    if committed_at is not None:
        layout.committed[entry] = committed_at
    if problem is None:
        return
    orbax = find_orbax_step(entry)
    if orbax is not None:
        layout.orbax[int(entry.name)] = orbax
    elif (entry / STATE_ITEM).is_dir():
        if entry.exists():
            layout.damaged.append((entry, problem))
    elif entry.exists():
        raise ValueError(
            f"directory: {entry} looks like a checkpoint step but has neither a "
            f"'{STATE_ITEM}' item of cocijax's nor Orbax's metadata naming its items "
            "(_CHECKPOINT_METADATA); it was written by neither. Use an empty, cocijax "
            "or Orbax CheckpointManager directory."
        )


def _read_step(step_dir: Path) -> tuple[datetime.datetime | None, str | None]:
    """(its commit time, None) for a committed step; (None, why not) or (None, None) when it
    vanished while it was read (a writer deleted it).

    Raises:
      OSError: the step cannot be read (an I/O error, not damage: see :func:`_unreadable`).
    """
    error = _manifest_error(step_dir)
    if isinstance(error, OSError) and not isinstance(error, _DAMAGE_ERRORS):
        raise _unreadable(step_dir, error) from error
    if error is not None:
        return None, _manifest_problem(step_dir)
    try:
        metadata = ocp.path.step.Metadata(int(step_dir.name), epath.Path(step_dir))
        return metadata.commit_timestamp, None
    except (FileNotFoundError, NotADirectoryError):
        return None, None if not step_dir.exists() else "its Orbax metadata vanished"
    except _DAMAGE_ERRORS as e:
        return None, f"its Orbax metadata cannot be read ({type(e).__name__}: {e})"
    except OSError as e:
        raise _unreadable(step_dir, e) from e
    except Exception as e:  # Orbax's own errors of a damaged metadata file are of any type
        return None, f"its Orbax metadata cannot be read ({type(e).__name__}: {e})"


def merge_options(
    options: ocp.CheckpointManagerOptions | None, **shortcuts: Any
) -> ocp.CheckpointManagerOptions:
    options = options or ocp.CheckpointManagerOptions()
    _check_retention({**vars(options), **{k: v for k, v in shortcuts.items() if v is not None}})
    for name, value in shortcuts.items():
        if value is None:
            continue
        current = getattr(options, name)
        if current is not None and current != value:
            raise ValueError(
                f"{name}: given as {value!r} and as {current!r} in options; give it once."
            )
        options = dataclasses.replace(options, **{name: value})
    unsupported = (
        "save_decision_policy",
        "should_save_fn",
        "step_name_format",
        "step_prefix",
        "step_format_fixed_length",
        "save_on_steps",
    )
    for name in unsupported:
        if getattr(options, name):  # None or empty (Orbax turns save_on_steps into a set)
            raise ValueError(
                f"options.{name}: not supported by cocijax.CheckpointManager (the policy decides "
                "when to save, and step directories keep Orbax's plain numeric names); leave it "
                "unset."
            )
    return dataclasses.replace(
        options,
        # Orbax's commit fsyncs nothing; a user's own temporary-path class is kept as given.
        temporary_path_class=options.temporary_path_class or DurableRenameTemporaryPath,
        step_name_format=CommittedStepFormat(),
        # Failed saves are removed by the manager's garbage collection (_gc), after waiting:
        # Orbax's own cleanup ran in a thread of its own, racing it.
        cleanup_tmp_directories=False,
        # A reader deletes nothing: Orbax would drop the trash itself, with a warning.
        todelete_subdir=None if options.read_only else TRASH_DIR,
        create=not options.read_only,
        # Orbax reads each step's metrics and commit time when it opens; cocijax's retention
        # reads the metrics it ranks by itself, and the commit times matter to Orbax's
        # retention only with keep_time_interval or a preservation policy, which may rank
        # steps by metrics or time (check_layout has read the times anyway;
        # CommittedStepFormat passes them on).
        lightweight_initialize=options.lightweight_initialize
        or (options.keep_time_interval is None and options.preservation_policy is None),
    )


def _check_retention(options: Mapping[str, Any]) -> None:
    """Refuses retention options that would delete every step, or that Orbax refuses late.

    Orbax accepts ``max_to_keep=0`` (and then deletes every committed step, the preemption
    save included) and ``keep_period=0`` (which fails only at the first save, inside its
    thread); a negative value is taken as it comes.

    Raises:
      ValueError: ``max_to_keep`` or ``keep_period`` below 1, or ``keep_time_interval`` not a
        positive duration (naming the argument and what to pass).
    """
    for name in ("max_to_keep", "keep_period"):
        value = options.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(
                f"{name}: expected an int >= 1 or None, got {value!r}"
                + ("; None keeps every step." if name == "max_to_keep" else ".")
            )
    interval = options.get("keep_time_interval")
    if interval is not None and (
        not isinstance(interval, datetime.timedelta) or interval <= datetime.timedelta(0)
    ):
        raise ValueError(
            f"keep_time_interval: expected a positive datetime.timedelta or None, got {interval!r}."
        )


def split_best(
    options: ocp.CheckpointManagerOptions,
    *,
    best_fn: Callable[[Mapping[str, Any]], Any] | None,
    best_mode: str,
) -> tuple[ocp.CheckpointManagerOptions, tuple[Any, str] | None]:
    """Takes best-N retention out of Orbax's options: cocijax keeps the newest steps itself.

    Orbax's ``best_fn`` ranks the newest step too and deletes it when it scores worse
    (google/orbax#526). With a ``best_fn`` (the keyword, or ``options.best_fn``), Orbax is left
    without ``best_fn``, ``max_to_keep`` and ``keep_period``, and the manager applies them
    (``_retention.BestN``).

    Returns:
      The options for Orbax, and ``(best_fn, best_mode)`` or ``None``.

    Raises:
      ValueError: ``best_fn`` or ``best_mode`` given twice with different values, or a
        ``preservation_policy`` beside a ``best_fn``.
    """
    if options.best_fn is not None:
        if best_fn is not None and best_fn is not options.best_fn:
            raise ValueError("best_fn: given as an argument and in options; give it once.")
        if best_mode != "max" and best_mode != options.best_mode:
            raise ValueError(
                f"best_mode: given as {best_mode!r} and as {options.best_mode!r} in options; "
                "give it once."
            )
        best_fn, best_mode = options.best_fn, options.best_mode
    if best_fn is None:
        return options, None
    if options.preservation_policy is not None:
        raise ValueError(
            "preservation_policy: cannot be combined with best_fn (the manager keeps the best "
            "max_to_keep steps and the newest keep_latest ones); give one of them."
        )
    options = dataclasses.replace(options, best_fn=None, max_to_keep=None, keep_period=None)
    return options, (best_fn, best_mode)
