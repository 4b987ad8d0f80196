"""Combine the results.json of several rounds of one ``bench`` command (each a separate process, run one after the
other) into one JSON and print each method's speed-up per round and its range.

    bash run.sh python benchmarks/rounds.py out/r1 out/r2 out/r3 --output docs/measurements/rounds.json
"""

import argparse
import json
import os


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="+", help="the rounds' --output folders (each holds results.json)")
    parser.add_argument("--output", required=True, help="the combined JSON to write")
    args = parser.parse_args()
    rounds = []
    for folder in args.folders:
        with open(os.path.join(folder, "results.json"), encoding="utf-8") as f:
            rounds.append(json.load(f))
    methods = [cell["label"] for cell in rounds[0]["cells"]]
    summary = {}
    print(f"{'method':<14} | " + " | ".join(f"round {i + 1}" for i in range(len(rounds))) + " | range | rel. L2")
    for label in methods:
        cells = [next(cell for cell in r["cells"] if cell["label"] == label) for r in rounds]
        speedups = [cell["speedup"] for cell in cells]
        summary[label] = {"speedups": speedups, "min": min(speedups), "max": max(speedups),
                          "seconds_per_image": [cell["seconds_per_image"] for cell in cells],
                          "rel_l2": cells[0]["rel_l2"], "ops_per_block": cells[0].get("ops_per_block")}
        print(f"{label:<14} | " + " | ".join(f"{s:7.2f}x" for s in speedups)
              + f" | {min(speedups):.2f}-{max(speedups):.2f}x | {cells[0]['rel_l2']:.4f}")
    with open(args.output, "w", encoding="utf-8") as f:
        json.dump({"command": rounds[0]["command"], "environment": rounds[0]["environment"],
                   "settings": rounds[0]["settings"], "summary": summary, "rounds": rounds}, f, indent=1)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
