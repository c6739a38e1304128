"""``python -m specdecode.server``: the same as ``specdecode serve``."""

import sys

from specdecode.server.launch import main

sys.exit(main())
