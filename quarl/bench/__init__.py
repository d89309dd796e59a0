"""Benchmarks run by `quarl bench ...` (GPU). Each prints a table and appends a dated entry to bench/results/."""

from __future__ import annotations

import argparse


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
