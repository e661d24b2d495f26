"""The manager's ``compilation_cache``: compiled programs reused across restarts.

A job that restarts after a failure compiles its training step again before its first step;
for a large model that takes longer than the restore. JAX's persistent compilation cache keeps
each compiled program in a folder, keyed by the program, its options and the devices, and a
later process that compiles the same program loads it from there instead. This module points
that cache at a folder kept beside the checkpoint (a hidden sub-folder of the directory, which
step listings, retention, the tiers' copies and the CLI skip as they skip every hidden entry),
or at a folder the user names.

JAX reads the setting when it first looks the cache up (at the first compilation that may be
cached): a program compiled before the manager is built is neither loaded from the cache nor
written to it. A cache folder the user set already (``jax_compilation_cache_dir``, or the
``JAX_COMPILATION_CACHE_DIR`` environment variable) is kept: JAX initialises its cache once per
process, so a second folder would not be used anyway.
"""

from __future__ import annotations

import logging
import os
import warnings
from pathlib import Path
from typing import Any

import jax

__all__ = ["CACHE_DIR", "check_compilation_cache", "use_compilation_cache"]

log = logging.getLogger(__name__)

# The folder of ``compilation_cache=True``, inside the checkpoint directory (hidden: not a step).
CACHE_DIR = ".cocijax-compile-cache"
# JAX's defaults, which leave out programs that compile in under a second; a training step of a
# small model is one of them, and its restart pays that second each time.
_DEFAULT_MIN_COMPILE_TIME_S = 1.0
_DEFAULT_MIN_ENTRY_SIZE = 0


def check_compilation_cache(value: Any, directory: Path) -> Path | None:
    """The folder a manager's ``compilation_cache`` argument names (None: no cache).

    Args:
      value: ``None``/``False`` (off), ``True`` (``<directory>/.cocijax-compile-cache``), or a
        folder (str or path).
      directory: the checkpoint directory, absolute.

    Returns:
      The cache folder, absolute, or None.

    Raises:
      TypeError: ``value`` is neither a bool, None, nor a path.
      ValueError: the folder is the directory or lies inside it (other than ``True``'s): JAX's
        files there are not steps, and the directory's next opening would refuse it.
    """
    if value is None or value is False:
        return None
    if value is True:
        return directory / CACHE_DIR
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(
            f"compilation_cache: expected True, a folder (str or path) or None, got {value!r}."
        )
    folder = Path(value).expanduser().absolute()
    real, home = folder.resolve(), directory.resolve()
    if (real == home or home in real.parents) and real != home / CACHE_DIR:
        raise ValueError(
            f"compilation_cache={str(value)!r}: is the checkpoint directory {directory} or "
            "lies inside it; JAX's cache files there are not steps, and the directory's next "
            "opening would refuse it. Pass compilation_cache=True (a hidden folder of the "
            "directory), or a folder outside it."
        )
    return folder


def use_compilation_cache(folder: Path) -> None:
    """Points JAX's persistent compilation cache at ``folder``, unless one is set already.

    Small programs are cached too: JAX's minimum compile time and entry size are lowered to
    zero when they are at JAX's defaults (a value the user chose is kept).

    Args:
      folder: the cache folder (created by JAX at its first write).
    """
    current = jax.config.jax_compilation_cache_dir
    if current and Path(current).expanduser().absolute() != folder:
        warnings.warn(
            f"compilation_cache: JAX's compilation cache is set already to {current!r} "
            f"(jax_compilation_cache_dir or JAX_COMPILATION_CACHE_DIR); kept, {str(folder)!r} "
            "is not used. Drop compilation_cache= to silence this.",
            RuntimeWarning,
            stacklevel=4,  # the caller of CheckpointManager(), through checked_once
        )
        return
    if jax.config.jax_persistent_cache_min_compile_time_secs == _DEFAULT_MIN_COMPILE_TIME_S:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    if jax.config.jax_persistent_cache_min_entry_size_bytes == _DEFAULT_MIN_ENTRY_SIZE:
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    jax.config.update("jax_compilation_cache_dir", str(folder))
    log.info("JAX's persistent compilation cache: %s", folder)
