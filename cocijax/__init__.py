"""cocijax: decide *when* to checkpoint a training job, and make each checkpoint cheap.

* ``cocijax.policies``: convergence-aware (COCI) and classic (Young, Daly, CheckFreq, fixed)
  save policies as pure ``init``/``update`` pairs, optax style.
* ``cocijax.sim``: a fault-injection simulator that scores a save schedule.
* ``cocijax.storage``: an asynchronous Orbax handler that stripes TensorStore writes across
  several storage roots.
"""

__version__ = "0.1.0"

from cocijax import policies, sim, storage
from cocijax._save_decision import SaveDecisionPolicy
from cocijax.manager import CheckpointManager
from cocijax.policies import plan
from cocijax.storage import StripedCheckpointHandler, StripedRestore, StripedSave

__all__ = [
    "CheckpointManager",
    "SaveDecisionPolicy",
    "StripedCheckpointHandler",
    "StripedRestore",
    "StripedSave",
    "plan",
    "policies",
    "sim",
    "storage",
]
