"""nftables backend: tables `ip reconciler` and `ip6 reconciler`, one chain per service port."""
