"""Checkpoint managers: a policy decides when to save; the manager measures what it needs.

* :class:`CheckpointManager` (JAX): composes Orbax's ``CheckpointManager`` with the striped
  handler; ``save(step, state, loss=...)`` after every step.
* :class:`SaveDecisionPolicy`: any cocijax policy inside your own ``ocp.CheckpointManager``.
* ``cocijax.torch.CheckpointManager`` (PyTorch, DCP) shares this package's core: the driver
  (``_driver``: measured step time and save cost, the loss read late, the policy fed only at
  its check steps), the job history (``_history``: learned MTBF and recovery time), the
  directory lock (``_lock``), best-N retention that keeps the newest steps
  (``_retention.BestN``), preemption signals turned into one agreed save step
  (``_preemption.PreemptionWatcher``) and the contract and errors (``_contract``) both managers
  follow.

With ``durable=``, the JAX manager keeps a second, durable tier (``_tiers``): committed steps
are drained there in the background (an object store or a shared file system). With
``host_local=True`` each process of a multi-process job has local folders of its own and the
durable tier is shared (``_hosts``).
"""

from cocijax.core._contract import (
    DirectoryLockedError,
    ManagerClosedError,
    ManagerProtocol,
    Measurements,
    StepDeletedError,
    StepMismatchError,
)
from cocijax.manager._checkpoint_manager import CheckpointManager
from cocijax.manager._hosts import HostsError
from cocijax.manager._save_decision import SaveDecisionPolicy
from cocijax.manager._tiers import DurableTierError

__all__ = [
    "CheckpointManager",
    "DirectoryLockedError",
    "DurableTierError",
    "HostsError",
    "ManagerClosedError",
    "ManagerProtocol",
    "Measurements",
    "SaveDecisionPolicy",
    "StepDeletedError",
    "StepMismatchError",
]
