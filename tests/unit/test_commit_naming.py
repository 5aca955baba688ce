"""Which transactions are certain to commit, so that a generation moved by exactly their count
across them moved by them alone (see reconcile.apply and drift.py)."""

from __future__ import annotations

from reconciler.backends.generation import commits_between, follows, next_generation
from reconciler.backends.iptables.backend import expected_commits
from reconciler.backends.nftables.kernel import certain_to_commit


def test_an_nft_script_is_certain_to_commit_when_it_adds_a_rule_or_deletes_or_creates() -> None:
    assert certain_to_commit("add table ip t\nadd chain ip t c\nadd rule ip t c counter\n")
    assert certain_to_commit("add chain ip t c {\n\tcounter\n}\ndelete element ip t s { 1.2.3.4 }\n")
    assert certain_to_commit("create set ip t s { type ipv4_addr; }\n")
    assert certain_to_commit("add chain ip t svc-a {\n\tdnat to 10.244.1.5:8080\n}\n")  # a block of rules
    assert not certain_to_commit("add chain ip t c {\n\ttype filter hook input priority 0;\n}\n")
    # what exists already is added again without a change (no commit): not certain
    assert not certain_to_commit("add table ip t\nadd chain ip t c\nadd element ip t s { 1.2.3.4 }\n")
    assert not certain_to_commit("flush chain ip t c\n")  # (an empty chain: nothing to flush)
    assert not certain_to_commit("add chain ip t c { comment \"add rule x\"; }\n")  # not at a line's start


def test_iptables_restore_commits_once_per_table_when_each_surely_changes() -> None:
    nat = ["*nat", ":RECONCILER-SVC-A - [0:0]", "-A RECONCILER-SVC-A -j RECONCILER-SEP-B", "COMMIT"]
    dropped = ["*filter", "-D INPUT -j RECONCILER-FILTER", "-X RECONCILER-FILTER", "COMMIT"]
    assert expected_commits(nat) == 1 and expected_commits(nat + dropped) == 2
    flush_only = ["*filter", ":RECONCILER-FIREWALL - [0:0]", "COMMIT"]  # empty already: no commit
    created = ["*nat", "-N RECONCILER-NEW", "COMMIT"]  # (a retry may flush it as existing instead)
    assert expected_commits(created) is None
    assert expected_commits(flush_only + nat) is None and expected_commits(nat + flush_only) is None


def test_commits_are_named_only_when_they_alone_moved_the_generation() -> None:
    assert commits_between(5, 7, 2) == [6, 7]
    assert commits_between(5, 8, 2) is None  # somebody else's beside them
    assert commits_between(0xFFFFFFFF, 2, 2) == [1, 2]  # (the counter skips 0)
    assert commits_between(None, 7, 2) is None and commits_between(5, 7, None) is None
    assert follows(5, [6, 7]) == 7 and follows(5, []) == 5
    assert follows(5, [7]) is None and follows(None, [6]) is None and follows(5, None) is None
    assert follows(0xFFFFFFFF, [next_generation(0xFFFFFFFF)]) == 1
