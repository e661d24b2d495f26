"""cocijax: decide *when* to checkpoint a training job, and make each checkpoint cheap.

* ``cocijax.policies``: convergence-aware (COCI) and classic (Young, Daly, CheckFreq, fixed)
  save policies as pure ``init``/``update`` pairs, optax style.
* ``cocijax.sim``: scores a save schedule (Monte Carlo, exact expectation, exact optimum).
* ``cocijax.storage``: an asynchronous Orbax handler that stripes TensorStore writes across
  several storage roots.
* ``cocijax.manager``: checkpoint managers that measure what the policy needs themselves.
* ``cocijax.cli``: the ``cocijax`` command line; ``cocijax.torch``: the PyTorch manager.

Names are imported on first use (PEP 562), so ``import cocijax.cli`` does not import JAX.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# Public name -> the module that defines it (submodules map to themselves).
_EXPORTS = {
    "CheckpointManager": "cocijax.manager",
    "SaveDecisionPolicy": "cocijax.manager",
    "StripedCheckpointHandler": "cocijax.storage",
    "StripedRestore": "cocijax.storage",
    "StripedSave": "cocijax.storage",
    "plan": "cocijax.policies",
    "manager": None,
    "policies": None,
    "sim": None,
    "storage": None,
}

__all__ = [
    "CheckpointManager",
    "SaveDecisionPolicy",
    "StripedCheckpointHandler",
    "StripedRestore",
    "StripedSave",
    "manager",
    "plan",
    "policies",
    "sim",
    "storage",
]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'cocijax' has no attribute {name!r}")
    module = _EXPORTS[name]
    value = (
        importlib.import_module(f"cocijax.{name}")
        if module is None
        else getattr(importlib.import_module(module), name)
    )
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})


if TYPE_CHECKING:  # what type checkers and IDEs see
    from cocijax import manager, policies, sim, storage
    from cocijax.manager import CheckpointManager, SaveDecisionPolicy
    from cocijax.policies import plan
    from cocijax.storage import StripedCheckpointHandler, StripedRestore, StripedSave
