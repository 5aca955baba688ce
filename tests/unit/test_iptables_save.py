"""Tests for reconciler.backends.iptables.save on recorded iptables-save output.

Fixtures in tests/data/iptables/ come from record.sh (iptables 1.8.9, nft and
legacy).  Tests marked ``needs_netns`` run real iptables-restore/-save inside
throwaway network namespaces (root only); the host's rules are never touched.
"""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from reconciler.backends.iptables.save import (
    Chain,
    ParseError,
    Rule,
    RuleOp,
    Ruleset,
    Table,
    format_probability,
    parse_save,
    quote_arg,
    render_restore,
    split_args,
)

DATA = Path(__file__).resolve().parents[1] / "data" / "iptables"
FIXTURES = ["save.txt", "save-counters.txt", "save6-counters.txt", "save-legacy-counters.txt"]


def load(name: str) -> str:
    return (DATA / name).read_text()


def strip_comments(text: str) -> str:
    return "".join(line + "\n" for line in text.splitlines() if not line.startswith("#"))


# --------------------------------------------------------------------------- parsing


@pytest.mark.parametrize("name", FIXTURES)
def test_fixture_round_trips_byte_for_byte(name: str) -> None:
    text = load(name)
    rs = parse_save(text)
    assert rs.to_text() == strip_comments(text)
    assert parse_save(rs.to_text()) == rs


def test_parse_structure() -> None:
    rs = parse_save(load("save.txt"))
    assert list(rs.tables) == ["filter", "nat"]
    flt, nat = rs["filter"], rs["nat"]
    assert flt["FORWARD"].policy == "DROP" and flt["FORWARD"].is_builtin
    assert flt["KUBE-FORWARD"].policy is None and not flt["KUBE-FORWARD"].is_builtin
    assert flt["INPUT"].counters == (0, 0)
    assert list(nat.chains)[:4] == ["PREROUTING", "INPUT", "OUTPUT", "POSTROUTING"]
    # user chains come back sorted by name, whatever the creation order
    assert list(nat.chains)[4:] == sorted(list(nat.chains)[4:])
    assert [r.chain for r in nat["KUBE-SVC-ABC"].rules] == ["KUBE-SVC-ABC"] * 5
    assert all(r.counters is None for c in nat.chains.values() for r in c.rules)


def test_parse_rule_details() -> None:
    nat = parse_save(load("save.txt"))["nat"]
    svc = nat["KUBE-SVC-ABC"].rules
    assert svc[0].args[:4] == ("!", "-s", "10.244.0.0/16", "-d")
    assert svc[0].comment == "default/my-svc:http cluster IP"
    assert svc[0].target == "KUBE-MARK-MASQ"
    assert "--rcheck" in svc[1].args and svc[1].args[svc[1].args.index("--name") + 1] == "KUBE-SEP-1"
    assert svc[1].args[svc[1].args.index("--mask") + 1] == "255.255.255.255"
    assert svc[2].args[svc[2].args.index("--probability") + 1] == "0.33333333349"
    assert svc[3].args[svc[3].args.index("--probability") + 1] == "0.50000000000"  # given as 0.5
    sep1 = nat["KUBE-SEP-1"].rules
    assert sep1[0].comment == "default/my-svc:http"  # quoted by iptables-save because of '/' ':'
    assert ("recent", "--set", "--name", "KUBE-SEP-1") == sep1[1].args[7:11]
    assert sep1[1].args[-3:] == ("DNAT", "--to-destination", "10.244.1.5:8080")
    sep2 = nat["KUBE-SEP-2"].rules
    assert sep2[0].comment == 'say "hi" there'
    assert sep2[1].comment == "it's quoted, back\\slash"
    assert nat["KUBE-NODEPORTS"].rules[0].comment == "kube-system_dns"
    # --or-mark / --xor-mark are printed as --set-xmark
    assert nat["KUBE-MARK-MASQ"].rules[0].args == ("-j", "MARK", "--set-xmark", "0x4000/0x4000")
    post = nat["KUBE-POSTROUTING"].rules
    assert post[0].args == ("-m", "mark", "!", "--mark", "0x4000/0x4000", "-j", "RETURN")
    assert post[1].args == ("-j", "MARK", "--set-xmark", "0x4000/0x0")
    assert post[2].args[-2:] == ("MASQUERADE", "--random-fully") and post[2].target == "MASQUERADE"

    fwd = parse_save(load("save.txt"))["filter"]["KUBE-FORWARD"].rules
    assert fwd[2].args[-3:] == ("REJECT", "--reject-with", "icmp-port-unreachable")
    assert fwd[3].args[:8] == ("-p", "udp", "-m", "udp", "!", "--dport", "53", "-m")
    assert ("addrtype", "!", "--dst-type", "LOCAL") == fwd[3].args[8:12]
    assert fwd[4].args[:3] == ("!", "-i", "lo") and fwd[4].comment == ""
    assert fwd[5].args == ("-j", "LOG", "--log-prefix", "kube fwd: ") and fwd[5].comment is None


def test_parse_counters() -> None:
    rs = parse_save(load("save-counters.txt"))
    inp = rs["filter"]["INPUT"]
    assert inp.counters == (0, 0)  # iptables-nft: built-in chain counters are always [0:0]
    assert inp.rules[1].counters is not None and inp.rules[1].counters[0] == 3
    assert rs["nat"]["KUBE-SVC-ABC"].rules[0].counters == (0, 0)
    assert rs.without_counters() == parse_save(load("save.txt")).without_counters()
    legacy = parse_save(load("save-legacy-counters.txt"))
    assert legacy["filter"]["INPUT"].counters != (0, 0)  # legacy keeps real policy counters
    assert legacy.without_counters() == rs.without_counters()


def test_parse_ipv6() -> None:
    nat = parse_save(load("save6-counters.txt"))["nat"]
    (rule,) = nat["KUBE-SVC-6"].rules
    assert rule.args[:3] == ("!", "-s", "fd00::/64")
    assert rule.args[-1] == "[fd00::5]:8080" and rule.comment == "v6 svc"


@pytest.mark.parametrize(
    ("text", "args"),
    [
        ('a "b c" d', ["a", "b c", "d"]),
        ('x "" y', ["x", "", "y"]),
        ('"say \\"hi\\""', ['say "hi"']),
        ('"it\\\'s \\\\"', ["it's \\"]),
        ("'a b'", ["'a", "b'"]),  # single quotes are not special
        ("a\\ b", ["a\\", "b"]),  # nor is a backslash outside double quotes
        ('pre"fix x"', ["prefix x"]),
        ('"one"two', ["one", "two"]),  # a closing quote ends the token
        ("a\t b  \n", ["a", "b"]),
    ],
)
def test_split_args_matches_iptables_restore(text: str, args: list[str]) -> None:
    assert split_args(text) == args


def test_quoting() -> None:
    assert quote_arg("10.0.0.1:80") == "10.0.0.1:80"
    assert quote_arg("a b") == '"a b"'
    assert quote_arg("") == '""'
    assert quote_arg("it's") == "it's"  # harmless outside a free-text option
    assert quote_arg("it's", after="--comment") == '"it\\\'s"'
    assert quote_arg("ns/svc", after="--comment") == '"ns/svc"'
    assert quote_arg("kube-proxy_x", after="--comment") == "kube-proxy_x"
    for value in ["a b", 'q"uote', "back\\slash", "", "it's", "tab\there", "  lead"]:
        rule = Rule("C", ("-m", "comment", "--comment", value, "-j", "ACCEPT"))
        assert Rule.from_text(rule.to_text()) == rule
        assert Rule.from_text(Rule("C", ("-j", "LOG", "--log-prefix", value)).to_text()).args[-1] == value


def test_spec_quotes_each_argument_as_quote_arg_does() -> None:
    """Rule.spec() (its fast path for the usual rule included) is quote_arg() of each argument
    after the one before it: the values of free-text options quoted as iptables-save does."""
    import random

    rng = random.Random(7)
    words = ["-m", "comment", "--comment", "--log-prefix", "--helper", "-j", "ACCEPT", "ns/web:http", "web",
             "", "a b", '"', "tab\there", "it's", "x\\y", "10.0.0.1:80", "-p", "tcp", "--dport", "80"]
    for _ in range(5000):
        args = tuple(rng.choice(words) for _ in range(rng.randint(1, 10)))
        expected = " ".join(quote_arg(a, after=args[i - 1] if i else None) for i, a in enumerate(args))
        assert Rule("C", args).spec() == expected, args


def test_rule_from_text_and_helpers() -> None:
    text = '-A KUBE-X -m comment --comment "a b" -j DNAT --to-destination 10.0.0.1:80'
    rule = Rule.from_text(text)
    assert rule == Rule("KUBE-X", ("-m", "comment", "--comment", "a b", "-j", "DNAT", "--to-destination", "10.0.0.1:80"))
    assert rule.comment == "a b" and rule.target == "DNAT" and not rule.is_goto
    assert rule.to_text() == text and str(rule) == text
    assert Rule.from_text("[12:3456] -A X -g KUBE-Y").counters == (12, 3456)
    assert Rule.from_text("[1:2]-A X -g Y").target == "Y"
    assert Rule.from_text("[1:2] -A X -g Y").to_text() == "[1:2] -A X -g Y"
    assert Rule.from_text("[1:2] -A X -g Y").to_text(counters=False) == "-A X -g Y"
    assert Rule.from_text("-A X -g KUBE-Y").is_goto
    # option-looking free text is not mistaken for options
    tricky = Rule.from_text('-A X -m comment --comment "-j" -j LOG --log-prefix "-j"')
    assert tricky.comment == "-j" and tricky.target == "LOG"
    assert Rule.from_text("-A X -j ACCEPT").comment is None
    assert Rule.from_text("-A X -s 1.2.3.4/32").target is None
    assert Rule.from_text("-A X -j ACCEPT").to_text(command="-I", position=2) == "-I X 2 -j ACCEPT"
    assert Rule("X", ["-j", "ACCEPT"]).args == ("-j", "ACCEPT")  # type: ignore[arg-type]  # frozen to a tuple
    with pytest.raises(ValueError):
        Rule("bad chain", ())


def test_chain_policy_dash_is_none() -> None:
    assert Chain("X", "-") == Chain("X", None)
    with pytest.raises(ValueError):
        Chain("X", None, None, [Rule("Y", ())])


def test_format_probability_matches_iptables() -> None:
    assert format_probability(0.5) == "0.50000000000"
    assert format_probability(1 / 3) == "0.33333333349"
    assert format_probability(0.1) == "0.10000000009"
    assert format_probability(0.3333) == "0.33330000006"
    assert format_probability(1.0) == "1.00000000000"
    with pytest.raises(ValueError):
        format_probability(1.5)


GOOD = "*filter\n:INPUT ACCEPT [0:0]\n:X - [0:0]\n-A X -j ACCEPT\nCOMMIT\n"


@pytest.mark.parametrize(
    ("text", "lineno", "snippet"),
    [
        ("-A X -j ACCEPT\n", 1, "-A X -j ACCEPT"),
        (":X - [0:0]\n", 1, ":X - [0:0]"),
        ("COMMIT\n", 1, "COMMIT"),
        ("*filter\n:X - [0:0]\n-A X -j ACCEPT\n", 1, "*filter"),
        ("*filter\n*nat\nCOMMIT\n", 2, "*nat"),
        (GOOD + "*filter\nCOMMIT\n", 6, "*filter"),
        ("*filter\n:X - [0:0]\n-A Y -j ACCEPT\nCOMMIT\n", 3, "-A Y"),
        ("*filter\n:X - [0:0]\n:X - [0:0]\nCOMMIT\n", 3, ":X"),
        ("*filter\n:X -\n:Y\nCOMMIT\n", 3, ":Y"),
        ("*filter\n:X - [a:0]\nCOMMIT\n", 2, "[a:0]"),
        ("*filter\n:X - [0:0]\n[1:] -A X -j ACCEPT\nCOMMIT\n", 3, "[1:]"),
        ('*filter\n:X - [0:0]\n-A X -m comment --comment "open -j ACCEPT\nCOMMIT\n', 3, '"open'),
        ("*filter\n:X - [0:0]\n-I X 1 -j ACCEPT\nCOMMIT\n", 3, "-I X 1"),
        ("*filter\n:X - [0:0]\n-A\nCOMMIT\n", 3, "-A"),
        ("*filter\n:X - [0:0]\ngarbage\nCOMMIT\n", 3, "garbage"),
        ("*\nCOMMIT\n", 1, "*"),
        ("*filter\n-F NOPE\nCOMMIT\n", 2, "-F NOPE"),
    ],
)
def test_parse_errors_name_line_and_text(text: str, lineno: int, snippet: str) -> None:
    with pytest.raises(ParseError) as exc:
        parse_save(text)
    assert exc.value.lineno == lineno
    assert exc.value.line is not None and snippet in exc.value.line
    assert f"line {lineno}:" in str(exc.value) and snippet in str(exc.value)


def test_parse_tolerates_optional_counters_and_blank_lines() -> None:
    rs = parse_save("\n# hi\n*filter\n:X -\n\n-A X -j ACCEPT\nCOMMIT\n")
    assert rs["filter"]["X"].counters is None and rs["filter"]["X"].rules[0].target == "ACCEPT"
    assert parse_save("") == Ruleset()


# --------------------------------------------------------------------------- rendering


def _small() -> Ruleset:
    return parse_save(
        "*filter\n:INPUT ACCEPT [1:2]\n:KUBE-A - [0:0]\n:KUBE-B - [0:0]\n"
        "[5:6] -A INPUT -j KUBE-A\n-A KUBE-A -m comment --comment \"a b\" -j KUBE-B\n-A KUBE-B -j ACCEPT\nCOMMIT\n"
    )


def test_render_layout() -> None:
    rs = _small()
    ops = [
        RuleOp("filter", "insert", Rule.from_text("-A INPUT -j KUBE-B"), position=1),
        RuleOp("filter", "delete", Rule.from_text("-A INPUT -j KUBE-OLD")),
        RuleOp("nat", "append", Rule.from_text('-A OUTPUT -m comment --comment "x y" -j RETURN')),
    ]
    text = render_restore(rs, {"filter": ["KUBE-A"]}, delete_chains={"filter": ["KUBE-OLD"]}, rule_ops=ops)
    assert text == (
        "*filter\n"
        ":KUBE-A - [0:0]\n"
        ":KUBE-OLD - [0:0]\n"
        '-A KUBE-A -m comment --comment "a b" -j KUBE-B\n'
        "-I INPUT 1 -j KUBE-B\n"
        "-D INPUT -j KUBE-OLD\n"
        "-X KUBE-OLD\n"
        "COMMIT\n"
        "*nat\n"
        '-A OUTPUT -m comment --comment "x y" -j RETURN\n'
        "COMMIT\n"
    )


def test_render_everything_flushes_builtins_and_reparses_equal() -> None:
    rs = _small()
    text = render_restore(rs)
    assert text.splitlines()[:5] == ["*filter", ":INPUT ACCEPT [0:0]", ":KUBE-A - [0:0]", ":KUBE-B - [0:0]", "-F INPUT"]
    assert "[5:6]" not in text
    assert parse_save(text).without_counters() == rs.without_counters()
    with_counters = render_restore(rs, counters=True)
    assert ":INPUT ACCEPT [1:2]" in with_counters and "[5:6] -A INPUT -j KUBE-A" in with_counters
    assert parse_save(with_counters) == rs


def test_render_nothing_and_errors() -> None:
    rs = _small()
    assert render_restore(rs, {}) == ""
    assert render_restore({}, None) == ""
    with pytest.raises(KeyError):
        render_restore(rs, {"filter": ["NOPE"]})
    with pytest.raises(ValueError, match="both"):
        render_restore(rs, {"filter": ["KUBE-A"]}, delete_chains={"filter": ["KUBE-A"]})
    with pytest.raises(ValueError, match="built-in"):
        render_restore(rs, {}, delete_chains={"filter": ["INPUT"]})
    with pytest.raises(ValueError):
        RuleOp("filter", "append", Rule("X", ()), position=1)
    with pytest.raises(ValueError):
        RuleOp("filter", "insert", Rule("X", ()), position=0)


@pytest.mark.parametrize("name", FIXTURES)
def test_render_of_fixture_reparses_equal(name: str) -> None:
    rs = parse_save(load(name))
    assert parse_save(render_restore(rs)).without_counters() == rs.without_counters()
    assert parse_save(render_restore(rs, counters=True)) == rs


# --------------------------------------------------------------------------- real iptables in a netns

Run = Callable[..., subprocess.CompletedProcess[str]]
_ids = itertools.count()

needs_netns = pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("iptables-restore"),
    reason="needs root, iproute2 and iptables",
)


@contextmanager
def netns() -> Iterator[Run]:
    """A throwaway network namespace; yields run(*argv, input=None, check=True)."""
    name = f"ipt-ut-{os.getpid()}-{next(_ids)}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:

        def run(*argv: str, input: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
            return subprocess.run(
                ["ip", "netns", "exec", name, *argv], input=input, text=True, capture_output=True, check=check
            )

        yield run
    finally:
        subprocess.run(["ip", "netns", "del", name], check=True)


def _tool(name: str) -> str:
    if not shutil.which(name):
        pytest.skip(f"{name} not installed")
    return name


def _flavour(fixture: str) -> tuple[str, str]:
    if "legacy" in fixture:
        return _tool("iptables-legacy-restore"), _tool("iptables-legacy-save")
    if fixture.startswith("save6"):
        return "ip6tables-restore", "ip6tables-save"
    return "iptables-restore", "iptables-save"


def _only(rs: Ruleset, like: Ruleset) -> Ruleset:
    return Ruleset({t: rs[t] for t in like.tables if t in rs})


@needs_netns
@pytest.mark.parametrize("name", FIXTURES)
def test_rendered_text_passes_iptables_restore_test(name: str) -> None:
    restore, _ = _flavour(name)
    rs = parse_save(load(name))
    with netns() as run:
        for text in (render_restore(rs), render_restore(rs, counters=True)):
            res = run(restore, "--test", "--noflush", input=text, check=False)
            assert res.returncode == 0, res.stderr
        assert run(restore, "--test", input="*filter\n-A INPUT --bogus -j ACCEPT\nCOMMIT\n", check=False).returncode != 0


@needs_netns
@pytest.mark.parametrize("name", FIXTURES)
def test_real_restore_and_save_round_trip(name: str) -> None:
    restore, save = _flavour(name)
    rs = parse_save(load(name))
    with netns() as run:
        run(restore, "--noflush", input=render_restore(rs))
        back = _only(parse_save(run(save).stdout), rs).without_counters()
        assert back.to_text() == rs.without_counters().to_text()
        assert back == rs.without_counters()
        # again with -c: counters are restored too, and a second run is idempotent
        run(restore, "-c", "--noflush", input=render_restore(rs, counters=True))
        back = _only(parse_save(run(save, "-c").stdout), rs)
        assert back.without_counters() == rs.without_counters()
        if name.startswith("save6"):
            return  # ip6tables-nft 1.8.9 drops rule counters on restore (and on ip6tables -c)
        for table in rs.tables.values():
            for chain in table.chains.values():
                got = [r.counters for r in back[table.name][chain.name].rules]
                assert got == [r.counters or (0, 0) for r in chain.rules]
        if name == "save-counters.txt":  # iptables-nft keeps no policy counters: exact match
            assert back == rs


@needs_netns
def test_noflush_incremental_update() -> None:
    rs = parse_save(load("save.txt"))
    with netns() as run:
        run("iptables-restore", "--noflush", input=render_restore(rs))
        host_rule = Rule.from_text("-A INPUT -s 192.0.2.1/32 -j DROP")  # someone else's rule: must survive
        run("iptables", "-I", "INPUT", "1", *host_rule.args)

        # desired: KUBE-SVC-ABC keeps one endpoint; KUBE-SEP-2 goes away; move the INPUT jump to the top
        nat = rs["nat"]
        svc = nat["KUBE-SVC-ABC"]
        new_svc = Chain(svc.name, None, None, [r for r in svc.rules if r.target != "KUBE-SEP-2"])
        desired_nat = Table("nat", {**nat.chains, new_svc.name: new_svc})
        jump = rs["filter"]["INPUT"].rules[0]
        text = render_restore(
            {"nat": desired_nat},
            {"nat": [new_svc.name]},
            delete_chains={"nat": ["KUBE-SEP-2"]},
            rule_ops=[
                RuleOp("filter", "delete", jump),
                RuleOp("filter", "insert", jump, position=1),
            ],
        )
        assert ":KUBE-SVC-ABC - [0:0]" in text and "-X KUBE-SEP-2" in text
        run("iptables-restore", "--noflush", input=text)
        back = parse_save(run("iptables-save").stdout).without_counters()

        expected = rs.without_counters()
        expected["nat"].chains["KUBE-SVC-ABC"] = new_svc
        del expected["nat"].chains["KUBE-SEP-2"]
        expected["filter"]["INPUT"].rules.insert(1, host_rule)  # our jump is back above the foreign rule
        assert back.to_text() == expected.to_text()
        assert back == expected

        # deleting a chain that is still referenced fails, and (atomic) changes nothing
        bad = render_restore(rs, {}, delete_chains={"nat": ["KUBE-SEP-1"]})
        res = run("iptables-restore", "--noflush", input=bad, check=False)
        assert res.returncode != 0 and "KUBE-SEP-1" in res.stderr
        assert parse_save(run("iptables-save").stdout).without_counters() == back

        # deleting a chain that does not exist is harmless (it is declared first)
        run("iptables-restore", "--noflush", input=render_restore({}, {}, delete_chains={"nat": ["KUBE-NEVER"]}))
        assert parse_save(run("iptables-save").stdout).without_counters() == back


@needs_netns
def test_builtin_declaration_alone_does_not_flush() -> None:
    """Why render_restore adds ``-F`` for built-in chains in --noflush mode."""
    with netns() as run:
        run("iptables", "-A", "INPUT", "-j", "ACCEPT")
        run("iptables-restore", "--noflush", input="*filter\n:INPUT ACCEPT [0:0]\n-A INPUT -j DROP\nCOMMIT\n")
        assert [r.target for r in parse_save(run("iptables-save").stdout)["filter"]["INPUT"].rules] == ["ACCEPT", "DROP"]
        rs = parse_save("*filter\n:INPUT DROP [0:0]\n-A INPUT -j DROP\nCOMMIT\n")
        run("iptables-restore", "--noflush", input=render_restore(rs))
        assert parse_save(run("iptables-save").stdout)["filter"]["INPUT"] == rs["filter"]["INPUT"]


def test_split_args_fast_path_agrees_with_the_character_loop():
    """split_args takes a str.split shortcut for save-style lines; on any input it must give
    what iptables-restore's own character-by-character tokenizer gives."""
    import random

    from reconciler.backends.iptables import save

    rng = random.Random(1)
    alphabet = ["a", "b", "-", '"', "\\", " ", "\t", "\n", "x", "\r", "/", ":", "\x0b", "\xa0"]
    for _ in range(20000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 14)))
        try:
            slow = save._split_args_slowly(text)
        except save.ParseError:
            slow = None
        try:
            fast = save.split_args(text)
        except save.ParseError:
            fast = None
        assert fast == slow, repr(text)
    line = '-A X -m comment --comment "ns/web:http cluster IP" -j DNAT --to-destination 10.0.0.1:80'
    assert save.split_args(line)[4:6] == ["--comment", "ns/web:http cluster IP"]


def _fake_save(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, script: str) -> None:
    """An `iptables-fake-save` on PATH that runs `script` (sh)."""
    tool = tmp_path / "iptables-fake-save"
    tool.write_text("#!/bin/sh\n" + script)
    tool.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")


def test_read_save_parses_the_tool_output_as_it_streams(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from reconciler.backends.iptables import kernel
    from reconciler.backends.iptables.observed import read_our_tables

    _fake_save(tmp_path, monkeypatch, 'printf "*nat\\n:RECONCILER-X - [0:0]\\n'
                                      '-A RECONCILER-X -m comment --comment \\"a b\\" -j ACCEPT\\nCOMMIT\\n"\n')
    seen = []

    def parse(lines):
        seen.append(type(lines))
        return read_our_tables(lines)

    state = kernel.read_save("iptables", "fake", parse)["nat"]
    assert seen[0] is not str  # lines, not the whole text
    assert [r.args for r in state.chains["RECONCILER-X"]] == [("-m", "comment", "--comment", "a b", "-j", "ACCEPT")]


def test_read_save_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from reconciler.backends.base import KernelError
    from reconciler.backends.iptables import kernel
    from reconciler.backends.iptables.observed import read_our_tables

    # no tables at all (nothing loaded yet): nothing of ours
    _fake_save(tmp_path, monkeypatch, "exit 0\n")
    assert all(t.empty for t in kernel.read_save("iptables", "fake", read_our_tables).values())
    # the tool fails, whatever it says: an error, never "empty" (the plan would re-add what is there)
    _fake_save(tmp_path, monkeypatch, 'printf "*nat\\n:RECONCILER-X - [0:0]\\nCOMMIT\\n"; '
                                      "echo \"can't initialize iptables table 'security'\" >&2; exit 1\n")
    with pytest.raises(KernelError, match="iptables-fake-save exited 1: can't initialize"):
        kernel.read_save("iptables", "fake", read_our_tables)
    # the tool dies mid-output: its error, not the parser's complaint about the cut-off text
    _fake_save(tmp_path, monkeypatch, 'printf "*nat\\n:RECONCILER-X - [0:0]\\n"; echo "out of memory" >&2; exit 4\n')
    with pytest.raises(KernelError, match="out of memory"):
        kernel.read_save("iptables", "fake", read_our_tables)
    _fake_save(tmp_path, monkeypatch, 'printf "*nat\\n-A RECONCILER-Y -j ACCEPT\\nCOMMIT\\n"\n')
    with pytest.raises(ParseError, match="line 2: rule for undeclared chain"):
        kernel.read_save("iptables", "fake", read_our_tables)


def test_a_kernel_tool_that_hangs_is_killed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A tool that never ends (a wedged netlink socket, a lock kept) is killed after TOOL_TIMEOUT:
    the sync fails and is retried, instead of the run loop waiting for ever."""
    import time

    from reconciler.backends import base
    from reconciler.backends.base import KernelError, run_tool
    from reconciler.backends.iptables import kernel
    from reconciler.backends.iptables.observed import read_our_tables

    monkeypatch.setattr(base, "TOOL_TIMEOUT", 0.3)
    started = time.monotonic()
    with pytest.raises(KernelError, match=r"sleep: no answer in 0.3 s: killed"):
        run_tool(["sleep", "30"])
    with pytest.raises(KernelError, match=r"no answer in 0.3 s"):
        run_tool(["sh", "-c", "sleep 30"], ["*nat", "COMMIT"])  # (with input)
    _fake_save(tmp_path, monkeypatch, 'printf "*nat\n"; exec sleep 30\n')
    with pytest.raises(KernelError, match=r"iptables-fake-save: no answer in 0.3 s: killed"):
        kernel.read_save("iptables", "fake", read_our_tables)
    assert time.monotonic() - started < 5
    assert run_tool(["true"]).returncode == 0  # (a tool that ends is not touched)
    # nor one that ended while its output is still being parsed, slower than the timeout
    _fake_save(tmp_path, monkeypatch, 'printf "*nat\\nCOMMIT\\n"\n')

    def slow_parse(lines: Any) -> Any:
        tables = read_our_tables(lines)
        time.sleep(0.5)
        return tables

    assert "nat" in kernel.read_save("iptables", "fake", slow_parse)


def test_restore_errors_say_what_happened(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from reconciler.backends.base import KernelError
    from reconciler.backends.iptables import kernel

    def fake_restore(script: str) -> None:
        tool = tmp_path / "iptables-fake-restore"
        tool.write_text("#!/bin/sh\ncat >/dev/null\n" + script)
        tool.chmod(0o755)
        monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")

    lines = ["*filter", "-A RECONCILER-X -j ACCEPT", "COMMIT", "*nat", "-A RECONCILER-Y -j ACCEPT", "COMMIT"]
    fake_restore('echo "Another app is currently holding the xtables lock. Stopped waiting after 5s." >&2; exit 4\n')
    with pytest.raises(KernelError) as exc:
        kernel.restore("iptables", "fake", lines)
    assert "nothing was committed (it did not get the xtables lock)" in str(exc.value)
    assert "--- input ---" not in str(exc.value)  # (nothing of it was read)
    assert not exc.value.partial  # (nothing of ours in the kernel: drift found next is somebody else's)
    fake_restore("kill -9 $$\n")
    with pytest.raises(KernelError, match="failed: killed by signal 9") as exc:
        kernel.restore("iptables", "fake", lines)
    assert exc.value.partial  # (which tables it committed is not known)
    fake_restore('echo "iptables-restore: line 5 failed" >&2; exit 1\n')
    with pytest.raises(KernelError, match="committed before it failed: table filter") as exc:
        kernel.restore("iptables", "fake", lines)
    assert exc.value.partial


def test_the_rule_hot_path_parses_as_the_general_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Lines as iptables-save writes them take _add_simple_rule; whatever it takes or declines,
    the result (or the error) is what the general tokenizer gives."""
    import random

    from reconciler.backends.iptables import save

    lines = [
        '-A X -p tcp -m comment --comment "ns/web:http/TCP" -m tcp -j DNAT --to-destination 10.0.0.1:80',
        '-A X -m comment --comment "ns/web:http cluster IP" -j Y',
        "-A X -j Y", "-A  X   -j   Y  ", "-A X\t-j Y", '-A X -m comment --comment "" -j Y',
        '-A X -m comment --comment "a"b -j Y', '-A X -m comment --comment a"b c" -j Y',
        '-A X -m comment --comment "a" --comment "b"', '-A X -m comment --comment "a\\"b"',
        '-A X -m comment --comment "é" -j Y', "-A Z -j Y", '-A X -m comment --comment "unclosed',
        "-A X -s 10.0.0.0/8\x0b-j Y", "[1:2] -A X -j Y", '-A X "quoted"', "-A Y",
    ]
    rng = random.Random(7)
    alphabet = ["a", "-j", "Y", '"', "\\", " ", "  ", "\t", "x", "/", ":", "\xa0", "é", "-m"]
    lines += ["-A X " + "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 10))) for _ in range(3000)]

    def parsed(line: str) -> object:
        try:
            rs = save.parse_save(f"*nat\n:X - [0:0]\n:Y - [0:0]\n{line}\nCOMMIT\n")
        except save.ParseError as exc:
            return str(exc)
        return {name: chain.rules for name, chain in rs["nat"].chains.items()}

    taken = []
    real = save._add_simple_rule

    def recording(table, line):
        taken.append(real(table, line))
        return taken[-1]

    monkeypatch.setattr(save, "_add_simple_rule", recording)
    fast = [parsed(line) for line in lines]
    assert taken[:2] == [True, True] and sum(taken) > 500  # the common shapes do take it
    monkeypatch.setattr(save, "_add_simple_rule", lambda table, line: False)
    assert [parsed(line) for line in lines] == fast


def test_reading_all_tables_keeps_ours_and_passes_over_the_others(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from reconciler.backends.iptables import kernel
    from reconciler.backends.iptables.observed import read_our_tables

    args, out = tmp_path / "args", tmp_path / "out"
    mangle = "*mangle\n:KUBE-IPTABLES-HINT - [0:0]\n-A PREROUTING this is no rule at all\nCOMMIT\n"
    out.write_text(mangle + "*nat\n:PREROUTING ACCEPT [0:0]\n:OPS - [0:0]\n:RECONCILER-SERVICES - [0:0]\n"
                   '-A PREROUTING -m comment --comment "service-reconciler service portals" -j RECONCILER-SERVICES\n'
                   "-A PREROUTING -s 192.0.2.1/32 -j RECONCILER-SERVICES\n-A PREROUTING -j OPS\n"
                   "-A OPS -s 192.0.2.0/24 -j RECONCILER-SERVICES\n-A OPS -j RETURN\n"
                   "[0:0] -A OPS -s 192.0.2.2/32 -j RECONCILER-SERVICES\n"
                   "-A RECONCILER-SERVICES -j RETURN\nCOMMIT\n"
                   "*filter\n:INPUT ACCEPT [0:0]\n:OTHER - [0:0]\n-A OTHER -j ACCEPT\nCOMMIT\n")
    _fake_save(tmp_path, monkeypatch, f'echo "$@" > {args}\ncat {out}\n')
    tables = kernel.read_save("iptables", "fake", read_our_tables)
    assert args.read_text().strip() == ""  # one save of all tables, no -t
    assert set(tables) == {"nat", "filter"} and tables["filter"].empty
    assert [r.args for r in tables["nat"].chains["RECONCILER-SERVICES"]] == [("-j", "RETURN")]
    assert [r.target for r in tables["nat"].jumps] == ["RECONCILER-SERVICES"]
    # the rules of others that jump to ours (in a built-in chain without our comment, or in their chain)
    assert [r.to_text(counters=False) for r in tables["nat"].foreign] == [
        "-A PREROUTING -s 192.0.2.1/32 -j RECONCILER-SERVICES", "-A OPS -s 192.0.2.0/24 -j RECONCILER-SERVICES",
        "-A OPS -s 192.0.2.2/32 -j RECONCILER-SERVICES"]
    # an error in a table of ours names its line, counted over the whole output
    out.write_text(mangle + "*nat\n-A RECONCILER-Y -j ACCEPT\nCOMMIT\n")
    with pytest.raises(ParseError, match="line 6: rule for undeclared chain"):
        kernel.read_save("iptables", "fake", read_our_tables)


def test_quoting_target_and_comment_on_random_rules() -> None:
    """to_text() survives iptables-restore's tokenizer for any arguments, and target / comment
    read the (option, value) pairs as iptables does: the value of a free-text option, -m, -j or
    -g is never taken for an option."""
    import random

    valued = {"--comment", "--log-prefix", "-j", "--jump", "-g", "--goto", "-m", "--match"}

    def pairs(args):
        i = 0
        while i < len(args):
            if args[i] in valued:
                yield args[i], args[i + 1] if i + 1 < len(args) else None
                i += 2
            else:
                yield args[i], None
                i += 1

    def reference(args):
        target = next((v for o, v in pairs(args) if o in ("-j", "--jump", "-g", "--goto")), None)
        seen, comment = False, None
        for o, v in pairs(args):
            if o in ("-m", "--match") and v == "comment":
                seen = True
            elif o == "--comment" and seen:
                comment = v
                break
        return target, comment

    rng = random.Random(3)
    words = ["-j", "-g", "-m", "comment", "--comment", "--log-prefix", "ACCEPT", "a b", "", '"', "x\\y",
             "it's", "10.0.0.1:80", "ns/web:http", "\t", "-p", "tcp"]
    for _ in range(5000):
        args = tuple(rng.choice(words) for _ in range(rng.randint(0, 9)))
        rule = Rule("C", args)
        assert Rule.from_text(rule.to_text()) == rule, args
        assert (rule.target, rule.comment) == reference(args), args


# --------------------------------------------------------------------------- flavour detection


@pytest.mark.parametrize("nft_installed", [True, False])
@pytest.mark.parametrize("hint", ["KUBE-IPTABLES-HINT", "KUBE-KUBELET-CANARY", None])
def test_nft_hint_is_asked_read_only(monkeypatch, nft_installed, hint):
    """With nft: `nft list chain FAMILY mangle CHAIN` per hint chain, nothing else. Without it: a save of
    mangle, searched for the chains. (Real kernels: tests/e2e/test_iptables_switch.py.)"""
    from reconciler.backends.iptables import kernel

    calls: list[list[str]] = []

    def run_tool(argv, stdin=None):
        calls.append(argv)
        if argv[0] == "/usr/sbin/nft":
            return subprocess.CompletedProcess(argv, 0 if argv[-1] == hint else 1, "", "")
        save = "*mangle\n:PREROUTING ACCEPT [0:0]\n" + (f":{hint} - [0:0]\n" if hint else "") + "COMMIT\n"
        return subprocess.CompletedProcess(argv, 0, save, "")

    monkeypatch.setattr(kernel, "run_tool", run_tool)
    monkeypatch.setattr(kernel.shutil, "which",
                        lambda name: None if name == "nft" and not nft_installed else f"/usr/sbin/{name}")
    assert kernel._has_nft_hint("ip6tables", "ip6") is (hint is not None)
    if nft_installed:
        assert calls and all(c[:4] == ["/usr/sbin/nft", "list", "chain", "ip6"] and c[4] == "mangle" for c in calls)
    else:
        assert calls == [["ip6tables-nft-save", "-t", "mangle"]]


@pytest.mark.parametrize("stderr,committed", [
    # recorded from iptables-nft-restore and iptables-legacy-restore 1.8.9: filter was committed
    ("iptables-nft-restore v1.8.9 (nf_tables): Chain 'NOPE-X' does not exist\nError occurred at line: 8",
     "iptables: committed before it failed: table filter; not the rest"),
    ("iptables-restore v1.8.9 (legacy): Couldn't load target `NOPE-X':No such file or directory\n\n"
     "Error occurred at line: 7", "iptables: committed before it failed: table filter; not the rest"),
    ("iptables-restore: line 2 failed", "iptables: nothing was committed"),
    ("iptables-restore: out of memory", "iptables: which of its tables were committed is not known"),
])
def test_a_failed_restore_says_which_tables_it_had_committed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              stderr: str, committed: str) -> None:
    """Each table commits at its COMMIT line: a restore failing in the second table has changed the
    first, and the error says so (the kernel is then half-way: the next apply or sync finishes it)."""
    from reconciler.backends.base import KernelError
    from reconciler.backends.iptables import kernel

    (tmp_path / "err").write_text(stderr + "\n")
    tool = tmp_path / "iptables-fake-restore"
    tool.write_text(f"#!/bin/sh\ncat >/dev/null\ncat {tmp_path / 'err'} >&2\nexit 2\n")
    tool.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    lines = ["*filter", ":RECONCILER-A - [0:0]", "-A RECONCILER-A -j RETURN", "COMMIT",
             "*nat", ":RECONCILER-B - [0:0]", "-A RECONCILER-B -j NOPE-X", "COMMIT"]
    with pytest.raises(KernelError) as failed:
        kernel.restore("iptables", "fake", lines)
    assert committed in str(failed.value)


def test_a_failed_ip6tables_restore_says_the_iptables_one_was_applied(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from reconciler.backends.base import KernelError
    from reconciler.backends.iptables import backend, kernel
    from reconciler.backends.iptables.diff import diff
    from reconciler.backends.iptables.render import IptablesModel, render

    for cmd, code in (("iptables", 0), ("ip6tables", 2)):
        tool = tmp_path / f"{cmd}-legacy-restore"
        tool.write_text(f"#!/bin/sh\ncat >/dev/null\necho 'Error occurred at line: 2' >&2\nexit {code}\n")
        tool.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(kernel, "binary", lambda cmd, flavour, tool: str(tmp_path / f"{cmd}-legacy-{tool}"))
    from tests.unit.test_iptables_render import example_state  # (a dual-stack state: both families)
    ops = diff(render(example_state()), IptablesModel())
    assert {op.name.split()[0] for op in ops} == {"iptables", "ip6tables"}
    with pytest.raises(KernelError, match=r"(?s)ip6tables: nothing was committed.*"
                                          r"before it, the iptables restore was applied in full"):
        backend.IptablesBackend(flavour="legacy").apply(ops)
