"""One rank of the job of ``test_ranks.py``, launched by ``torchrun``; argument: a JSON config.

Every rank feeds the manager its own step times, losses and save costs (a scripted clock), so
a rank deciding on its own inputs would save at other steps than rank 0. Each rank saves an
``extra`` counter and draws from its RNGs with its own seed; then it reopens the directory,
scrambles its state, restores, and records what came back in ``out/rank<r>.json``; then rank
1's extra item fails at a forced save; last, both ranks save steps with best-N retention, each
passing its own metrics (rank 1's rank the steps the other way round).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch_helpers import ManualClock, SlowStaging

import cocijax as cj
import cocijax.torch as cjt


def main() -> None:
    cfg = json.loads(sys.argv[1])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mine = cfg["ranks"][rank]
    clock = ManualClock()
    policy = cj.policies.young(**cfg["policy_kwargs"])
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)  # the same on every rank: replicated, written once
    torch.manual_seed(100 + rank)
    counter = SlowStaging(clock, mine["cost_s"])  # an extra item, its value per rank
    state = {"model": model}
    decisions = []
    with cjt.CheckpointManager(cfg["directory"], policy=policy, clock=clock) as mngr:
        assert (mngr.rank, mngr.world_size) == (rank, 2)
        for step, (dt, loss) in enumerate(zip(mine["step_times"], mine["losses"], strict=True), 1):
            clock.t += dt
            counter.value = 1000 * rank + step
            decisions.append(mngr.save(step, state, loss=loss, extra={"counter": counter}))
        mngr.wait_until_finished()
        latest = mngr.latest_step()
    # Nothing in the loop draws: this is the RNG state every save recorded, this rank's own.
    expected_rng = torch.get_rng_state()
    draws_after = torch.rand(3).tolist()

    torch.manual_seed(999)  # scrambled: restore must bring back this rank's own state
    with torch.no_grad():
        model.weight.zero_()
    fresh = SlowStaging(clock, 0.0)
    with cjt.CheckpointManager(cfg["directory"], policy=policy, clock=clock) as mngr:
        _, extra = mngr.restore(target=state, extra={"counter": fresh})
    # One rank's extra item fails to give its state: every rank raises, none waits for ever,
    # nothing is listed, and the next save works.
    broken = SlowStaging(clock, 0.0)
    if rank == 1:
        broken.state_dict = lambda: {}["no state on rank 1"]
    n = len(mine["step_times"])
    with cjt.CheckpointManager(cfg["directory"], policy=policy, clock=clock) as mngr:
        try:
            mngr.save(n + 1, state, loss=1.0, force=True, extra={"broken": broken})
            error = None
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
        steps_after_error = mngr.all_steps()
        saved_after_error = mngr.save(n + 2, state, loss=1.0, force=True)
        mngr.wait_until_finished()
        steps_after_next = mngr.all_steps()
    best_dir = Path(cfg["directory"]).with_name("best")
    best = {"best_fn": lambda m: m["acc"], "max_to_keep": 2}
    with cjt.CheckpointManager(best_dir, policy=policy, clock=clock, **best) as mngr:
        for step, acc in enumerate(cfg["accuracies"], 1):
            mine = acc if rank == 0 else 1.0 - acc
            mngr.save(step, state, loss=1.0, force=True, metrics={"acc": torch.tensor(mine)})
        mngr.wait_until_finished()
        best_steps = mngr.all_steps()
        best_metrics = {s: mngr.metrics(s) for s in best_steps}
    record = {
        "error": error,
        "steps_after_error": steps_after_error,
        "saved_after_error": saved_after_error,
        "steps_after_next": steps_after_next,
        "best_steps": best_steps,
        "best_metrics": best_metrics,
        "decisions": decisions,
        "latest": latest,
        "steps_on_disk": sorted(
            int(p.name) for p in Path(cfg["directory"]).iterdir() if p.name.isdigit()
        ),
        "restored_counter": extra["counter"].value,
        "restored_rng_equal": bool(torch.equal(torch.get_rng_state(), expected_rng)),
        "draws_after_restore": torch.rand(3).tolist(),
        "draws_after": draws_after,
        "weight": model.weight.tolist(),
    }
    (Path(cfg["out"]) / f"rank{rank}.json").write_text(json.dumps(record))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
