"""A tiny text-to-image model trained on synthetic shapes: the captioned dataset
(:mod:`~research.shapes.dataset`), the pipeline's architecture (:mod:`~research.shapes.model`),
its training script (:mod:`~research.shapes.train`) and the classifier that scores generated images
(:mod:`~research.shapes.classifier`, :mod:`~research.shapes.scoring`).

Only the dataset is imported here (numpy and PIL); the other modules import Paddle and ppdiffusers when imported.
"""

from .dataset import COLOURS, POSITIONS, SHAPES, batch, sample

__all__ = ["COLOURS", "POSITIONS", "SHAPES", "batch", "sample"]
