"""``python -m fedssl.cli``: the ``fedssl`` command."""

import sys

from fedssl.cli import main

sys.exit(main())
