"""Online convergence model: a bounded loss history and a robust curve fit.

The history keeps ``NUM_BINS`` bins of (mean position, mean loss, count). Points go into the open
bin until it holds ``width`` points; when all bins are closed, neighbours merge pairwise and
``width`` doubles. Memory and refit cost are therefore fixed whatever the job length, and the
bins stay evenly spread over the whole history. Upward spikes are clipped before binning
(a loss above ``level + SPIKE_SIGMAS * scale``, with ``level``/``scale`` running averages of the
loss and of its absolute deviation, counts as that bound), a Huber-like guard that keeps a
divergence spike from bending the fit; NaN/inf losses never reach the history.

The fit tries three families, each linear in ``(c, a)`` once its nonlinear parameter is fixed
from a small grid, so every candidate is a closed-form weighted least-squares solve:

* power law ``c + a * (u + b) ** -p`` (``p = 1`` is the ``1 / (alpha k + beta) + c`` form of
  Optimus and SLAQ),
* exponential ``c + a * exp(-u / s)`` (the COCI artifact's ``exp(theta1 t + theta2)`` plus a
  floor),

with ``u = k / k_ref`` the position relative to the newest point. The candidate with the lowest
weighted squared error and ``a >= 0`` (a loss that falls) wins. Bins are weighted by their count
times ``u ** RECENCY`` so that the latest regime (after a learning-rate drop, say) dominates.

References:
  Peng et al., `Optimus: an efficient dynamic resource scheduler for deep learning clusters
  <https://doi.org/10.1145/3190508.3190517>`_, EuroSys 2018 (``1 / (a k + b) + c``).
  Hestness et al., `Deep learning scaling is predictable, empirically
  <https://arxiv.org/abs/1712.00409>`_, 2017 (power laws).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

NUM_BINS = 64
SPIKE_SIGMAS = 6.0
SPIKE_MIN_POINTS = 8
LEVEL_ALPHA = 0.1
RECENCY = 2.0

# Candidate grid: (family, p1, p2); family 0 = power (p1 = p, p2 = b), 1 = exp (p1 = s).
_POWER = [(0, p, b) for p in (0.25, 0.5, 1.0, 2.0) for b in (0.01, 0.05, 0.25, 1.0)]
_EXP = [(1, s, 0.0) for s in (0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 3.2)]
GRID = np.array(_POWER + _EXP, dtype=np.float32)


class History(NamedTuple):
    """Downsampled loss history."""

    x: jnp.ndarray  # shape=(NUM_BINS,), float32, mean position of each bin
    y: jnp.ndarray  # shape=(NUM_BINS,), float32, mean (spike-clipped) loss of each bin
    n: jnp.ndarray  # shape=(NUM_BINS,), float32, points in each bin
    closed: jnp.ndarray  # shape=(), int32, closed bins; bin `closed` is the open one
    width: jnp.ndarray  # shape=(), int32, points per closed bin
    level: jnp.ndarray  # shape=(), float32, running average of the clipped loss
    scale: jnp.ndarray  # shape=(), float32, running average of |loss - level|
    count: jnp.ndarray  # shape=(), int32, finite losses seen


class Fit(NamedTuple):
    """A fitted curve ``c + a * phi(k / k_ref)``."""

    ok: jnp.ndarray  # shape=(), bool, a fit exists
    family: jnp.ndarray  # shape=(), int32, 0 power, 1 exp
    p1: jnp.ndarray  # shape=(), float32, p (power) or s (exp)
    p2: jnp.ndarray  # shape=(), float32, b (power)
    a: jnp.ndarray  # shape=(), float32
    c: jnp.ndarray  # shape=(), float32
    k_ref: jnp.ndarray  # shape=(), float32, position the fit is scaled to
    rmse: jnp.ndarray  # shape=(), float32, weighted RMS residual


def history_init() -> History:
    z = jnp.zeros((NUM_BINS,), jnp.float32)
    return History(
        z,
        z,
        z,
        jnp.zeros((), jnp.int32),
        jnp.ones((), jnp.int32),
        jnp.asarray(jnp.nan, jnp.float32),
        jnp.zeros((), jnp.float32),
        jnp.zeros((), jnp.int32),
    )


def fit_init() -> Fit:
    f = jnp.zeros((), jnp.float32)
    return Fit(
        jnp.zeros((), bool), jnp.zeros((), jnp.int32), f, f, f, f, jnp.ones((), jnp.float32), f
    )


def clip_spike(h: History, loss) -> jnp.ndarray:
    """The loss with upward spikes clipped to the running band."""
    loss = jnp.asarray(loss, jnp.float32)
    bound = h.level + SPIKE_SIGMAS * h.scale + 1e-6 * jnp.abs(h.level)
    return jnp.where(h.count >= SPIKE_MIN_POINTS, jnp.minimum(loss, bound), loss)


def history_add(h: History, x, loss, valid) -> History:
    """Adds point ``(x, loss)`` when ``valid`` (a traced bool); ``loss`` must be finite then."""
    # Module-level branches (not closures) so that eager calls hit JAX's compile cache.
    return jax.lax.cond(
        valid, _add, _keep, h, jnp.asarray(x, jnp.float32), jnp.asarray(loss, jnp.float32)
    )


def _keep(h: History, x, loss) -> History:
    del x, loss
    return h


def _add(h: History, x, loss) -> History:
    y = clip_spike(h, loss)
    first = jnp.isnan(h.level)
    level = jnp.where(first, y, h.level + LEVEL_ALPHA * (y - h.level))
    scale = jnp.where(first, 0.0, h.scale + LEVEL_ALPHA * (jnp.abs(y - h.level) - h.scale))
    i = h.closed
    ni = h.n[i] + 1.0
    xs = h.x.at[i].set(h.x[i] + (x - h.x[i]) / ni)
    ys = h.y.at[i].set(h.y[i] + (y - h.y[i]) / ni)
    ns = h.n.at[i].set(ni)
    closed = jnp.where(ni >= h.width, i + 1, i)
    full = closed >= NUM_BINS
    # Pairwise merge of all bins, used only when every bin is closed.
    n2 = ns[0::2] + ns[1::2]
    x2 = (xs[0::2] * ns[0::2] + xs[1::2] * ns[1::2]) / n2
    y2 = (ys[0::2] * ns[0::2] + ys[1::2] * ns[1::2]) / n2
    pad = jnp.zeros((NUM_BINS // 2,), jnp.float32)
    merge = lambda a, b: jnp.where(full, jnp.concatenate([a, pad]), b)
    return History(
        x=merge(x2, xs),
        y=merge(y2, ys),
        n=merge(n2, ns),
        closed=jnp.where(full, NUM_BINS // 2, closed),
        width=jnp.where(full, h.width * 2, h.width),
        level=level,
        scale=scale,
        count=h.count + 1,
    )


def _phi(family, p1, p2, u):
    power = jnp.power(jnp.maximum(u + p2, 1e-6), -p1)
    expo = jnp.exp(-u / jnp.maximum(p1, 1e-6))
    return jnp.where(family == 0, power, expo)


def predict(fit: Fit, k) -> jnp.ndarray:
    """The fitted loss at position ``k`` (same units as the history's ``x``)."""
    u = jnp.asarray(k, jnp.float32) / fit.k_ref
    return fit.c + fit.a * _phi(fit.family, fit.p1, fit.p2, u)


def converged_at(fit: Fit, drop_total, fraction) -> jnp.ndarray:
    """Position where the forecast drop still to come is ``fraction`` of ``drop_total``.

    Solves ``a * phi(u) = fraction * drop_total`` for the fitted family; ``inf`` when there is
    no usable fit.
    """
    target = fraction * drop_total / jnp.where(fit.a > 0, fit.a, 1.0)
    target = jnp.maximum(target, 1e-30)
    u_power = jnp.power(target, -1.0 / jnp.maximum(fit.p1, 1e-6)) - fit.p2
    u_exp = -fit.p1 * jnp.log(target)
    u = jnp.where(fit.family == 0, u_power, u_exp)
    return jnp.where(fit.ok & (fit.a > 0) & (drop_total > 0), u * fit.k_ref, jnp.inf)


def maybe_fit(do: jnp.ndarray, h: History, k_ref, old: Fit) -> Fit:
    """``fit_history(h, k_ref)`` if ``do`` else ``old``, as a ``lax.cond``."""
    return jax.lax.cond(do, _refit, _old_fit, h, jnp.asarray(k_ref, jnp.float32), old)


def _refit(h: History, k_ref, old: Fit) -> Fit:
    del old
    return fit_history(h, k_ref)


def _old_fit(h: History, k_ref, old: Fit) -> Fit:
    del h, k_ref
    return old


def fit_history(h: History, k_ref) -> Fit:
    """Weighted least-squares fit of every grid candidate; returns the best one."""
    k_ref = jnp.maximum(jnp.asarray(k_ref, jnp.float32), 1e-6)
    u = h.x / k_ref
    w = h.n * jnp.power(jnp.clip(u, 0.0, 1.0), RECENCY)
    grid = jnp.asarray(GRID)
    fam, p1, p2 = grid[:, 0:1].astype(jnp.int32), grid[:, 1:2], grid[:, 2:3]
    phi = _phi(fam, p1, p2, u[None, :])  # (candidates, bins)
    sw = jnp.maximum(w.sum(), 1e-12)
    ybar = (w * h.y).sum() / sw
    pbar = (phi * w).sum(axis=1) / sw
    dp = phi - pbar[:, None]
    dy = h.y - ybar
    var = (w * dp * dp).sum(axis=1)
    cov = (w * dp * dy).sum(axis=1)
    syy = (w * dy * dy).sum()
    good = var > 1e-12 * jnp.maximum(syy, 1e-12)
    a = jnp.where(good, cov / jnp.where(good, var, 1.0), 0.0)
    sse = jnp.where(good & (a >= 0), syy - a * cov, jnp.inf)
    best = jnp.argmin(sse)
    ok = jnp.isfinite(sse[best]) & jnp.isfinite(a[best])
    return Fit(
        ok=ok,
        family=fam[best, 0],
        p1=p1[best, 0],
        p2=p2[best, 0],
        a=a[best],
        c=ybar - a[best] * pbar[best],
        k_ref=k_ref,
        rmse=jnp.sqrt(jnp.maximum(sse[best], 0.0) / sw),
    )


def history_of(x, y) -> History:
    """The history after adding the points ``(x, y)`` in order (NaN/inf ``y`` skipped)."""
    return _history_of(
        jnp.asarray(np.asarray(x, np.float32)), jnp.asarray(np.asarray(y, np.float32))
    )


@jax.jit
def _history_of(x, y):
    def body(h, xy):
        xi, yi = xy
        ok = jnp.isfinite(yi)
        return history_add(h, xi, jnp.where(ok, yi, 0.0), ok), None

    return jax.lax.scan(body, history_init(), (x, y))[0]


def fit_points(x, y, k_ref=None) -> Fit:
    """Fits a whole recorded curve through the same history (a convenience for tests).

    Args:
      x: positions (steps or seconds), increasing.
      y: losses; NaN/inf entries are skipped.
      k_ref: position the fit is scaled to; the last ``x`` by default.

    Returns:
      The best :class:`Fit`.
    """
    h = history_of(x, y)
    return fit_history(h, float(np.max(x)) if k_ref is None else k_ref)
