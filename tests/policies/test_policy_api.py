"""Every policy, table-driven: jit vs eager, purity, state shape, bad arguments, odd inputs."""

import math
import threading

import hypothesis.extra.numpy as hnp
import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import cocijax as cj

N = 120

CASES = {
    "fixed": lambda: cj.policies.fixed(7),
    "young": lambda: cj.policies.young(mtbf_s=600.0),
    "daly": lambda: cj.policies.daly(mtbf_s=600.0),
    "checkfreq": lambda: cj.policies.checkfreq(max_overhead=0.2),
    "coci": lambda: cj.policies.coci(mtbf_s=600.0, recovery_s=30.0, total_steps=N),
    "coci_no_total": lambda: cj.policies.coci(mtbf_s=600.0),
    "coci_paper": lambda: cj.policies.coci_paper(
        mtbf_s=600.0, profile_steps=20, fit_interval=50, time_unit_s=1.0
    ),
}
# Built once: `plan` caches its compiled scan per policy object.
POLICIES = {name: make() for name, make in CASES.items()}


def _inputs(n=N, seed=0):
    rng = np.random.default_rng(seed)
    k = np.arange(1, n + 1)
    losses = (2.0 + 3.0 / np.sqrt(k) + 0.02 * rng.standard_normal(n)).astype(np.float32)
    losses[[5, 40]] = np.nan
    losses[60] = np.inf
    step_times = (1.0 + 0.1 * rng.random(n)).astype(np.float32)
    costs = np.full(n, 4.0, np.float32)
    costs[:3] = np.nan  # not measured yet
    return losses, step_times, costs


def _eager(policy, losses, step_times, costs, steps=None):
    state = policy.init()
    saves = []
    steps = range(1, len(losses) + 1) if steps is None else steps
    for s, loss, t, c in zip(steps, losses, step_times, costs, strict=True):
        save, state = policy.update(state, step=s, loss=loss, step_time_s=t, checkpoint_cost_s=c)
        saves.append(bool(save))
    return np.flatnonzero(saves) + 1, state


@pytest.mark.parametrize("name", CASES)
def test_jit_and_eager_decide_the_same(name):
    losses, step_times, costs = _inputs()
    eager, _ = _eager(POLICIES[name], losses, step_times, costs)
    planned = cj.plan(losses, POLICIES[name], step_time_s=step_times, checkpoint_cost_s=costs)
    np.testing.assert_array_equal(planned, eager)
    assert planned.size > 0, "every policy should save at least once in this job"


@pytest.mark.parametrize("name", CASES)
def test_update_is_pure_and_state_is_arrays(name):
    policy = POLICIES[name]
    update = jax.jit(policy.update)
    state = policy.init()
    for s in range(1, 30):
        _, state = update(state, step=s, loss=3.0 / s, step_time_s=1.0, checkpoint_cost_s=2.0)
    before = jax.tree.map(np.asarray, state)
    out1 = update(state, step=30, loss=0.1, step_time_s=1.0, checkpoint_cost_s=2.0)
    out2 = update(state, step=30, loss=0.1, step_time_s=1.0, checkpoint_cost_s=2.0)
    jax.tree.map(np.testing.assert_array_equal, out1, out2)
    # The input state is untouched.
    jax.tree.map(np.testing.assert_array_equal, before, jax.tree.map(np.asarray, state))
    save = out1[0]
    assert np.asarray(save).dtype == bool and np.asarray(save).shape == ()
    for leaf in jax.tree.leaves(state):
        assert isinstance(leaf, jax.Array)
    assert type(state) is type(policy.init())


@pytest.mark.parametrize("name", ["fixed", "young", "daly", "checkfreq", "coci", "coci_paper"])
def test_by_name_builds_each_policy(name):
    kwargs = {"fixed": {"every": 3}, "checkfreq": {}}.get(name, {"mtbf_s": 100.0})
    policy = cj.policies.by_name(name, **kwargs)
    assert isinstance(policy, cj.policies.Policy)
    save, _ = policy.update(policy.init(), step=3, loss=1.0, step_time_s=1.0, checkpoint_cost_s=1.0)
    assert np.asarray(save).dtype == bool


def test_by_name_rejects_unknown_names_and_arguments():
    with pytest.raises(ValueError, match=r"'nope'.*checkfreq"):
        cj.policies.by_name("nope")
    with pytest.raises(ValueError, match="young"):
        cj.policies.by_name("young", mtbf=1.0)
    assert isinstance(cj.policies.by_name("COCI-paper", mtbf_s=5.0), cj.policies.Policy)


def test_coci_without_an_mtbf_plans_with_the_default_prior():
    """``coci()`` assumes ``default_prior_mtbf_s()`` (24 h over the device count) until an MTBF
    is measured: it saves where it does when that MTBF is measured, and not where another is."""
    prior = cj.policies.default_prior_mtbf_s()
    assert prior == pytest.approx(24 * 3600.0 / jax.device_count())
    n = 1000
    losses = (2.0 + 3.0 / np.sqrt(np.arange(1, n + 1))).astype(np.float32)
    policy = cj.policies.coci()  # one policy object: `plan` compiles its scan once

    def saves(mtbf_s=math.nan):
        return cj.plan(losses, policy, step_time_s=1.0, checkpoint_cost_s=4.0, mtbf_s=mtbf_s)

    default = saves()
    assert default.size > 0
    np.testing.assert_array_equal(default, saves(prior))
    for other in (prior / 4, prior * 4):
        assert not np.array_equal(default, saves(other)), other


BAD = [
    (cj.policies.fixed, {"every": 0}, "every"),
    (cj.policies.fixed, {"every": 2.5}, "every"),
    (cj.policies.young, {"mtbf_s": 0.0}, "mtbf_s"),
    (cj.policies.young, {"mtbf_s": -1.0}, "mtbf_s"),
    (cj.policies.daly, {"mtbf_s": math.inf}, "mtbf_s"),
    (cj.policies.checkfreq, {"max_overhead": 0.0}, "max_overhead"),
    (cj.policies.checkfreq, {"max_overhead": 1.5}, "max_overhead"),
    (cj.policies.coci, {"mtbf_s": math.nan}, "mtbf_s"),
    (cj.policies.coci, {"recovery_s": -1.0}, "recovery_s"),
    (cj.policies.coci, {"time_weight": 1.5}, "time_weight"),
    (cj.policies.coci, {"time_weight": -0.1}, "time_weight"),
    (cj.policies.coci, {"total_steps": 0}, "total_steps"),
    (cj.policies.coci, {"max_weight": 0.5}, "max_weight"),
    (cj.policies.coci, {"decay": 0.0}, "decay"),
    (cj.policies.coci, {"horizon_range": (0.5, 2.0)}, "horizon_range"),
    (cj.policies.coci, {"horizon_range": "far"}, "horizon_range"),
    (cj.policies.coci, {"min_points": 1}, "min_points"),
    (cj.policies.coci, {"prior_mtbf_s": 0.0}, "prior_mtbf_s"),
    (cj.policies.young, {"prior_mtbf_s": -5.0}, "prior_mtbf_s"),
    (cj.policies.coci_paper, {"mtbf_s": 0.0}, "mtbf_s"),
    (cj.policies.coci_paper, {"mtbf_s": 1.0, "fit_interval": 1}, "fit_interval"),
    (cj.policies.young, {"mtbf_s": 1.0, "cost_prior_s": -1.0}, "cost_prior_s"),
]


@pytest.mark.parametrize(("ctor", "kwargs", "param"), BAD)
def test_constructors_reject_bad_arguments_naming_them(ctor, kwargs, param):
    with pytest.raises(ValueError, match=param):
        ctor(**kwargs)


@settings(max_examples=40, deadline=None)
@given(mtbf=st.floats(allow_nan=True, allow_infinity=True), tw=st.floats(allow_nan=True))
def test_coci_arguments_are_validated(mtbf, tw):
    mtbf_ok = math.isfinite(mtbf) and mtbf > 0
    tw_ok = 0.0 <= tw <= 1.0
    if mtbf_ok and tw_ok:
        assert isinstance(cj.policies.coci(mtbf_s=mtbf, time_weight=tw), cj.policies.Policy)
    else:
        with pytest.raises(ValueError, match="mtbf_s" if not mtbf_ok else "time_weight"):
            cj.policies.coci(mtbf_s=mtbf, time_weight=tw)


LOSSES = hnp.arrays(
    np.float32,
    64,
    elements=st.one_of(
        st.floats(-1e6, 1e6, width=32), st.sampled_from([np.nan, np.inf, -np.inf, 0.0, 1e30])
    ),
)


@settings(max_examples=25, deadline=None)
@given(
    losses=LOSSES,
    name=st.sampled_from(sorted(CASES)),
    cost=st.sampled_from([0.0, 0.5, 5.0, np.nan]),
)
def test_any_losses_give_increasing_in_range_saves(losses, name, cost):
    saves = cj.plan(losses, POLICIES[name], step_time_s=1.0, checkpoint_cost_s=cost)
    assert saves.dtype == np.int64
    assert np.all(np.diff(saves) > 0)
    assert saves.size == 0 or (saves[0] >= 1 and saves[-1] <= losses.size)


def test_replayed_steps_count_as_time_but_not_as_new_losses():
    """Documented behaviour: a repeated/decreasing step counts as time, not as new history."""
    policy = POLICIES["coci_no_total"]

    def run(steps):
        state, saves = policy.init(), []
        for i, s in enumerate(steps):
            save, state = policy.update(
                state, step=s, loss=2.0 + 1.0 / s, step_time_s=1.0, checkpoint_cost_s=1.0
            )
            if bool(save):
                saves.append(i + 1)  # in calls, i.e. in seconds of training
        return np.asarray(saves), state

    replayed, state = run(list(range(1, 81)) + list(range(41, 121)))  # a restore to step 40
    assert int(state.count) == 120  # losses of steps 1..120 once each, not 160
    assert int(state.clock.last_step) == 120
    assert float(state.clock.elapsed) == pytest.approx(160.0)
    straight, _ = run(list(range(1, 161)))
    # The replay is exposure like any other time: saves stay about as far apart, in seconds,
    # as in a job without a restore. (Were the 40 replayed steps not counted, the save after
    # them would come 40 seconds later: a gap of about 90 s instead of about 50 s.)
    gap = lambda saves: np.diff(saves[saves > 40]).max()
    assert gap(replayed) <= 1.25 * gap(straight)
    assert replayed[replayed > 80].size > 0

    steps = list(range(1, 81)) + list(range(41, 121))

    young = POLICIES["young"]
    ref, _ = _eager(young, np.ones(160), np.ones(160), np.full(160, 2.0))
    got, _ = _eager(young, np.ones(160), np.ones(160), np.full(160, 2.0), steps=steps)
    np.testing.assert_array_equal(got, ref)  # time-based rules ignore the step number


@pytest.mark.parametrize("name", CASES)
def test_no_save_before_the_check_step_whatever_the_inputs(name):
    """The contract that lets a caller skip the policy between checks (see policies._base)."""
    policy = POLICIES[name]
    update = jax.jit(policy.update)
    rng = np.random.default_rng(7)
    state = policy.init()
    checked = 0
    for s in range(1, 400):
        due = int(cj.policies.next_check(state))
        # Adversarial inputs between checks: jumps in loss, step time and cost.
        loss = float(rng.choice([1e3, 1e-3, np.nan, 2.0 / s]))
        step_time = float(rng.choice([1e-3, 1.0, 50.0]))
        save, state = update(
            state, step=s, loss=loss, step_time_s=step_time, checkpoint_cost_s=4.0,
            mtbf_s=float(rng.choice([np.nan, 60.0, 6000.0])), recovery_s=5.0,
        )  # fmt: skip
        if s < due:
            assert not bool(save), (name, s, due)
        else:
            checked += 1
    assert checked < 399 or name in ("coci_paper", "fixed")  # some steps were skippable


@pytest.mark.parametrize("name", CASES)
def test_the_runner_decides_like_a_call_per_step(name):
    """Runner skips steps before next_check and feeds them with the check step, in batches."""
    policy = POLICIES[name]
    losses, step_times, costs = _inputs()
    every_step = cj.plan(losses, policy, step_time_s=step_times, checkpoint_cost_s=costs)
    runner = cj.policies.Runner(policy)
    checks = 0
    saves = []
    for s in range(1, N + 1):
        checks += s >= runner.next_check
        save = runner.update(
            s, loss=jax.numpy.float32(losses[s - 1]), step_time_s=float(step_times[s - 1]),
            checkpoint_cost_s=float(costs[s - 1]),
        )  # fmt: skip
        assert type(save) is bool
        if save:
            saves.append(s)
    np.testing.assert_array_equal(np.asarray(saves, np.int64), every_step)
    if name != "coci_paper":  # it checks every step by design
        assert checks < N  # the point of it: fewer dispatches than steps


def test_the_runner_runs_the_update_only_for_real_steps():
    """The batch's padding rows skip ``update``: COCI's cost 20 ms a dispatch when they ran."""
    ran: list[int] = []
    fixed = cj.policies.fixed(3)

    def update(state, *, step, **kw):
        jax.debug.callback(lambda s: ran.append(int(s)), step)
        return fixed.update(state, step=step, **kw)

    runner = cj.policies.Runner(cj.policies.Policy(fixed.init, update))
    saves = [s for s in range(1, 7)
             if runner.update(s, loss=1.0, step_time_s=1.0, checkpoint_cost_s=1.0)]  # fmt: skip
    assert saves == [3, 6]
    jax.effects_barrier()
    assert ran == [1, 2, 3, 4, 5, 6]  # not BATCH rows per dispatch


def _gated(policy, gate: threading.Event, calls: list[str]):
    """``policy`` whose ``update`` waits for ``gate`` while it is traced (i.e. compiled)."""

    def update(state, **kw):
        calls.append(threading.current_thread().name)
        if not gate.wait(timeout=60):
            raise RuntimeError("gate never opened")
        return policy.update(state, **kw)

    return cj.policies.Policy(policy.init, update)


def test_the_runner_compiles_in_a_thread_and_the_first_check_waits_for_it():
    gate, calls = threading.Event(), []
    runner = cj.policies.Runner(_gated(cj.policies.fixed(3), gate, calls))
    # Returns although the compilation is held at the gate (a synchronous one would fail).
    runner.compile(background=True)
    threading.Timer(0.2, gate.set).start()
    saves = [s for s in range(1, 7)
             if runner.update(s, loss=1.0, step_time_s=1.0, checkpoint_cost_s=1.0)]  # fmt: skip
    assert saves == [3, 6]
    assert calls == ["cocijax-policy-compile"]  # traced once, in the thread
    assert runner.compile_count() == 1


def test_a_failed_background_compilation_is_raised_at_the_first_check():
    def update(state, **kw):
        raise ValueError("this policy cannot be traced")

    runner = cj.policies.Runner(cj.policies.Policy(cj.policies.fixed(3).init, update))
    runner.compile(background=True)
    with pytest.raises(ValueError, match="cannot be traced"):
        runner.update(3, loss=1.0, step_time_s=1.0, checkpoint_cost_s=1.0)


def _alternating_levels(levels=2):
    """A two-level policy of its own: level 1 at every 2nd step, level 2 at every 6th."""
    jnp = jax.numpy

    def update(state, *, step, persist_cost_s, **_):
        level = jnp.where(step % 6 == 0, 2, jnp.where(step % 2 == 0, 1, 0))
        # Reads a two-level input: the runner must pass it (a NaN passes through).
        return jnp.where(jnp.isnan(persist_cost_s), -1, level), state

    return cj.policies.Policy(lambda: jnp.zeros(()), jax.jit(update), levels=levels)


def test_a_two_level_policy_s_levels_reach_the_runner_and_one_level_saves_are_level_2():
    runner = cj.policies.Runner(_alternating_levels())
    inputs = dict(loss=1.0, step_time_s=1.0, checkpoint_cost_s=0.5)
    levels = [runner.decide(s, **inputs, persist_cost_s=30.0) for s in range(1, 13)]
    assert levels == [0, 1, 0, 1, 0, 2, 0, 1, 0, 1, 0, 2]
    one_level = cj.policies.Runner(cj.policies.fixed(3))
    assert [one_level.decide(s, **inputs) for s in (1, 2, 3)] == [0, 0, 2]
    assert one_level.update(6, **inputs) is True
    with pytest.raises(TypeError, match="persist_cost"):
        one_level.decide(7, **inputs, persist_cost=1.0)


def test_a_runner_refuses_a_level_count_other_than_1_or_2():
    with pytest.raises(ValueError, match=r"policy\.levels: expected 1 or 2, got 3"):
        cj.policies.Runner(_alternating_levels(levels=3))
