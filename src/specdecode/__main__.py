"""``python -m specdecode``: the ``specdecode`` command (``specdecode.cli``)."""

import sys

from specdecode.cli import main

sys.exit(main())
