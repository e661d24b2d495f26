"""The framework-neutral core both checkpoint managers stand on.

:class:`cocijax.CheckpointManager` (JAX, Orbax) and ``cocijax.torch.CheckpointManager`` (PyTorch,
DCP) are thin backends over this package: they write, list, delete and read their own files;
what a manager *decides* lives here, once:

* the contract and its errors (``_contract``: :class:`ManagerProtocol`, step checks);
* the policy driver (``_driver``: the policy fed at its check steps, the first save early),
  what it feeds the policy (``_policy_inputs``: robust measured step time and cost, the cost
  prior, the loss read late) and the policy state's JSON format (``_policy_state``);
* the job's run history (``_history``: failures, uptime, learned MTBF and recovery time);
* the writer's lock (``_lock``);
* the checkpoint directory's identity (``_identity``), and the memory tier's rules: its
  arguments, its folder's lock and owner, its budget and two slots (``_memory``);
* preemption signals turned into one save per manager, and the job's end (``_preemption``);
* retention: best-N that keeps the newest steps (``_retention``);
* the close order (``_session``).

It imports neither Orbax nor TensorStore nor torch (``import cocijax.torch`` stays light); JAX
only for the policies it drives. This is not a user API: users import ``cocijax`` and
``cocijax.torch``.
"""
