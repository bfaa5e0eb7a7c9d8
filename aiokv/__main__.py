"""Command line: ``python -m aiokv demo`` (the benchmarks are not installed: ``python -m benchmarks`` from a
checkout)."""

from __future__ import annotations

import sys

_USAGE = """usage: python -m aiokv demo [options]

  demo   store a long prompt from one paged cache, load it into another, verify every byte

The benchmarks live in the repository, not in the installed package: from a checkout's root run
`python -m benchmarks --help`.
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
    sys.stderr.write(f"unknown command {command!r}\n{_USAGE}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
