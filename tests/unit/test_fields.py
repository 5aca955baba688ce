"""reconciler/fields.py: its catalog is Kubernetes v1.36's (as the API's OpenAPI schema, shipped
by kubernetes-validate, has it), and what it says of a field it does not know."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest

from reconciler import fields

# what is not looked into although the API types it: a Node's spec and status (we read only its
# labels and status.addresses)
NOT_DESCENDED = {"Node.spec", "Node.status"}


def schema(file: str) -> tuple[dict[str, Any], dict[str, Any]]:
    kv = pytest.importorskip("kubernetes_validate")
    root = os.path.join(os.path.dirname(kv.__file__), "kubernetes-json-schema", "v1.36.0-local")
    if not os.path.isdir(root):
        pytest.skip(f"kubernetes-validate {kv.__version__} ships no v1.36.0 schemas")
    with open(os.path.join(root, file)) as fh:
        top = json.load(fh)
    with open(os.path.join(root, "_definitions.json")) as fh:
        return top, json.load(fh)["$defs"]


def typed(prop: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any] | None:
    """The object type a property holds (itself, or as list items), if it is one with fields."""
    ref = prop.get("$ref") or prop.get("items", {}).get("$ref")
    target = defs[ref.rsplit("/", 1)[1]] if ref else None
    return target if target is not None and target.get("properties") else None


def compare(t: fields.Type, obj: dict[str, Any], defs: dict[str, Any], where: str) -> None:
    assert t.fields == set(obj["properties"]), where
    for name, prop in obj["properties"].items():
        target = typed(prop, defs)
        if name in t.nested:
            assert target is not None, f"{where}.{name}"
            compare(t.nested[name], target, defs, f"{t.name}.{name}")
        else:  # a scalar, a free-form map, or what we leave alone
            assert target is None or f"{t.name}.{name}" in NOT_DESCENDED, f"{where}.{name} is not checked"


@pytest.mark.parametrize("type_, file", [(fields.SERVICE, "service-v1.json"),
                                         (fields.ENDPOINT_SLICE, "endpointslice-discovery-v1.json"),
                                         (fields.NODE, "node-v1.json")], ids=["Service", "EndpointSlice", "Node"])
def test_the_catalog_holds_the_fields_of_kubernetes_v1_36(type_: fields.Type, file: str) -> None:
    top, defs = schema(file)
    compare(type_, top, defs, type_.name)


def test_an_unknown_field_is_found_wherever_it_is_and_named_with_what_it_likely_misspells() -> None:
    body = {"apiVersion": "v1", "kind": "Service", "metadta": {}, "metadata": {"name": "a", "labels": {"x": "y"}},
            "spec": {"ports": [{"port": 80}, {"port": 81, "nodeport": 30001}], "selector": {"any": "key"},
                     "sessionAffinityConfig": {"clientIP": {"timeout": 5}}}}
    assert fields.unknown_fields(body, fields.SERVICE) == (
        ("metadta",), ("spec", "ports", 1, "nodeport"), ("spec", "sessionAffinityConfig", "clientIP", "timeout"))
    assert fields.field_type(fields.SERVICE, ("spec", "ports", 1, "nodeport")) is fields.SERVICE_PORT
    assert fields.unknown_field_message(fields.SERVICE_PORT, "nodeport") == (
        "unknown field of ServicePort, ignored (did you mean nodePort?); kubectl's strict field validation would "
        "refuse it")
    assert "did you mean" not in fields.unknown_field_message(fields.CLIENT_IP_CONFIG, "timeout")
    assert fields.unknown_fields({"spec": "x", "status": None}, fields.SERVICE) == ()  # (its reader refuses "x")
