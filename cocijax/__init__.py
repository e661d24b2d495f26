"""cocijax: decide *when* to checkpoint a training job, and make each checkpoint cheap.

* ``cocijax.policies``: convergence-aware (COCI) and classic (Young, Daly, CheckFreq, fixed)
  save policies as pure ``init``/``update`` pairs, optax style.
* ``cocijax.sim``: a fault-injection simulator that scores a save schedule.
* ``cocijax.storage``: an asynchronous Orbax handler that stripes TensorStore writes across
  several storage roots.
"""

__version__ = "0.1.0"

# Each subsystem re-exports its public names below, one import a line.
