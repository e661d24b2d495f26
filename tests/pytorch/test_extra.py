"""``extra`` items of the PyTorch manager, their bad input, and checkpoints of the first format."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from torch_helpers import ManualClock, SlowStaging
from torchdata.stateful_dataloader import StatefulDataLoader

import cocijax as cj
import cocijax.torch as cjt

pytestmark = [
    pytest.mark.filterwarnings("ignore:torch.distributed is:UserWarning"),
    pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning"),
]
OLD = Path(__file__).parents[1] / "data" / "torch-v1-checkpoint"


def _loader(seed: int) -> StatefulDataLoader:
    data = torch.utils.data.TensorDataset(torch.arange(40.0))
    return StatefulDataLoader(
        data, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(seed)
    )


def test_a_stateful_dataloader_resumes_where_it_was_saved(tmp_path):
    model = torch.nn.Linear(2, 1)
    loader = _loader(seed=1)
    batches = iter(loader)
    with cjt.CheckpointManager(tmp_path, policy=cj.policies.fixed(3)) as mngr:
        for step in range(1, 5):
            next(batches)
            mngr.save(step, {"model": model}, loss=1.0, extra={"data": loader})
        assert mngr.all_steps() == [3]
    # Saved after the third batch: the fourth one and the rest of the epoch come next.
    expected = [b[0].tolist() for b in _loader(seed=1)][3:]

    fresh = _loader(seed=2)  # another shuffle: only the restored state can give `expected`
    with cjt.CheckpointManager(tmp_path, policy=cj.policies.fixed(3)) as mngr:
        out, extra = mngr.restore(target={"model": model}, extra={"data": fresh})
        plain = mngr.restore(target={"model": model})  # without extra: the state alone
    assert extra == {"data": fresh} and out["model"] is model and plain["model"] is model
    assert [b[0].tolist() for b in fresh] == expected


def test_extra_state_dict_is_called_only_on_saved_steps(tmp_path):
    calls = []
    counter = SlowStaging(ManualClock(), 0.0)
    counter.state_dict = lambda: calls.append(1) or {"value": 0}
    with cjt.CheckpointManager(tmp_path, policy=cj.policies.fixed(3)) as mngr:
        saved = [mngr.save(s, {}, loss=1.0, extra={"c": counter}) for s in range(1, 7)]
    assert saved == [False, False, True, False, False, True] and len(calls) == 2


@pytest.mark.parametrize(
    ("extra", "error", "match"),
    [
        ({"state": SlowStaging(ManualClock(), 0.0)}, ValueError, r"extra\[.state.\].*reserved"),
        ({"policy": SlowStaging(ManualClock(), 0.0)}, ValueError, r"extra\[.policy.\].*reserved"),
        ({"loader": object()}, TypeError, r"extra\['loader'\]: expected an object with state_d"),
        ({"step": 3}, TypeError, r"extra\['step'\]: .*got int"),
        ({1: SlowStaging(ManualClock(), 0.0)}, TypeError, "item names must be strings, got 1"),
        ([SlowStaging(ManualClock(), 0.0)], TypeError, "extra: expected a dict"),
    ],
    ids=["reserved-state", "reserved-policy", "no-state-dict", "a-number", "int-key", "a-list"],
)
def test_bad_extra_is_refused_by_save_and_restore(tmp_path, extra, error, match):
    model = torch.nn.Linear(2, 1)
    with cjt.CheckpointManager(tmp_path, policy=cj.policies.fixed(1)) as mngr:
        with pytest.raises(error, match=match):
            mngr.save(1, {"model": model}, loss=1.0, extra=extra)
        assert mngr.all_steps() == []  # nothing saved, the manager goes on
        assert mngr.save(2, {"model": model}, loss=1.0)
        with pytest.raises(error, match=match):
            mngr.restore(target={"model": model}, extra=extra)


def test_restoring_an_extra_item_the_step_lacks_names_it(tmp_path):
    model = torch.nn.Linear(2, 1)
    with cjt.CheckpointManager(tmp_path, policy=cj.policies.fixed(1)) as mngr:
        mngr.save(1, {"model": model}, loss=1.0, extra={"data": _loader(0)})
        with pytest.raises(
            ValueError, match=r"step 1 .* has no extra item 'sampler' \(it has \['data'\]\)"
        ):
            mngr.restore(target={"model": model}, extra={"sampler": _loader(0)})


def test_a_checkpoint_of_the_first_format_restores_bit_exact(tmp_path):
    shutil.copytree(OLD / "ckpt", tmp_path / "ckpt")
    expected = json.loads((OLD / "expected.json").read_text())
    torch.manual_seed(123)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with cjt.CheckpointManager(tmp_path / "ckpt", policy=cj.policies.fixed(2)) as mngr:
        assert mngr.all_steps() == [2, 4]
        mngr.restore(target={"model": model, "optimizer": opt})
        assert torch.rand(3).tolist() == expected["rand_after"]  # its RNG state came back
        assert model.weight.tolist() == expected["weight"]
        assert model.bias.tolist() == expected["bias"]
        assert mngr.save(6, {"model": model, "optimizer": opt}, loss=1.0)  # and it goes on
        with pytest.raises(ValueError, match="has no extra item 'data'"):
            mngr.restore(step=4, target={"model": model}, extra={"data": _loader(0)})
