"""The trained shapes model and classifier that ship inside the package, and how to load them offline.

The weights live in ``ppdiffusers_tome/shapes/weights/``: ``pipeline/`` is a ``save_pretrained`` folder (UNet, VAE,
text encoder, tokenizer, DDIM scheduler: :mod:`ppdiffusers_tome.shapes.model`) made by
:mod:`ppdiffusers_tome.shapes.train`, ``classifier.pdparams`` the scorer of :mod:`ppdiffusers_tome.shapes.classifier`,
and ``training.json`` the command lines and step counts that reproduce both. Nothing is downloaded: the pipeline
loads with ``StableDiffusionPipeline.from_pretrained(pipeline_folder())``, which is all :func:`load_pipeline` does.

    >>> from ppdiffusers_tome.shapes import shipped
    >>> shipped.DEMO_PROMPT
    'a large red star at the top left on a blue background'
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Sequence, Tuple

__all__ = [
    "WEIGHTS_DIR",
    "DEMO_PROMPT",
    "DEMO_GUIDANCE",
    "DEMO_STEPS",
    "pipeline_folder",
    "classifier_path",
    "has_weights",
    "load_pipeline",
    "load_classifier",
    "training_info",
    "held_out_prompts",
    "label_targets",
]

WEIGHTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "weights")
# What the demo draws by default: every word is in the dataset's grammar (a single object, so its position is named)
DEMO_PROMPT = "a large red star at the top left on a blue background"
DEMO_GUIDANCE = 4.0  # classifier-free guidance that suits the small model (SD's 7.5 over-saturates its colours)
DEMO_STEPS = 20  # DDIM steps: the small model needs more than the 8 the random presets are timed with
HELD_OUT_SEED = 4242  # dataset seed of the prompts the model is scored on: the training stream uses seed 0


def pipeline_folder() -> str:
    """The folder of the shipped pipeline (``model_index.json`` and one folder per component)."""
    return os.path.join(WEIGHTS_DIR, "pipeline")


def classifier_path() -> str:
    """The shipped classifier's weights (``.pdparams``; its accuracy is in the ``.json`` beside it)."""
    return os.path.join(WEIGHTS_DIR, "classifier.pdparams")


def has_weights() -> bool:
    """Whether this installation carries the trained weights (a source tree or a wheel built from one does)."""
    return os.path.isfile(os.path.join(pipeline_folder(), "model_index.json")) and os.path.isfile(classifier_path())


def _require_weights() -> None:
    if not has_weights():
        raise FileNotFoundError(
            f"the trained shapes weights are missing from {WEIGHTS_DIR}; reinstall the package, or train them with "
            "`python -m ppdiffusers_tome.shapes.train` (see training.json for the exact command)")


def load_pipeline(dtype: str = "float32", folder: str = ""):
    """The shipped text-to-image pipeline (``StableDiffusionPipeline`` with DDIM), loaded offline from
    ``folder`` (default :func:`pipeline_folder`) in ``dtype``; the progress bar is off.

        >>> from ppdiffusers_tome.shapes import shipped
        >>> pipe = shipped.load_pipeline()
        >>> image = pipe(shipped.DEMO_PROMPT, num_inference_steps=4, guidance_scale=shipped.DEMO_GUIDANCE,
        ...              height=64, width=64, output_type="np").images[0]
        >>> image.shape
        (64, 64, 3)
    """
    from ..presets import load_local_pipeline

    if not folder:
        _require_weights()
    return load_local_pipeline(folder or pipeline_folder(), dtype=dtype)


def load_classifier(path: str = ""):
    """The shipped :class:`~ppdiffusers_tome.shapes.classifier.ShapesClassifier` (eval mode), or the one at ``path``."""
    from .classifier import load_classifier as load

    if not path:
        _require_weights()
    return load(path or classifier_path())


def training_info() -> Dict[str, Any]:
    """What ``training.json`` records: the commands that made the weights, their step counts and accuracy."""
    path = os.path.join(WEIGHTS_DIR, "training.json")
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def held_out_prompts(count: int, seed: int = HELD_OUT_SEED, single_object: bool = True
                     ) -> Tuple[List[str], List[Dict[str, Any]], Any]:
    """``count`` captions of dataset images the model never saw (dataset seed ``seed``), their labels, and the
    real images ``[count, 3, 64, 64]`` in [-1, 1]. With ``single_object`` (default) only one-object images are kept,
    the ones whose caption names every label the classifier reads (shape, colour, position, background).

        >>> prompts, labels, images = held_out_prompts(3)
        >>> len(prompts), images.shape, all(label["n_objects"] == 1 for label in labels)
        (3, (3, 3, 64, 64), True)
    """
    import numpy as np

    from . import dataset

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
    import numpy as np

    from . import dataset

    indices = [dataset.label_indices(label) for label in labels]
    return {key: np.array([item[key] for item in indices]) for key in indices[0]}
