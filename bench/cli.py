"""`clusterkit --help` latency against bare Python and a minimal typer app, side by side.

Each side is a fresh process, timed until it exits; sides interleaved with alternating order,
medians of --reps:

- `python -c pass`: the interpreter's own start (this environment's site hooks included)
- a minimal typer app's `--help`: two commands, the same rich help (typer's floor)
- `clusterkit --help`, and `clusterkit profiles --help` and `--version`, through the console
  script users type

Printed: median ms [min-max], the ratio to the typer app, and the ms above each baseline.
Target (issue 27): `clusterkit --help` below 300 ms.
Run: .venv/bin/python bench/cli.py [--reps 20]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _side_by_side as B

PY = sys.executable
TARGET_MS = 300.0
TYPER_APP = '''
import typer

app = typer.Typer(help="A minimal typer app.", no_args_is_help=True, rich_markup_mode="rich")


@app.command()
def hello(name: str = typer.Argument("world", help="Who to greet.")) -> None:
    """Say hello."""
    typer.echo(f"hello {name}")


@app.command()
def bye() -> None:
    """Say goodbye."""
    typer.echo("bye")


app()
'''


def seconds(command: list[str]) -> float:
    """Wall seconds of ``command`` in a fresh process, until it exits (output discarded)."""
    started = time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    B.compile_clusterkit()
    with tempfile.TemporaryDirectory() as directory:
        app = Path(directory) / "minimal_typer.py"
        app.write_text(TYPER_APP)
        sides = {
            "python -c pass": [PY, "-c", "pass"],
            "minimal typer app --help": [PY, str(app), "--help"],
            "clusterkit --help": [B.CLUSTERKIT, "--help"],
            "clusterkit profiles --help": [B.CLUSTERKIT, "profiles", "--help"],
            "clusterkit --version": [B.CLUSTERKIT, "--version"],
        }
        for command in sides.values():  # warm the file cache; untimed
            seconds(command)
        times: dict[str, list[float]] = {label: [] for label in sides}
        for rep in range(args.reps):
            order = list(sides) if rep % 2 == 0 else list(reversed(sides))
            for label in order:
                times[label].append(seconds(sides[label]))
    table(times, args.reps)


def table(times: dict[str, list[float]], reps: int) -> None:
    median = {label: 1000 * statistics.median(values) for label, values in times.items()}
    bare, floor = median["python -c pass"], median["minimal typer app --help"]
    print(f"{reps} reps; load average {B.load()}; {os.cpu_count()} cores")
    print(f"{'side':30}{'median ms':>10}{'min':>7}{'max':>7}{'/ typer':>9}{'+ms typer':>11}"
          f"{'+ms python':>12}")  # fmt: skip
    for label, values in times.items():
        print(
            f"{label:30}{median[label]:10.0f}{1000 * min(values):7.0f}{1000 * max(values):7.0f}"
            f"{median[label] / floor:9.2f}{median[label] - floor:11.0f}{median[label] - bare:12.0f}"
        )
    ours = median["clusterkit --help"]
    verdict = "met" if ours < TARGET_MS else "MISSED"
    print(f"\nclusterkit --help: {ours:.0f} ms, target < {TARGET_MS:.0f} ms: {verdict}")


if __name__ == "__main__":
    main()
