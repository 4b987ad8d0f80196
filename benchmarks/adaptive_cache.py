"""The adaptive step cache against the baseline every step cache must beat: fewer steps in the same time.

For one model and one number of steps ``N``, every configuration below runs from the same initial latents per seed
(configurations in an order rotated per seed, each after one untimed 2-step run):

* ``vanilla`` (``N`` steps), ``fewer steps 1/2``, ``1/3`` and ``1/4`` (``N // 2``, ``N // 3`` and ``N // 4`` steps,
  no cache);
* ``interval 2`` / ``3`` / ``4``: the fixed-interval cache;
* ``adaptive T`` for each ``--thresholds`` T, and ``adaptive T + forecast`` (``forecast="linear"``; from 0.17.0 the
  rule then decides on the forecast's own error);
* ``whole-model T`` and ``whole-model T + forecast``: the whole-model cache (what SD3 built with
  ``INFERENCE_OPTIMIZE=True`` takes) with the adaptive rule, on every model; ``whole-model interval 2`` / ``3`` /
  ``4``, with and without ``+ forecast``: the same cache at a fixed interval; with ``--full-steps``,
  ``whole-model full steps + forecast``: the same cache with the forecast on the given full steps (the schedule the
  rule chose on another model, replayed: on random weights, the speed of a trained model's decisions);
* each of the above again with merging: ``+ ToMe 0.5`` on the shapes models, ``+ ToDo`` on SD3's layout
  (``--merge``).

Per configuration: the wall-time ratio to vanilla (vanilla's seconds of the same seed over the configuration's:
median and range over seeds), the steps computed in full per generation (the denoiser's full calls, from
``cache_status``), and the distance of the final image to vanilla's: PSNR and SSIM (:func:`ssim`, this script's numpy
implementation of Wang et al. 2004: 11-tap Gaussian window, sigma 1.5, reflected borders, K1 0.01, K2 0.03, the mean
over channels of the mean SSIM map without its 5-pixel border, as scikit-image's ``structural_similarity`` with
``gaussian_weights=True, use_sample_covariance=False`` computes it), and a learned-feature distance in LPIPS's spirit.

Models (``--model``):

* ``shapes``: the shipped shapes pipeline (trained, 64 x 64, DDIM unless ``--scheduler``, guidance 4), one image per
  held-out caption; the feature distance is ``1 - cosine`` of the shapes classifier's 128 features of the image and
  of vanilla's (mean over images), and the classifier's accuracy against the caption is reported (mean of its four
  heads; ``research/shapes/``, as ``benchmarks/shapes_fidelity.py`` scores the shipped pipeline).
* ``shapes-sd3``: the shipped SD3 shapes pipeline (trained, six MMDiT blocks, 64 x 64, flow-matching Euler,
  guidance 4), scored as ``shapes``.
* ``sd3``: SD3-medium's layout at ``--width`` with random weights (``benchmarks/sd3_forward.py``'s model and its
  flow-matching Euler loop with guidance, batch 2 = one image), the transformer alone: speed only. PSNR and SSIM are
  then of the final latents scaled to [0, 1] by vanilla's range, and the distance is their relative L2; with random
  weights none of them judges an image.

Writes ``results.json``, ``table.md`` and a plot of quality (PSNR) against speed-up, one curve per method
(``--plot``, e.g. into ``docs/``). ``--signals`` times nothing: on the shapes model without a cache it records the
adaptive rule's signal (the input of the UNet's first deep part) at every step, for DDIM, Euler and DPM-Solver++ at
each of ``--signal-steps``, and prints the sum of its relative changes and the full steps each threshold would give
(``signals.json``): what the default threshold is chosen from::

    bash run.sh python benchmarks/adaptive_cache.py --model shapes --steps 50 --seeds 3 --prompts 16 \\
        --threads 2 --output outputs/adaptive_shapes_50 --plot docs/adaptive_cache_shapes_50.png
    bash run.sh python benchmarks/adaptive_cache.py --model sd3 --steps 28 --size 512 --layers 24 --seeds 1 \\
        --threads 2 --output outputs/adaptive_sd3_28 --plot docs/adaptive_cache_sd3_28.png
    bash run.sh python benchmarks/adaptive_cache.py --render outputs/adaptive_shapes_50/results.json
    bash run.sh python benchmarks/adaptive_cache.py --combine outputs/run1/results.json outputs/run2/results.json \\
        --output outputs/runs
    bash run.sh python benchmarks/adaptive_cache.py --signals --prompts 4 --threads 2 --output outputs/signals
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import ppdiffusers_tome  # noqa: E402  (registers apply_tome; quiets Paddle's import)
from ppdiffusers_tome.cache.adaptive import DEFAULT_THRESHOLD, full_step_due  # noqa: E402
from ppdiffusers_tome.tools.measure import environment, psnr, render_table, set_threads  # noqa: E402

THRESHOLDS = (0.05, 0.1, DEFAULT_THRESHOLD, 0.2, 0.3)
MERGES = {"tome": ("ToMe 0.5", dict(ratio=0.5)), "todo": ("ToDo", dict(method="todo"))}
SCHEDULERS = {"ddim": "DDIMScheduler", "euler": "EulerDiscreteScheduler", "dpm++": "DPMSolverMultistepScheduler"}


class Config:
    """One configuration: its ``name``, the ``family`` its curve belongs to, the denoising ``steps``, the
    ``apply_cache`` options (None: no cache) and the ``apply_tome`` options (None: no merging). (A plain class: the
    tests load this script without registering it as a module, which a dataclass needs.)"""

    def __init__(self, name: str, family: str, steps: int, cache: Optional[Dict[str, Any]] = None,
                 merge: Optional[Dict[str, Any]] = None) -> None:
        self.name, self.family, self.steps, self.cache, self.merge = name, family, steps, cache, merge


def configurations(steps: int, thresholds: Sequence[float] = THRESHOLDS,
                   merge: Optional[str] = "tome", schedule: Optional[Sequence[int]] = None) -> Dict[str, Config]:
    """Every configuration for ``steps`` denoising steps, by name, vanilla first (see the module docstring).

    >>> names = list(configurations(20, thresholds=(0.15,), merge=None))
    >>> names
    ['vanilla', 'fewer steps 1/2', 'fewer steps 1/3', 'fewer steps 1/4', 'interval 2', 'interval 3', 'interval 4', 'adaptive 0.15', 'adaptive 0.15 + forecast', 'whole-model 0.15', 'whole-model 0.15 + forecast', 'whole-model interval 2', 'whole-model interval 3', 'whole-model interval 4', 'whole-model interval 2 + forecast', 'whole-model interval 3 + forecast', 'whole-model interval 4 + forecast']
    >>> configurations(20, (0.15,), merge=None)["fewer steps 1/3"].steps
    6
    """
    plain: List[Config] = [Config("vanilla", "vanilla", steps)]
    plain += [Config(f"fewer steps 1/{k}", "fewer steps", max(1, steps // k)) for k in (2, 3, 4)]
    plain += [Config(f"interval {k}", "interval", steps, dict(interval=k)) for k in (2, 3, 4)]
    for threshold in thresholds:
        plain.append(Config(f"adaptive {threshold:g}", "adaptive", steps, dict(threshold=threshold)))
        plain.append(Config(f"adaptive {threshold:g} + forecast", "adaptive + forecast", steps,
                            dict(threshold=threshold, forecast="linear")))
    plain += [Config(f"whole-model {t:g}", "whole-model", steps, dict(whole_model=True, threshold=t))
              for t in thresholds]
    plain += [Config(f"whole-model {t:g} + forecast", "whole-model + forecast", steps,
                     dict(whole_model=True, threshold=t, forecast="linear")) for t in thresholds]
    plain += [Config(f"whole-model interval {k}", "whole-model interval", steps, dict(whole_model=True, interval=k))
              for k in (2, 3, 4)]
    plain += [Config(f"whole-model interval {k} + forecast", "whole-model interval + forecast", steps,
                     dict(whole_model=True, interval=k, forecast="linear")) for k in (2, 3, 4)]
    if schedule:
        plain.append(Config("whole-model full steps + forecast", "whole-model full steps + forecast", steps,
                            dict(whole_model=True, full_steps=tuple(schedule), forecast="linear")))
    configs = {config.name: config for config in plain}
    if merge is not None:
        label, options = MERGES[merge]
        for config in plain:
            name = label if config.name == "vanilla" else f"{config.name} + {label}"
            family = label if config.family == "vanilla" else f"{config.family} + {label}"
            configs[name] = Config(name, family, config.steps, config.cache, dict(options))
    return configs


def _filtered(image: np.ndarray, kernel: np.ndarray) -> np.ndarray:
    """``image`` ``[H, W]`` filtered by the separable ``kernel`` along both axes, borders reflected with the edge
    pixel repeated (``b a | a b c d | d c``: scipy.ndimage's "reflect", numpy's "symmetric")."""
    radius = len(kernel) // 2
    padded = np.pad(image, radius, mode="symmetric")
    rows = sum(kernel[k] * padded[k:k + image.shape[0], :] for k in range(len(kernel)))
    return sum(kernel[k] * rows[:, k:k + image.shape[1]] for k in range(len(kernel)))


def ssim(reference: np.ndarray, test: np.ndarray, data_range: float = 1.0, sigma: float = 1.5) -> float:
    """The structural similarity of two images ``[H, W, C]`` (or ``[H, W]``) with values in ``[0, data_range]``
    (Wang et al. 2004; see the module docstring for the choices): 1.0 for equal images.

    >>> image = np.random.default_rng(0).uniform(size=(16, 16, 3))
    >>> ssim(image, image)
    1.0
    """
    reference, test = np.asarray(reference, np.float64), np.asarray(test, np.float64)
    if reference.shape != test.shape:
        raise ValueError(f"ssim needs two images of one shape; got {reference.shape} and {test.shape}")
    if reference.ndim == 2:
        reference, test = reference[..., None], test[..., None]
    radius = int(3.5 * sigma + 0.5)
    if min(reference.shape[:2]) <= 2 * radius:
        raise ValueError(f"ssim needs images of more than {2 * radius} pixels per side (its window is "
                         f"{2 * radius + 1}); got {reference.shape[:2]}")
    kernel = np.exp(-0.5 * (np.arange(-radius, radius + 1) / sigma) ** 2)
    kernel /= kernel.sum()
    c1, c2 = (0.01 * data_range) ** 2, (0.03 * data_range) ** 2
    values = []
    for channel in range(reference.shape[-1]):
        x, y = reference[..., channel], test[..., channel]
        mx, my = _filtered(x, kernel), _filtered(y, kernel)
        vx, vy = _filtered(x * x, kernel) - mx * mx, _filtered(y * y, kernel) - my * my
        cov = _filtered(x * y, kernel) - mx * my
        index = ((2 * mx * my + c1) * (2 * cov + c2)) / ((mx * mx + my * my + c1) * (vx + vy + c2))
        values.append(index[radius:-radius, radius:-radius].mean())
    return float(round(np.mean(values), 12))


def feature_distance(reference: np.ndarray, test: np.ndarray) -> float:
    """Mean over images of ``1 - cosine`` of their feature vectors (``[N, D]`` each): 0 for equal features.

    >>> feature_distance(np.array([[1.0, 0.0]]), np.array([[0.0, 2.0]]))
    1.0
    """
    reference, test = np.asarray(reference, np.float64), np.asarray(test, np.float64)
    cosine = (reference * test).sum(1) / (np.linalg.norm(reference, axis=1) * np.linalg.norm(test, axis=1))
    return float(np.mean(1.0 - cosine))


def planned_full_steps(changes: Sequence[float], threshold: float, max_skips: Optional[int] = None) -> List[int]:
    """The steps the adaptive rule runs in full in a pipeline call of ``len(changes) + 1`` steps whose signal changed
    by ``changes[t - 1]`` (relative) from step ``t - 1`` to step ``t``: the first and the last step always.

    >>> planned_full_steps([0.1, 0.1, 0.1, 0.1, 0.1], threshold=0.25)
    [0, 3, 5]
    """
    full, total, skips = [0], 0.0, 0
    for step, change in enumerate(changes, start=1):
        if step == len(changes):
            full.append(step)
            break
        is_full, total, skips = full_step_due(total, change, skips, threshold, max_skips)
        if is_full:
            full.append(step)
    return full


def record_signals(args: argparse.Namespace) -> Dict[str, Any]:
    """The signal's relative change per step, per sampler and number of steps, on the shapes model (no cache)."""
    import ppdiffusers

    from ppdiffusers_tome.cache.step_cache import deep_blocks

    model, out = ShapesModel(args), {}
    seen: List[np.ndarray] = []
    first = deep_blocks(model.pipe.unet, 1)[0][1]
    hook = first.register_forward_post_hook(lambda _, a, k, o: seen.append((a[0] if a else k["hidden_states"]).numpy()),
                                            with_kwargs=True)
    config = model.pipe.scheduler.config
    for name in SCHEDULERS:
        model.pipe.scheduler = getattr(ppdiffusers, SCHEDULERS[name]).from_config(config)
        for steps in args.signal_steps:
            seen.clear()
            model.generate(steps, 0)
            changes = [float(np.abs(b - a).mean() / np.abs(a).mean()) for a, b in zip(seen, seen[1:])]
            out[f"{name}, {steps} steps"] = {
                "changes": changes, "sum": float(np.sum(changes)),
                "full_steps": {f"{t:g}": planned_full_steps(changes, t) for t in args.thresholds}}
            print(f"{name:>6}, {steps:3d} steps: summed change {np.sum(changes):.3f}; full steps "
                  + ", ".join(f"{t}: {len(v)}" for t, v in out[f'{name}, {steps} steps']['full_steps'].items()),
                  flush=True)
    hook.remove()
    return out


def rel_l2(reference: np.ndarray, test: np.ndarray) -> float:
    reference, test = np.asarray(reference, np.float64), np.asarray(test, np.float64)
    return float(np.linalg.norm(test - reference) / np.linalg.norm(reference))


def summarise(per_seed: Dict[str, List[Dict[str, Any]]]) -> Dict[str, Dict[str, Any]]:
    """Per configuration, over seeds: the speed-up's median and range, the mean full steps, and the mean and sd of
    every quality number a seed recorded (``psnr_db``, ``ssim``, ``distance``, ``accuracy``)."""
    summary = {}
    for name, rows in per_seed.items():
        speedups = [row["speedup"] for row in rows]
        out = {"seconds_median": float(np.median([row["seconds"] for row in rows])),
               "speedup_median": float(np.median(speedups)), "speedup_min": min(speedups),
               "speedup_max": max(speedups), "full_steps": float(np.mean([row["full_steps"] for row in rows])),
               "steps": rows[0]["steps"]}
        for key in ("psnr_db", "ssim", "distance", "accuracy"):
            values = [row[key] for row in rows if key in row]
            if values:
                out[key] = {"mean": float(np.mean(values)),
                            "sd": float(np.std(values, ddof=1)) if len(values) > 1 else 0.0}
        summary[name] = out
    return summary


def curves(summary: Dict[str, Dict[str, Any]], families: Dict[str, str],
           quality: str = "psnr_db") -> Dict[str, List[tuple]]:
    """One curve per family: its configurations' ``(speed-up, quality)`` points in order of speed-up (vanilla,
    whose PSNR is infinite, is left out; the curves start from 1.0x in the plot's title instead).

    >>> curves({"a": {"speedup_median": 2.0, "psnr_db": {"mean": 30.0}},
    ...         "b": {"speedup_median": 1.5, "psnr_db": {"mean": 35.0}}}, {"a": "x", "b": "x"})
    {'x': [(1.5, 35.0), (2.0, 30.0)]}
    """
    out: Dict[str, List[tuple]] = {}
    for name, row in summary.items():
        if quality in row:
            out.setdefault(families[name], []).append((row["speedup_median"], row[quality]["mean"]))
    return {family: sorted(points) for family, points in out.items()}


def plot(summary: Dict[str, Dict[str, Any]], families: Dict[str, str], path: str, title: str) -> str:
    """Quality (PSNR to vanilla) against speed-up, one curve per family, into ``path`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    merged = tuple(label for label, _ in MERGES.values())
    fig, ax = plt.subplots(figsize=(7.5, 4.8), dpi=110)
    for family, points in curves(summary, families).items():
        xs, ys = zip(*points)
        ax.plot(xs, ys, marker="o", linestyle="--" if family.endswith(merged) else "-", label=family)
    ax.set_xlabel("speed-up over vanilla (wall time, median over seeds)")
    ax.set_ylabel("PSNR to vanilla, dB (higher is closer)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, metadata={"Software": None})
    plt.close(fig)
    return path


# the models ---------------------------------------------------------------------------------------------------------
def _sibling(name: str) -> Any:
    """Another script of ``benchmarks/`` as a module (they are scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                                     name + ".py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class ShapesModel:
    """A shipped shapes pipeline (the UNet's, or SD3's with ``--model shapes-sd3``), its held-out captions and its
    classifier."""

    def __init__(self, args: argparse.Namespace) -> None:
        from ppdiffusers_tome.tools import shapes
        from research.shapes import scoring

        sd3 = args.model == "shapes-sd3"
        self.pipe = shapes.load_sd3_pipeline() if sd3 else shapes.load_pipeline()
        if args.scheduler:
            import ppdiffusers

            cls = getattr(ppdiffusers, SCHEDULERS[args.scheduler])
            self.pipe.scheduler = cls.from_config(self.pipe.scheduler.config)
        self.classifier = scoring.load_trained_classifier()
        self.prompts, labels, _ = scoring.held_out_prompts(args.prompts)
        self.targets = scoring.label_targets(labels)
        self.guidance, self.batch = (shapes.SD3_DEMO_GUIDANCE if sd3 else shapes.DEMO_GUIDANCE), args.batch
        self.denoiser = self.pipe.transformer if sd3 else self.pipe.unet

    def configure(self, config: Config) -> None:
        ppdiffusers_tome.remove_tome(self.pipe)
        ppdiffusers_tome.remove_cache(self.pipe)
        if config.merge is not None:
            self.pipe.apply_tome(**config.merge)
        if config.cache is not None:
            self.pipe.apply_cache(**config.cache)

    def generate(self, steps: int, seed: int, prompts: Optional[int] = None) -> np.ndarray:
        """Images ``[N, 64, 64, 3]`` in [0, 1]; batch ``k`` from generator seed ``seed * 1000 + k``."""
        import paddle

        chosen = self.prompts[:prompts] if prompts else self.prompts
        images = []
        for k in range(0, len(chosen), self.batch):
            out = self.pipe(list(chosen[k:k + self.batch]), num_inference_steps=steps, guidance_scale=self.guidance,
                            height=64, width=64, output_type="np",
                            generator=paddle.Generator().manual_seed(seed * 1000 + k // self.batch)).images
            images.append(np.asarray(out, dtype=np.float64))
        return np.concatenate(images)

    def quality(self, vanilla: np.ndarray, images: np.ndarray) -> Dict[str, float]:
        from research.shapes import classifier

        as_model_input = lambda x: (x.transpose(0, 3, 1, 2) * 2.0 - 1.0).astype(np.float32)  # noqa: E731
        accuracy = classifier.accuracy(self.classifier, as_model_input(images), self.targets)
        features = [classifier.extract_features(self.classifier, as_model_input(x)) for x in (vanilla, images)]
        return {"psnr_db": float(np.mean([psnr(v, x) for v, x in zip(vanilla, images)])),
                "ssim": float(np.mean([ssim(v, x) for v, x in zip(vanilla, images)])),
                "distance": feature_distance(*features),
                "accuracy": float(np.mean(list(accuracy.values())))}


class SD3Model:
    """SD3-medium's layout with random weights and ``sd3_forward.py``'s denoising loop (the transformer alone)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.loop = _sibling("sd3_forward")
        self.size = args.size
        self.denoiser = self.loop.narrow_sd3(args.layers, args.width)

    def configure(self, config: Config) -> None:
        ppdiffusers_tome.remove_tome(self.denoiser)
        ppdiffusers_tome.remove_cache(self.denoiser)
        if config.merge is not None:
            ppdiffusers_tome.apply_tome(self.denoiser, **config.merge)
        if config.cache is not None:
            # the loop is not a pipeline, so the cache cannot know its last step: stop= protects it, as a
            # pipeline's progress bar does
            extra = {"stop": config.steps - 1} if "threshold" in config.cache else {}
            ppdiffusers_tome.apply_cache(self.denoiser, **config.cache, **extra)

    def generate(self, steps: int, seed: int, prompts: Optional[int] = None) -> np.ndarray:
        return self.loop.denoise(self.denoiser, self.size, steps, seed)

    def quality(self, vanilla: np.ndarray, latents: np.ndarray) -> Dict[str, float]:
        low, high = float(vanilla.min()), float(vanilla.max())
        scaled = [np.clip((x - low) / (high - low), 0.0, 1.0).transpose(0, 2, 3, 1)[0] for x in (vanilla, latents)]
        out = {"psnr_db": psnr(*scaled), "distance": rel_l2(vanilla, latents)}
        if min(scaled[0].shape[:2]) > 10:  # (SSIM's window is 11 latent pixels: 88 px or more)
            out["ssim"] = ssim(*scaled)
        return out


def full_steps(model: Any, config: Config, generations: int) -> float:
    """The denoiser's full calls per generation since its cache was applied (without a cache: every step)."""
    found = next(iter(ppdiffusers_tome.cache_status(model.denoiser).values()))
    return float(config.steps) if found is None else found["full_calls"] / generations


def run(args: argparse.Namespace) -> Dict[str, Any]:
    threads = set_threads(args.threads)
    trained = args.model in ("shapes", "shapes-sd3")  # a shipped pipeline, scored by the classifier
    if args.scheduler and args.model != "shapes":
        raise SystemExit(f"--scheduler: only the shapes UNet model takes another sampler; {args.model} runs SD3's "
                         "flow-matching Euler")
    model = ShapesModel(args) if trained else SD3Model(args)
    merge = None if args.merge == "none" else args.merge or ("todo" if args.model == "sd3" else "tome")
    configs = configurations(args.steps, args.thresholds, merge, args.full_steps)
    names = ["vanilla"] + [name for name in (args.configs or list(configs)) if name != "vanilla"]
    unknown = [name for name in names if name not in configs]
    if unknown:
        raise SystemExit(f"unknown configuration(s) {unknown}; the configurations are {list(configs)}")
    generations = -(-args.prompts // args.batch) if trained else 1
    for name in names:  # untimed warm-up: first-call allocations
        model.configure(configs[name])
        model.generate(2, 0, prompts=1)
    per_seed: Dict[str, List[Dict[str, Any]]] = {name: [] for name in names}
    for seed in range(args.seeds):
        shift = seed % len(names)
        images: Dict[str, np.ndarray] = {}
        rows: Dict[str, Dict[str, Any]] = {}
        for name in names[shift:] + names[:shift]:
            config = configs[name]
            model.configure(config)
            began = time.perf_counter()
            images[name] = model.generate(config.steps, seed)
            seconds = time.perf_counter() - began
            rows[name] = {"seconds": seconds, "steps": config.steps,
                          "full_steps": full_steps(model, config, generations)}
            print(f"seed {seed} {name:>36}: {seconds:8.2f} s, {rows[name]['full_steps']:.1f} full steps", flush=True)
        for name in names:
            rows[name]["speedup"] = rows["vanilla"]["seconds"] / rows[name]["seconds"]
            if name != "vanilla":  # (vanilla's own PSNR is infinite: left out, keeping the JSON standard)
                rows[name].update(model.quality(images["vanilla"], images[name]))
            elif trained:
                rows[name]["accuracy"] = model.quality(images["vanilla"], images["vanilla"])["accuracy"]
            per_seed[name].append(rows[name])
    model.configure(Config("vanilla", "vanilla", args.steps))
    return {
        "command": " ".join(["benchmarks/adaptive_cache.py"] + sys.argv[1:]),
        "version": ppdiffusers_tome.__version__,
        "environment": environment(threads, "float32"),
        "settings": {"model": args.model, "steps": args.steps, "seeds": args.seeds, "thresholds": list(args.thresholds),
                     **({"full_steps": list(args.full_steps)} if args.full_steps else {}),
                     "merge": merge, "scheduler": args.scheduler or ("ddim" if args.model == "shapes" else
                                                                     "flow-match euler"),
                     **({"prompts": args.prompts, "batch": args.batch} if trained else
                        {"size": args.size, "layers": args.layers, "width": args.width})},
        "families": {name: configs[name].family for name in names},
        "per_seed": per_seed,
        "summary": summarise(per_seed),
    }


def combine(runs: Sequence[Dict[str, Any]], command: str) -> Dict[str, Any]:
    """Several runs of the same configurations as one record: per configuration the median of the runs' median
    speed-ups and their range over the runs; steps and quality from the first run, with ``images_identical``
    telling whether every run's PSNR and feature distance equal the first's (the same seeds give the same images).

    >>> run = lambda speed: {"version": "v", "settings": {}, "families": {"a": "a"},
    ...                      "summary": {"a": {"speedup_median": speed, "psnr_db": 30.0}}}
    >>> out = combine([run(2.0), run(1.5), run(2.5)], "x")
    >>> out["summary"]["a"]["speedup_median"], out["summary"]["a"]["speedup_min"], out["images_identical"]
    (2.0, 1.5, True)
    """
    if len({json.dumps(r["settings"], sort_keys=True) for r in runs}) != 1 or \
            len({tuple(r["summary"]) for r in runs}) != 1:
        raise SystemExit("--combine: the runs differ in settings or configurations")
    first = runs[0]
    summary = {}
    for name, row in first["summary"].items():
        speeds = [r["summary"][name]["speedup_median"] for r in runs]
        summary[name] = dict(row, speedup_median=float(np.median(speeds)), speedup_min=min(speeds),
                             speedup_max=max(speeds))
    identical = all(r["summary"][name].get(key) == row.get(key) for r in runs for name, row in first["summary"].items()
                    for key in ("psnr_db", "distance"))
    return {"command": command, "version": first["version"], "settings": first["settings"],
            "families": first["families"], "over": "runs", "images_identical": identical, "runs": list(runs),
            "summary": summary}


def table_rows(data: Dict[str, Any]) -> List[List[str]]:
    shapes = data["settings"]["model"] in ("shapes", "shapes-sd3")
    spread = "median and range over runs" if data.get("over") == "runs" else "median, range"
    header = ["configuration", "steps (full)", f"speed-up ({spread})", "PSNR to vanilla dB", "SSIM",
              "feature distance (1 - cos)" if shapes else "rel. L2 of latents"]
    rows = [header + (["classifier accuracy %"] if shapes else [])]
    cell = lambda s, key, digits: (f"{s[key]['mean']:.{digits}f} ± {s[key]['sd']:.{digits}f}"  # noqa: E731
                                   if key in s else "–")
    for name, s in data["summary"].items():
        row = [name, f"{s['steps']} ({s['full_steps']:.1f})",
               f"{s['speedup_median']:.2f}× ({s['speedup_min']:.2f}–{s['speedup_max']:.2f})",
               "inf" if name == "vanilla" else cell(s, "psnr_db", 1), "1" if name == "vanilla" else cell(s, "ssim", 3),
               "0" if name == "vanilla" else cell(s, "distance", 4)]
        if shapes:
            row.append(f"{s['accuracy']['mean'] * 100:.1f} ± {s['accuracy']['sd'] * 100:.1f}")
        rows.append(row)
    return rows


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--model", choices=("shapes", "shapes-sd3", "sd3"), default="shapes",
                        help="the shipped shapes UNet model, the shipped SD3 shapes model, or SD3-medium's layout "
                             "with random weights (speed only)")
    parser.add_argument("--steps", type=int, default=50, help="denoising steps of vanilla and the caches")
    parser.add_argument("--thresholds", type=float, nargs="+", default=list(THRESHOLDS))
    parser.add_argument("--merge", choices=("tome", "todo", "none"), default=None,
                        help="merging added to every configuration (default: tome on shapes, todo on sd3)")
    parser.add_argument("--full-steps", type=int, nargs="+", default=None, metavar="STEP",
                        help="the full steps of the configuration 'whole-model full steps + forecast'")
    parser.add_argument("--seeds", type=int, default=3, help="initial-latent seeds")
    parser.add_argument("--prompts", type=int, default=16, help="shapes: held-out captions per seed")
    parser.add_argument("--batch", type=int, default=16, help="shapes: images per pipeline call")
    parser.add_argument("--scheduler", choices=list(SCHEDULERS), default=None, help="shapes: another sampler")
    parser.add_argument("--size", type=int, default=512, help="sd3: image side in pixels")
    parser.add_argument("--layers", type=int, default=24, help="sd3: transformer blocks")
    parser.add_argument("--width", type=int, default=384, help="sd3: transformer width")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (default: all cores)")
    parser.add_argument("--configs", nargs="+", default=None, metavar="NAME", help="configurations (default: all)")
    parser.add_argument("--output", default=os.path.join("outputs", "adaptive_cache"))
    parser.add_argument("--plot", default=None, help="PNG of PSNR against speed-up (default: OUTPUT/quality_speed.png)")
    parser.add_argument("--render", default=None, help="print the table of an earlier results.json (and plot it)")
    parser.add_argument("--combine", nargs="+", default=None, metavar="RESULTS",
                        help="combine the results.json of several runs into OUTPUT/results.json (speed-ups: the "
                             "median and range over the runs)")
    parser.add_argument("--signals", action="store_true", help="record the rule's signal per sampler; time nothing")
    parser.add_argument("--signal-steps", type=int, nargs="+", default=[20, 50], help="with --signals: step counts")
    args = parser.parse_args(argv)
    if args.signals:
        set_threads(args.threads)
        signals = {"command": " ".join(["benchmarks/adaptive_cache.py"] + sys.argv[1:]),
                   "version": ppdiffusers_tome.__version__, "prompts": args.prompts, "runs": record_signals(args)}
        os.makedirs(args.output, exist_ok=True)
        with open(os.path.join(args.output, "signals.json"), "w", encoding="utf-8") as f:
            json.dump(signals, f, indent=1)
        return 0
    if args.render:
        with open(args.render, encoding="utf-8") as f:
            data = json.load(f)
    elif args.combine:
        runs = []
        for path in args.combine:
            with open(path, encoding="utf-8") as f:
                runs.append(json.load(f))
        data = combine(runs, " ".join(["benchmarks/adaptive_cache.py"] + sys.argv[1:]))
    else:
        if args.steps < 3 or args.seeds < 1 or args.prompts < 1 or any(t < 0 for t in args.thresholds):
            parser.error("--steps must be >= 3, --seeds and --prompts >= 1, --thresholds >= 0")
        data = run(args)
    if not args.render:
        os.makedirs(args.output, exist_ok=True)
        with open(os.path.join(args.output, "results.json"), "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1)
    rows = table_rows(data)
    print(render_table(rows))
    settings = data["settings"]
    title = (f"{settings['model']}, {settings['steps']} steps, {settings['scheduler']}, "
             f"{settings['seeds']} seed(s), ppdiffusers_tome {data['version']}"
             + (f", speed-up: median of {len(data['runs'])} runs" if data.get("over") == "runs" else ""))
    if args.plot or not args.render:
        print("wrote", plot(data["summary"], data["families"], args.plot or os.path.join(args.output,
                                                                                          "quality_speed.png"), title))
    if not args.render:
        with open(os.path.join(args.output, "table.md"), "w", encoding="utf-8") as f:
            f.write("\n".join(["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
                              + ["| " + " | ".join(row) + " |" for row in rows[1:]]) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
