"""``python -m ppdiffusers_tome demo|bench ...``: see :mod:`ppdiffusers_tome.tools.cli`."""

import sys

from .tools.cli import main

sys.exit(main())
