#!/usr/bin/env bash
# The library's own tests, fast: scripts/test.sh (same setup, same private network namespace) without
# the slow kinds of test (markers registered in pyproject.toml, applied in tests/conftest.py):
#   engine      real vLLM engines (tests/vllm/, the vLLM benchmark's test)
#   cluster     a Mooncake cluster in network namespaces (tests/cluster/)
#   soak        the 1,000-request soak
#   subprocess  a fresh Python per case (the documents' code blocks, the examples, the demo)
#   mooncake    a real mooncake_master (most of their time is waiting: masters started, killed, stopped)
# Extra arguments go to pytest, e.g. `-x` or a path. The whole suite is `bash scripts/test.sh`.
set -euo pipefail
exec bash "$(dirname "$0")/test.sh" -m "not (engine or cluster or soak or subprocess or mooncake)" "$@"
