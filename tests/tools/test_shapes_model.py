"""The shapes pipeline's layout (ppdiffusers_tome/shapes/model.py): a word-level offline tokenizer, a UNet whose
finest transformer level has 1024 tokens, a size that ships (<= 10 MB in float32), and a folder that loads offline
through from_pretrained and load_local_pipeline and runs with and without ToMe."""

import json
import os
import random

import numpy as np
import paddle
import pytest
from ppdiffusers import StableDiffusionPipeline
from ppdiffusers.models.attention_processor import Attention

import ppdiffusers_tome
from ppdiffusers_tome.presets import load_local_pipeline
from research.shapes import dataset, model
from research.shapes.model import _apply_bpe, build_pipeline, count_parameters, word_merges


@pytest.fixture(scope="module")
def pipe():
    return build_pipeline(seed=0)


@pytest.fixture(scope="module")
def folder(pipe, tmp_path_factory):
    path = tmp_path_factory.mktemp("shapes_pipe")
    pipe.save_pretrained(str(path))
    return str(path)


def generate(pipe, prompt="a small red star at the top left on a blue background", seed=0):
    return pipe(prompt, num_inference_steps=1, height=64, width=64, generator=paddle.Generator().manual_seed(seed),
                output_type="np").images


def test_every_dataset_word_is_one_token_and_captions_fit(pipe):
    tokenizer = pipe.tokenizer
    for word in dataset.VOCABULARY:
        assert tokenizer.tokenize(word) == [word + "</w>"], word
    for index in range(200):
        caption = dataset.sample(index, seed=0)[1]
        ids = tokenizer(caption).input_ids
        assert len(ids) == len(caption.split()) + 2 <= model.MAX_LENGTH
    # text outside the vocabulary still tokenizes byte by byte, without unknown tokens
    tokens = tokenizer.tokenize("zebra")
    assert "".join(tokens) == "zebra</w>" and len(tokens) > 1


def test_word_merges_make_single_tokens_of_arbitrary_words():
    rng = random.Random(0)
    words = sorted({"".join(rng.choice("abcdeqrs") for _ in range(rng.randint(1, 7))) for _ in range(80)})
    merges = word_merges(words)
    ranks = {pair: rank for rank, pair in enumerate(merges)}
    for word in words:
        assert _apply_bpe(tuple(word[:-1]) + (word[-1] + "</w>",), ranks) == (word + "</w>",)
    with pytest.raises(ValueError, match="lowercase ASCII"):
        word_merges(["Red"])


def test_parameters_fit_ten_megabytes(pipe):
    counts = count_parameters(pipe)
    assert counts["total"] == counts["unet"] + counts["vae"] + counts["text_encoder"]
    assert counts["total"] * 4 <= 10 * 1024**2  # float32
    assert pipe.vae_scale_factor == 2 and pipe.unet.config.sample_size == 32


def test_finest_transformer_level_has_1024_tokens(pipe):
    seen = []
    layers = [m for name, m in pipe.unet.named_sublayers() if name.endswith("attn1") and isinstance(m, Attention)]
    hooks = [m.register_forward_pre_hook(lambda layer, args: seen.append(args[0].shape[1])) for m in layers]
    try:
        generate(pipe)
    finally:
        for hook in hooks:
            hook.remove()
    assert max(seen) == 1024  # 64 px images, 32x32 latents
    assert seen.count(1024) == 3  # down 1 + up 2 transformer blocks (guidance runs both halves in one batch)


def test_folder_loads_offline_and_generates_with_and_without_tome(pipe, folder):
    with open(os.path.join(folder, "model_index.json"), encoding="utf-8") as f:
        index = json.load(f)
    assert index["_class_name"] == "StableDiffusionPipeline"
    assert set(os.listdir(os.path.join(folder, "tokenizer"))) >= {"vocab.json", "merges.txt"}
    loaded = StableDiffusionPipeline.from_pretrained(folder)
    loaded.set_progress_bar_config(disable=True)
    assert loaded.tokenizer.tokenize("a small cyan cross") == ["a</w>", "small</w>", "cyan</w>", "cross</w>"]
    vanilla = generate(loaded)
    assert vanilla.shape == (1, 64, 64, 3) and np.isfinite(vanilla).all()
    np.testing.assert_allclose(vanilla, generate(pipe), atol=1e-5)  # the weights survived the round trip
    loaded.apply_tome(ratio=0.5)
    merged = generate(loaded)
    stats = ppdiffusers_tome.tome_stats(loaded)["unet"]
    assert stats["merges"] > 0 and stats["calls"] == 1
    assert np.isfinite(merged).all() and np.abs(merged - vanilla).max() > 1e-6
    loaded.remove_tome()
    np.testing.assert_allclose(generate(loaded), vanilla, atol=1e-6)


def test_load_local_pipeline_reads_the_folder(folder):
    pipe = load_local_pipeline(folder)
    assert type(pipe).__name__ == "StableDiffusionPipeline"
    assert pipe.unet.config.attention_head_dim == model.UNET_CONFIG["attention_head_dim"]
    assert np.isfinite(generate(pipe, "a large green circle left of a small red square on a gray background")).all()
