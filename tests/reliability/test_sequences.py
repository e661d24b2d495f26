"""Sequences of save, delete, restore, reopen (other spellings) and damage, checked by a model.

A hypothesis state machine drives a manager with external roots shared with another directory,
reopening it through a symlink, an ``x/../`` spelling and the plain path, and damages steps for
``restore(fallback=True)`` to skip. A model holds what each committed step must contain. After
every operation:

* the listed steps are the model's (nothing committed and kept is lost, nothing dropped stays);
* every listed step restores bit-exact;
* the roots hold the stripes of the listed steps and of the damaged steps set aside, and nothing
  else: disk usage stays bounded by what retention keeps;
* the neighbour directory sharing the roots still restores bit-exact.

``COCIJAX_SEQUENCE_EXAMPLES`` sets how many sequences ``make test`` runs (default 3), and
``COCIJAX_SEQUENCE_EXAMPLES_LONG`` how many ``make test-long`` runs besides (default 30).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import orbax.checkpoint as ocp
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import cocijax as cj
from cocijax import storage
from cocijax.storage import _stripes
from cocijax.storage._records import STRIPE_PREFIX

EXAMPLES = int(os.environ.get("COCIJAX_SEQUENCE_EXAMPLES", "3"))
LONG_EXAMPLES = int(os.environ.get("COCIJAX_SEQUENCE_EXAMPLES_LONG", "30"))
KEEP = 3


def _state(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"a": rng.standard_normal((32, 64)).astype(np.float32), "b": np.arange(seed, seed + 5)}


def _equal(a, b) -> bool:
    return set(a) == set(b) and all(np.asarray(a[k]).tobytes() == b[k].tobytes() for k in a)


class Sequences(RuleBasedStateMachine):
    """The manager against a model of what it must hold."""

    @initialize()
    def open_first(self):
        self.base = Path(tempfile.mkdtemp(prefix="cocijax-seq-"))
        self.root = self.base / "root"
        (self.base / "x").mkdir()
        (self.base / "run").mkdir()
        (self.base / "link").symlink_to(self.base / "run")
        self.spellings = [self.base / "run", self.base / "link", self.base / "x" / ".." / "run"]
        # A neighbour directory on the same root: nothing here may touch its stripes.
        with self._open(self.base / "neighbour") as other:
            other.save(1, _state(10**6), loss=1.0, force=True)
        self.model: dict[int, int] = {}  # step -> seed of its state
        self.seed = 0
        self.next_step = 1
        self.mngr = self._open(self.spellings[0])

    def _open(self, directory: Path) -> cj.CheckpointManager:
        return cj.CheckpointManager(
            directory,
            roots=[self.root],
            policy=cj.policies.fixed(10**6),
            max_to_keep=KEEP,
            exit_on_preemption=False,
        )

    def teardown(self):
        mngr = getattr(self, "mngr", None)
        if mngr is not None:
            mngr.close()
        shutil.rmtree(getattr(self, "base", "/nonexistent"), ignore_errors=True)

    @rule(skip=st.integers(0, 2))
    def save(self, skip):
        step = self.next_step + skip
        self.seed += 1
        assert self.mngr.save(step, _state(self.seed), loss=1.0, force=True)
        self.mngr.wait_until_finished()
        self.model[step] = self.seed
        for old in sorted(self.model)[:-KEEP]:
            del self.model[old]
        self.next_step = step + 1

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def delete(self, data):
        step = data.draw(st.sampled_from(sorted(self.model)))
        self.mngr.delete(step)
        del self.model[step]

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def restore_and_train_on(self, data):
        step = data.draw(st.sampled_from(sorted(self.model)))
        assert _equal(self.mngr.restore(step), _state(self.model[step]))
        # The next save comes after the newest step, whichever was restored.
        self.next_step = max(self.next_step, max(self.model) + 1)

    @rule(spelling=st.integers(0, 2))
    def reopen(self, spelling):
        self.mngr.close()
        self.mngr = None
        self.mngr = self._open(self.spellings[spelling])

    @precondition(lambda self: len(self.model) >= 2)
    @rule()
    def damage_the_newest_and_fall_back(self):
        newest, older = sorted(self.model)[-1], sorted(self.model)[-2]
        manifest = storage.read_manifest(self.mngr.item_directory(newest))
        piece = manifest.piece_path(manifest.pieces[0], self.mngr.item_directory(newest))
        for f in Path(piece).rglob("*"):
            if f.is_file() and f.name != "zarr.json":
                f.write_bytes(b"\xff" * f.stat().st_size)
        with pytest.warns(RuntimeWarning, match="skipping damaged"):
            restored = self.mngr.restore(fallback=True)
        assert self.mngr.restored_step == older
        assert _equal(restored, _state(self.model[older]))
        del self.model[newest]  # set aside: no longer listed
        self.next_step = max(self.next_step, newest + 1)

    @invariant()
    def listed_steps_are_the_model_s_and_restore_bit_exact(self):
        if getattr(self, "mngr", None) is None:
            return
        assert self.mngr.all_steps() == sorted(self.model)
        for step, seed in self.model.items():
            assert _equal(self.mngr.restore(step), _state(seed)), step

    @invariant()
    def the_roots_hold_what_is_kept_and_nothing_else(self):
        if getattr(self, "mngr", None) is None:
            return
        self.mngr.wait_until_finished()  # collects garbage
        directory = self.base / "run"
        kept = [directory / str(s) / "state" for s in self.model]
        aside = directory / ".cocijax-quarantine"
        kept += [p / "state" for p in aside.iterdir()] if aside.is_dir() else []
        kept.append(self.base / "neighbour" / "1" / "state")
        referenced = set().union(*(_stripes.stripe_names_in_use(k) or set() for k in kept))
        on_disk = {p.name for p in self.root.rglob(f"{STRIPE_PREFIX}*") if p.is_dir()}
        assert on_disk == referenced
        with cj.CheckpointManager(
            self.base / "neighbour", options=ocp.CheckpointManagerOptions(read_only=True)
        ) as other:
            assert _equal(other.restore(1), _state(10**6))


Sequences.TestCase.settings = settings(
    max_examples=EXAMPLES,
    stateful_step_count=12,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestSequences = Sequences.TestCase


class SequencesWithDurable(RuleBasedStateMachine):
    """Two tiers: a local directory drained to a durable path; machines replaced, lost, damaged.

    The model holds what each tier must list. Every save is drained (``durable_every=1``) and
    waited for, so the durable tier holds the newest ``DURABLE_KEEP`` saves; the local tier the
    newest ``KEEP``. A replaced machine opens an empty local directory on the same durable tier.
    """

    @initialize()
    def open_first(self):
        self.base = Path(tempfile.mkdtemp(prefix="cocijax-seq2-"))
        self.durable = self.base / "durable"
        self.machine = 0
        self.local: dict[int, int] = {}  # step -> seed, on the local tier
        self.remote: dict[int, int] = {}  # step -> seed, on the durable tier
        self.seed = 0
        self.next_step = 1
        self.mngr = self._open()

    def _open(self) -> cj.CheckpointManager:
        return cj.CheckpointManager(
            self.base / f"machine{self.machine}",
            roots=[self.base / f"nvme{self.machine}"],
            policy=cj.policies.fixed(10**6),
            max_to_keep=KEEP,
            durable=str(self.durable),
            durable_max_to_keep=DURABLE_KEEP,
            exit_on_preemption=False,
        )

    def teardown(self):
        mngr = getattr(self, "mngr", None)
        if mngr is not None:
            mngr.close()
        shutil.rmtree(getattr(self, "base", "/nonexistent"), ignore_errors=True)

    @rule(skip=st.integers(0, 2))
    def save(self, skip):
        step = self.next_step + skip
        self.seed += 1
        assert self.mngr.save(step, _state(self.seed), loss=1.0, force=True)
        self.mngr.wait_until_finished(durable=True)
        for tier, keep in ((self.local, KEEP), (self.remote, DURABLE_KEEP)):
            tier[step] = self.seed
            for old in sorted(tier)[:-keep]:
                del tier[old]
        self.next_step = step + 1

    @rule()
    def replace_the_machine(self):
        # A new machine: an empty local directory, the same durable tier.
        self.mngr.close()
        self.mngr = None
        self.machine += 1
        self.local = {}
        self.mngr = self._open()
        if self.remote:
            assert _equal(self.mngr.restore(), _state(self.remote[max(self.remote)]))
            assert self.mngr.restored_step == max(self.remote)

    @precondition(lambda self: self.local or self.remote)
    @rule(data=st.data())
    def restore_any(self, data):
        listed = {**self.remote, **self.local}
        step = data.draw(st.sampled_from(sorted(listed)))
        assert _equal(self.mngr.restore(step), _state(listed[step]))
        self.next_step = max(self.next_step, max(listed) + 1)

    @invariant()
    def both_tiers_list_the_model_and_restore_bit_exact(self):
        if getattr(self, "mngr", None) is None:
            return
        assert self.mngr.durable_steps() == sorted(self.remote)
        assert self.mngr.all_steps() == sorted(set(self.local) | set(self.remote))
        for step, seed in self.remote.items():
            assert _equal(self.mngr.restore(step, tier="durable"), _state(seed)), step
        for step, seed in self.local.items():
            assert _equal(self.mngr.restore(step, tier="local"), _state(seed)), step


DURABLE_KEEP = 2
SequencesWithDurable.TestCase.settings = settings(
    max_examples=EXAMPLES,
    stateful_step_count=10,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestSequencesWithDurable = SequencesWithDurable.TestCase


def _long(case: type) -> type:
    """``case`` with ``LONG_EXAMPLES`` sequences, marked ``long`` (``make test-long``)."""
    longer = type(f"{case.__name__}Long", (case,), {})
    longer.settings = settings(case.settings, max_examples=LONG_EXAMPLES)
    return pytest.mark.long(longer)


TestSequencesLong = _long(TestSequences)
TestSequencesWithDurableLong = _long(TestSequencesWithDurable)
