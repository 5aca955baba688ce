"""nftables backend: per family a `reconciler` table (shared checks, masquerading) and sixteen DNAT
shard tables `reconciler-NN`, one chain per service port."""
