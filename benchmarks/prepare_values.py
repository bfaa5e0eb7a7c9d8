"""prepare_values vs the scalar reference and the write-up's version, plus chunk hashing.

Usage: python benchmarks/prepare_values.py [--tokens N] [--regions R] [--repeats K] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys

from aiokv.bench.prepare import DEFAULT_TOKENS, run_prepare_benchmark

ROWS = [
    ("scalar_reference", "scalar reference (loop over chunks)"),
    ("writeup_vectorised", "write-up vectorised (.tolist())"),
    ("prepare_values_lists", "KVLayout.prepare_values, list inputs"),
    ("prepare_values_arrays", "KVLayout.prepare_values, int64 arrays"),
    ("chunk_hashes_int64_array", "chunk_hashes, int64 array"),
    ("chunk_hashes_list", "chunk_hashes, Python list"),
]

WIDTHS = (40, 9, 9, 9, 11)


def _row(cells: tuple[str, ...]) -> str:
    first, *rest = cells
    right = " | ".join(f"{c:>{w}}" for c, w in zip(rest, WIDTHS[1:], strict=True))
    return f"| {first:<{WIDTHS[0]}} | {right} |"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=DEFAULT_TOKENS)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--regions", type=int, default=96)
    parser.add_argument("--chunk-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--json", action="store_true", help="print the raw result as JSON")
    args = parser.parse_args(argv)
    result = run_prepare_benchmark(
        tokens=args.tokens,
        block_size=args.block_size,
        regions=args.regions,
        chunk_tokens=args.chunk_tokens,
        repeats=args.repeats,
    )
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    cfg = result["config"]
    print(
        f"{cfg['tokens']:,} tokens, block_size {cfg['block_size']}, {cfg['chunks']:,} chunks of "
        f"{cfg['chunk_tokens']} tokens, {cfg['regions']} regions; best/median of {cfg['repeats']}; "
        f"Python {cfg['python']}, NumPy {cfg['numpy']}, {cfg['cpus']} CPUs"
    )
    timings = result["timings"]
    speedups = result["speedups"]
    header = ("implementation", "best ms", "median ms", "vs scalar", "vs write-up")
    print(_row(header))
    print(f"|{'-' * (WIDTHS[0] + 2)}|" + "|".join("-" * (w + 1) + ":" for w in WIDTHS[1:]) + "|")
    for key, label in ROWS:
        t = timings[key]
        vs_scalar = vs_writeup = ""
        if key.startswith("prepare_values"):
            form = key.removeprefix("prepare_values_")
            vs_scalar = f"{speedups[f'prepare_values_{form}_vs_scalar']['best']:.0f}x"
            vs_writeup = f"{speedups[f'prepare_values_{form}_vs_writeup']['best']:.1f}x"
        print(_row((label, f"{t['best_ms']:.3f}", f"{t['median_ms']:.3f}", vs_scalar, vs_writeup)))
    for goal, met in result["goals_met"].items():
        print(f"goal {goal}: {'met' if met else 'MISSED'}")
    return 0 if all(result["goals_met"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
