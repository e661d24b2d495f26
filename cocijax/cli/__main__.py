"""``python -m cocijax.cli``: the same as the ``cocijax`` command."""

import sys

from cocijax.cli import main

if __name__ == "__main__":
    sys.exit(main())
