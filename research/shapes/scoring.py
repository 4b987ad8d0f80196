"""Scoring the shipped shapes pipeline: the trained classifier, and held-out captions with their labels.

The classifier's weights live in ``research/shapes/weights/`` (``classifier.json`` beside them holds its accuracy);
the pipeline it scores ships in the package (:mod:`ppdiffusers_tome.tools.shapes`).

    >>> from research.shapes import scoring
    >>> prompts, labels, images = scoring.held_out_prompts(3)
    >>> len(prompts), images.shape, all(label["n_objects"] == 1 for label in labels)
    (3, (3, 3, 64, 64), True)
"""

from __future__ import annotations

import os
from typing import Any, Dict, List, Sequence, Tuple

import numpy as np

from . import dataset

__all__ = ["CLASSIFIER_PATH", "HELD_OUT_SEED", "held_out_prompts", "label_targets", "load_trained_classifier"]

CLASSIFIER_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "weights", "classifier.pdparams")
HELD_OUT_SEED = 4242  # dataset seed of the prompts the model is scored on: the training stream uses seed 0


def load_trained_classifier(path: str = ""):
    """The trained :class:`~research.shapes.classifier.ShapesClassifier` (eval mode), or the one at ``path``."""
    from .classifier import load_classifier

    return load_classifier(path or CLASSIFIER_PATH)


def held_out_prompts(count: int, seed: int = HELD_OUT_SEED, single_object: bool = True
                     ) -> Tuple[List[str], List[Dict[str, Any]], Any]:
    """``count`` captions of dataset images the model never saw (dataset seed ``seed``), their labels, and the
    real images ``[count, 3, 64, 64]`` in [-1, 1]. With ``single_object`` (default) only one-object images are kept,
    the ones whose caption names every label the classifier reads (shape, colour, position, background)."""
    if count < 1:
        raise ValueError(f"count must be >= 1; got {count}")
    prompts: List[str] = []
    labels: List[Dict[str, Any]] = []
    arrays: List[Any] = []
    index = 0
    while len(prompts) < count:
        image, caption, label = dataset.sample(index, seed=seed)
        index += 1
        if single_object and label["n_objects"] != 1:
            continue
        prompts.append(caption)
        labels.append(label)
        arrays.append(np.asarray(image, dtype=np.float32).transpose(2, 0, 1) / 127.5 - 1.0)
    return prompts, labels, np.stack(arrays)


def label_targets(labels: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
    """The classifier's target indices (``{head: int array}``) of one-object ``labels``."""
    indices = [dataset.label_indices(label) for label in labels]
    return {key: np.array([item[key] for item in indices]) for key in indices[0]}
