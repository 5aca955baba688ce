#!/usr/bin/env bash
# Set up a fresh Debian/Ubuntu machine (as root): kernel tools, then the project's venv in .venv.
set -euo pipefail
cd "$(dirname "$0")/.."

need=()
for tool in nft:nftables iptables:iptables conntrack:conntrack ipvsadm:ipvsadm ip:iproute2 sysctl:procps; do
  command -v "${tool%%:*}" >/dev/null 2>&1 || need+=("${tool##*:}")
done
command -v python3 >/dev/null 2>&1 || need+=(python3 python3-venv)
if ((${#need[@]})); then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${need[@]}"
fi

if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check -e '.[test]'
echo "setup: ok ($(nft --version), $(iptables --version), $(.venv/bin/python --version))"
