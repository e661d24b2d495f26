"""The online convergence model: bounded history, spike clipping, parameter recovery."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cocijax.policies import _convergence as conv


@pytest.mark.parametrize(
    ("family", "p1", "p2", "a", "c"),
    [
        (0, 0.5, 0.05, 2.0, 3.0),  # power law c + a (u + b)^-p
        (0, 1.0, 0.25, 1.5, 0.8),  # 1 / (alpha k + beta) + c
        (0, 2.0, 1.0, 4.0, 1.0),
        (1, 0.2, 0.0, 3.0, 0.5),  # exponential c + a exp(-u / s)
        (1, 0.8, 0.0, 1.0, 2.0),
    ],
)
def test_fitter_recovers_parameters_from_noisy_curves(family, p1, p2, a, c):
    rng = np.random.default_rng(family * 10 + int(p1 * 10))
    n = 5000
    k = np.arange(1, n + 1, dtype=np.float64)
    u = k / n
    clean = c + a * ((u + p2) ** -p1 if family == 0 else np.exp(-u / p1))
    noise = 0.01 * (clean.max() - clean.min())
    y = clean + noise * rng.standard_normal(n)
    y[rng.choice(n, 50, replace=False)] = np.nan  # ignored
    y[rng.choice(n, 20, replace=False)] += 50.0 * (clean.max() - clean.min())  # spikes: clipped
    fit = conv.fit_points(k, y)
    assert bool(fit.ok)
    assert int(fit.family) == family
    assert float(fit.p1) == pytest.approx(p1)
    assert float(fit.a) == pytest.approx(a, rel=0.05)
    assert float(fit.c) == pytest.approx(c, abs=0.05 * a)
    pred = np.asarray(jax.vmap(lambda kk: conv.predict(fit, kk))(jnp.asarray(k, jnp.float32)))
    assert np.max(np.abs(pred - clean)[n // 20 :]) < 3 * noise


def test_history_is_bounded_and_keeps_every_point():
    h = conv.history_init()
    add = jax.jit(conv.history_add)
    n = 3 * conv.NUM_BINS * 4 + 5
    for i in range(1, n + 1):
        h = add(h, float(i), 1.0 / i, True)
    h = add(h, float(n + 1), 0.0, False)  # invalid: not added
    assert int(h.count) == n
    assert float(h.n.sum()) == n
    assert int(h.closed) < conv.NUM_BINS
    assert int(h.width) in (4, 8, 16)
    used = np.asarray(h.n) > 0
    assert np.all(np.diff(np.asarray(h.x)[used]) > 0)  # bins stay in order
    # A bin's mean position is the mean of the steps it holds.
    w = int(h.width)
    assert float(h.x[0]) == pytest.approx((w + 1) / 2)


def test_spikes_are_clipped_before_binning():
    rng = np.random.default_rng(1)
    y = 2.0 + 0.01 * rng.standard_normal(200)
    spiked = y.copy()
    spiked[150] = 1e6
    k = np.arange(1, 201)
    f1, f2 = conv.fit_points(k, y), conv.fit_points(k, spiked)
    assert float(conv.predict(f2, 200.0)) == pytest.approx(float(conv.predict(f1, 200.0)), abs=0.02)


def test_flat_losses_forecast_no_drop_and_rising_ones_no_fit():
    k = np.arange(1, 300)
    flat = conv.fit_points(k, np.full(k.size, 2.0))
    assert float(conv.predict(flat, 299.0) - conv.predict(flat, 1e5)) == pytest.approx(0.0)
    assert not bool(conv.fit_points(k, 1.0 + 1e-3 * k).ok)
