#!/usr/bin/env bash
# The library's own tests, fast, with the `test` extra only (no vLLM, no Mooncake): a fresh clone
# installs it into .venv and runs in about a minute. It leaves out the slow kinds of test (markers
# registered in pyproject.toml, applied in tests/conftest.py):
#   engine      real vLLM engines (tests/vllm/, the vLLM benchmark's test)
#   cluster     a Mooncake cluster in network namespaces (tests/cluster/)
#   soak        the 1,000-request soak
#   subprocess  a fresh Python per case (the documents' code blocks, the examples, the demo)
#   mooncake    a real mooncake_master
# Tests of the vLLM connector's pure parts skip where vLLM is not installed. Extra arguments go to
# pytest, e.g. `-x` or a path. The whole suite (every install, every kind) is `bash scripts/test.sh`.
set -euo pipefail
cd "$(dirname "$0")/.."

[ -x .venv/bin/python ] || python3 -m venv .venv
wanted=$(sha256sum pyproject.toml | cut -d' ' -f1)
# scripts/test.sh's stamp means every extra is in already, the test extra included.
if [ "$(cat .venv/.aiokv-test-extras 2>/dev/null)" != "$wanted" ] &&
    [ "$(cat .venv/.aiokv-fast-extras 2>/dev/null)" != "$wanted" ]; then
    .venv/bin/pip install -q -e '.[test]'
    echo "$wanted" >.venv/.aiokv-fast-extras
fi

markers="not (engine or cluster or soak or subprocess or mooncake)"
# A private network namespace where one can be made, as in scripts/test.sh; these tests need no network.
if command -v unshare >/dev/null && command -v ip >/dev/null && unshare -rn true 2>/dev/null; then
    exec unshare -rn sh -c 'ip link set lo up && exec .venv/bin/python -m pytest -m "$0" "$@"' "$markers" "$@"
fi
exec .venv/bin/python -m pytest -m "$markers" "$@"
