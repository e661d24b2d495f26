"""``python -m cocijax.cli``: the same as the ``cocijax`` command."""

import sys

from cocijax.cli import main

sys.exit(main())
