#!/usr/bin/env bash
# Set up a fresh Debian 12+/Ubuntu 24.04+ machine (as root; needs apt mirrors and PyPI): the kernel
# tools the tool and its tests use, then the project's venv in .venv.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$PATH:/usr/local/sbin:/usr/sbin:/sbin"

need=()
for tool in nft:nftables iptables:iptables conntrack:conntrack ip:iproute2 sysctl:procps; do
  command -v "${tool%%:*}" >/dev/null 2>&1 || need+=("${tool##*:}")
done
if ! command -v python3 >/dev/null 2>&1; then
  need+=(python3 python3-venv)
elif ! python3 -c 'import ensurepip, venv' >/dev/null 2>&1; then
  need+=(python3-venv)  # Debian/Ubuntu ship python3 without venv support
fi
if ((${#need[@]})); then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${need[@]}"
fi

python3 -c 'import sys; sys.exit(sys.version_info < (3, 11))' || {
  echo "setup: Python 3.11 or newer is needed (found $(python3 --version))" >&2; exit 1; }
if [ ! -x .venv/bin/python ] || ! .venv/bin/python -m pip --version >/dev/null 2>&1; then
  rm -rf .venv  # missing, or left half-made by an earlier failed run
  python3 -m venv .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check -e '.[test]'
echo "setup: ok ($(nft --version), $(iptables --version), $(.venv/bin/python --version))"
