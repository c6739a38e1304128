"""``python -m specdecode.server``: the same as ``specdecode serve``."""

import sys

from specdecode.server.entry import main

sys.exit(main())
