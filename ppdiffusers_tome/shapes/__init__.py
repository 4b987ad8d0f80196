"""A tiny text-to-image model trained on synthetic shapes (issue #20): the captioned dataset
(:mod:`~ppdiffusers_tome.shapes.dataset`), the pipeline's architecture (:mod:`~ppdiffusers_tome.shapes.model`),
its training script (:mod:`~ppdiffusers_tome.shapes.train`) and the classifier that scores generated images
(:mod:`~ppdiffusers_tome.shapes.classifier`).

Only the dataset is imported here (numpy and PIL); the other modules import Paddle and ppdiffusers when imported.
"""

from .dataset import COLOURS, POSITIONS, SHAPES, batch, sample

__all__ = ["COLOURS", "POSITIONS", "SHAPES", "batch", "sample"]
