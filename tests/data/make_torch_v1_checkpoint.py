"""Writes tests/data/torch-v1-checkpoint/: a directory made by cocijax.torch's first format.

Format ``cocijax.torch/1`` kept one RNG state under ``cocijax.rng`` (no ranks, no extra items).
It was run once, with the code of main before multi-rank PyTorch (issue 10, commit 0368f90),
as ``PYTHONPATH=<that checkout> python tests/data/make_torch_v1_checkpoint.py``;
tests/pytorch/test_manager.py checks that the current code restores it bit-exact. Do not
regenerate it with newer code: its point is to be old.

Contents: ``ckpt/`` (steps 2 and 4 of a ``Linear(3, 2)`` with SGD and momentum, policy
``fixed(2)``) and ``expected.json`` (the weights at step 4, and the first ``torch.rand(3)``
drawn after it was saved).
"""

import json
import random
import shutil
from pathlib import Path

import numpy as np
import torch

import cocijax as cj
import cocijax.torch as cjt

HERE = Path(__file__).resolve().parent / "torch-v1-checkpoint"


def main() -> None:
    shutil.rmtree(HERE, ignore_errors=True)
    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with cjt.CheckpointManager(HERE / "ckpt", policy=cj.policies.fixed(2)) as mngr:
        for step in range(1, 5):
            loss = model(torch.randn(5, 3)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            mngr.save(step, {"model": model, "optimizer": opt}, loss=loss.item())
    expected = {"weight": model.weight.tolist(), "bias": model.bias.tolist()}
    expected["rand_after"] = torch.rand(3).tolist()
    (HERE / "expected.json").write_text(json.dumps(expected))
    for lock in HERE.glob("ckpt/.cocijax*"):
        lock.unlink()


if __name__ == "__main__":
    main()
