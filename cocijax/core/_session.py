"""What a manager does around its backend, whatever writes the files.

* Which copies a restore tries, in which order (:func:`restore_order`): the step asked for (or
  the newest), then with ``fallback`` every older one, each tier's copy in the tiers' order.
* The close order, which must complete whatever fails on the way (a failed save's error, an I/O
  error, a KeyboardInterrupt): the lock is always released and the previous signal handlers are
  always back. :func:`run_all` is that order's one rule.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

__all__ = ["restore_order", "run_all"]


def restore_order(
    step: int | None,
    tiers: Mapping[str, Sequence[int]],
    *,
    fallback: bool,
    where: str,
) -> list[tuple[int, str]]:
    """The copies a restore tries in turn, ``(step, tier)``: the first that restores wins.

    Args:
      step: the step asked for, or None for the newest of all tiers.
      tiers: each tier's committed steps, in the order its copies are tried (e.g. local first).
      fallback: after the step asked for, every older step, newest first.
      where: names the tiers in errors (the directory, a URL).

    Raises:
      FileNotFoundError: no committed step, or ``step`` is not one (lists the committed ones).

    Example:
      >>> restore_order(None, {"local": [2, 4], "durable": [4, 6]}, fallback=True, where="d")
      [(6, 'durable'), (4, 'local'), (4, 'durable'), (2, 'local')]
    """
    steps = sorted(set().union(*map(set, tiers.values())))
    if step is None:
        if not steps:
            raise FileNotFoundError(f"restore: no committed step in {where}.")
        step = steps[-1]
    elif step not in steps:
        raise FileNotFoundError(
            f"restore: step {step} is not a committed step in {where} (committed: {steps})."
        )
    order = [step] + ([s for s in reversed(steps) if s < step] if fallback else [])
    copies = [(s, tier) for s in order for tier, ts in tiers.items() if s in ts]
    return copies if fallback else copies[:1]


def run_all(*calls: Callable[[], object]) -> None:
    """Calls every one of ``calls`` whatever the earlier ones raise; then raises the first error.

    Later errors are attached to the first as notes, so none is lost and none masks the first
    (a ``finally`` chain would raise the last). A ``KeyboardInterrupt`` does not stop the calls
    that follow it either: they release what must be released.
    """
    first: BaseException | None = None
    for call in calls:
        try:
            call()
        except BaseException as e:
            if first is None:
                first = e
            else:
                first.add_note(f"also: {type(e).__name__}: {e}")
    if first is not None:
        raise first
