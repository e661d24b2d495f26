"""cocijax for PyTorch: the same save policies drive a PyTorch training loop.

``cocijax.torch.CheckpointManager`` has the contract of ``cocijax.CheckpointManager``: call
``save(step, state, loss=loss)`` after every training step and the policy decides whether this
step is checkpointed. Data is written by ``torch.distributed.checkpoint`` (DCP) with
``async_save``: only the copy of the tensors to host memory blocks the loop; the write, the
``fsync`` and the atomic commit (a rename of a temporary directory) happen in the background.

Layout of ``directory``::

    <step>/                 one committed checkpoint (DCP files + cocijax.json)
    .tmp-<step>-<uuid>/     a save still being written (removed on start-up after a crash)

``cocijax.json`` holds the policy state, so a restarted job continues its schedule instead of
starting it over.

Limitations: one process (DCP's ``no_dist`` mode); a job with an initialised multi-rank process
group is rejected rather than written wrongly.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import random
import re
import shutil
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

try:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import state_dict as dcp_state_dict
    from torch.distributed.checkpoint.api import CheckpointException
except ImportError as e:  # pragma: no cover - exercised in a subprocess test
    raise ImportError(
        "cocijax.torch needs PyTorch, which is not installed: pip install 'cocijax[torch]'"
    ) from e

import numpy as np

from cocijax import policies as _policies
from cocijax._validate import POSITIVE, check
from cocijax.manager._contract import (
    ManagerClosedError,
    Measurements,
    check_step,
    check_step_order,
)
from cocijax.manager._driver import PolicyDriver
from cocijax.manager._faults import run_all
from cocijax.manager._history import RunHistory, process_age_s
from cocijax.manager._lock import DirectoryLock
from cocijax.storage import fsync_dir

__all__ = ["CheckpointManager"]

METADATA_NAME = "cocijax.json"
_FORMAT = "cocijax.torch/1"
_RESERVED_KEY = "cocijax"
_TMP_PREFIX = ".tmp-"
_STEP_DIR = re.compile(r"^\d+$")

# DCP warns on every single-process save/load, even with no_dist=True, which is this module's
# deliberate mode; the async save warns from a worker thread, where catch_warnings cannot reach.
warnings.filterwarnings(
    "ignore",
    message=r"torch\.distributed is (disabled, )?unavailable or uninitialized, assuming the intent",
    category=UserWarning,
)


class CheckpointManager:
    """Saves and restores PyTorch training state when a cocijax policy says so.

    ``state`` is a dict of named objects, the same dict for ``save`` and ``restore``:

    * ``torch.nn.Module``: saved with ``get_model_state_dict`` and loaded in place;
    * ``torch.optim.Optimizer``: saved with ``get_optimizer_state_dict`` (keyed by parameter
      names, so a freshly built optimizer can be restored into) and loaded in place; its
      parameters must belong to the modules in the same dict;
    * anything else with ``state_dict``/``load_state_dict`` (LR schedulers, ``GradScaler``):
      handled by DCP's ``Stateful`` protocol;
    * tensors, numbers, strings and nested dicts of them: saved as they are; ``restore``
      returns the loaded values.

    The manager also saves the RNG states of ``torch`` (and CUDA when present), ``numpy`` and
    Python's ``random``, restored by ``restore``; the key ``"cocijax"`` is reserved for them.

    Step time is measured between ``save`` calls; checkpoint cost is the time ``save`` blocks
    (host copy, plus waiting for the previous save when it is still being written). Both feed
    the policy, with the loss, on every call.

    Args:
      directory: where checkpoints live; created if missing.
      policy: a ``cocijax.policies.Policy``; defaults to ``cocijax.policies.coci()``.
      max_to_keep: keep only the newest this many committed steps (``None`` keeps all).
      use_async: write in the background with ``dcp.async_save`` (default); ``False`` writes
        and commits inside ``save``.
      clock: a monotonic clock in seconds; injectable so tests can replay step times.

    Raises:
      ValueError: when ``max_to_keep`` < 1, or ``directory`` holds checkpoints that were not
        written by ``cocijax.torch``.
      RuntimeError: when a multi-rank process group is initialised.

    Examples:
      >>> import tempfile, torch, cocijax as cj, cocijax.torch as cjt
      >>> model = torch.nn.Linear(4, 1)
      >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
      >>> path, n = tempfile.mkdtemp(), 250
      >>> with cjt.CheckpointManager(path, policy=cj.policies.fixed(100)) as mngr:
      ...     state = {"model": model, "optimizer": opt}
      ...     start = mngr.latest_step() or 0
      ...     if start:
      ...         _ = mngr.restore(target=state)
      ...     for step in range(start + 1, n + 1):
      ...         loss = model(torch.ones(4)).pow(2).sum()
      ...         opt.zero_grad(); loss.backward(); opt.step()
      ...         _ = mngr.save(step, state, loss=loss)
      ...     mngr.wait_until_finished()
      ...     mngr.all_steps()
      [100, 200]
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        policy: _policies.Policy | None = None,
        max_to_keep: int | None = None,
        use_async: bool = True,
        prior_mtbf_s: float | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ):
        age = process_age_s()
        if max_to_keep is not None and max_to_keep < 1:
            raise ValueError(f"max_to_keep must be >= 1 or None, got {max_to_keep}")
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            raise RuntimeError(
                "cocijax.torch.CheckpointManager writes from one process; a process group with "
                f"world_size={dist.get_world_size()} is initialised"
            )
        self._dir = Path(directory)
        self._dir.mkdir(parents=True, exist_ok=True)
        prior = _policies.default_prior_mtbf_s() if prior_mtbf_s is None else prior_mtbf_s
        prior = check("prior_mtbf_s", prior, POSITIVE)
        # Before anything is cleaned up: a second writer would remove the first's save in flight.
        self._dir_lock = DirectoryLock(self._dir)
        self._dir_lock.acquire()
        self._history = RunHistory(self._dir, clock=clock, opened_at_age_s=age)
        self._driver = PolicyDriver(
            policy if policy is not None else _policies.coci(),
            clock=clock,
            history=self._history,
            prior_mtbf_s=prior,
        )
        self._policy_warned = False
        self._max_to_keep = max_to_keep
        self._use_async = use_async
        self._clock = clock
        self._lock = threading.Lock()
        self._executor = concurrent.futures.ThreadPoolExecutor(1, "cocijax-torch-commit")
        self._pending: concurrent.futures.Future | None = None
        self._closed = False

        self._remove_uncommitted()
        self._steps = self._scan_steps()
        self._history.adopt(None)
        if self._steps:
            self._load_policy_state(self._steps[-1], history=True)

    # ----------------------------------------------------------------------------- queries
    @property
    def directory(self) -> Path:
        """The checkpoint directory."""
        return self._dir

    @property
    def policy_state(self) -> Any:
        """The policy state after the latest ``save`` call (a pytree)."""
        return self._driver.state

    @property
    def measurements(self) -> Measurements:
        """The inputs of the policy's last decision, as for ``cocijax.CheckpointManager``.

        Unlike the JAX manager, the loss is this step's own (read at once, not one step late).
        """
        return self._driver.measurements()

    @property
    def checkpoint_cost_s(self) -> float:
        """The latest measured stall of a save in seconds (NaN before the first save)."""
        return self._driver.cost_s

    def all_steps(self) -> list[int]:
        """Saved steps, oldest first, including one still being written."""
        with self._lock:
            return list(self._steps)

    def latest_step(self) -> int | None:
        """The newest saved step (possibly still being written), or ``None``."""
        with self._lock:
            return self._steps[-1] if self._steps else None

    # -------------------------------------------------------------------------------- save
    def save(self, step: int, state: Mapping[str, Any], *, loss: Any, force: bool = False) -> bool:
        """Reports a finished training step; checkpoints it when the policy says so.

        Args:
          step: the number of completed training steps (1-based), larger than every saved step.
          state: the named objects to save (see the class docstring).
          loss: this step's training loss (a float or a 0-d tensor; NaN/inf are passed on and
            ignored by the policies). A tensor is read with ``float``, which waits for it.
          force: save whatever the policy decides (e.g. on the last step). The policy is still
            called, so its state keeps counting steps.

        Returns:
          True when this step is being saved.

        Raises:
          ValueError: when ``step`` is not larger than the latest saved step or the previous
            call's, ``loss`` has several elements, or ``state`` uses the reserved key
            ``"cocijax"``.
          TypeError: when ``step`` is not an int or ``loss`` is not a number.
        """
        self._check_open()
        step = _as_step(step)
        check_step_order(step, self.latest_step(), self._driver.step, self._dir)
        if _RESERVED_KEY in state:
            raise ValueError(f"state key {_RESERVED_KEY!r} is reserved by cocijax.torch")
        loss = _as_float(loss)
        if not (self._driver.decide(step, loss=loss) or force):
            return False
        tmp = self._dir / f"{_TMP_PREFIX}{step}-{uuid.uuid4().hex[:12]}"
        with self._lock:
            self._steps.append(step)
        try:
            # The stall this save costs the loop: waiting for the previous save plus staging.
            with self._driver.saving():
                self._wait_pending()
                state_dict = self._to_state_dict(state)
                state_dict[_RESERVED_KEY] = {"step": step, "rng": _rng_state()}
                snapshot = self._driver.snapshot(loss)
                if self._use_async:
                    write = dcp.async_save(state_dict, checkpoint_id=tmp, no_dist=True)
                else:
                    dcp.save(state_dict, checkpoint_id=tmp, no_dist=True)
                    write = None
            meta = {
                "format": _FORMAT,
                "step": step,
                "time": time.time(),
                "policy": self._driver.to_json(snapshot, cost_s=self._driver.cost_s),
            }
            if write is None:
                self._commit(step, tmp, meta, None)
            else:
                self._pending = self._executor.submit(self._commit, step, tmp, meta, write)
        except BaseException:
            self._abandon(step, tmp)
            raise
        return True

    def _abandon(self, step: int, tmp: Path) -> None:
        """Forgets a save that failed and removes what it wrote."""
        with self._lock:
            if step in self._steps:
                self._steps.remove(step)
        shutil.rmtree(tmp, ignore_errors=True)

    def _commit(self, step: int, tmp: Path, meta: dict, write: Any) -> None:
        """Waits for the DCP write, then publishes ``tmp`` as ``<step>`` atomically."""
        try:
            try:
                if write is not None:
                    write.result()
            except CheckpointException as e:
                # DCP's error is a BaseException carrying per-rank tracebacks: make it ordinary.
                raise RuntimeError(f"saving step {step} to {tmp} failed: {_dcp_message(e)}") from e
            _write_json(tmp / METADATA_NAME, meta)
            os.rename(tmp, self._dir / str(step))
            fsync_dir(self._dir)
            self._history.recorded()  # the job's failures are on record with this step
        except BaseException:
            self._abandon(step, tmp)
            raise
        self._garbage_collect()

    def _garbage_collect(self) -> None:
        if self._max_to_keep is None:
            return
        with self._lock:
            doomed = self._steps[: max(len(self._steps) - self._max_to_keep, 0)]
            self._steps = self._steps[len(doomed) :]
        for s in doomed:
            shutil.rmtree(self._dir / str(s), ignore_errors=True)

    def _wait_pending(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def wait_until_finished(self) -> None:
        """Blocks until the save in flight (if any) is committed; re-raises its error."""
        self._wait_pending()

    # ----------------------------------------------------------------------------- restore
    def restore(
        self, step: int | None = None, target: Mapping[str, Any] | None = None
    ) -> dict[str, Any]:
        """Loads a checkpoint into ``target`` in place, with the RNG and policy states.

        Args:
          step: the step to restore; defaults to the latest.
          target: the same kind of dict that was passed to ``save`` (modules, optimizers and
            stateful objects are loaded in place; tensors are filled in place).

        Returns:
          ``target`` as a new dict whose plain (non-stateful) values are the loaded ones.

        Raises:
          FileNotFoundError: when there is no checkpoint (at ``step``).
          ValueError: when ``target`` is missing or asks for keys the checkpoint lacks.
        """
        self._check_open()
        self.wait_until_finished()
        if target is None:
            raise ValueError(
                "target is required: pass the dict given to save, e.g. "
                "{'model': model, 'optimizer': optimizer}"
            )
        steps = self.all_steps()
        if step is None:
            if not steps:
                raise FileNotFoundError(f"no checkpoint to restore in {self._dir}")
            step = steps[-1]
        elif step not in steps:
            raise FileNotFoundError(f"no checkpoint for step {step} in {self._dir}; have {steps}")
        path = self._dir / str(step)
        state_dict = self._to_state_dict(target)
        state_dict[_RESERVED_KEY] = {"step": 0, "rng": _rng_state()}
        try:
            dcp.load(state_dict, checkpoint_id=path, no_dist=True)
        except (Exception, CheckpointException) as e:
            raise ValueError(f"cannot restore step {step} from {path}: {_dcp_message(e)}") from e
        out = self._from_state_dict(target, state_dict)
        _set_rng_state(state_dict[_RESERVED_KEY]["rng"])
        self._load_policy_state(step)
        self._driver.restart_timing()
        self._history.restored()
        return out

    # ----------------------------------------------------------------------------- helpers
    def _to_state_dict(self, state: Mapping[str, Any]) -> dict[str, Any]:
        modules = {k: v for k, v in state.items() if isinstance(v, torch.nn.Module)}
        container = torch.nn.ModuleDict(modules)
        out: dict[str, Any] = {}
        for key, value in state.items():
            if isinstance(value, torch.nn.Module):
                out[key] = dcp_state_dict.get_model_state_dict(value)
            elif isinstance(value, torch.optim.Optimizer):
                _check_params_owned(key, value, container)
                out[key] = dcp_state_dict.get_optimizer_state_dict(container, value)
            else:
                out[key] = value
        return out

    def _from_state_dict(self, target: Mapping[str, Any], loaded: dict) -> dict[str, Any]:
        modules = {k: v for k, v in target.items() if isinstance(v, torch.nn.Module)}
        container = torch.nn.ModuleDict(modules)
        out = {}
        for key, value in target.items():
            if isinstance(value, torch.nn.Module):
                dcp_state_dict.set_model_state_dict(value, loaded[key])
                out[key] = value
            elif isinstance(value, torch.optim.Optimizer):
                dcp_state_dict.set_optimizer_state_dict(container, value, loaded[key])
                out[key] = value
            elif hasattr(value, "load_state_dict") and hasattr(value, "state_dict"):
                out[key] = value  # DCP already called load_state_dict
            else:
                out[key] = loaded[key]
        return out

    def _load_policy_state(self, step: int, *, history: bool = False) -> None:
        path = self._dir / str(step) / METADATA_NAME
        meta = _read_json(path)
        if history:
            self._driver.load_history(meta.get("policy"))
        try:
            self._driver.load_json(meta.get("policy"), where=str(path))
        except (KeyError, TypeError, ValueError) as e:
            # A different policy than at save time: its schedule cannot continue. Said once.
            if not self._policy_warned:
                self._policy_warned = True
                warnings.warn(
                    f"{e}; this manager's policy starts its schedule fresh.",
                    RuntimeWarning,
                    stacklevel=3,
                )

    def _scan_steps(self) -> list[int]:
        steps = []
        for entry in self._dir.iterdir():
            if not (entry.is_dir() and _STEP_DIR.match(entry.name)):
                continue
            if not (entry / METADATA_NAME).is_file():
                raise ValueError(
                    f"{entry} has no {METADATA_NAME}: {self._dir} holds checkpoints not written "
                    "by cocijax.torch (a JAX cocijax.CheckpointManager directory? use that "
                    "manager or another directory)"
                )
            steps.append(int(entry.name))
        return sorted(steps)

    def _remove_uncommitted(self) -> None:
        for entry in self._dir.iterdir():
            if entry.is_dir() and entry.name.startswith(_TMP_PREFIX):
                shutil.rmtree(entry, ignore_errors=True)

    def _check_open(self) -> None:
        if self._closed:
            raise ManagerClosedError(f"CheckpointManager for {self._dir} is closed.")

    def close(self) -> None:
        """Waits for the save in flight and releases the background thread."""
        if self._closed:
            return
        self._closed = True
        # Each runs whatever the ones before raised: the lock is always released.
        run_all(
            self.wait_until_finished,
            lambda: self._executor.shutdown(wait=True),
            self._history.close,
            self._dir_lock.release,
        )

    def __enter__(self) -> CheckpointManager:
        return self

    def __del__(self):
        # A manager dropped without close() must not keep the directory locked; at interpreter
        # exit the modules used here may already be gone, hence the broad guard.
        try:  # noqa: SIM105
            self._dir_lock.release()
        except Exception:
            pass

    def __exit__(self, *exc: object) -> None:
        self.close()


# --------------------------------------------------------------------------------- helpers
def _dcp_message(e: BaseException) -> str:
    """The underlying errors of a DCP ``CheckpointException`` (without its tracebacks)."""
    if isinstance(e, CheckpointException):
        return "; ".join(str(exc) for exc, _ in e.failures.values())
    return str(e)


def _as_step(step: Any) -> int:
    """:func:`check_step`, which also takes a one-element integer tensor."""
    if isinstance(step, torch.Tensor) and step.numel() == 1 and not step.is_floating_point():
        step = int(step.item())
    return check_step(step)


def _as_float(loss: Any) -> float:
    if isinstance(loss, bool) or loss is None:
        raise TypeError(f"loss must be a number or a one-element tensor, got {loss!r}")
    if isinstance(loss, torch.Tensor | np.ndarray):
        if loss.size == 1 if isinstance(loss, np.ndarray) else loss.numel() == 1:
            return float(loss.item())
        raise ValueError(
            f"loss must have one element, got shape {tuple(loss.shape)}; pass the step's mean loss"
        )
    try:
        return float(loss)
    except (TypeError, ValueError):
        raise TypeError(f"loss must be a number or a one-element tensor, got {loss!r}") from None


def _check_params_owned(key: str, optimizer: torch.optim.Optimizer, modules: torch.nn.Module):
    owned = {id(p) for p in modules.parameters()}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in owned:
                raise ValueError(
                    f"optimizer {key!r} holds a parameter of shape {tuple(p.shape)} that belongs "
                    "to no torch.nn.Module in state; add its module to the same dict"
                )


def _rng_state() -> dict[str, Any]:
    """Every RNG a training loop commonly draws from, as tensors and plain numbers."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    version, internal, gauss_next = random.getstate()
    state = {
        "torch": torch.get_rng_state(),
        "numpy": {
            "kind": kind,
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(gauss),
        },
        "python": {
            "version": int(version),
            "internal": torch.tensor(internal, dtype=torch.int64),
            "gauss_next": gauss_next,
        },
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.stack(torch.cuda.get_rng_state_all())
    return state


def _set_rng_state(state: Mapping[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state(
        (
            n["kind"],
            n["keys"].numpy().astype(np.uint32),
            n["pos"],
            n["has_gauss"],
            n["cached_gaussian"],
        )
    )
    p = state["python"]
    random.setstate((p["version"], tuple(int(x) for x in p["internal"].tolist()), p["gauss_next"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(list(state["cuda"]))


def _write_json(path: Path, obj: Any) -> None:
    with open(path, "w") as f:
        json.dump(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _read_json(path: Path) -> dict:
    try:
        with open(path) as f:
            meta = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read cocijax.torch metadata {path}: {e}") from e
    if not isinstance(meta, dict) or meta.get("format") != _FORMAT:
        raise ValueError(f"{path} is not cocijax.torch metadata (expected format {_FORMAT!r})")
    return meta
