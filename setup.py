"""Packaging for ppdiffusers_tome.

Paddle itself is not an install requirement: CPU users install ``paddlepaddle``, GPU users ``paddlepaddle-gpu``
(requiring one would fight the other). ``requirements.txt`` + ``constraints.txt`` hold a known-good CPU set.
"""

import os
import re

from setuptools import find_packages, setup

here = os.path.dirname(os.path.abspath(__file__))
with open(os.path.join(here, "ppdiffusers_tome", "__init__.py"), encoding="utf-8") as f:
    version = re.search(r'^__version__ = "([^"]+)"', f.read(), re.M).group(1)  # one version, kept in the package
readme = os.path.join(here, "README.md")
long_description = open(readme, encoding="utf-8").read() if os.path.exists(readme) else ""

setup(
    name="ppdiffusers_tome",
    version=version,
    description="Token Merging for Stable Diffusion (ToMe SD) for PaddlePaddle and ppdiffusers",
    long_description=long_description,
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    packages=find_packages(include=["ppdiffusers_tome", "ppdiffusers_tome.*"]),
    # the presets' configs and the trained shapes pipelines of the offline demo (the UNet's, about 7 MB, and SD3's);
    # the repository's research/ (training, dataset, classifier) and benchmarks/ stay out of the wheel
    package_data={"ppdiffusers_tome": ["tools/configs/*.json"] + [
        f"tools/{model}/{pattern}" for model in ("shapes_model", "shapes_sd3_model")
        for pattern in ("*.json", "pipeline/*.json", "pipeline/*/*")]},
    python_requires=">=3.8",
    install_requires=["ppdiffusers>=0.29,<0.30", "numpy", "Pillow"],
    extras_require={"test": ["pytest>=7", "hypothesis>=6"], "plots": ["matplotlib>=3.5"]},
    entry_points={"console_scripts": ["ppdiffusers-tome=ppdiffusers_tome.tools.cli:main"]},
    classifiers=[
        "Programming Language :: Python :: 3",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
)
