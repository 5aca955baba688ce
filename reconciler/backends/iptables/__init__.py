"""iptables backend: iptables-save parsing and iptables-restore rendering (see :mod:`.save`)."""
