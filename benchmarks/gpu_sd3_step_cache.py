"""What the step cache's adaptive rule and the whole-model cache cost and give on a GPU, on SD3-medium's layout.

A self-contained PyTorch script (no Paddle, no network): its own transcription of SD3's MMDiT (joint blocks with
adaLN-zero modulation of both streams, joint attention over [image, text] tokens through
``scaled_dot_product_attention``, GELU-tanh MLPs of 4x width, the last block ``context_pre_only``), random seeded
weights, FP16 on CUDA. It is NOT this package's Paddle code: it transcribes what the package's caches do, run by
PyTorch. The loop: flow-match Euler over ``--steps`` steps (SD3's sigmas, shift 3) on random latents, batch 2
(guidance 7); the model predicts the velocity, so the latents and every signal move each step. Modes:

- ``vanilla`` (all steps full; ``vanilla-end``: the same, timed again last, a drift check); ``fewer-steps-N``;
- ``interval-k``: the block cache, full every k-th step and the last (the package's interval does not protect the
  last step: at 28 steps the same for k=3, one full step more here for k=2 and 4); a cached step runs block 0 and
  the last block, the blocks between add what they added on the last full step, on both streams;
- ``adaptive-T``: the package's rule (``cache/adaptive.py``) on the segment's input (image stream): the relative
  change ``mean|s_t - s_{t-1}| / mean|s_{t-1}|`` read with one ``.item()`` per step, summed since the last full
  step; full when the sum reaches T or after ``--max-skips`` cached steps in a row; first and last step full;
- ``adaptive-replay-T``: the schedule ``adaptive-T`` chose, from a Python list; the change is still computed on the
  device, only not read: the difference to ``adaptive-T`` is the read and the CPU/GPU overlap it costs;
- ``adaptive-T+forecast``: the segment's contribution extrapolated linearly from the last two full steps;
- ``whole-T``, ``whole-interval-k`` (``+forecast`` too): the whole-model cache, signal = the model's input; a full
  step keeps output - input, a cached one returns input + that; ``whole-0`` (every step full) must time as vanilla;
- ``whole-steps-0.1.2.4.7...+forecast``: the whole-model cache on the listed full steps (and the last) with the
  forecast and the cost of the package's rule with the forecast (0.17.0 on): from the third full step on, each full
  step measures the forecast's error on the kept work and reads it with one ``.item()`` (a replay of the schedule
  the rule chose on a trained model).

Random weights make the rule's skip counts arbitrary: each mode reports its full and cached steps, vanilla's ms per
(full) step and a derived ms per cached step ((loop - full x vanilla's step) / cached), to cost any schedule;
``speedup`` is vanilla's median loop time over the mode's, in the same run. Threshold-0 modes must end on vanilla's
latents exactly, replays on their source's (column ``check``; ``!sched``, ``!nondet``, ``!nan`` flag a schedule
without its first and last step full or over ``--max-skips``, repeats that differ, non-finite latents).

    python benchmarks/gpu_sd3_step_cache.py --sizes 512 1024 --output $OUT/gpu_sd3_step_cache.json
    python benchmarks/gpu_sd3_step_cache.py --device cpu --width 64 --heads 2 --layers 4 --sizes 64 128 --repeats 1
"""
import argparse
import json
import math
import os
import re
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

THRESHOLDS = (0.1, 0.15, 0.2, 0.3)
GUIDANCE, SHIFT, TEXT_TOKENS, TEXT_DIM, POOLED_DIM, CHANNELS, PATCH = 7.0, 3.0, 154, 4096, 2048, 16, 2


def default_modes():
    return (["vanilla", "whole-0", "fewer-steps-14", "fewer-steps-10", "fewer-steps-9", "interval-2", "interval-3",
             "interval-4"] + [f"adaptive{r}-{t}" for t in THRESHOLDS for r in ("", "-replay")]
            + [f"adaptive-{t}+forecast" for t in THRESHOLDS] + [f"whole-{t}" for t in THRESHOLDS]
            + ["whole-interval-3", "vanilla-end"])


def norm(x):
    return F.layer_norm(x, x.shape[-1:], eps=1e-6)


def mlp(width):
    return nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(approximate="tanh"), nn.Linear(4 * width, width))


class JointBlock(nn.Module):
    """One SD3 joint block: both streams modulated from ``temb``, one attention over [image, text] tokens."""

    def __init__(self, width, heads, pre_only):
        super().__init__()
        self.heads, self.pre_only = heads, pre_only
        self.mod, self.mod_c = nn.Linear(width, 6 * width), nn.Linear(width, (2 if pre_only else 6) * width)
        self.qkv, self.qkv_c = nn.Linear(width, 3 * width), nn.Linear(width, 3 * width)
        self.out, self.ff = nn.Linear(width, width), mlp(width)
        if not pre_only:
            self.out_c, self.ff_c = nn.Linear(width, width), mlp(width)

    def forward(self, x, c, temb):
        e = F.silu(temb)
        shift, scale, gate, shift2, scale2, gate2 = self.mod(e)[:, None].chunk(6, dim=-1)
        if self.pre_only:  # AdaLayerNormContinuous on the text stream: scale, shift
            c_scale, c_shift = self.mod_c(e)[:, None].chunk(2, dim=-1)
        else:
            c_shift, c_scale, c_gate, c_shift2, c_scale2, c_gate2 = self.mod_c(e)[:, None].chunk(6, dim=-1)
        n = x.shape[1]
        qkv = torch.cat([self.qkv(norm(x) * (1 + scale) + shift), self.qkv_c(norm(c) * (1 + c_scale) + c_shift)], 1)
        q, k, v = (t.unflatten(-1, (self.heads, -1)).transpose(1, 2) for t in qkv.chunk(3, dim=-1))
        a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2)
        x = x + gate * self.out(a[:, :n])
        x = x + gate2 * self.ff(norm(x) * (1 + scale2) + shift2)
        if self.pre_only:
            return x, None
        c = c + c_gate * self.out_c(a[:, n:])
        return x, c + c_gate2 * self.ff_c(norm(c) * (1 + c_scale2) + c_shift2)


class MMDiT(nn.Module):
    def __init__(self, width, layers, heads, max_grid):
        super().__init__()
        self.patch_embed = nn.Conv2d(CHANNELS, width, PATCH, stride=PATCH)
        self.pos = nn.Parameter(0.02 * torch.randn(max_grid, max_grid, width))
        self.t1, self.t2 = nn.Linear(256, width), nn.Linear(width, width)
        self.p1, self.p2 = nn.Linear(POOLED_DIM, width), nn.Linear(width, width)
        self.context_embedder = nn.Linear(TEXT_DIM, width)
        self.blocks = nn.ModuleList(JointBlock(width, heads, i == layers - 1) for i in range(layers))
        self.mod_out, self.proj_out = nn.Linear(width, 2 * width), nn.Linear(width, PATCH * PATCH * CHANNELS)

    def embed(self, x, t, ctx, pooled):
        gh, gw = x.shape[2] // PATCH, x.shape[3] // PATCH
        h = self.patch_embed(x).flatten(2).transpose(1, 2) + self.pos[:gh, :gw].reshape(1, gh * gw, -1)
        freqs = torch.exp(-math.log(10000.0) * torch.arange(128, device=t.device, dtype=torch.float32) / 128)
        angles = t.float()[:, None] * freqs[None]
        sinus = torch.cat([torch.cos(angles), torch.sin(angles)], dim=-1).to(x.dtype)
        temb = self.t2(F.silu(self.t1(sinus))) + self.p2(F.silu(self.p1(pooled)))
        return h, self.context_embedder(ctx), temb

    def head(self, h, temb, shape):
        scale, shift = self.mod_out(F.silu(temb))[:, None].chunk(2, dim=-1)
        h = self.proj_out(norm(h) * (1 + scale) + shift)
        b, ch, hh, ww = shape
        h = h.view(b, hh // PATCH, ww // PATCH, PATCH, PATCH, ch).permute(0, 5, 1, 3, 2, 4)
        return h.reshape(b, ch, hh, ww)

    def forward(self, x, t, ctx, pooled):
        h, c, temb = self.embed(x, t, ctx, pooled)
        for block in self.blocks:
            h, c = block(h, c, temb)
        return self.head(h, temb, x.shape)


def relative_change(current, previous):
    """``mean|current - previous| / mean|previous|``, a 0-d float32 tensor on the device (not read)."""
    return ((current - previous).abs().mean() / previous.abs().mean()).float()


def full_step_due(accumulated, change, skips, threshold, max_skips):
    total = accumulated + change
    if not total < threshold or (max_skips is not None and skips >= max_skips):
        return True, 0.0, 0
    return False, total, skips + 1


class Rule:
    """Which steps are full, for one mode and one loop, and the work kept from the last full step(s)."""

    def __init__(self, spec, steps, max_skips, source=None):
        self.spec, self.steps, self.max_skips = spec, steps, max_skips
        self.kept = self.earlier = self.previous = None
        self.accumulated, self.skips = 0.0, 0
        self.log, self.reads = [], []
        self.source = source  # a replay: the (log, reads) of the adaptive run

    def full(self, i, signal):
        self.log.append(self._decide(i, signal, i == self.steps - 1))
        return self.log[-1]

    def _decide(self, i, signal, last):
        if self.spec["rule"] == "interval":
            return self.kept is None or i % self.spec["k"] == 0 or last
        if self.spec["rule"] == "steps":
            return self.kept is None or i in self.spec["full"] or last
        if self.source is not None:  # replay: the same device work, no read
            if i in self.source[1]:
                relative_change(signal, self.previous)
            self.previous = signal
            return self.source[0][i]
        threshold = self.spec["threshold"]
        decide = not (self.kept is None or threshold == 0 or i == 0 or last
                      or (self.max_skips is not None and self.skips >= self.max_skips))
        previous, self.previous = self.previous, signal
        if decide and previous is not None and previous.shape == signal.shape:
            change = relative_change(signal, previous).item()  # the one host read per step
            self.reads.append(i)
            full, self.accumulated, self.skips = full_step_due(self.accumulated, change, self.skips, threshold,
                                                               self.max_skips)
            return full
        self.accumulated, self.skips = 0.0, 0
        return True

    def needs_keep(self, i):
        """The package keeps a full step's work when a later step may use it (the interval: the next is cached)."""
        if self.spec["rule"] != "interval" or self.spec["forecast"]:
            return True
        return i + 1 < self.steps - 1 and (i + 1) % self.spec["k"] != 0

    def keep(self, i, work):
        if self.spec["rule"] == "steps" and self.spec["forecast"] and self.earlier is not None:
            relative_change(work[0], self.work(i)[0]).item()  # the rule's error at a full step: one read
            self.reads.append(i)
        self.earlier = self.kept if self.spec["forecast"] else None
        self.kept = (i, work)

    def work(self, i):  # the kept work, or its linear forecast from the last two full steps (f0 < f1)
        (f1, last), (f0, earlier) = self.kept, self.earlier or (None, None)
        if earlier is None:
            return last
        return tuple(w + (w - e) * ((i - f1) / (f1 - f0)) for w, e in zip(last, earlier))


def parse_mode(name):
    forecast = name.endswith("+forecast")
    base = name[: -len("+forecast")] if forecast else name
    spec = {"name": name, "layout": "none", "rule": None, "forecast": forecast, "steps": None, "source": None}
    if base in ("vanilla", "vanilla-end") and not forecast:
        return spec
    m = re.fullmatch(r"fewer-steps-(\d+)", base)
    if m and not forecast:
        return dict(spec, steps=int(m.group(1)))
    m = re.fullmatch(r"(whole-)?interval-(\d+)", base)
    if m and int(m.group(2)) >= 1:
        return dict(spec, layout="whole" if m.group(1) else "block", rule="interval", k=int(m.group(2)))
    m = re.fullmatch(r"whole-steps-(\d+(?:\.\d+)*)", base)
    if m:
        return dict(spec, layout="whole", rule="steps", full={int(k) for k in m.group(1).split(".")})
    m = re.fullmatch(r"adaptive-replay-(\d+(?:\.\d*)?)", base)
    if m:
        return dict(spec, layout="block", rule="replay", threshold=float(m.group(1)),
                    source=name.replace("-replay", ""))
    m = re.fullmatch(r"(adaptive|whole)-(\d+(?:\.\d*)?)", base)
    if m:
        return dict(spec, layout="block" if m.group(1) == "adaptive" else "whole", rule="adaptive",
                    threshold=float(m.group(2)))
    raise argparse.ArgumentTypeError(f"unknown mode {name!r} (e.g. vanilla, fewer-steps-10, interval-3, adaptive-0.15,"
                                     " adaptive-replay-0.15, adaptive-0.15+forecast, whole-0.15, whole-interval-3)")


def sigmas(steps):
    ts = [1.0 + (0.001 - 1.0) * i / max(steps - 1, 1) for i in range(steps)]
    return [SHIFT * t / (1 + (SHIFT - 1) * t) for t in ts] + [0.0]


def predict(model, spec, rule, i, xin, t, ctx, pooled):
    """The model's velocity for step ``i`` under ``spec``'s cache (``rule``: None = a plain full call)."""
    if spec["layout"] == "none":
        return model(xin, t, ctx, pooled)
    if spec["layout"] == "whole":
        if rule.full(i, xin):
            out = model(xin, t, ctx, pooled)
            if rule.needs_keep(i):
                rule.keep(i, (out - xin,))
            return out
        return xin + rule.work(i)[0]
    h, c, temb = model.embed(xin, t, ctx, pooled)
    h, c = model.blocks[0](h, c, temb)
    if rule.full(i, h):  # the signal: the cached segment's input, image stream
        hs, cs = h, c
        for block in model.blocks[1:-1]:
            h, c = block(h, c, temb)
        if rule.needs_keep(i):
            rule.keep(i, (h - hs, c - cs))
    else:
        dh, dc = rule.work(i)
        h, c = h + dh, c + dc
    h, _ = model.blocks[-1](h, c, temb)
    return model.head(h, temb, xin.shape)


def generate(model, spec, inputs, steps, max_skips, source=None):
    x, ctx, pooled = inputs
    sig = sigmas(steps)
    times = torch.tensor(sig[:-1], device=x.device) * 1000.0
    rule = None if spec["layout"] == "none" else Rule(spec, steps, max_skips, source)
    for i in range(steps):
        xin = torch.cat([x, x])
        out = predict(model, spec, rule, i, xin, times[i].expand(2), ctx, pooled)
        uncond, cond = out.chunk(2)
        v = uncond + GUIDANCE * (cond - uncond)
        x = (x.float() + (sig[i + 1] - sig[i]) * v.float()).to(x.dtype)  # the scheduler steps in float32
    return (x, rule.log, rule.reads) if rule is not None else (x, [True] * steps, [])


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def item_cost_us(device, n=200):
    """One ``.item()`` of a 0-d tensor after a tiny kernel, minus the kernel alone, in microseconds (idle device)."""
    z = torch.zeros((), device=device)

    def loop(read):
        sync(device)
        begin = time.perf_counter()
        for _ in range(n):
            y = z + 1
            if read:
                y.item()
        sync(device)
        return time.perf_counter() - begin
    loop(True)
    return (loop(True) - loop(False)) / n * 1e6


def schedule_ok(schedule, max_skips):
    """First and last step full, no more than ``max_skips`` cached steps in a row (``schedule``: "FccF...")."""
    longest = max(len(run) for run in schedule.split("F"))
    return schedule[0] == schedule[-1] == "F" and (max_skips is None or longest <= max_skips)


def main():
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if cuda else "cpu")
    p.add_argument("--dtype", choices=["float16", "bfloat16", "float32"], help="float16 on cuda, float32 on cpu")
    for flag, default in (("--width", 1536), ("--layers", 24), ("--heads", 24), ("--steps", 28), ("--repeats", 3),
                          ("--seed", 0), ("--size", None), ("--max-skips", None)):
        p.add_argument(flag, type=int, default=default)  # --size S = --sizes S; --max-skips: the rule's cap
    p.add_argument("--sizes", type=int, nargs="+", default=[512, 1024], help="image sizes (multiples of 16)")
    p.add_argument("--modes", nargs="+", type=parse_mode, help="default: " + " ".join(default_modes()))
    p.add_argument("--budget-s", type=float, help="skip the remaining modes once this many seconds have passed")
    out_dir = os.environ.get("OUT")
    p.add_argument("--output", default=os.path.join(out_dir, "gpu_sd3_step_cache.json") if out_dir else None)
    args = p.parse_args()
    start = time.perf_counter()
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ("float16" if device.type == "cuda" else "float32"))
    sizes = [args.size] if args.size else args.sizes
    specs = args.modes or [parse_mode(m) for m in default_modes()]
    names = [s["name"] for s in specs]
    if any(s % 16 for s in sizes) or args.width % args.heads or args.layers < 3:
        p.error("sizes must be multiples of 16, width a multiple of heads, layers >= 3 (first and last run cached)")
    torch.manual_seed(args.seed)
    with torch.device(device):
        model = MMDiT(args.width, args.layers, args.heads, max(sizes) // 16).to(dtype).eval()
    read_us = item_cost_us(device)
    result = {"torch": torch.__version__, "device": torch.cuda.get_device_name(device) if device.type == "cuda"
              else "cpu", "dtype": str(dtype).replace("torch.", ""),
              "settings": dict(vars(args), modes=names, sizes=sizes, guidance=GUIDANCE, shift=SHIFT,
                               text_tokens=TEXT_TOKENS, batch=2, patch=PATCH, latent_channels=CHANNELS),
              "parameters": sum(t.numel() for t in model.parameters()), "item_read_us": round(read_us, 2),
              "build_s": round(time.perf_counter() - start, 2), "sizes": {}, "skipped": []}
    print(f"torch {result['torch']}, {result['device']}, {result['dtype']}, {result['parameters'] / 1e6:.1f} M "
          f"parameters, built in {result['build_s']} s; one .item() read on an idle device: {read_us:.1f} us")

    def write():
        result["elapsed_s"] = round(time.perf_counter() - start, 1)
        if args.output:
            os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
            with open(args.output, "w") as f:
                json.dump(result, f, indent=1)

    header = (f"{'mode':<24}{'full':>5}{'cached':>7}{'reads':>6}{'median ms':>11}{'min-max ms':>17}{'speedup':>8}"
              f"{'ms/full':>9}{'ms/cached':>10}  {'check':<14}{'rel.dist':>9}{'s':>6}")
    for size in sizes:
        gen = torch.Generator(device=device).manual_seed(args.seed + size)
        inputs = tuple(torch.randn(*shape, generator=gen, device=device).to(dtype) for shape in (
            (1, CHANNELS, size // 8, size // 8), (2, TEXT_TOKENS, TEXT_DIM), (2, POOLED_DIM)))
        rows, finals, sources = {}, {}, {}
        result["sizes"][str(size)] = {"image_tokens": (size // 16) ** 2, "modes": rows}
        print(f"\n== {size}x{size}: {(size // 16) ** 2} image + {TEXT_TOKENS} text tokens, batch 2, "
              f"{args.steps} steps ==\n{header}")
        for spec in specs:
            name = spec["name"]
            if args.budget_s is not None and time.perf_counter() - start > args.budget_s:
                result["skipped"].append(f"{size}:{name}")
                print(f"{name:<24}skipped: --budget-s {args.budget_s:g} exceeded", flush=True)
                continue
            row = rows[name] = measure(model, spec, inputs, args, device, rows, finals, sources)
            print(line(name, row), flush=True)
            write()
        summary = result["sizes"][str(size)]["summary"] = summarize(rows, read_us)
        print("summary: " + ", ".join(f"{k} {v}" for k, v in summary.items()))
        write()
    if result["skipped"]:
        print(f"skipped (budget): {' '.join(result['skipped'])}")
    print(f"total {time.perf_counter() - start:.1f} s" + (f"; wrote {args.output}" if args.output else ""))


def line(name, row):
    def num(key, width):
        return f"{row[key]:>{width}.2f}" if key in row else f"{'-':>{width}}"
    spread = f"{row['min_ms']:.1f}-{row['max_ms']:.1f}"
    return (f"{name:<24}{row['full_steps']:>5}{row['cached_steps']:>7}{row['reads']:>6}{row['median_ms']:>11.1f}"
            f"{spread:>17}{num('speedup', 8)}{num('ms_per_full_step', 9)}{num('ms_per_cached_step', 10)}  "
            f"{row['check']:<14}{row.get('rel_dist', float('nan')):>9.2e}{row['elapsed_s']:>6.1f}")


def measure(model, spec, inputs, args, device, rows, finals, sources):
    """One mode at one size: a warm-up loop, ``--repeats`` timed loops, the checks; its row."""
    name, begin = spec["name"], time.perf_counter()
    steps, source = spec["steps"] or args.steps, None
    with torch.inference_mode():
        if spec["rule"] == "replay":
            if spec["source"] not in sources:  # its adaptive run was not in --modes (or skipped): run it, untimed
                x, log, reads = generate(model, parse_mode(spec["source"]), inputs, steps, args.max_skips)
                sources[spec["source"]], finals[spec["source"]] = (log, set(reads)), x
            source = sources[spec["source"]]
        x, log, reads = generate(model, spec, inputs, steps, args.max_skips, source)  # warm-up
        times, same = [], True
        for _ in range(args.repeats):
            sync(device)
            t0 = time.perf_counter()
            x2, log2, _ = generate(model, spec, inputs, steps, args.max_skips, source)
            sync(device)
            times.append((time.perf_counter() - t0) * 1e3)
            same = same and log2 == log and torch.equal(x2, x)
    if spec["rule"] == "adaptive":
        sources[name] = (log, set(reads))
    finals.setdefault(name, x)
    full, cached, med = sum(log), len(log) - sum(log), statistics.median(times)
    row = {"times_ms": [round(t, 3) for t in times], "median_ms": round(med, 3), "min_ms": round(min(times), 3),
           "max_ms": round(max(times), 3), "steps": steps, "full_steps": full, "cached_steps": cached,
           "reads": len(reads), "schedule": "".join("F" if f else "c" for f in log), "deterministic": same,
           "finite": bool(torch.isfinite(x).all())}
    row["schedule_ok"] = schedule_ok(row["schedule"], args.max_skips)
    base = dict(row) if name == "vanilla" else rows.get("vanilla")
    if base:
        vx = finals["vanilla"].float()
        row["speedup"] = round(base["median_ms"] / med, 3)
        row["rel_dist"] = float((x.float() - vx).norm() / vx.norm())
        if cached:
            row["ms_per_cached_step"] = round((med - full * base["median_ms"] / base["steps"]) / cached, 3)
    if not cached:
        row["ms_per_full_step"] = round(med / full, 3)
    row["check"] = "-"
    if (spec.get("threshold") == 0 or spec.get("k") == 1 or name == "vanilla-end") and "vanilla" in finals:
        row["equals_vanilla"] = torch.equal(x, finals["vanilla"])
        row["check"] = "=vanilla" if row["equals_vanilla"] else "DIFFERS"
    elif spec["rule"] == "replay":
        row["equals_source"] = torch.equal(x, finals[spec["source"]]) and log == source[0]
        row["check"] = "=adaptive" if row["equals_source"] else "DIFFERS"
    for key, flag in (("schedule_ok", "!sched"), ("deterministic", "!nondet"), ("finite", "!nan")):
        row["check"] += "" if row[key] else flag
    row["elapsed_s"] = round(time.perf_counter() - begin, 2)
    return row


def summarize(rows, read_us):
    """Per size: vanilla's ms per step, a cached step of each layout (median over the interval modes), and what one
    read costs in the loop ((adaptive - replay) / reads)."""
    out = {"vanilla_ms_per_step": rows["vanilla"]["ms_per_full_step"]} if "vanilla" in rows else {}
    for layout, prefix in (("block", "interval-"), ("whole", "whole-interval-")):
        vals = [r["ms_per_cached_step"] for n, r in rows.items() if n.startswith(prefix) and "ms_per_cached_step" in r]
        if vals:
            out[f"{layout}_cached_step_ms"] = round(statistics.median(vals), 3)
    pairs = [(n.replace("-replay", ""), r) for n, r in rows.items() if "-replay-" in n]
    out["loop_ms_per_read"] = {n: round((rows[n]["median_ms"] - r["median_ms"]) / rows[n]["reads"], 4)
                               for n, r in pairs if rows.get(n, {}).get("reads")}
    out["idle_item_read_ms"] = round(read_us / 1e3, 4)
    return out


if __name__ == "__main__":
    main()
