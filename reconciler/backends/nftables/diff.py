"""Ruleset (desired) vs Ruleset (observed) -> the minimal ordered `nft -f` operations.

Objects are compared one by one (a chain by its rules, a set by its elements), so a change to one
service port touches only that service port's chains and elements. Order inside the transaction:
create tables, sets and chains; flush chains that change or go away; replace recreated sets;
update elements; fill chains; delete what is gone (nothing references it any more by then).
"""

from __future__ import annotations

from ..base import Operation
from .objects import Chain, NftSet, Ruleset, Table, element_text

_PREFIXES = ("svc-", "ext-", "ep-", "aff-")


def owner(name: str) -> str | None:
    """The service port id a per-service object belongs to: ep-ns/web/http/tcp/… -> ns/web:http/TCP."""
    for p in _PREFIXES:
        if name.startswith(p):
            parts = name[len(p):].split("/")
            if len(parts) >= 4:
                return f"{parts[0]}/{parts[1]}:{parts[2]}/{parts[3].upper()}"
    return None


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
        if old is not None and old.rules:
            flush.append(Operation("~", "chain", obj, f"flush chain {t} {name}", svc))
        for rule in c.rules:
            fill.append(Operation("+", "rule", obj, f"add rule {t} {name} {rule}", svc))
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


def script(ops: list[Operation]) -> str:
    """The `nft -f` text for ops; consecutive element operations on one set become one command."""
    lines: list[str] = []
    batch_head: str | None = None
    batch: list[str] = []

    def flush_batch() -> None:
        nonlocal batch_head, batch
        if batch_head is not None:
            lines.append(f"{batch_head} {{ {', '.join(batch)} }}")
        batch_head, batch = None, []

    for op in ops:
        if op.kind == "element":
            head, _, body = op.text.partition(" { ")
            if head != batch_head or len(batch) >= 1000:
                flush_batch()
                batch_head = head
            batch.append(body[:-2])
        else:
            flush_batch()
            lines.append(op.text)
    flush_batch()
    return "\n".join(lines) + ("\n" if lines else "")
