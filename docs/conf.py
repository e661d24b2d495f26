"""Sphinx configuration of the cocijax site: ``make docs`` builds it into ``docs/_build/html``.

The source directory is the repository root, so that README.md and BENCHMARKS.md are pages of
the site and every relative link between them and ``docs/`` resolves as it does on GitHub; only
those files and ``docs/`` are read.
"""

from pathlib import Path

project = "cocijax"

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
]

root_doc = "README"
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
include_patterns = ["README.md", "BENCHMARKS.md", "docs/*.md", "docs/api/*.rst"]
# Every other top-level directory (the package, tests, a virtual environment, checkpoints a demo
# left) is left unwalked, and so is the built site.
exclude_patterns = [
    p.name for p in Path(__file__).resolve().parents[1].iterdir() if p.is_dir() and p.name != "docs"
] + ["docs/_build"]

# Markdown: GitHub-style heading anchors, so that `page.md#a-heading` links work here as there.
myst_heading_anchors = 3

# API reference: Google-style docstrings with reST roles, as optax and Orbax write them.
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_ivar = True  # Attributes: as fields; autodoc documents the members themselves
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True}

html_theme = "sphinx_book_theme"
html_title = "cocijax"
html_theme_options = {"show_toc_level": 2}

# The navigation, appended to README.md (the home page) when Sphinx reads it, so that the
# README stays plain Markdown on GitHub.
NAVIGATION = """

```{toctree}
:hidden:
:caption: Guide

docs/porting
docs/policies
docs/manager
docs/storage
docs/pytorch
docs/cli
docs/demo
```

```{toctree}
:hidden:
:caption: Design and evidence

docs/architecture
docs/reliability
docs/bad-input
docs/benchmarks
Benchmark results <BENCHMARKS>
```

```{toctree}
:hidden:
:caption: API reference

docs/api/cocijax
docs/api/policies
docs/api/sim
docs/api/manager
docs/api/storage
docs/api/torch
```
"""


def _add_navigation(app, docname, source):
    if docname == root_doc:
        source[0] += NAVIGATION


def setup(app):
    app.connect("source-read", _add_navigation)
