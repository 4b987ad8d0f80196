"""What merging does to images a person can judge: the shipped shapes model, scored by the shipped classifier (#20).

The paper's FID table in miniature. For every configuration (vanilla, ToMe at 0.3 / 0.5 / 0.6, ToDo,
ppdiffusers' built-in port at 0.5, the step cache with interval 2, 3 and 5 alone and with interval 3 after ToMe 0.5
or ToDo, all at the default ``layers="auto"`` (DeepCache's finest branch), and interval 3 on the whole first level,
alone and after ToMe 0.5; ``--configs`` picks some) and every seed, the shipped pipeline draws one image per held-out
caption
(captions of dataset images the model never saw, one object each, so that the caption names all four labels),
from the same initial latents for every configuration (generator seed = seed x 1000 + batch). Per configuration,
mean and seed-to-seed standard deviation of:

* classifier accuracy against the caption, per head (shape, colour, position, background) and their mean;
* feature distance: the Frechet distance between the classifier's 128 features of the generated images and of
  ``--reference`` real held-out images (FID's formula on a small, task-specific feature space; with a few dozen
  images per seed it is biased upwards alike for every row: compare rows, not with published FIDs);
* PSNR of each image to vanilla's image from the same latents (vanilla: inf).

Two reference rows bound the scale: ``real images`` (the classifier on the captions' own dataset images: its
ceiling; the distance of disjoint real sets of the same size: the floor that sampling noise alone gives).
Also printed: the seconds per configuration relative to vanilla, from this run only (at 1,024 tokens merging
saves little: use ``bench`` on the SD presets for speed). Writes ``results.json``, ``table.md`` and ``grid.png``
(the first ``--grid`` captions of the first seed, one row per caption, one column per configuration).

    bash run.sh python benchmarks/shapes_fidelity.py --seeds 4 --prompts 32 --output outputs/shapes_fidelity
    bash run.sh python benchmarks/shapes_fidelity.py --render outputs/shapes_fidelity/results.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any, Dict, List, Sequence

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import ppdiffusers_tome  # noqa: E402,F401  (registers apply_tome; quiets Paddle's import)
from ppdiffusers_tome.tools.bench.methods import Method, configure  # noqa: E402
from ppdiffusers_tome.tools.measure import environment, psnr, render_table, set_threads  # noqa: E402
from research.shapes import classifier as shapes_classifier  # noqa: E402
from ppdiffusers_tome.tools import shapes as shipped  # noqa: E402
from research.shapes import scoring
from research.shapes.classifier import HEADS  # noqa: E402

CONFIGS: Dict[str, Method] = {
    "vanilla": Method("vanilla"),
    "ToMe 0.3": Method("tome", 0.3),
    "ToMe 0.5": Method("tome", 0.5),
    "ToMe 0.6": Method("tome", 0.6),
    "ToDo": Method("todo"),
    "built-in 0.5": Method("builtin", 0.5),
    "cache 2": Method("cache", cache={"interval": 2}),
    "cache 3": Method("cache", cache={"interval": 3}),
    "cache 5": Method("cache", cache={"interval": 5}),
    "ToMe 0.5 + cache 3": Method("tome", 0.5, cache={"interval": 3}),
    "ToDo + cache 3": Method("todo", cache={"interval": 3}),
    # the whole first level on a cached step (DeepCache's branch 2 on SD-1.5; the default before 0.14.0)
    "cache 3, whole level": Method("cache", cache={"interval": 3, "layers": None}),
    "ToMe 0.5 + cache 3, whole level": Method("tome", 0.5, cache={"interval": 3, "layers": None}),
    # DeepCache's finest branch: a cached step runs only the last layer of the last up block (the shapes UNet has
    # one layer per down block, two per up block, so layers=1 is the only branch finer than depth=1 there); the
    # cache's default (layers="auto") since 0.14.0, so "cache 3" above is "cache 3, layers 1"
    "cache 3, layers 1": Method("cache", cache={"interval": 3, "layers": 1}),
    "ToMe 0.5 + cache 3, layers 1": Method("tome", 0.5, cache={"interval": 3, "layers": 1}),
}

# The SD3 shapes model (--model shapes-sd3): ppdiffusers' built-in port has no SD3 path, so it is left out; ToMe on
# the joint attention alone and with the MLP, ToDo, and the transformer step cache (its default layers)
SD3_CONFIGS: Dict[str, Method] = {
    "vanilla": Method("vanilla"),
    "ToMe 0.3": Method("tome", 0.3),
    "ToMe 0.5": Method("tome", 0.5),
    "ToMe 0.3 + MLP": Method("tome", 0.3, options={"merge_mlp": True}),
    "ToMe 0.5 + MLP": Method("tome", 0.5, options={"merge_mlp": True}),
    "ToDo": Method("todo"),
    "cache 2": Method("cache", cache={"interval": 2}),
    "cache 3": Method("cache", cache={"interval": 3}),
    "cache 4": Method("cache", cache={"interval": 4}),
    "ToMe 0.5 + cache 3": Method("tome", 0.5, cache={"interval": 3}),
    "ToDo + cache 3": Method("todo", cache={"interval": 3}),
}
MODELS = {"shapes": CONFIGS, "shapes-sd3": SD3_CONFIGS}


def generate(pipe, prompts: Sequence[str], seed: int, steps: int, guidance: float, batch: int) -> np.ndarray:
    """One image per prompt as float ``[N, 3, 64, 64]`` in [-1, 1]; batch ``k`` starts from generator seed
    ``seed * 1000 + k``, so every configuration starts from the same latents."""
    import paddle

    out = []
    for k in range(0, len(prompts), batch):
        images = pipe(list(prompts[k:k + batch]), num_inference_steps=steps, guidance_scale=guidance, height=64,
                      width=64, generator=paddle.Generator().manual_seed(seed * 1000 + k // batch),
                      output_type="np").images
        out.append(np.asarray(images, dtype=np.float32).transpose(0, 3, 1, 2) * 2.0 - 1.0)
    return np.concatenate(out)


def score(model, images: np.ndarray, targets: Dict[str, np.ndarray], reference: np.ndarray) -> Dict[str, Any]:
    """Accuracy per head and its mean, and the feature distance of ``images`` to ``reference``."""
    acc = shapes_classifier.accuracy(model, images, targets)
    return {"accuracy": acc, "accuracy_mean": float(np.mean([acc[h] for h in HEADS])),
            "feature_distance": shapes_classifier.feature_distance(model, images, reference)}


def mean_sd(values: Sequence[float]) -> Dict[str, float]:
    """``{"mean", "sd"}`` of finite ``values`` (sd 0 for one value; both inf when every value is inf)."""
    finite = [v for v in values if np.isfinite(v)]
    if not finite:
        return {"mean": float("inf"), "sd": 0.0}
    return {"mean": float(np.mean(finite)), "sd": float(statistics.stdev(finite)) if len(finite) > 1 else 0.0}


def summarise(per_seed: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Mean and sd over seeds of every number of :func:`score` (plus ``psnr_db`` and ``seconds_ratio``)."""
    out: Dict[str, Any] = {"seeds": len(per_seed)}
    for head in HEADS:
        out[head] = mean_sd([s["accuracy"][head] for s in per_seed])
    for key in ("accuracy_mean", "feature_distance", "psnr_db", "seconds_ratio"):
        if all(key in s for s in per_seed):
            out[key] = mean_sd([s[key] for s in per_seed])
    return out


def _cell(stat: Dict[str, float], digits: int = 3, percent: bool = False) -> str:
    if stat["mean"] == float("inf"):
        return "inf"
    scale = 100.0 if percent else 1.0
    return f"{stat['mean'] * scale:.{digits}f} ± {stat['sd'] * scale:.{digits}f}"


def table_rows(data: Dict[str, Any]) -> List[List[str]]:
    """The table: header, then the real-images row and one row per configuration."""
    header = ["configuration", "accuracy %", *[f"{h} %" for h in HEADS], "feature distance", "PSNR to vanilla dB",
              "time / vanilla (this run)"]
    rows = [header]
    real = data["real"]
    rows.append(["real images", _cell(real["accuracy_mean"], 1, True),
                 *[_cell(real[h], 1, True) for h in HEADS], _cell(real["feature_distance"], 1), "", ""])
    for name, summary in data["summary"].items():
        rows.append([name, _cell(summary["accuracy_mean"], 1, True), *[_cell(summary[h], 1, True) for h in HEADS],
                     _cell(summary["feature_distance"], 1),
                     _cell(summary["psnr_db"], 1) if "psnr_db" in summary else "inf",
                     "1.00" if name == "vanilla" else f"{summary['seconds_ratio']['mean']:.2f}"])
    return rows


def markdown(rows: List[List[str]]) -> str:
    """``rows`` as a GitHub markdown table."""
    lines = ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
    lines += ["| " + " | ".join(row) + " |" for row in rows[1:]]
    return "\n".join(lines)


def fidelity_grid(images: Dict[str, np.ndarray], prompts: Sequence[str]):
    """One labelled row per prompt (caption above it), one column per configuration."""
    from PIL import Image, ImageDraw

    from ppdiffusers_tome.tools.images import label_font as _font, side_by_side

    rows = []
    for k, prompt in enumerate(prompts):
        tiles = [Image.fromarray(np.clip(np.rint((v[k].transpose(1, 2, 0) + 1.0) * 127.5), 0, 255).astype(np.uint8))
                 for v in images.values()]
        row = side_by_side(tiles, list(images))
        font = _font(15)
        title = Image.new("RGB", (row.width, 24), "white")
        ImageDraw.Draw(title).text((6, 3), f"“{prompt}”", fill="black", font=font)
        rows += [title, row]
    sheet = Image.new("RGB", (max(r.width for r in rows), sum(r.height for r in rows)), "white")
    y = 0
    for r in rows:
        sheet.paste(r, (0, y))
        y += r.height
    return sheet


def run(args: argparse.Namespace) -> Dict[str, Any]:
    threads = set_threads(args.threads)
    configs = MODELS[args.model]
    pipe = shipped.load_sd3_pipeline() if args.model == "shapes-sd3" else shipped.load_pipeline()
    model = scoring.load_trained_classifier()
    prompts, labels, real_of_prompts = scoring.held_out_prompts(args.prompts)
    targets = scoring.label_targets(labels)
    # the reference set: later held-out images, disjoint from the prompts' own
    _, _, pool = scoring.held_out_prompts(args.prompts + args.reference)
    reference = pool[args.prompts:]
    real_sets = [scoring.held_out_prompts(args.prompts, seed=scoring.HELD_OUT_SEED + 1 + s)[2] for s in range(args.seeds)]
    real = {"accuracy": shapes_classifier.accuracy(model, real_of_prompts, targets)}
    real["accuracy_mean"] = {"mean": float(np.mean([real["accuracy"][h] for h in HEADS])), "sd": 0.0}
    for head in HEADS:
        real[head] = {"mean": real["accuracy"][head], "sd": 0.0}
    real["feature_distance"] = mean_sd([shapes_classifier.feature_distance(model, s, reference) for s in real_sets])

    unknown = sorted(set(args.configs or []) - set(configs))
    if unknown:
        raise SystemExit(f"--configs: {', '.join(unknown)} not among {args.model}'s: {', '.join(configs)}")
    names = ["vanilla"] + [name for name in (args.configs or list(configs)) if name != "vanilla"]
    per_config: Dict[str, List[Dict[str, Any]]] = {name: [] for name in names}
    grid_images: Dict[str, np.ndarray] = {}
    for seed in range(args.seeds):
        turn = seed % max(1, len(names) - 1)  # each seed starts the others at a different one (vanilla first)
        order = ["vanilla"] + names[1:][turn:] + names[1:][:turn]
        results: Dict[str, Dict[str, Any]] = {}
        outputs: Dict[str, np.ndarray] = {}
        for name in order:
            configure(pipe, configs[name], "auto")
            began = time.perf_counter()
            images = generate(pipe, prompts, seed, args.steps, args.guidance, args.batch)
            seconds = time.perf_counter() - began
            outputs[name] = images
            result = score(model, images, targets, reference)
            result["seconds"] = seconds
            results[name] = result
            print(f"seed {seed} {name:>12}: accuracy {result['accuracy_mean'] * 100:.1f} %, "
                  f"distance {result['feature_distance']:.1f}, {seconds:.1f} s", flush=True)
        configure(pipe, Method("vanilla"), "auto")
        vanilla_images, vanilla_seconds = outputs["vanilla"], results["vanilla"]["seconds"]
        for name in names:
            if name != "vanilla":  # (vanilla's own PSNR is infinite: left out, keeping the JSON standard)
                results[name]["psnr_db"] = float(np.mean([psnr((vanilla_images[k] + 1) / 2, (outputs[name][k] + 1) / 2)
                                                          for k in range(len(prompts))]))
            results[name]["seconds_ratio"] = results[name]["seconds"] / vanilla_seconds
            per_config[name].append(results[name])
        if seed == 0:
            grid_images = {name: outputs[name][: args.grid] for name in names}
    data = {
        "command": " ".join(["benchmarks/shapes_fidelity.py"] + sys.argv[1:]),
        "version": ppdiffusers_tome.__version__,
        "environment": environment(threads, "float32"),
        "settings": {"model": args.model, "seeds": args.seeds, "prompts": args.prompts, "reference": args.reference, "steps": args.steps,
                     "guidance": args.guidance, "max_downsample": "auto"},
        "prompts": prompts,
        "real": real,
        "per_seed": per_config,
        "summary": {name: summarise(per_config[name]) for name in names},
    }
    os.makedirs(args.output, exist_ok=True)
    fidelity_grid(grid_images, prompts[: args.grid]).save(os.path.join(args.output, "grid.png"))
    return data


def main(argv: Sequence[str] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--model", choices=list(MODELS), default="shapes",
                        help="the shipped UNet model, or the same task on SD3's MMDiT")
    parser.add_argument("--seeds", type=int, default=4, help="initial-latent seeds (>= 2 for a spread)")
    parser.add_argument("--prompts", type=int, default=32, help="held-out captions per seed")
    parser.add_argument("--reference", type=int, default=512, help="real images the feature distance compares with")
    parser.add_argument("--steps", type=int, default=None, help="sampling steps (default: the model's demo steps)")
    parser.add_argument("--guidance", type=float, default=None,
                        help="classifier-free guidance (default: the model's demo guidance)")
    parser.add_argument("--batch", type=int, default=16, help="images per pipeline call")
    parser.add_argument("--grid", type=int, default=6, help="captions shown in grid.png")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (default: all cores)")
    parser.add_argument("--output", default=os.path.join("outputs", "shapes_fidelity"))
    parser.add_argument("--configs", nargs="+", default=None, metavar="NAME",
                        help=f"configurations to score (default: all; vanilla always): {', '.join(CONFIGS)}; "
                             f"shapes-sd3: {', '.join(SD3_CONFIGS)}")
    parser.add_argument("--render", default=None, help="print the tables of an earlier results.json and exit")
    args = parser.parse_args(argv)
    if args.render:
        with open(args.render, encoding="utf-8") as f:
            data = json.load(f)
    else:
        if args.seeds < 1 or args.prompts < 2 or args.reference < 2:
            parser.error("--seeds must be >= 1, --prompts and --reference >= 2")
        sd3 = args.model == "shapes-sd3"
        args.steps = args.steps or (shipped.SD3_DEMO_STEPS if sd3 else shipped.DEMO_STEPS)
        args.guidance = args.guidance if args.guidance is not None else (
            shipped.SD3_DEMO_GUIDANCE if sd3 else shipped.DEMO_GUIDANCE)
        data = run(args)
        with open(os.path.join(args.output, "results.json"), "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1, default=str)
    rows = table_rows(data)
    print(render_table(rows))
    text = markdown(rows)
    if not args.render:
        with open(os.path.join(args.output, "table.md"), "w", encoding="utf-8") as f:
            f.write(text + "\n")
        print(f"wrote {args.output}/results.json, table.md and grid.png")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
