"""Packaging for ppdiffusers_tome.

Paddle itself is not an install requirement: CPU users install ``paddlepaddle``, GPU users ``paddlepaddle-gpu``
(requiring one would fight the other). ``requirements.txt`` + ``constraints.txt`` hold a known-good CPU set.
"""

import os

from setuptools import find_packages, setup

here = os.path.dirname(os.path.abspath(__file__))
readme = os.path.join(here, "README.md")
long_description = open(readme, encoding="utf-8").read() if os.path.exists(readme) else ""

setup(
    name="ppdiffusers_tome",
    version="0.8.1",
    description="Token Merging for Stable Diffusion (ToMe SD) for PaddlePaddle and ppdiffusers",
    long_description=long_description,
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    packages=find_packages(include=["ppdiffusers_tome", "ppdiffusers_tome.*"]),
    # the presets' configs, and the trained shapes model + classifier (shapes/weights: about 9.5 MB)
    package_data={"ppdiffusers_tome": ["configs/*.json", "shapes/weights/*.json", "shapes/weights/*.pdparams",
                                       "shapes/weights/pipeline/*.json", "shapes/weights/pipeline/*/*"]},
    python_requires=">=3.8",
    install_requires=["ppdiffusers>=0.29,<0.30", "numpy", "Pillow"],
    extras_require={"test": ["pytest>=7", "hypothesis>=6"], "plots": ["matplotlib>=3.5"]},
    entry_points={"console_scripts": ["ppdiffusers-tome=ppdiffusers_tome.cli:main"]},
    classifiers=[
        "Programming Language :: Python :: 3",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
)
