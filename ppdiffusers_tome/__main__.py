"""``python -m ppdiffusers_tome demo ...``: see :mod:`ppdiffusers_tome.cli`."""

import sys

from .cli import main

sys.exit(main())
