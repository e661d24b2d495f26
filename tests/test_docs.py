"""The documentation: every Python block of README.md and docs/ runs, and the site builds.

Each page is one test: its Python blocks run in order in one namespace (Sybil's parser and
evaluators), in a fresh working directory, as a reader would run them one after the other. A
``>>>`` block is a doctest whose output must match. What a reader brings comes from here:
stand-ins for their training code (:func:`jax_training`, :func:`torch_training`), and for the
pages in ``S3_PAGES`` the suite's S3 server (the ``s3`` fixture: moto on 127.0.0.1) as
``s3_endpoint`` and ``s3_bucket``. A block that cannot run here is a ``bash`` block, or follows
``<!-- skip: next "why" -->`` (Sybil's skip syntax).

Each manager a page opens compiles its policy's update (seconds for ``coci``), the same program
every time: the pages run with JAX's persistent compilation cache on, as the docs advise for a
job that restarts often, so that it is compiled once per worker and loaded after that.

One test per page, not one per block: a page's blocks build on each other, and with
pytest 9.2 ``--dist loadgroup`` no longer keeps an ``xdist_group`` on one worker
(pytest-dev/pytest-xdist#1386).
"""

from __future__ import annotations

import unittest
from pathlib import Path

import pytest
from sphinx.cmd import build
from sybil import Sybil
from sybil.evaluators.skip import Skipper
from sybil.parsers.markdown import PythonCodeBlockParser, SkipParser

ROOT = Path(__file__).resolve().parents[1]
S3_PAGES = {"docs/manager.md", "docs/storage.md"}
TORCH_PAGES = {"docs/pytorch.md"}

_PARSER = Sybil([PythonCodeBlockParser(), SkipParser()])


def _python_blocks(page: str) -> int:
    """How many Python code blocks and doctest examples the page holds."""
    examples = _PARSER.parse(ROOT / page).examples()
    return sum(not isinstance(e.region.evaluator, Skipper) for e in examples)


# Pages with no Python block (command lines, tables) have nothing to run.
PAGES = [
    page
    for page in ["README.md", *sorted(str(p.relative_to(ROOT)) for p in ROOT.glob("docs/*.md"))]
    if _python_blocks(page)
]


def jax_training(namespace: dict) -> None:
    """Stand-ins for a reader's JAX training code: a linear model trained with Adam."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    optimizer = optax.adam(1e-2)
    params = {"w": jnp.zeros((8, 1)), "b": jnp.zeros((1,))}

    def loss_fn(params, batch):
        x, y = batch
        return jnp.mean((x @ params["w"] + params["b"] - y) ** 2)

    @jax.jit
    def train_step(state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(state["params"], batch)
        updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        return {"params": params, "opt_state": opt_state}, loss

    def batches():
        rng = np.random.default_rng(0)
        while True:
            x = rng.normal(size=(32, 8)).astype(np.float32)
            yield x, x.sum(axis=1, keepdims=True)

    namespace.update(
        state={"params": params, "opt_state": optimizer.init(params)},
        train_step=train_step,
        batches=batches(),
        evaluate=lambda state: float(loss_fn(state["params"], next(namespace["batches"]))),
        num_steps=200,
    )


def torch_training(namespace: dict) -> None:
    """Stand-ins for a reader's PyTorch training code: a linear model trained with SGD."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)

    def train_step(model, optimizer, batch):
        x, y = batch
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        return loss

    namespace.update(
        model=model,
        optimizer=optimizer,
        scheduler=torch.optim.lr_scheduler.StepLR(optimizer, step_size=100),
        train_step=train_step,
        num_steps=200,
    )


@pytest.fixture(scope="session")
def _cache_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("jax-compilation-cache"))


@pytest.fixture
def compilation_cache(_cache_dir):
    """JAX's persistent compilation cache, on for one test and off again after it."""
    import jax
    from jax.experimental.compilation_cache import compilation_cache

    previous = jax.config.jax_compilation_cache_dir
    compilation_cache.reset_cache()  # JAX decides whether to use the cache once, at first use
    compilation_cache.set_cache_dir(_cache_dir)
    yield
    jax.config.update("jax_compilation_cache_dir", previous)
    compilation_cache.reset_cache()


@pytest.mark.parametrize("page", PAGES)
def test_every_python_block_of_the_page_runs(
    page, tmp_path, monkeypatch, request, compilation_cache
):
    document = _PARSER.parse(ROOT / page)
    (torch_training if page in TORCH_PAGES else jax_training)(document.namespace)
    if page in S3_PAGES:
        bucket = request.getfixturevalue("s3")
        document.namespace.update(s3_endpoint=bucket.endpoint, s3_bucket=bucket.name)
    monkeypatch.chdir(tmp_path)
    for example in document.examples():
        try:
            example.evaluate()
        except unittest.SkipTest:
            continue
        except BaseException as error:
            error.add_note(f"in the block at {page}:{example.line}")
            raise


# Sphinx 9's own napoleon, MyST and the theme use APIs Sphinx 11 removes: their business.
@pytest.mark.filterwarnings("ignore::sphinx.deprecation.RemovedInSphinx11Warning")
def test_the_site_builds_without_a_warning(tmp_path, capsys):
    """``make docs``'s build (warnings are errors: broken links, bad docstrings), in-process."""
    status = build.build_main(
        [
            "-W",
            "--keep-going",
            "-q",
            "-b",
            "html",
            "-c",
            str(ROOT / "docs"),
            str(ROOT),
            str(tmp_path),
        ]
    )
    assert status == 0, capsys.readouterr().err
    assert (tmp_path / "docs" / "porting.html").is_file()
    assert (tmp_path / "docs" / "api" / "storage.html").is_file()
