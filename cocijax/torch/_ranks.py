"""The ranks of a PyTorch job as the manager sees them: one process, or a process group.

A job launched with ``torchrun`` has one process per rank, all writing into one checkpoint
directory on a file system every rank sees (DCP's ``FileSystemWriter`` needs that: rank 0 writes
the metadata, every rank its shards, and any rank may read any file at restore). So everything
that acts on the directory as a whole (the writer's lock, the running marker, removing a
crashed save's leftovers, the commit rename, deleting old steps) is done once, by rank 0, and
the other ranks learn its outcome through a collective (:meth:`Ranks.lead`), success or error:
every rank raises the same error, none waits for ever on a peer that gave up.

The collectives run on two gloo groups of all ranks, created when the manager opens:
``control`` for the training thread (the policy's inputs, opening, restoring) and ``writes``
for the save thread (DCP's own planning and write agreement, then the commit). Gloo pairs the
n-th collective of a group on every rank, so two threads sharing one group could pair
different calls on different ranks; a group per thread cannot. Gloo runs on CPU tensors
whatever backend the job trains with (DCP's ``async_save`` needs a CPU backend anyway).
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any, TypeVar, final

import numpy as np
import torch
import torch.distributed as dist

__all__ = ["Ranks"]

T = TypeVar("T")


@final
class Ranks:
    """This process's rank, the job's world size, and the collectives the manager needs.

    Construct it on every rank at the same point (it creates two process groups: a collective
    call). Without an initialised process group, or with one rank, it is rank 0 of 1 and every
    method runs locally.

    Attributes:
      rank: this process's rank in the default process group (0 without one).
      world: the number of ranks (1 without a process group).
      control: the group of the training thread's collectives (None with one rank).
      writes: the group of the save thread's collectives (None with one rank).

    Example:
      >>> ranks = Ranks()  # no process group: one rank
      >>> (ranks.rank, ranks.world, ranks.leader)
      (0, 1, True)
      >>> ranks.lead(lambda: "done on rank 0", group=ranks.control)
      'done on rank 0'
    """

    def __init__(self) -> None:
        self.control: dist.ProcessGroup | None = None
        self.writes: dist.ProcessGroup | None = None
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            self.rank, self.world = dist.get_rank(), dist.get_world_size()
            self.control = dist.new_group(backend="gloo")
            self.writes = dist.new_group(backend="gloo")
        else:
            self.rank, self.world = 0, 1

    @property
    def leader(self) -> bool:
        """Whether this process is rank 0, the one that acts on the directory."""
        return self.rank == 0

    def broadcast(self, values: np.ndarray) -> np.ndarray:
        """Rank 0's ``values`` on every rank (same shape and dtype on every rank).

        The policy driver applies it to the measured inputs (loss, step time, cost, MTBF,
        recovery) before they reach the policy, so every rank takes rank 0's decisions.
        """
        if self.control is None:
            return values
        tensor = torch.from_numpy(np.array(values, copy=True))
        dist.broadcast(tensor, src=0, group=self.control)
        return tensor.numpy()

    def allgather(self, values: np.ndarray) -> np.ndarray:
        """Every rank's ``values``, stacked in rank order: shape ``(world, *values.shape)``.

        The preemption watcher gathers each rank's signal flag with it (on :attr:`control`),
        so that a signal any one rank received makes every rank save the same step.
        """
        tensor = torch.from_numpy(np.array(values, copy=True))
        if self.control is None:
            return tensor.numpy()[None]
        gathered = [torch.empty_like(tensor) for _ in range(self.world)]
        dist.all_gather(gathered, tensor, group=self.control)
        return torch.stack(gathered).numpy()

    def gather(self, value: T) -> list[T]:
        """Every rank's ``value`` (anything that pickles), in rank order, on :attr:`control`.

        The memory tier's agreements use it: which memory steps each rank holds, whether its
        copy of a step checks out, its run marker's token. Bounded as every collective here:
        by the group's timeout, and by ``torchrun`` stopping the others when a rank dies.
        """
        if self.control is None:
            return [value]
        values: list[Any] = [None] * self.world
        dist.all_gather_object(values, value, group=self.control)
        return values

    def lead(self, fn: Callable[[], T], *, group: dist.ProcessGroup | None) -> T:
        """Runs ``fn`` on rank 0 only; every rank returns its result or raises its error.

        Args:
          fn: the work (its result must pickle).
          group: the group to broadcast the outcome on (:attr:`control` or :attr:`writes`,
            whichever belongs to the calling thread).
        """
        if group is None:
            return fn()
        box: list[Any] = [None]
        if self.leader:
            try:
                box[0] = (True, fn())
            except Exception as e:
                box[0] = (False, _picklable(e))
        dist.broadcast_object_list(box, src=0, group=group)
        ok, value = box[0]
        if not ok:
            raise value
        return value

    def agree(self, fn: Callable[[], T], *, group: dist.ProcessGroup | None) -> T:
        """Runs ``fn`` on every rank; when it fails on any rank, raises on every rank.

        Before a collective write starts, so that one rank's error (e.g. an object whose
        ``state_dict`` raises) is an error on every rank rather than a peer waiting for ever.
        """
        try:
            result, error = fn(), None
        except Exception as e:
            result, error = None, e
        if group is not None:
            errors: list[Any] = [None] * self.world
            dist.all_gather_object(errors, None if error is None else _picklable(error), group)
            failed = [rank for rank, e in enumerate(errors) if e is not None]
            if error is None and failed:
                raise RuntimeError(
                    f"rank {failed[0]} failed, so this rank ({self.rank}) stops too: "
                    f"{type(errors[failed[0]]).__name__}: {errors[failed[0]]}"
                )
        if error is not None:
            raise error
        return result  # type: ignore[return-value]

    def dcp_args(self, group: dist.ProcessGroup | None) -> dict[str, Any]:
        """The process-group arguments of a DCP ``save``/``async_save``/``load`` call.

        None with one rank: DCP then works in this process alone (its ``no_dist`` argument
        says the same, but older torch releases lack it).
        """
        return {} if group is None else {"process_group": group}

    def close(self) -> None:
        """Destroys the two groups (when the default group still exists)."""
        for group in (self.control, self.writes):
            if group is not None and dist.is_initialized():
                dist.destroy_process_group(group)
        self.control = self.writes = None


def _picklable(error: Exception) -> Exception:
    """``error`` itself when it pickles (to cross to the other ranks), else its words."""
    try:
        pickle.loads(pickle.dumps(error))
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")
    return error
