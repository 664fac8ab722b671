"""``python -m unickpt``: the command line (:mod:`unickpt.cli`), as the ``unickpt`` script."""

import sys

from .cli import main

sys.exit(main())
