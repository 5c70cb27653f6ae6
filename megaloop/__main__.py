"""``python -m megaloop``: the megaloop command."""

import sys

from megaloop.cli import main

sys.exit(main())
