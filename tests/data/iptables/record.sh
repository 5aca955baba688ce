#!/bin/sh
# Re-record the iptables-save fixtures in this directory (needs root).
# Builds a kube-proxy-like ruleset in a throwaway network namespace, sends a
# little loopback traffic so counters are non-zero, and dumps it.
set -eu
cd "$(dirname "$0")"
NS=ipt-record-$$
ip netns add "$NS"
trap 'ip netns del "$NS"' EXIT
ns() { ip netns exec "$NS" "$@"; }
send() { ns bash -c "echo hello >/dev/udp/$1/9"; }  # one UDP datagram to the discard port
ns ip link set lo up

build() {  # $1 = iptables binary (iptables or iptables-legacy)
ipt=$1
for c in KUBE-SERVICES KUBE-NODEPORTS KUBE-SVC-ABC KUBE-SEP-1 KUBE-SEP-2 KUBE-POSTROUTING KUBE-MARK-MASQ; do
  ns $ipt -t nat -N $c
done
ns $ipt -t nat -A PREROUTING -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
ns $ipt -t nat -A OUTPUT -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
ns $ipt -t nat -A POSTROUTING -m comment --comment "kubernetes postrouting rules" -j KUBE-POSTROUTING
ns $ipt -t nat -A KUBE-MARK-MASQ -j MARK --or-mark 0x4000
ns $ipt -t nat -A KUBE-POSTROUTING -m mark ! --mark 0x4000/0x4000 -j RETURN
ns $ipt -t nat -A KUBE-POSTROUTING -j MARK --xor-mark 0x4000
ns $ipt -t nat -A KUBE-POSTROUTING -m comment --comment "kubernetes service traffic requiring SNAT" -j MASQUERADE --random-fully
ns $ipt -t nat -A KUBE-SERVICES -d 10.96.0.10/32 -p tcp -m comment --comment "default/my-svc:http cluster IP" -m tcp --dport 80 -j KUBE-SVC-ABC
ns $ipt -t nat -A KUBE-SERVICES -m comment --comment "kubernetes service nodeports; NOTE: this must be the last rule in this chain" -m addrtype --dst-type LOCAL -j KUBE-NODEPORTS
ns $ipt -t nat -A KUBE-NODEPORTS -p tcp -m comment --comment kube-system_dns -m tcp --dport 30053 -j KUBE-SVC-ABC
ns $ipt -t nat -A KUBE-SVC-ABC ! -s 10.244.0.0/16 -d 10.96.0.10/32 -p tcp -m comment --comment "default/my-svc:http cluster IP" -m tcp --dport 80 -j KUBE-MARK-MASQ
ns $ipt -t nat -A KUBE-SVC-ABC -m comment --comment "default/my-svc:http" -m recent --rcheck --seconds 10800 --reap --name KUBE-SEP-1 --mask 255.255.255.255 --rsource -j KUBE-SEP-1
ns $ipt -t nat -A KUBE-SVC-ABC -m comment --comment "default/my-svc:http -> 10.244.1.5:8080" -m statistic --mode random --probability 0.33333333349 -j KUBE-SEP-1
ns $ipt -t nat -A KUBE-SVC-ABC -m comment --comment "default/my-svc:http -> 10.244.1.6:8080" -m statistic --mode random --probability 0.5 -j KUBE-SEP-2
ns $ipt -t nat -A KUBE-SVC-ABC -m comment --comment "default/my-svc:http -> 10.244.1.7:8080" -j KUBE-SEP-2
ns $ipt -t nat -A KUBE-SEP-1 -s 10.244.1.5/32 -m comment --comment default/my-svc:http -j KUBE-MARK-MASQ
ns $ipt -t nat -A KUBE-SEP-1 -p tcp -m comment --comment default/my-svc:http -m recent --set --name KUBE-SEP-1 --mask 255.255.255.255 --rsource -m tcp -j DNAT --to-destination 10.244.1.5:8080
ns $ipt -t nat -A KUBE-SEP-2 -p tcp -m comment --comment 'say "hi" there' -m tcp -j DNAT --to-destination 10.244.1.6:8080
ns $ipt -t nat -A KUBE-SEP-2 -p udp -m comment --comment "it's quoted, back\\slash" -j DNAT --to-destination 10.244.1.7:53
ns $ipt -N KUBE-FIREWALL
ns $ipt -N KUBE-FORWARD
ns $ipt -P FORWARD DROP
ns $ipt -A INPUT -m comment --comment "kubernetes firewall" -j KUBE-FIREWALL
ns $ipt -A INPUT -i lo -p udp -m udp --dport 9 -j ACCEPT
ns $ipt -A FORWARD -m comment --comment "kubernetes forwarding rules" -j KUBE-FORWARD
ns $ipt -A KUBE-FIREWALL ! -s 127.0.0.0/8 -d 127.0.0.0/8 -m comment --comment "block incoming localnet connections" -m conntrack ! --ctstate RELATED,ESTABLISHED,DNAT -j DROP
ns $ipt -A KUBE-FORWARD -m conntrack --ctstate INVALID -j DROP
ns $ipt -A KUBE-FORWARD -m mark --mark 0x4000/0x4000 -j ACCEPT
ns $ipt -A KUBE-FORWARD -d 10.96.0.11/32 -p tcp -m comment --comment "default/no-ep:http has no endpoints" -m tcp --dport 80 -j REJECT --reject-with icmp-port-unreachable
ns $ipt -A KUBE-FORWARD -p udp -m udp ! --dport 53 -m addrtype ! --dst-type LOCAL -j REJECT --reject-with icmp-host-prohibited
ns $ipt -A KUBE-FORWARD ! -i lo -o eth0 -m comment --comment "" -j ACCEPT
ns $ipt -A KUBE-FORWARD -j LOG --log-prefix "kube fwd: "
}

build iptables
ns ip6tables -t nat -N KUBE-SVC-6
ns ip6tables -t nat -A OUTPUT -d fd00:10::a/128 -j KUBE-SVC-6
ns ip6tables -t nat -A KUBE-SVC-6 ! -s fd00::/64 -p tcp -m comment --comment "v6 svc" -m tcp --dport 80 -j DNAT --to-destination [fd00::5]:8080
ns ip6tables -A INPUT -p udp -m udp --dport 9 -j ACCEPT
ns ip6tables -A INPUT -p tcp -j REJECT --reject-with tcp-reset
send 127.0.0.1; send 127.0.0.1; send 127.0.0.1
send ::1; send ::1
ns iptables-save >save.txt
ns iptables-save -c >save-counters.txt
ns ip6tables-save -c >save6-counters.txt
# same ruleset through the legacy (x_tables) backend, in its own namespace
ip netns del "$NS"; ip netns add "$NS"; ns ip link set lo up
build iptables-legacy
send 127.0.0.1; send 127.0.0.1
ns iptables-legacy-save -c >save-legacy-counters.txt
