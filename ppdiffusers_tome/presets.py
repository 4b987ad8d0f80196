"""Model presets with random weights, built offline: ``preset_pipeline("sd15")`` and the tiny models of the tests.

The public name of :mod:`ppdiffusers_tome.tools.presets`, whose public functions it re-exports.

>>> from ppdiffusers_tome.presets import available_presets
>>> "sd15" in available_presets()
True
"""

from .tools.presets import *  # noqa: F401,F403
from .tools.presets import __all__  # noqa: F401
