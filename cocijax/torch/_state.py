"""What a PyTorch checkpoint holds, as the state dict DCP writes and reads.

One step's state dict::

    {<the user's state>: modules, optimizers, stateful objects, tensors, values,
     "cocijax": {"step": <int>,
                 "ranks": {"<rank>": {"rng": {...},                   # this rank's RNG states
                                      "extra": {<name>: <bytes>}}}}}  # this rank's extra items

The user's state is written the DCP way: each rank contributes what it holds (the shards of a
``fully_shard`` model), and a value every rank holds alike (a replicated model) is written once.
RNG states and ``extra`` items differ from rank to rank (a data loader's position in its shard
of the data), so each rank writes its own under its rank number and reads back its own. An
``extra`` item is the pickled ``state_dict()`` of its object, one opaque value: a loader's state
dict changes shape as it runs (``None`` before the first batch, a dict after), which DCP's
key-by-key loading of nested dicts could not follow.

Checkpoints of cocijax 0.1 (format ``cocijax.torch/1``) kept one RNG state under
``cocijax.rng``; :func:`rank_template` reads them too.
"""

from __future__ import annotations

import io
import random
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint import state_dict as dcp_state_dict

from cocijax.core._contract import check_extra_names, check_step

__all__ = [
    "RESERVED",
    "RESERVED_EXTRA",
    "check_extra",
    "from_state_dict",
    "load_extra",
    "loaded_rng",
    "own_entry",
    "rank_template",
    "set_rng_state",
    "to_state_dict",
]

RESERVED = "cocijax"
# The names the JAX manager gives its own items; kept out of `extra` in both managers.
RESERVED_EXTRA = ("state", "policy")


def check_extra(extra: Mapping[str, Any] | None) -> dict[str, Any]:
    """The ``extra`` argument of ``save``/``restore``, checked.

    Raises:
      TypeError: ``extra`` is not a mapping, a key is not a string, or an object lacks a
        callable ``state_dict`` or ``load_state_dict`` (naming the key).
      ValueError: a key is reserved (``state``, ``policy``).
    """
    extra = check_extra_names(
        extra, reserved=RESERVED_EXTRA, expected="objects with state_dict/load_state_dict"
    )
    for name, obj in extra.items():
        if not (
            callable(getattr(obj, "state_dict", None))
            and callable(getattr(obj, "load_state_dict", None))
        ):
            raise TypeError(
                f"extra[{name!r}]: expected an object with state_dict() and load_state_dict() "
                f"(e.g. a torchdata StatefulDataLoader), got {type(obj).__name__}."
            )
    return dict(extra)


def own_entry(step: int, rank: int, extra: Mapping[str, Any]) -> dict[str, Any]:
    """The reserved entry this rank writes: the step, its RNG states, its extra items."""
    return {
        "step": step,
        "ranks": {
            str(rank): {
                "rng": _rng_state(),
                "extra": {name: _pack(obj.state_dict()) for name, obj in extra.items()},
            }
        },
    }


def rank_template(fmt: str, rank: int, extra: Mapping[str, Any], *, rng: bool) -> dict[str, Any]:
    """The reserved entry to load this rank's part into (see :func:`own_entry`).

    Args:
      fmt: the checkpoint's format (``cocijax.torch/1`` or ``/2``).
      rank: this rank.
      extra: the extra items to load.
      rng: whether to load the RNG states (not when the world size changed).
    """
    if fmt.endswith("/1"):
        return {"step": 0, **({"rng": _rng_state()} if rng else {})}
    mine: dict[str, Any] = {"extra": {name: b"" for name in extra}}
    if rng:
        mine["rng"] = _rng_state()
    return {"step": 0, "ranks": {str(rank): mine}}


def loaded_rng(entry: Mapping[str, Any], rank: int) -> Mapping[str, Any] | None:
    """The RNG states in a loaded :func:`rank_template`, if it asked for them."""
    if "rng" in entry:
        return entry["rng"]
    return entry.get("ranks", {}).get(str(rank), {}).get("rng")


def load_extra(entry: Mapping[str, Any], rank: int, extra: Mapping[str, Any], step: int) -> None:
    """Loads each extra object from a loaded :func:`rank_template`, in place."""
    saved = entry["ranks"][str(rank)]["extra"]
    for name, obj in extra.items():
        try:
            obj.load_state_dict(torch.load(io.BytesIO(saved[name]), weights_only=False))
        except Exception as e:
            e.add_note(f"while loading extra[{name!r}] of step {step} (rank {rank})")
            raise


def _pack(value: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


# ----------------------------------------------------------------------------- user state
def to_state_dict(state: Mapping[str, Any]) -> dict[str, Any]:
    """The user's ``state`` as DCP saves it (modules and optimizers through DCP's API)."""
    container = _modules(state)
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


def from_state_dict(target: Mapping[str, Any], loaded: Mapping[str, Any]) -> dict[str, Any]:
    """Loads modules and optimizers in place; returns ``target`` with plain values replaced."""
    container = _modules(target)
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


def _modules(state: Mapping[str, Any]) -> torch.nn.ModuleDict:
    return torch.nn.ModuleDict({k: v for k, v in state.items() if isinstance(v, torch.nn.Module)})


def _check_params_owned(key: str, optimizer: torch.optim.Optimizer, modules: torch.nn.Module):
    owned = {id(p) for p in modules.parameters()}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in owned:
                raise ValueError(
                    f"optimizer {key!r} holds a parameter of shape {tuple(p.shape)} that belongs "
                    "to no torch.nn.Module in state; add its module to the same dict"
                )


# ------------------------------------------------------------------------------------ RNG
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


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Sets the RNGs from what :func:`own_entry` saved."""
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


def as_step(step: Any) -> int:
    """:func:`check_step`, which also takes a one-element integer tensor."""
    if isinstance(step, torch.Tensor) and step.numel() == 1 and not step.is_floating_point():
        step = int(step.item())
    return check_step(step)


def tree_nbytes(value: Any) -> int:
    """Bytes of the tensors a save of ``value`` writes (once, for the cost prior)."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, torch.nn.Module):
        return sum(map(tree_nbytes, value.state_dict().values()))
    if isinstance(value, torch.optim.Optimizer):
        return sum(tree_nbytes(v) for per_param in value.state.values() for v in per_param.values())
    if isinstance(value, Mapping):
        return sum(map(tree_nbytes, value.values()))
    return int(getattr(value, "nbytes", 0) or 0)


def as_float(loss: Any) -> float:
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
