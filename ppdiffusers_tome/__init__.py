"""ppdiffusers_tome: Token Merging for Stable Diffusion (ToMe SD) on PaddlePaddle, for ppdiffusers pipelines.

>>> import ppdiffusers_tome                        # adds apply_tome/remove_tome to pipelines and models
>>> from ppdiffusers_tome.testing import tiny_sd_pipeline
>>> pipe = tiny_sd_pipeline().apply_tome(ratio=0.5)
>>> pipe = pipe.remove_tome()
"""

from .api import apply_tome, install_methods, remove_tome, reset_tome, tome_config, tome_stats, uninstall_methods
from .config import ToMeConfig
from .merge import DownsamplePlan, MergePlan, bipartite_soft_matching_random2d, downsample_tokens

__version__ = "0.2.0"

__all__ = [
    "ToMeConfig",
    "MergePlan",
    "DownsamplePlan",
    "downsample_tokens",
    "apply_tome",
    "remove_tome",
    "reset_tome",
    "tome_config",
    "tome_stats",
    "bipartite_soft_matching_random2d",
    "install_methods",
    "uninstall_methods",
]

install_methods()
