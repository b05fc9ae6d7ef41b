"""``python -m tidal.cli``: the ``tidal`` command."""

import sys

from tidal.cli import main

sys.exit(main())
