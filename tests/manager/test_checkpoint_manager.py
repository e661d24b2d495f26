"""Tests of cocijax.CheckpointManager: decisions, measurements, restore, GC, restart, bad input."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import sys
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from manager_helpers import FakeClock, recording  # pytest puts tests/ on sys.path

import cocijax as cj
from cocijax import _files, storage
from cocijax.core._policy_inputs import PRIOR_FIXED_S, prior_cost_s, tree_nbytes
from cocijax.manager import DirectoryLockedError
from cocijax.storage import _codec, _manifest_io
from cocijax.storage._records import MANIFEST_NAME, STRIPE_PREFIX
from cocijax.storage._stripes import referenced_stripe_dirs


def small_state(seed: int = 0):
    k1, k2 = jax.random.split(jax.random.key(seed))
    params = {"w": jax.random.normal(k1, (4, 8)), "b": jax.random.normal(k2, (8,))}
    return {"params": params, "opt_state": optax.adam(1e-3).init(params)}


def abstract(tree):
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)


def assert_trees_bit_equal(a, b):
    la, ta = jax.tree.flatten(a)
    lb, tb = jax.tree.flatten(b)
    assert ta == tb
    for x, y in zip(la, lb, strict=True):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape
        assert x.tobytes() == y.tobytes()


def stripes(root: Path) -> set[Path]:
    """Every stripe directory on ``root``, in whichever checkpoint directory's folder it is."""
    return {p.resolve() for p in root.rglob(f"{STRIPE_PREFIX}*") if p.is_dir()}


def referenced(mngr: cj.CheckpointManager) -> set[Path]:
    out: set[Path] = set()
    for step in mngr.all_steps():
        out |= {p.resolve() for p in referenced_stripe_dirs(mngr.item_directory(step))}
    return out


def test_saves_where_the_policy_says_and_lists_them(tmp_path):
    state = small_state()
    with cj.CheckpointManager(tmp_path / "ck", policy=cj.policies.fixed(3)) as mngr:
        saved = [mngr.save(s, state, loss=1.0 / s) for s in range(1, 11)]
        mngr.wait_until_finished()
        assert saved == [s % 3 == 0 for s in range(1, 11)]
        assert mngr.all_steps() == [3, 6, 9]
        assert mngr.latest_step() == 9
        assert mngr.save(11, state, loss=0.1, force=True)  # force saves off-schedule
        mngr.wait_until_finished()
        assert mngr.all_steps() == [3, 6, 9, 11]


def test_restore_is_bit_exact_with_external_roots(tmp_path):
    state = small_state(1)
    state["extra"] = {
        "bf16": jnp.linspace(-3, 3, 37, dtype=jnp.bfloat16),
        "ints": jnp.arange(-5, 12, dtype=jnp.int32),
        "nan": jnp.array([np.nan, np.inf, -0.0], jnp.float32),
    }
    roots = [tmp_path / "r0", tmp_path / "r1"]
    with cj.CheckpointManager(tmp_path / "ck", roots=roots, policy=cj.policies.fixed(1)) as m:
        m.save(1, state, loss=jnp.float32(0.5))
    with cj.CheckpointManager(tmp_path / "ck", roots=roots, policy=cj.policies.fixed(1)) as m:
        assert m.latest_step() == 1
        restored = m.restore(target=abstract(state))
        assert m.restored_step == 1
    assert_trees_bit_equal(restored, state)


@pytest.mark.parametrize("read_only", [False, True])
def test_opening_and_restoring_parse_each_manifest_once(tmp_path, monkeypatch, read_only):
    # Each parse decodes, validates and hashes the whole manifest. Orbax looks a step up twice
    # per restore, the manager restores two items and Orbax's threads read each step's
    # metrics: opening a manager with 3 steps parsed them 14 times. Opening now parses none
    # (the digest over the bytes vouches for them) and a restore parses its step once.
    state = small_state(2)
    with cj.CheckpointManager(tmp_path / "ck", policy=cj.policies.fixed(1)) as m:
        m.save(1, state, loss=1.0)
        m.save(2, state, loss=1.0)
    parsed = []
    parse = _codec.decode_manifest

    def counted(raw, source):
        parsed.append(Path(source).parts[-3])
        return parse(raw, source)

    # Counted wherever the parser is called from: every module that holds it.
    holders = [
        module
        for name, module in list(sys.modules.items())
        if name.startswith("cocijax") and getattr(module, "decode_manifest", None) is parse
    ]
    assert _codec in holders and _manifest_io in holders
    for module in holders:
        monkeypatch.setattr(module, "decode_manifest", counted)
    monkeypatch.setattr(_manifest_io, "_PARSED", {})  # as in a new process
    options = ocp.CheckpointManagerOptions(read_only=read_only)
    with cj.CheckpointManager(tmp_path / "ck", options=options, policy=cj.policies.fixed(1)) as m:
        assert parsed == []
        assert_trees_bit_equal(m.restore(1, target=abstract(state)), state)
        assert_trees_bit_equal(m.restore(target=abstract(state)), state)
        assert sorted(parsed) == ["1", "2"]
        # Read again, by a restore or a reader: the same bytes are not parsed again.
        assert_trees_bit_equal(m.restore(1, target=abstract(state)), state)
        storage.read_manifest(m.item_directory(2))
        assert sorted(parsed) == ["1", "2"]
    # A manifest replaced by other bytes is parsed again, whatever its timestamps say.
    manifest = tmp_path / "ck" / "2" / "state" / MANIFEST_NAME
    stat = manifest.stat()
    data = json.loads(manifest.read_bytes())
    data["digest"] = "0" * len(str(data.get("digest", "")))  # same length, other bytes
    manifest.write_bytes(json.dumps(data, separators=(",", ":")).encode())
    os.utime(manifest, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    with pytest.raises(storage.CheckpointFormatError, match="digest"):
        storage.read_manifest(manifest.parent)
    assert sorted(parsed) == ["1", "2", "2"]


def test_measures_step_time_cost_and_reads_loss_one_step_late(tmp_path):
    clock = FakeClock(tick=0.25)  # every reading advances the clock by a tick
    d = 0.5  # the "training" time the test lets pass before each save call
    losses = [jnp.float32(3.0), jnp.float32(2.0), jnp.float32(1.5)]
    with cj.CheckpointManager(tmp_path / "ck", policy=recording(2), clock=clock) as mngr:
        for step, loss in enumerate(losses, start=1):
            clock.advance(d)
            mngr.save(step, small_state(), loss=loss)
            seen = mngr.policy_state
            if step == 1:
                # Nothing is measured yet: step 1 is not timed (compilation), no save, no loss;
                # the cost assumed is the prior from the state's size, seen at this first call.
                assert math.isnan(seen.loss) and math.isnan(seen.step_time)
                prior = prior_cost_s(tree_nbytes(small_state()))
                assert float(seen.cost) == np.float32(prior) and prior >= PRIOR_FIXED_S
            if step == 2:
                # Step 2's own time is measured (from the reading that ended step 1's call to
                # the one that started step 2's decision: d plus that reading's tick), but one
                # time could be a pause: it is given from the second on. Step 1's loss.
                assert math.isnan(seen.step_time)
                assert float(seen.loss) == 3.0
        # Step 3: its own time excludes step 2's save (timed from the save's end), the median
        # of the two; step 2's loss; the blocking time of step 2's save (one tick between its
        # start and end).
        assert float(seen.loss) == 2.0
        assert float(seen.step_time) == d + 0.25
        assert float(seen.cost) == 0.25
        assert int(seen.calls) == 3
        m = mngr.measurements
        assert (m.step_time_s, m.loss, m.cost_estimate_s) == (d + 0.25, 2.0, 0.25)
        # The policy's batched update is compiled once (at open), not per step.
        assert mngr._driver.compile_count() == 1


def run_steps(mngr, clock, first, last, losses):
    decisions = {}
    for step in range(first, last + 1):
        clock.advance(1.0)
        decisions[step] = mngr.save(
            step, {"x": jnp.full((3,), float(step))}, loss=jnp.float32(losses[step - 1])
        )
    return decisions


def test_policy_schedule_continues_after_reopen(tmp_path):
    n = 48
    losses = 0.2 + 3.0 * np.exp(-np.arange(n) / 12.0)

    def policy():
        # A given recovery time: a restarted job otherwise plans with the one it measured.
        return cj.policies.coci(mtbf_s=60.0, recovery_s=0.0, total_steps=n, min_points=8)

    clock = FakeClock(tick=0.5)
    with cj.CheckpointManager(tmp_path / "a", policy=policy(), clock=clock) as mngr:
        whole = run_steps(mngr, clock, 1, n, losses)
        whole_state = mngr.policy_state
    saves = [s for s, saved in whole.items() if saved]
    assert 2 <= len(saves) < n // 2, saves  # a real schedule, not "always" or "never"
    # Cut right after the first save: the cost it measured must travel with it, else the resumed
    # policy would fall back on its cost prior.
    cut = saves[0]

    clock = FakeClock(tick=0.5)
    with cj.CheckpointManager(tmp_path / "b", policy=policy(), clock=clock) as mngr:
        first = run_steps(mngr, clock, 1, cut, losses)
    assert first == {s: whole[s] for s in range(1, cut + 1)}

    clock = FakeClock(tick=0.5)
    with cj.CheckpointManager(tmp_path / "b", policy=policy(), clock=clock) as mngr:
        start = mngr.latest_step()
        assert start == cut
        mngr.restore(target={"x": jax.ShapeDtypeStruct((3,), jnp.float32)})
        rest = run_steps(mngr, clock, start + 1, n, losses)
        resumed_state = mngr.policy_state
    assert rest == {s: whole[s] for s in range(cut + 1, n + 1)}
    assert_trees_bit_equal(resumed_state, whole_state)


def test_opening_and_restoring_do_not_wait_for_the_policy_to_compile(tmp_path):
    """A restarted job restores and compiles its own step while the policy's update compiles."""
    with cj.CheckpointManager(tmp_path / "ck", policy=cj.policies.fixed(3)) as mngr:
        run_steps(mngr, FakeClock(), 1, 3, np.ones(3))
    gate = threading.Event()
    fixed = cj.policies.fixed(3)

    def update(state, **kw):  # runs when the update is traced, i.e. compiled
        if not gate.wait(timeout=60):
            raise RuntimeError("the test never opened the gate")
        return fixed.update(state, **kw)

    # Opening reloads the saved policy state and restoring reads the state, both while the
    # compilation is held (a manager that waited for it would fail here after 60 s).
    mngr = cj.CheckpointManager(tmp_path / "ck", policy=cj.policies.Policy(fixed.init, update))
    with mngr:
        assert mngr.latest_step() == 3
        restored = mngr.restore(target={"x": jax.ShapeDtypeStruct((3,), jnp.float32)})
        assert float(restored["x"][0]) == 3.0
        gate.set()
        # The schedule continues from the saved policy state: next saves at 6 and 9.
        assert [s for s, saved in run_steps(mngr, FakeClock(), 4, 9, np.ones(9)).items()
                if saved] == [6, 9]  # fmt: skip


def _save_three_steps(directory: Path, policy) -> Path:
    # Three: the policy is given step times from the second measured one, step 3's.
    with cj.CheckpointManager(directory, policy=policy) as mngr:
        for step in (1, 2, 3):
            mngr.save(step, {"x": jnp.ones(3)}, loss=1.0 / step, force=True)
        saved = mngr.policy_state
    return saved


def test_a_policy_state_of_another_policy_is_said_once_and_the_schedule_starts_fresh(tmp_path):
    _save_three_steps(tmp_path, cj.policies.fixed(5))
    coci = cj.policies.coci(mtbf_s=60.0, recovery_s=0.0, total_steps=50)
    said = r"3/policy: .*another policy.*starts its schedule"
    with (
        pytest.warns(RuntimeWarning, match=said),
        cj.CheckpointManager(tmp_path, policy=coci) as mngr,
    ):
        assert_trees_bit_equal(mngr.policy_state, coci.init())
        mngr.save(4, {"x": jnp.ones(3)}, loss=0.3)  # and the manager works on
    # The data saved before is all there.
    options = ocp.CheckpointManagerOptions(read_only=True)
    with cj.CheckpointManager(tmp_path, options=options) as reader:
        assert reader.all_steps()[:3] == [1, 2, 3]
        assert (
            np.asarray(reader.restore(1, target=abstract({"x": jnp.ones(3)}))["x"]).tolist()
            == [1.0] * 3
        )


def test_a_field_added_to_a_policy_state_takes_its_initial_value(tmp_path):
    # A newer cocijax whose policy state gained a field must continue an older state: drop
    # one field from the state on disk, as an older version would have written it.
    policy = cj.policies.coci(mtbf_s=60.0, recovery_s=0.0, total_steps=50)
    saved = _save_three_steps(tmp_path, policy)
    state_file = tmp_path / "3" / "policy" / "policy_state.json"
    data = json.loads(state_file.read_text())
    kept = [e for e in data["policy_state"] if e["path"] != ".exposure"]
    assert len(kept) == len(data["policy_state"]) - 1
    del data["digest"]  # nor did older versions write a digest
    state_file.write_text(json.dumps({**data, "policy_state": kept}))
    with cj.CheckpointManager(tmp_path, policy=policy) as mngr:
        loaded = mngr.policy_state
    assert_trees_bit_equal(loaded._replace(exposure=saved.exposure), saved)
    assert np.asarray(loaded.exposure) == np.asarray(policy.init().exposure)
    assert np.asarray(saved.exposure) != np.asarray(policy.init().exposure)


def test_max_to_keep_and_delete_remove_stripes_on_every_root(tmp_path):
    roots = [tmp_path / "r0", tmp_path / "r1"]
    with cj.CheckpointManager(
        tmp_path / "ck", roots=roots, policy=cj.policies.fixed(1), max_to_keep=2
    ) as mngr:
        for step in range(1, 6):
            mngr.save(step, small_state(step), loss=1.0)
        mngr.wait_until_finished()
        assert mngr.all_steps() == [4, 5]
        refs = referenced(mngr)
        for root in roots:
            assert stripes(root), f"nothing striped onto {root}"
        assert set().union(*(stripes(r) for r in roots)) == refs
        mngr.delete(4)
        assert mngr.all_steps() == [5]
        assert set().union(*(stripes(r) for r in roots)) == referenced(mngr)
        with pytest.raises(FileNotFoundError, match="step 4"):
            mngr.delete(4)


def test_orphan_stripes_of_a_crashed_save_are_removed_at_start(tmp_path):
    roots = [tmp_path / "r0", tmp_path / "r1"]
    ck = tmp_path / "ck"
    with cj.CheckpointManager(ck, roots=roots, policy=cj.policies.fixed(1)) as mngr:
        mngr.save(1, small_state(1), loss=1.0)
        mngr.save(2, small_state(2), loss=1.0)
    # What a crash before Orbax's commit leaves: the step under its temporary name, with its
    # stripes already on the roots. Plus a user's file on a root, which is not ours to remove.
    (ck / "2").rename(ck / "2.orbax-checkpoint-tmp-1234")
    (roots[0] / "notes.txt").write_text("keep me")
    before = stripes(roots[0]) | stripes(roots[1])
    with cj.CheckpointManager(ck, roots=roots, policy=cj.policies.fixed(1)) as mngr:
        assert mngr.all_steps() == [1]
        mngr.wait_until_finished()  # the opening's removals run in a thread of their own
        after = stripes(roots[0]) | stripes(roots[1])
        assert after == referenced(mngr)
        assert after < before  # the orphans existed and are gone
        assert (roots[0] / "notes.txt").read_text() == "keep me"
        assert_trees_bit_equal(mngr.restore(1, target=abstract(small_state(1))), small_state(1))
        assert mngr.save(2, small_state(2), loss=1.0)


def test_step_without_manifest_is_not_listed_and_can_be_saved_again(tmp_path):
    ck = tmp_path / "ck"
    with cj.CheckpointManager(ck, policy=cj.policies.fixed(1)) as mngr:
        mngr.save(1, small_state(1), loss=1.0)
        mngr.save(2, small_state(2), loss=1.0)
        item = mngr.item_directory(2)
    shutil.rmtree(item)
    item.mkdir()  # the item is there, its manifest is not
    with cj.CheckpointManager(ck, policy=cj.policies.fixed(1)) as mngr:
        assert mngr.all_steps() == [1]
        assert_trees_bit_equal(mngr.restore(target=abstract(small_state(1))), small_state(1))
        assert mngr.save(2, small_state(3), loss=1.0)
        mngr.wait_until_finished()
        assert mngr.all_steps() == [1, 2]
        assert_trees_bit_equal(mngr.restore(2, target=abstract(small_state(3))), small_state(3))


def test_nan_loss_is_accepted_and_training_continues(tmp_path):
    with cj.CheckpointManager(tmp_path / "ck", policy=cj.policies.fixed(2)) as mngr:
        decisions = []
        for step in range(1, 6):
            loss = jnp.float32(jnp.nan) if step % 2 else jnp.float32(jnp.inf)
            decisions.append(mngr.save(step, small_state(), loss=loss))
        assert decisions == [False, True, False, True, False]  # the schedule goes on
        assert mngr.save(6, small_state(), loss=float("nan"), force=True)
        mngr.wait_until_finished()
        assert mngr.all_steps() == [2, 4, 6]
        assert math.isnan(mngr.measurements.loss)  # what the policy saw: step 5's NaN


def test_bad_steps_and_losses(tmp_path):
    with cj.CheckpointManager(tmp_path / "ck", policy=cj.policies.fixed(2)) as mngr:
        mngr.save(1, small_state(), loss=1.0)
        mngr.save(2, small_state(), loss=1.0)
        with pytest.raises(ValueError, match="latest saved step 2"):
            mngr.save(2, small_state(), loss=1.0)
        mngr.save(3, small_state(), loss=1.0)  # not saved by the policy
        with pytest.raises(ValueError, match="previous call's step 3"):
            mngr.save(3, small_state(), loss=1.0)
        with pytest.raises(ValueError, match="loss"):
            mngr.save(4, small_state(), loss=jnp.ones(3))
        with pytest.raises(TypeError, match="loss"):
            mngr.save(4, small_state(), loss=None)
        with pytest.raises(TypeError, match="step"):
            mngr.save(4.0, small_state(), loss=1.0)
        with pytest.raises(FileNotFoundError, match="step 7"):
            mngr.restore(7)
    with pytest.raises(ValueError, match="closed"):
        mngr.save(5, small_state(), loss=1.0)


def test_directory_written_by_something_else_is_refused(tmp_path):
    # (A directory Orbax's own manager wrote is opened: tests/manager/test_from_orbax.py.)
    foreign = tmp_path / "foreign"
    (foreign / "7" / "weights").mkdir(parents=True)
    with pytest.raises(ValueError, match=re.escape(str(foreign / "7"))):
        cj.CheckpointManager(foreign)
    other = tmp_path / "other"
    other.mkdir()
    (other / "results.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match=re.escape("results.csv")):
        cj.CheckpointManager(other)


def test_missing_directory_is_created_and_options_are_checked(tmp_path):
    target = tmp_path / "a" / "b" / "ck"
    with cj.CheckpointManager(target, policy=cj.policies.fixed(1)) as mngr:
        assert target.is_dir() and mngr.all_steps() == []
    with pytest.raises(ValueError, match="max_to_keep"):
        cj.CheckpointManager(
            tmp_path / "x", max_to_keep=2, options=ocp.CheckpointManagerOptions(max_to_keep=3)
        )
    with pytest.raises(ValueError, match="save_decision_policy"):
        cj.CheckpointManager(
            tmp_path / "y",
            options=ocp.CheckpointManagerOptions(
                save_decision_policy=ocp.checkpoint_managers.FixedIntervalPolicy(2)
            ),
        )
    with pytest.raises(TypeError, match="policy"):
        cj.CheckpointManager(tmp_path / "z", policy="coci")


def test_second_writer_on_a_directory_gets_a_clear_error(tmp_path):
    first = cj.CheckpointManager(tmp_path / "ck", policy=cj.policies.fixed(1))
    with pytest.raises(DirectoryLockedError, match="another CheckpointManager"):
        cj.CheckpointManager(tmp_path / "ck", policy=cj.policies.fixed(1))
    first.close()
    with cj.CheckpointManager(tmp_path / "ck", policy=cj.policies.fixed(1)) as again:
        assert again.all_steps() == []


def test_read_only_manager_lists_and_restores_beside_a_writer(tmp_path):
    state = small_state(4)
    with cj.CheckpointManager(tmp_path / "ck", policy=cj.policies.fixed(1)) as writer:
        writer.save(1, state, loss=1.0)
        writer.wait_until_finished()
        reader = cj.CheckpointManager(
            tmp_path / "ck", options=ocp.CheckpointManagerOptions(read_only=True)
        )
        assert reader.all_steps() == [1]
        assert_trees_bit_equal(reader.restore(1, target=abstract(state)), state)
        with pytest.raises(ValueError, match="read_only"):
            reader.save(2, state, loss=1.0)
        reader.close()
    # A reader needs no storage roots and creates none (they may be read-only mounts).
    reader = cj.CheckpointManager(
        tmp_path / "ck",
        roots=[tmp_path / "absent"],
        options=ocp.CheckpointManagerOptions(read_only=True),
    )
    reader.close()
    assert not (tmp_path / "absent").exists()


def test_only_a_writer_compiles_its_policy_when_it_opens(tmp_path, monkeypatch):
    # A reader never decides: compiling per opening cost a reader that opens managers in a
    # loop seconds of CPU each (found by the long concurrent-readers run).
    compiles = []
    monkeypatch.setattr(cj.policies.Runner, "compile", lambda self, **kw: compiles.append(kw))
    with cj.CheckpointManager(tmp_path / "ck", policy=cj.policies.fixed(1)):
        assert compiles == [{"background": True}]
        reader = cj.CheckpointManager(
            tmp_path / "ck", options=ocp.CheckpointManagerOptions(read_only=True)
        )
        reader.close()
    assert compiles == [{"background": True}]


def test_a_restarted_policy_compiles_from_the_first_save_with_the_state_restored(
    tmp_path, monkeypatch
):
    # Compiling from the opening on competed with the opening, the restore and the job's own
    # compilation for the GIL and the cores (resume_bench: the time to the first step), and
    # ran policy.init() for a state the opening replaced at once.
    with cj.CheckpointManager(tmp_path / "ck", policy=cj.policies.fixed(3)) as mngr:
        run_steps(mngr, FakeClock(), 1, 3, np.ones(3))
    compiled_with = []
    record = lambda self, **kw: compiled_with.append((kw, self._state))
    monkeypatch.setattr(cj.policies.Runner, "compile", record)
    with cj.CheckpointManager(tmp_path / "ck", policy=cj.policies.fixed(3)) as mngr:
        mngr.restore(target={"x": jax.ShapeDtypeStruct((3,), jnp.float32)})
        assert compiled_with == []
        run_steps(mngr, FakeClock(), 4, 6, np.ones(6))
        [(kw, state)] = compiled_with  # once, at the first save
        assert kw == {"background": True} and int(state.clock.next_check) == 6  # step 3's


def test_synchronous_saves_commit_and_restore(tmp_path):
    options = ocp.CheckpointManagerOptions(enable_async_checkpointing=False)
    with cj.CheckpointManager(
        tmp_path / "ck", roots=[tmp_path / "r0"], options=options, policy=cj.policies.fixed(1)
    ) as mngr:
        for step in (1, 2):
            assert mngr.save(step, small_state(step), loss=1.0)
            assert mngr.all_steps()[-1] == step  # committed when save returns
        assert_trees_bit_equal(mngr.restore(2, target=abstract(small_state(2))), small_state(2))
        assert mngr.measurements.last_save_s > 0


def test_a_manifest_that_cannot_be_interpreted_is_set_aside_and_gc_goes_on(tmp_path):
    # Before: one such manifest stopped garbage collection for good (13 stripe folders where
    # 4 were needed after 10 more saves with max_to_keep=3), and its step was never deleted.
    roots = [tmp_path / "r0"]
    ck = tmp_path / "ck"
    with cj.CheckpointManager(ck, roots=roots, policy=cj.policies.fixed(1)) as mngr:
        mngr.save(1, small_state(1), loss=1.0)
        mngr.save(2, small_state(2), loss=1.0)
        mngr.wait_until_finished()
        damaged = referenced_by(mngr, 1)
        manifest = mngr.item_directory(1) / MANIFEST_NAME
    # What a newer cocijax might write: valid JSON that this version cannot interpret.
    data = json.loads(manifest.read_text())
    data["version"] += 1
    manifest.write_text(json.dumps(data))
    orphan = next(iter(damaged)).parent / f"{STRIPE_PREFIX}orphan"
    orphan.mkdir()
    with cj.CheckpointManager(ck, roots=roots, policy=cj.policies.fixed(1), max_to_keep=2) as mngr:
        assert mngr.all_steps() == [2]
        (aside,) = (ck / ".cocijax-quarantine").iterdir()
        assert (aside / "state" / MANIFEST_NAME).read_bytes() == manifest_bytes(data)
        assert "version 2" in (aside / "cocijax-quarantine.txt").read_text()
        for step in range(3, 9):
            mngr.save(step, small_state(step), loss=1.0)
        mngr.wait_until_finished()
        # The damaged step's stripes stay with it; the orphan and dropped steps' go.
        assert stripes(roots[0]) == referenced(mngr) | damaged
        assert mngr.all_steps() == [7, 8]


def manifest_bytes(data) -> bytes:
    return json.dumps(data).encode()


def referenced_by(mngr: cj.CheckpointManager, step: int) -> set[Path]:
    return {p.resolve() for p in referenced_stripe_dirs(mngr.item_directory(step))}


def test_restore_falls_back_to_the_newest_intact_step(tmp_path):
    with cj.CheckpointManager(tmp_path / "ck", policy=cj.policies.fixed(1)) as mngr:
        for step in (1, 2):
            mngr.save(step, small_state(step), loss=1.0)
        mngr.wait_until_finished()
        data = sorted(
            p for p in mngr.item_directory(2).rglob("*") if p.is_file() and p.name != MANIFEST_NAME
        )
        data[0].write_bytes(b"not the bytes that were saved")
        target = abstract(small_state(1))
        with pytest.raises(storage.CorruptCheckpointError):
            mngr.restore(target=target)
        with pytest.warns(RuntimeWarning, match="skipping damaged step 2"):
            restored = mngr.restore(target=target, fallback=True)
        assert mngr.restored_step == 1
        assert_trees_bit_equal(restored, small_state(1))


def test_keep_period_is_orbax_s_and_gc_keeps_what_it_keeps(tmp_path):
    roots = [tmp_path / "r0"]
    with cj.CheckpointManager(
        tmp_path / "ck", roots=roots, policy=cj.policies.fixed(1), max_to_keep=1, keep_period=3
    ) as mngr:
        for step in range(1, 8):
            mngr.save(step, small_state(step), loss=1.0)
        mngr.wait_until_finished()
        assert mngr.all_steps() == [3, 6, 7]
        assert stripes(roots[0]) == referenced(mngr)
        for step in (3, 6, 7):
            assert_trees_bit_equal(
                mngr.restore(step, target=abstract(small_state(step))), small_state(step)
            )


def test_a_save_in_flight_is_not_listed_or_done_until_committed(tmp_path, monkeypatch):
    # The save is held in its commit (at the fsync of its files) until the test lets it go.
    release = threading.Event()
    fsync_file = _files.fsync_file
    monkeypatch.setattr(_files, "fsync_file", lambda f: (release.wait(60), fsync_file(f)))
    state = {"w": np.ones((4, 1 << 18), np.float32)}
    with cj.CheckpointManager(tmp_path / "ck", policy=cj.policies.fixed(1)) as mngr:
        assert not mngr.is_saving_in_progress()
        assert mngr.save(1, state, loss=1.0)
        assert 1 in mngr.orbax.all_steps()  # Orbax lists the step it is writing...
        assert mngr.all_steps() == [] and mngr.latest_step() is None  # ...cocijax does not
        assert not (mngr.item_directory(1) / MANIFEST_NAME).exists()
        assert mngr.is_saving_in_progress()
        release.set()
        mngr.wait_until_finished()
        assert not mngr.is_saving_in_progress()
        assert mngr.all_steps() == [1] and mngr.latest_step() == 1
        mngr.delete(1)
        assert mngr.all_steps() == [] and mngr.latest_step() is None


def _young_with_a_jump(directory: Path, *, in_save: int | None = None, at_step: int | None = None):
    """Steps of 1 s and saves of 2 s (timed by the manager), one 10^6 s clock jump."""
    clock = FakeClock()
    saves: list[int] = []
    with cj.CheckpointManager(
        directory, policy=cj.policies.young(mtbf_s=900.0), clock=clock
    ) as mngr:
        orbax_save = mngr.orbax.save

        def timed_save(*args, **kwargs):  # runs inside the manager's timing of the save
            clock.advance(2.0 + (1e6 if len(saves) == in_save else 0.0))
            return orbax_save(*args, **kwargs)

        mngr.orbax.save = timed_save
        for step in range(1, 400):
            clock.advance(1.0 + (1e6 if step == at_step else 0.0))
            if mngr.save(step, {"x": np.ones(3)}, loss=1.0):
                saves.append(step)
        assert mngr.measurements.cost_estimate_s == 2.0
    return saves


def test_a_clock_jump_between_or_inside_saves_changes_no_decision(tmp_path):
    """Finding 22 through the manager's clock: a jump between saves made Young save every
    step for a while; inside a save, it never saved again."""
    baseline = _young_with_a_jump(tmp_path / "a")
    assert len(baseline) >= 5
    assert _young_with_a_jump(tmp_path / "b", at_step=200) == baseline
    assert _young_with_a_jump(tmp_path / "c", in_save=2) == baseline
