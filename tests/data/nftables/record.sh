#!/bin/sh
# Re-record the `nft list table` fixtures in this directory (needs root and the project's .venv):
# `reconciler apply` of the example state/ in a throwaway network namespace, then every table of
# ours as nft prints it. tests/unit/test_nftables.py parses them back and compares with render().
set -eu
cd "$(dirname "$0")"
REPO=$(cd ../../.. && pwd)
NS=nft-record-$$
ip netns add "$NS"
trap 'ip netns del "$NS"' EXIT
ip netns exec "$NS" ip link set lo up
ip netns exec "$NS" "$REPO/.venv/bin/reconciler" apply --source "$REPO/state" --node-name node-a \
  --cluster-cidr 10.244.0.0/16,fd00:244::/32 --service-cidr 10.96.0.0/16,fd00:96::/64 >/dev/null
rm -f state-example-*.json state-example-*.nft
ip netns exec "$NS" nft list tables | while read -r _ family name; do
  case "$name" in reconciler|reconciler-[0-9][0-9]) ;; *) continue ;; esac
  ip netns exec "$NS" nft list table "$family" "$name" > "state-example-$family-$name.nft"
done
ls state-example-*.nft
