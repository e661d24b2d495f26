"""The framework-neutral core both checkpoint managers stand on.

:class:`cocijax.CheckpointManager` (JAX, Orbax) and ``cocijax.torch.CheckpointManager`` (PyTorch,
DCP) are thin backends over this package: they write, list, delete and read their own files;
what a manager *decides* lives here, once:

* the contract and its errors (``_contract``: :class:`ManagerProtocol`, step checks);
* the policy driver (``_driver``: measured step time and cost, the loss read late, the policy
  fed at its check steps, its state to and from JSON);
* the job's run history (``_history``: failures, uptime, learned MTBF and recovery time);
* the writer's lock (``_lock``);
* preemption signals turned into one save per manager, and the job's end (``_preemption``);
* retention: best-N that keeps the newest steps (``_retention``);
* the close order (``_session``).

It imports neither Orbax nor TensorStore nor torch (``import cocijax.torch`` stays light); JAX
only for the policies it drives. This is not a user API: users import ``cocijax`` and
``cocijax.torch``.
"""
