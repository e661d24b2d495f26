"""Checkpoint policies: when to save, as pure ``init``/``update`` pairs.

Example:
  >>> import cocijax as cj
  >>> policy = cj.policies.coci(mtbf_s=4 * 3600.0, recovery_s=60.0, time_weight=0.25)
  >>> state = policy.init()
  >>> save, state = policy.update(state, step=1, loss=2.3, step_time_s=0.5,
  ...                             checkpoint_cost_s=8.0)
"""

from cocijax.policies._base import Policy, default_prior_mtbf_s
from cocijax.policies._by_name import by_name, names
from cocijax.policies._classic import checkfreq, daly, daly_interval, fixed, young, young_interval
from cocijax.policies._coci import CociState, coci
from cocijax.policies._levels import (
    LevelsState,
    YoungLevelsState,
    coci_two_level,
    young_two_level,
)
from cocijax.policies._paper import coci_paper
from cocijax.policies._plan import Batch, next_check, plan, update_many
from cocijax.policies._runner import Runner

__all__ = [
    "Batch",
    "CociState",
    "LevelsState",
    "Policy",
    "Runner",
    "YoungLevelsState",
    "by_name",
    "checkfreq",
    "coci",
    "coci_paper",
    "coci_two_level",
    "daly",
    "daly_interval",
    "default_prior_mtbf_s",
    "fixed",
    "names",
    "next_check",
    "plan",
    "update_many",
    "young",
    "young_interval",
    "young_two_level",
]
