"""Plot `bench_sandbox.py --json` runs of two versions side by side (medians of each run).

    pip install -e '.[bench]'
    python benchmarks/plot_compare.py --label before --runs a1.json a2.json \
        --label after --runs b1.json b2.json --output docs/img/hardening.png [--title TEXT] [--only KEY ...]

Each run is one point; the bar is the median of a version's runs. Docker-only figures are drawn
where a run has them.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import matplotlib
import matplotlib.pyplot as plt

FIGURES = (
    ("exec_true_ms", "bwrap exec"),
    ("service_exec_true_ms", "bwrap exec, CLI client"),
    ("client_exec_true_ms", "Client.exec"),
    ("client_floor_interleaved_ms", "python + json, socket (alternating)"),
    ("service_exec_interleaved_ms", "bwrap exec, CLI client (alternating)"),
    ("docker_exec_interleaved_ms", "docker exec (alternating)"),
    ("client_exec_interleaved_ms", "Client.exec (alternating)"),
    ("cycle_ms", "bwrap cycle"),
    ("service_cycle_ms", "bwrap cycle, CLI client"),
    ("service_warm_cycle_ms", "bwrap warm cycle, CLI client"),
    ("docker_exec_true_ms", "docker exec"),
    ("docker_backend_exec_ms", "Docker backend exec"),
    ("docker_run_true_ms", "docker run --rm"),
    ("docker_warm_cycle_ms", "Docker warm cycle"),
)


def main() -> None:
    """Read the runs, draw one group of bars per figure, save the PNG."""

    matplotlib.use("Agg")

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--label", action="append", required=True)
    parser.add_argument("--runs", action="append", nargs="+", required=True)
    parser.add_argument("--output", required=True)
    parser.add_argument("--title", default="sandboxer before and after (one machine, interleaved runs)")
    parser.add_argument("--only", nargs="+", metavar="KEY", help="draw only these figures (JSON keys), in this order")
    args = parser.parse_args()
    versions = [
        (label, [json.loads(Path(p).read_text()) for p in runs])
        for label, runs in zip(args.label, args.runs, strict=True)
    ]
    chosen = [(key, dict(FIGURES)[key]) for key in args.only] if args.only else FIGURES
    figures = [(key, name) for key, name in chosen if any(key in run for _, runs in versions for run in runs)]
    width = 0.8 / len(versions)
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for i, (label, runs) in enumerate(versions):
        for j, (key, _) in enumerate(figures):
            values = [run[key] for run in runs if isinstance(run.get(key), (int, float))]
            if not values:
                continue
            x = j + (i - (len(versions) - 1) / 2) * width
            ax.bar(x, statistics.median(values), width, color=f"C{i}", label=label if j == 0 else None)
            ax.plot([x] * len(values), values, "k.", markersize=4)
    ax.set_xticks(range(len(figures)), [name for _, name in figures], rotation=30, ha="right")
    ax.set_ylabel("median wall time (ms)")
    ax.legend()
    ax.set_title(args.title)
    fig.tight_layout()
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.output, dpi=110)


if __name__ == "__main__":
    main()
