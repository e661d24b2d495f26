"""cocijax for PyTorch: the same save policies drive a PyTorch training loop.

``cocijax.torch.CheckpointManager`` has the contract of ``cocijax.CheckpointManager``: call
``save(step, state, loss=loss)`` after every training step and the policy decides whether this
step is checkpointed. ``torch.distributed.checkpoint`` (DCP) writes the files, asynchronously,
from one process or from every rank of a ``torchrun`` job (see ``CheckpointManager``).

``import cocijax`` never imports this package (nor torch); it needs ``pip install
'cocijax[torch]'``.
"""

try:
    import torch
    import torch.distributed.checkpoint  # noqa: F401
except ImportError as e:  # pragma: no cover - exercised in a subprocess test
    raise ImportError(
        "cocijax.torch needs PyTorch, which is not installed: pip install 'cocijax[torch]'"
    ) from e

from cocijax.torch._directory import METADATA_NAME
from cocijax.torch._manager import CheckpointManager

__all__ = ["METADATA_NAME", "CheckpointManager"]
