"""Command line: ``python -m aiokv demo`` and ``python -m aiokv bench``."""

from __future__ import annotations

import sys

_USAGE = """usage: python -m aiokv {demo,bench} [options]

  demo   store a long prompt from one paged cache, load it into another, verify every byte
  bench  compare aiokv against the scalar reference, the write-up's version and direct backend calls
"""


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        sys.stdout.write(_USAGE)
        return 0 if args else 2
    command, rest = args[0], args[1:]
    if command == "demo":
        from .demo import main as demo_main

        return demo_main(rest)
    if command == "bench":
        from .bench.cli import main as bench_main

        return bench_main(rest)
    sys.stderr.write(f"unknown command {command!r}\n{_USAGE}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
