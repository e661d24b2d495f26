"""Two-tier benchmark: local commits drained to an S3-compatible server, against the upload limit.

The tree is write_bench's (a): 1 GiB as 16 x 64 MiB float32 (``--quick``: 64 MiB). The durable
tier is a real S3-compatible server on 127.0.0.1 (moto's server, in a process of its own, as an
object store is a service of its own), started and stopped by this script. Cases, each in a
fresh subprocess, repeated ``--repeat`` times and interleaved (case order rotates every round):

* ``single``: ``cj.CheckpointManager`` over two local roots, no durable tier;
* ``s3``: the same with ``durable="s3://bench/run-N"``;
* ``path``: the same with ``durable=<a local directory>`` (a shared file system's stand-in);
* ``upload``: the limit: the same bytes uploaded by TensorStore alone, every leaf as a zarr v3
  array (16 MiB chunks, the handler's) on the same server, all in parallel, twice (the second
  one counts, with the first on the server, as a second drain finds the step before);
* ``orbax``: Orbax's ``CheckpointManager`` (``StandardSave``, async) writing the tree straight
  to a local directory that stands for the durable path.

Each manager case times ``save`` (blocking), ``wait_until_finished()`` (local commit) and, with a
durable tier, ``wait_until_finished(durable=True)`` (durable), all from the start of ``save``,
plus the drain time the manager reports (``measurements.drain_s``). It does so for two saves of
the tree: the first (shown apart) faults in the host buffers the save and the drain keep, the
second is what every later save costs, and the targets use it (as ``write_bench`` does). Then it
saves two more steps back to back and times the second one's blocking and local commit: with a
durable tier that save runs while the step before it drains (what training sees during a
drain). Between cases the script empties the server and waits for the disk to write back
(``sync``). Orbax cannot write ``s3://`` at all: the script asks it to and prints its error.

Run: ``python benchmarks/tier_bench.py [--quick] [--dir DIR] [--repeat N] [--write]``. Prints a
table; ``--write`` also rewrites the ``tier_bench`` section of BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _report import cpu_and_ram, run_in_child, write_section

MiB = 1 << 20
SECTION = "tier_bench"
CASES = ["single", "s3", "path", "upload", "orbax"]
BUCKET = "bench"
AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "bench",
    "AWS_SECRET_ACCESS_KEY": "bench",
    "AWS_DEFAULT_REGION": "us-east-1",
}


def _options(endpoint: str) -> dict:
    return {
        "endpoint": endpoint,
        "aws_region": "us-east-1",
        "aws_credentials": {"type": "environment"},
    }


# --------------------------------------------------------------------------- the subprocess


def _manager_case(case: dict, tree) -> dict:
    import cocijax as cj

    work = Path(case["work"])
    durable = {"s3": f"s3://{BUCKET}/run-{case['round']}", "path": str(work / "durable")}
    kwargs = {}
    if case["name"] in durable:
        kwargs = {"durable": durable[case["name"]]}
        if case["name"] == "s3":
            kwargs["durable_options"] = _options(case["endpoint"])

    def manager(name: str, **extra):
        return cj.CheckpointManager(
            work / name,
            roots=[work / f"{name}-r0", work / f"{name}-r1"],
            policy=cj.policies.fixed(1),
            **extra,
        )

    # Warm-up: threads, TensorStore contexts, connections (a tiny tree, another directory).
    warm = {**kwargs}
    if "durable" in warm:
        warm["durable"] = warm["durable"] + "-warm"
    with manager("warm", **warm) as mngr:
        mngr.save(1, {"w": tree["w00"][:8]}, loss=1.0)
        mngr.wait_until_finished(durable=True)

    def save(mngr, step: int) -> tuple[float, float]:
        """Blocking time and local commit of one save, both from the start of ``save``."""
        start = time.perf_counter()
        mngr.save(step, tree, loss=1.0)
        blocking = time.perf_counter() - start
        mngr.wait_until_finished()
        return blocking, time.perf_counter() - start

    def save_durably(mngr, step: int) -> dict:
        """Blocking, local commit and (with a durable tier) time until durable and drain."""
        start = time.perf_counter()
        blocking, commit = save(mngr, step)
        out = {"blocking": blocking, "commit": commit}
        if kwargs:
            mngr.wait_until_finished(durable=True)
            out["durable"] = time.perf_counter() - start
            out["drain"] = mngr.measurements.drain_s
        return out

    # The durable tier keeps one step: the server holds at most two trees at once.
    if kwargs:
        kwargs["durable_max_to_keep"] = 1
    with manager("ckpt", **kwargs) as mngr:
        # Step 1, the first save: host buffers (the save's, the drain's) are faulted in.
        first = save_durably(mngr, 1)
        # Step 2: what every later save of the tree costs, on an idle machine.
        out = save_durably(mngr, 2) | {f"first_{k}": v for k, v in first.items()}
        # Steps 3 and 4 back to back: step 4 is saved while step 3 drains (training goes on
        # during a drain); without a durable tier the same two saves.
        save(mngr, 3)
        out["blocking_busy"], out["commit_busy"] = save(mngr, 4)
        mngr.wait_until_finished(durable=True)
    return out


def _upload_case(case: dict, tree) -> dict:
    import asyncio

    import numpy as np
    import tensorstore as ts

    host = {k: np.asarray(v) for k, v in tree.items()}
    context = ts.Context()
    base = {"driver": "s3", "bucket": BUCKET, **_options(case["endpoint"])}

    def spec(name: str, array: np.ndarray) -> dict:
        rows = max(1, (16 * MiB) // (array.nbytes // array.shape[0]))
        return {
            "driver": "zarr3",
            "kvstore": {**base, "path": f"upload-{case['round']}/{name}/"},
            "metadata": {
                "shape": list(array.shape),
                "data_type": array.dtype.name,
                "chunk_grid": {
                    "name": "regular",
                    "configuration": {"chunk_shape": [rows, *array.shape[1:]]},
                },
            },
            "create": True,
        }

    async def upload(prefix: str, arrays: dict) -> None:
        stores = await asyncio.gather(
            *[ts.open(spec(f"{prefix}{k}", a), context=context) for k, a in arrays.items()]
        )
        await asyncio.gather(*[s.write(arrays[k]) for s, k in zip(stores, arrays, strict=True)])

    asyncio.run(upload("warm-", {"w": host["w00"][:8]}))
    # Twice, as the manager cases save twice: the second upload, measured, finds the server
    # holding the first, as a second drain finds the previous step there.
    out = {}
    for key in ("first_upload", "upload"):
        start = time.perf_counter()
        asyncio.run(upload(f"{key}-", host))
        out[key] = time.perf_counter() - start
    return out


def _orbax_case(case: dict, tree) -> dict:
    import orbax.checkpoint as ocp

    work = Path(case["work"])
    with ocp.CheckpointManager(work / "orbax-warm") as mngr:
        mngr.save(1, args=ocp.args.StandardSave({"w": tree["w00"][:8]}))
        mngr.wait_until_finished()
    with ocp.CheckpointManager(work / "orbax") as mngr:
        start = time.perf_counter()
        mngr.save(1, args=ocp.args.StandardSave(tree))
        blocking = time.perf_counter() - start
        mngr.wait_until_finished()
        return {"blocking": blocking, "commit": time.perf_counter() - start}


def _run_case(case: dict) -> dict:
    import jax
    from _write_cases import make_tree

    tree = make_tree("a", case["quick"])
    jax.block_until_ready(tree)
    run = {"upload": _upload_case, "orbax": _orbax_case}.get(case["name"], _manager_case)
    out = run(case, tree)
    out["bytes"] = sum(x.nbytes for x in jax.tree.leaves(tree))
    return out


def _orbax_on_s3(endpoint: str) -> str:
    """What Orbax's CheckpointManager says when asked to write ``s3://``."""
    import jax.numpy as jnp
    import orbax.checkpoint as ocp

    try:
        with ocp.CheckpointManager(f"s3://{BUCKET}/orbax") as mngr:
            mngr.save(1, args=ocp.args.StandardSave({"w": jnp.ones(4)}))
            mngr.wait_until_finished()
    except Exception as e:  # whatever it raises is the answer
        return f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
    return "no error (it wrote somewhere: check)"


# ------------------------------------------------------------------------- the coordinator


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_moto() -> tuple[subprocess.Popen, str]:
    port = _free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    import boto3

    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    for _ in range(200):
        try:
            client.create_bucket(Bucket=BUCKET)
            return server, endpoint
        except Exception:
            time.sleep(0.05)
    server.kill()
    raise RuntimeError(f"moto's server did not start on {endpoint}")


def _empty_bucket(endpoint: str) -> None:
    """Deletes every object, so the server holds one case's bytes at a time."""
    import boto3

    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET)
    for page in pages:
        keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
        if keys:
            client.delete_objects(Bucket=BUCKET, Delete={"Objects": keys})


def _one(case: dict) -> dict:
    env = {**os.environ, **AWS_ENV, "TF_CPP_MIN_LOG_LEVEL": "2"}
    return run_in_child(
        __file__, case, label=case["name"], env=env, cwd=Path(__file__).resolve().parent
    )


def _median(runs: list[dict]) -> dict:
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def _verdict(value: float, bound: float, kind: str) -> str:
    ok = value <= bound if kind == "<=" else value >= bound
    return f"{value:.2f} (target {kind} {bound:.2f}: {'met' if ok else 'NOT met'})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a 64 MiB tree, one round")
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="where local data goes")
    parser.add_argument("--repeat", type=int, default=3, help="rounds (medians kept)")
    parser.add_argument("--write", action="store_true", help="record the section in BENCHMARKS.md")
    parser.add_argument("--_case", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args._case:
        print(json.dumps(_run_case(json.loads(args._case))))
        return 0

    from rich.console import Console
    from rich.table import Table

    repeat = 1 if args.quick else args.repeat
    os.environ.update(AWS_ENV)
    # A SIGTERM (a user's kill, a job's time limit) leaves through the finally below, which
    # stops the server; by default Python would exit at once and leave it running.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    server, endpoint = _start_moto()
    runs: dict[str, list[dict]] = {c: [] for c in CASES}
    try:
        orbax_s3 = _orbax_on_s3(endpoint)
        for r in range(repeat):
            order = CASES[r % len(CASES) :] + CASES[: r % len(CASES)]
            for name in order:
                work = Path(tempfile.mkdtemp(prefix="tier_bench-", dir=args.dir))
                case = {"name": name, "round": r, "quick": args.quick}
                case |= {"endpoint": endpoint, "work": str(work)}
                try:
                    runs[name].append(_one(case))
                finally:
                    shutil.rmtree(work, ignore_errors=True)
                    _empty_bucket(endpoint)
                    os.sync()  # the next case starts with no writeback of this one under way
                print(f"round {r + 1}/{repeat} {name}: {runs[name][-1]}", file=sys.stderr)
    finally:
        server.terminate()
        server.wait()
    res = {c: _median(v) for c, v in runs.items()}
    gib = res["single"]["bytes"] / 2**30
    upload_gibs = gib / res["upload"]["upload"]

    table = Table(title=f"tier_bench ({gib:.3g} GiB tree, medians of {repeat})")
    columns = (
        "case",
        "1st save: blocking s",
        "1st save: durable s",
        "blocking s",
        "local commit s",
        "blocking s, during a drain",
        "local commit s, during a drain",
        "durable s",
        "drain s",
        "drain GiB/s",
    )
    for col in columns:
        table.add_column(col, justify="left" if col == "case" else "right")
    rows = []
    for name in ("single", "s3", "path", "orbax"):
        m = res[name]
        drain = m.get("drain")
        rows.append(
            [
                {
                    "single": "cocijax, local only",
                    "s3": "cocijax, durable s3://",
                    "path": "cocijax, durable path",
                    "orbax": "Orbax CheckpointManager, straight to the path",
                }[name],
                f"{m['first_blocking']:.3f}" if "first_blocking" in m else "",
                f"{m['first_durable']:.3f}" if "first_durable" in m else "",
                f"{m['blocking']:.3f}",
                f"{m['commit']:.3f}",
                f"{m['blocking_busy']:.3f}" if "blocking_busy" in m else "",
                f"{m['commit_busy']:.3f}" if "commit_busy" in m else "",
                f"{m['durable']:.3f}" if "durable" in m else "",
                f"{drain:.3f}" if drain is not None else "",
                f"{gib / drain:.3f}" if drain is not None else "",
            ]
        )
    rows.append(
        [
            "limit: TensorStore upload to s3:// alone",
            "",
            f"{res['upload']['first_upload']:.3f}",
            "",
            "",
            "",
            "",
            f"{res['upload']['upload']:.3f}",
            "",
            f"{upload_gibs:.3f}",
        ]
    )
    for row in rows:
        table.add_row(*row)
    single, s3 = res["single"], res["s3"]
    targets = [
        "blocking, two tiers / one tier: "
        + _verdict(s3["blocking"] / single["blocking"], 1.10, "<="),
        "local commit, two tiers / one tier: "
        + _verdict(s3["commit"] / single["commit"], 1.10, "<="),
        "blocking during a drain, two tiers / one tier: "
        + _verdict(s3["blocking_busy"] / single["blocking_busy"], 1.10, "<="),
        "local commit during a drain, two tiers / one tier: "
        + _verdict(s3["commit_busy"] / single["commit_busy"], 1.10, "<="),
        "drain throughput / TensorStore upload: "
        + _verdict((gib / s3["drain"]) / upload_gibs, 0.8, ">="),
        "save to durable / (local commit + upload limit): "
        + _verdict(s3["durable"] / (s3["commit"] + res["upload"]["upload"]), 1.10, "<="),
        "the first save, to durable / (its local commit + the first upload), not a target: "
        f"{s3['first_durable'] / (s3['first_commit'] + res['upload']['first_upload']):.2f} "
        "(its drain faults in the buffers later drains reuse)",
    ]
    console = Console(width=190)
    console.print(table)
    for line in targets:
        console.print(line, markup=False)
    console.print(f"Orbax's CheckpointManager on s3://: {orbax_s3}", markup=False)

    if args.write:
        import jax
        import orbax.checkpoint as ocp

        cmd = "python benchmarks/tier_bench.py" + (" --quick" if args.quick else "")
        header = "| " + " | ".join(c.header for c in table.columns) + " |"
        lines = [
            "## tier_bench: two tiers, local first, drained to an S3-compatible server",
            "",
            f"Command: `{cmd}` (repeat={repeat}, median, cases interleaved). The durable tier "
            "is moto's S3 server in its own process on 127.0.0.1; the limit is the same bytes "
            "uploaded by TensorStore alone to the same server in the same run.",
            "",
            f"- Date: {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC",
            f"- CPU: {cpu_and_ram()}",
            f"- Python {platform.python_version()}, jax {jax.__version__}, "
            f"orbax-checkpoint {ocp.__version__}",
            "",
            header,
            "|" + "---|" * len(table.columns),
            *("| " + " | ".join(row) + " |" for row in rows),
            "",
            *(f"- {line}" for line in targets),
            f"- Orbax's CheckpointManager on `s3://`: {orbax_s3}",
        ]
        write_section(SECTION, "\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
