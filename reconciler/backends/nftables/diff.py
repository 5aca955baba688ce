"""Ruleset (desired) vs Ruleset (observed) -> the minimal ordered `nft -f` operations.

Objects are compared one by one (a chain by its rules, a set by its elements), so a change to one
service port touches only that service port's chains and elements. Order inside the transaction:
create tables, sets and chains; flush chains that change or go away; replace recreated sets;
update elements; fill chains; delete what is gone (nothing references it any more by then).
"""

from __future__ import annotations

import re

from ..base import Operation, SpooledInput
from .objects import FAMILIES, TABLE, Chain, NftSet, Ruleset, Table, element_text

_PREFIXES = ("svc-", "ext-", "ep-", "aff-")


def owner(name: str) -> str | None:
    """The service port id a per-service object belongs to: ep-ns/web/http/tcp/… -> ns/web:http/TCP."""
    for p in _PREFIXES:
        if name.startswith(p):
            parts = name[len(p):].split("/")
            if len(parts) >= 4:
                return f"{parts[0]}/{parts[1]}:{parts[2]}/{parts[3].upper()}"
    return None


def services_of_deleted_tables(observed: Ruleset, ops: list[Operation]) -> set[str]:
    """The service ports whose objects go with the tables `ops` delete whole (a shard table whose
    last service port goes, or all of ours): a `delete table` names no service port itself, so
    these are read from the table as `observed` holds it: its per-service chains' owners and its
    elements' comments."""
    out: set[str] = set()
    for op in ops:
        if op.kind != "table" or op.action != "-" or (table := observed.tables.get(op.name)) is None:
            continue
        out.update(sid for sid in map(owner, table.chains) if sid is not None)
        for s in table.sets.values():
            out.update(comment for _, comment in s.elements.values() if comment and ":" in comment)
    return out


def _chain_def(t: Table, c: Chain) -> str:
    spec = f" {{ {c.base.text()} }}" if c.base else ""
    return f"add chain {t.ref} {c.name}{spec}"


def _set_def(t: Table, s: NftSet) -> str:
    return f"add {s.kind} {t.ref} {s.name} {s.definition()}"


def _elements(s: NftSet, keys: list[str]) -> list[tuple[str, str | None]]:
    return [(element_text(k, *s.elements[k]), s.elements[k][1]) for k in keys]


def diff(desired: Ruleset, observed: Ruleset) -> list[Operation]:
    ops: list[Operation] = []
    for ref in sorted(set(observed.tables) - set(desired.tables)):
        ops.append(Operation("-", "table", ref, f"delete table {ref}"))
    for ref in sorted(desired.tables):
        want = desired.tables[ref]
        have = observed.tables.get(ref)
        if have is not want:  # the same object: the renderer did not touch it since it was applied
            ops += _diff_table(want, have)
    return ops


def _diff_table(want: Table, have: Table | None) -> list[Operation]:
    t = want.ref
    create: list[Operation] = []
    flush: list[Operation] = []
    set_delete: list[Operation] = []
    set_create: list[Operation] = []
    elems: list[Operation] = []
    fill: list[Operation] = []
    delete: list[Operation] = []
    have_chains = have.chains if have else {}
    have_sets = have.sets if have else {}
    if have is None:
        create.append(Operation("+", "table", t, f"add table {t}"))
    elif have.flags != want.flags:  # `add table` clears them (dormant switches off every hook)
        create.append(Operation("~", "table", t, f"add table {t}"))

    for name in sorted(want.sets):
        s, old = want.sets[name], have_sets.get(name)
        obj = f"{t} {s.kind} {name}"
        if old is not None and old.spec() == s.spec() and old.kind == s.kind:
            if s.dynamic or old.elements == s.elements:
                continue
            gone = sorted(k for k in old.elements if old.elements[k] != s.elements.get(k))
            new = sorted(k for k in s.elements if s.elements[k] != old.elements.get(k))
            for k in gone:
                elems.append(Operation("-", "element", obj, f"delete element {t} {name} {{ {k} }}",
                                       old.elements[k][1]))
            for text, comment in _elements(s, new):
                elems.append(Operation("+", "element", obj, f"add element {t} {name} {{ {text} }}", comment))
            continue
        if old is not None:
            set_delete.append(Operation("-", old.kind, f"{t} {old.kind} {name}", f"delete {old.kind} {t} {name}",
                                        owner(name)))
        set_create.append(Operation("+", s.kind, obj, _set_def(want, s), owner(name)))
        for text, comment in _elements(s, sorted(s.elements)):
            set_create.append(Operation("+", "element", obj, f"add element {t} {name} {{ {text} }}", comment))
    recreated = {name for name in want.sets if name in have_sets and
                 (have_sets[name].spec() != want.sets[name].spec() or have_sets[name].kind != want.sets[name].kind)}
    for name in sorted(set(have_sets) - set(want.sets)):
        old = have_sets[name]
        set_delete.append(Operation("-", old.kind, f"{t} {old.kind} {name}", f"delete {old.kind} {t} {name}",
                                    owner(name)))

    def references_recreated(c: Chain) -> bool:
        return any(f"@{n} " in r + " " for n in recreated for r in c.rules)

    for name, c in want.chains.items():
        old = have_chains.get(name)
        if old is c or (old is not None and old.base == c.base and old.rules == c.rules and not recreated):
            continue
        obj = f"{t} chain {name}"
        svc = owner(name)
        if old is not None and old.base != c.base:
            flush.append(Operation("~", "chain", obj, f"flush chain {t} {name}", svc))
            delete.append(Operation("-", "chain", obj, f"delete chain {t} {name}", svc))
            old = None
            fill.append(Operation("+", "chain", obj, _chain_def(want, c), svc))
        elif old is None:
            create.append(Operation("+", "chain", obj, _chain_def(want, c), svc))
        if old is not None and old.rules == c.rules and not references_recreated(old):
            continue
        held: frozenset[str] = frozenset()
        if old is not None and old.rules:
            held, wanted = frozenset(old.rules), frozenset(c.rules)
            flush.append(Operation("~", "chain", obj, f"flush chain {t} {name}", svc,
                                   drops=tuple(r for r in old.rules if r not in wanted)))
        for rule in c.rules:
            fill.append(Operation("+", "rule", obj, f"add rule {t} {name} {rule}", svc, restates=rule in held))
    for name in sorted(have_chains.keys() - want.chains.keys()):
        obj = f"{t} chain {name}"
        if have_chains[name].rules:
            flush.append(Operation("~", "chain", obj, f"flush chain {t} {name}", owner(name)))
        delete.append(Operation("-", "chain", obj, f"delete chain {t} {name}", owner(name)))
    create.sort(key=lambda op: (op.kind != "table", op.text))
    flush.sort(key=lambda op: op.text)
    fill.sort(key=lambda op: op.name)  # stable: a chain's rules keep their order
    # A recreated base chain is deleted before it is added again.
    fill = [op for op in fill if op.kind == "chain"] + [op for op in fill if op.kind != "chain"]
    late_delete = [op for op in delete if not any(f.kind == "chain" and f.name == op.name for f in fill)]
    early_delete = [op for op in delete if op not in late_delete]
    return create + flush + early_delete + set_delete + set_create + elems + fill + late_delete


_COMMAND = re.compile(r"(add|delete|flush) (table|chain|rule|set|map|element) (\S+) (\S+)(?: (\S+))?(?: |$)")
_OUR_TABLE = re.compile(rf"{TABLE}(?:-\d\d)?")
# the commands diff() makes, by verb and kind: the actions they are planned as, and whether the
# command goes on after the object's name (a rule's body, a definition, elements)
_MADE = {("add", "table"): (("+", "~"), False), ("delete", "table"): (("-",), False),
         ("add", "chain"): (("+",), None), ("flush", "chain"): (("~",), False), ("delete", "chain"): (("-",), False),
         ("add", "rule"): (("+",), True), ("add", "set"): (("+",), True), ("delete", "set"): (("-",), False),
         ("add", "map"): (("+",), True), ("delete", "map"): (("-",), False),
         ("add", "element"): (("+",), True), ("delete", "element"): (("-",), True)}


def foreign(op: Operation) -> str | None:
    """Why an operation is not one diff() makes (see Backend.foreign): one command, on one of our
    tables, of the kind, action and object the operation names."""
    m = _COMMAND.match(op.text)
    if m is None or "\n" in op.text or "\r" in op.text or _outside_braces(op.text, ";"):
        return f"not one nft command of ours: {op.text!r}"
    verb, kind, family, table, name = m.groups()
    if family not in FAMILIES.values() or not _OUR_TABLE.fullmatch(table):
        return f"table {family} {table} is not ours"
    made = _MADE.get((verb, kind))
    if made is None or op.kind != kind or op.action not in made[0]:
        return f"a {op.kind} operation ({op.action}) is not made as {verb} {kind}: {op.text!r}"
    if kind == "table":
        about, name = f"{family} {table}", None
    elif name is None:
        return f"not one nft command of ours: {op.text!r}"
    else:
        holder = {"chain": "chain", "rule": "chain", "set": "set", "map": "map"}.get(kind)
        if holder is None:  # (an element, of the set or map the operation names)
            holder = "map" if op.name.startswith(f"{family} {table} map ") else "set"
        about = f"{family} {table} {holder} {name}"
    if op.name != about:
        return f"its command is about {about}, not {op.name!r}"
    rest = op.text[len(f"{verb} {kind} {family} {table}" + (f" {name}" if name else "")):]  # ("" or " …")
    if made[1] is False and rest or made[1] is True and not rest \
            or made[1] is None and rest and not (rest.startswith(" {") and rest.endswith("}")):
        return f"not one nft command of ours: {op.text!r}"
    return None


def _outside_braces(text: str, char: str) -> bool:
    depth = 0
    for c in text:
        depth += (c == "{") - (c == "}")
        if c == char and depth == 0:
            return True
    return False


_SET_REF = re.compile(r"@([^\s,{}]+)")
_ELEMENT_BATCH = 1000


def script(ops: list[Operation], model: Ruleset | None = None, out: SpooledInput | None = None) -> str:
    """The `nft -f` text for ops: one transaction; consecutive element operations on one set
    become one command.

    With `model` (the desired Ruleset the ops were planned from) the text is also written so that
    nft need not read the ruleset before it can check it: before an `add rule` or `add element`,
    nft 1.0 fetches every chain, set and object of every table (at 10k services most of a small
    sync's time). A service chain's rules become one `add chain T C { … }` block, preceded by the
    definitions of the named sets its rules use; elements are added as `add map T M { type …;
    elements = { … }; }`. Both only ever name objects exactly as they exist (or are created in
    this same transaction), so the kernel result is the same as the plain commands'. Base chains,
    interval sets and deletions keep the plain form.

    With `out`, the text is written there as it is made (and "" returned): a big transaction's
    is never one string.
    """
    writer = _ScriptWriter(model, out)
    for op in ops:
        writer.add(op)
    return writer.text()


class _ScriptWriter:
    def __init__(self, model: Ruleset | None, out: SpooledInput | None = None) -> None:
        self.model = model
        self.out = out
        self.lines: list[str] = []  # (without `out`)
        self.head: str | None = None  # the open batch: a command head plus its items
        self.items: list[str] = []
        self.tail = ""
        self.block = False  # the batch is a chain block (one rule per line), else a list
        self.declared: set[tuple[str, str]] = set()
        self._chains: dict[str, tuple[Table, str, str] | None] = {}  # op.name -> its table, rule prefix, head
        self._sets: dict[str, NftSet | None] = {}  # op.name -> the set

    def add(self, op: Operation) -> None:
        if op.kind == "element":
            head, _, body = op.text.partition(" { ")
            head, item, tail = head + " {", body[:-2], " }"
            s = self._set(op) if op.action == "+" else None
            if s is not None and "interval" not in s.flags and not s.dynamic:
                t = op.name.rsplit(" ", 2)[0]
                head, tail = f"add {s.kind} {t} {s.name} {{ {s.properties()} elements = {{", " }; }"
                self.declared.add((t, s.name))
            self._item(head, item, tail, _ELEMENT_BATCH)
        elif op.kind == "rule" and op.action == "+" and (block := self._chain_block(op)) is not None:
            head, rule = block
            self._item(head, rule, "\n}", None, block=True)
        else:
            if op.kind in ("set", "map") and op.action == "+":
                self.declared.add(tuple(op.name.split(f" {op.kind} ")))  # type: ignore[arg-type]
            self._close()
            self._line(op.text)

    def text(self) -> str:
        self._close()
        return "\n".join(self.lines) + ("\n" if self.lines else "")

    def _line(self, line: str) -> None:
        if self.out is not None:
            self.out.write(line + "\n")
        else:
            self.lines.append(line)

    def _item(self, head: str, item: str, tail: str, limit: int | None, block: bool = False) -> None:
        if head != self.head or (limit is not None and len(self.items) >= limit):
            self._close()
            self.head, self.tail, self.block = head, tail, block
        self.items.append(item)

    def _close(self) -> None:
        if self.head is not None:
            if self.block:
                self._line(self.head + "".join("\n\t" + rule for rule in self.items) + self.tail)
            else:
                self._line(f"{self.head} {', '.join(self.items)}{self.tail}")
        self.head, self.items = None, []

    def _table(self, op: Operation) -> Table | None:
        family, table = op.name.split(" ", 2)[:2]
        return self.model.tables.get(f"{family} {table}") if self.model is not None else None

    def _set(self, op: Operation) -> NftSet | None:
        if op.name not in self._sets:
            table = self._table(op)
            self._sets[op.name] = table.sets.get(op.name.rsplit(" ", 1)[1]) if table is not None else None
        return self._sets[op.name]

    def _chain_block(self, op: Operation) -> tuple[str, str] | None:
        """(`add chain T C {`, rule) for a rule of a regular chain whose sets the model defines."""
        if op.name not in self._chains:  # (looked up once per chain: a cold start adds ~120k rules)
            table, found = self._table(op), None
            if table is not None:
                name = op.name.split(" chain ", 1)[1]
                chain = table.chains.get(name)
                if chain is not None and chain.base is None:
                    found = (table, f"add rule {table.ref} {name} ", f"add chain {table.ref} {name} {{")
            self._chains[op.name] = found
        found = self._chains[op.name]
        if found is None or not op.text.startswith(found[1]):
            return None
        table, prefix, head = found
        rule = op.text[len(prefix):]
        refs = _SET_REF.findall(rule)
        if any(r not in table.sets for r in refs):
            return None
        for r in refs:
            if (table.ref, r) not in self.declared:  # before the block (a block may be split in two)
                self._close()
                self.declared.add((table.ref, r))
                self._line(_set_def(table, table.sets[r]))
        return head, rule
