"""Benchmarks run by `quarl bench ...` (GPU). Each prints a table and appends a dated entry to bench/results/."""

from __future__ import annotations

import argparse
import datetime
import os
import shlex
import sys


def bench_main(name: str, doc: str, add_arguments, run, argv: list[str] | None = None) -> int:
    """The standalone entry point of `quarl bench NAME` (`python -m quarl.bench.NAME`): parse argv with
    add_arguments(parser), keep an explicit argv as args.argv (the command line a results entry records), run."""
    parser = argparse.ArgumentParser(prog=f"quarl bench {name}", description=doc.split("\n")[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    if argv is not None:
        args.argv = list(argv)
    return run(args)


def add_output_arguments(parser: argparse.ArgumentParser, default_results: str, json_help: str | None = None) -> None:
    """The options every benchmark shares: --json (when json_help is given), --out, --no-save, --seed."""
    if json_help is not None:
        parser.add_argument("--json", default=None, help=json_help)
    parser.add_argument("--out", default=default_results, help="results file to append the dated entry to")
    parser.add_argument("--no-save", action="store_true", help="print only; do not append to the results file")
    parser.add_argument("--seed", type=int, default=0)


def triton_version() -> str:
    """Triton's version, or "not installed"."""
    try:
        import triton
    except ImportError:
        return "not installed"
    return triton.__version__


def append_entry(path: str, title: str, intro: str, command: str, facts: list[str], body: str) -> None:
    """Append a dated entry (hardware, versions, command, facts, body) to a bench/results markdown file.

    The file starts with `# {title}` and `intro` when it is new or empty.
    """
    import torch

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "none (CPU)"
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    new = not os.path.exists(path) or os.path.getsize(path) == 0
    with open(path, "a") as fh:
        if new:
            fh.write(f"# {title}\n\n{intro}\n")
        fh.write(f"\n## {datetime.datetime.now().strftime('%Y-%m-%d %H:%M')}\n\n")
        fh.write(f"- GPU: {gpu}; torch {torch.__version__}; triton {triton_version()}\n")
        fh.write(f"- command: `{command}`\n")
        fh.writelines(f"- {f}\n" for f in facts)
        fh.write("\n" + body + "\n")


def bench_command(args, name: str) -> str:
    """The `quarl bench NAME ...` command line that ran, for a results entry: args.argv when main() was given
    an argument list, else what followed NAME on this process's command line (or the module's path)."""
    argv = getattr(args, "argv", None)
    if argv is None:
        argv = sys.argv[sys.argv.index(name) + 1:] if name in sys.argv else sys.argv[1:]
    return shlex.join(["quarl", "bench", name, *argv])
