"""``python -m uag ...`` (and ``torchrun -m uag ...``): the same as the ``uag`` command."""

import sys

from uag.cli import main

sys.exit(main())
