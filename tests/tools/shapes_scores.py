"""What the shapes tests share: a pipeline's images for held-out captions, and the classifier's scores of them."""

import numpy as np

from research.shapes import scoring
from research.shapes.classifier import HEADS, accuracy


def held_out(count):
    """``count`` held-out one-object captions, their classifier targets and the trained classifier."""
    prompts, labels, _ = scoring.held_out_prompts(count)
    return prompts, scoring.label_targets(labels), scoring.load_trained_classifier()


def generate(pipe, prompts, steps, guidance):
    """``pipe``'s 64 x 64 images for ``prompts`` (generator seed 0) as float ``[N, 3, 64, 64]`` in [-1, 1]."""
    import paddle

    out = pipe(prompts, num_inference_steps=steps, guidance_scale=guidance, height=64, width=64,
               generator=paddle.Generator().manual_seed(0), output_type="np").images
    return np.asarray(out, dtype=np.float32).transpose(0, 3, 1, 2) * 2.0 - 1.0


def mean_accuracy(model, images, targets):
    """The classifier's accuracy per head on ``images`` and its mean over the heads."""
    scores = accuracy(model, images, targets)
    return float(np.mean([scores[h] for h in HEADS])), scores
