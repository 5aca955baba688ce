"""The fields of the API types we read, as of Kubernetes v1.36 (the json names of k8s.io/api core/v1
and discovery/v1, and of k8s.io/apimachinery meta/v1), and the check that finds any other field.

A field the API does not have is refused by kubectl's strict field validation, else dropped by the
API server: in a manifest it is most likely a misspelt one (`sessionAfinity`), whose setting is
silently lost. Free-form maps (labels, annotations, selector, a managed field's
fieldsV1) are not descended into, nor is what we never read of a Node (its spec and status).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from .sources.objects import Path


@dataclass(frozen=True)
class Type:
    """An API type: its field names, and the type of each field whose value (an object, or a list
    of objects) is checked too."""

    name: str
    fields: frozenset[str]
    nested: Mapping[str, Type] = field(default_factory=dict)
    # (derived) the fields not descended into: an object with only these needs no more checks
    flat: frozenset[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "flat", self.fields - self.nested.keys())

    def without(self, *names: str) -> Type:
        """This type, not descending into `names` (their caller checks them as it reads them)."""
        return Type(self.name, self.fields, {k: v for k, v in self.nested.items() if k not in names})


def _type(name: str, scalars: str, **nested: Type) -> Type:
    return Type(name, frozenset((*scalars.split(), *nested)), nested)


# meta/v1
OWNER_REFERENCE = _type("OwnerReference", "apiVersion kind name uid controller blockOwnerDeletion")
MANAGED_FIELDS_ENTRY = _type("ManagedFieldsEntry", "manager operation apiVersion time fieldsType fieldsV1 subresource")
OBJECT_META = _type("ObjectMeta", "name generateName namespace selfLink uid resourceVersion generation "
                    "creationTimestamp deletionTimestamp deletionGracePeriodSeconds labels annotations finalizers",
                    ownerReferences=OWNER_REFERENCE, managedFields=MANAGED_FIELDS_ENTRY)
CONDITION = _type("Condition", "type status observedGeneration lastTransitionTime reason message")

# core/v1 Service
SERVICE_PORT = _type("ServicePort", "name protocol appProtocol port targetPort nodePort")
CLIENT_IP_CONFIG = _type("ClientIPConfig", "timeoutSeconds")
SESSION_AFFINITY_CONFIG = _type("SessionAffinityConfig", "", clientIP=CLIENT_IP_CONFIG)
SERVICE_SPEC = _type("ServiceSpec", "selector clusterIP clusterIPs type externalIPs sessionAffinity loadBalancerIP "
                     "loadBalancerSourceRanges externalName externalTrafficPolicy healthCheckNodePort "
                     "publishNotReadyAddresses ipFamilies ipFamilyPolicy allocateLoadBalancerNodePorts "
                     "loadBalancerClass internalTrafficPolicy trafficDistribution",
                     ports=SERVICE_PORT, sessionAffinityConfig=SESSION_AFFINITY_CONFIG)
PORT_STATUS = _type("PortStatus", "port protocol error")
LOAD_BALANCER_INGRESS = _type("LoadBalancerIngress", "ip hostname ipMode", ports=PORT_STATUS)
LOAD_BALANCER_STATUS = _type("LoadBalancerStatus", "", ingress=LOAD_BALANCER_INGRESS)
SERVICE_STATUS = _type("ServiceStatus", "", loadBalancer=LOAD_BALANCER_STATUS, conditions=CONDITION)
SERVICE = _type("Service", "apiVersion kind", metadata=OBJECT_META, spec=SERVICE_SPEC, status=SERVICE_STATUS)

# core/v1 Node: only what we read (its labels and status.addresses) may matter; its spec and
# status are large and not checked
NODE = _type("Node", "apiVersion kind spec status", metadata=OBJECT_META)

# discovery/v1 EndpointSlice
OBJECT_REFERENCE = _type("ObjectReference", "kind namespace name uid apiVersion resourceVersion fieldPath")
ENDPOINT_CONDITIONS = _type("EndpointConditions", "ready serving terminating")
FOR_ZONE = _type("ForZone", "name")
FOR_NODE = _type("ForNode", "name")
ENDPOINT_HINTS = _type("EndpointHints", "", forZones=FOR_ZONE, forNodes=FOR_NODE)
ENDPOINT = _type("Endpoint", "addresses hostname deprecatedTopology nodeName zone",
                 conditions=ENDPOINT_CONDITIONS, targetRef=OBJECT_REFERENCE, hints=ENDPOINT_HINTS)
ENDPOINT_PORT = _type("EndpointPort", "name protocol port appProtocol")
ENDPOINT_SLICE = _type("EndpointSlice", "apiVersion kind addressType", metadata=OBJECT_META,
                       endpoints=ENDPOINT, ports=ENDPOINT_PORT)

_NONE: tuple[Path, ...] = ()


def unknown_fields(value: dict[str, Any], type_: Type) -> tuple[Path, ...]:
    """The paths (relative to `value`, an object of `type_`) of the fields of `value` and of its
    nested objects that their types do not have, in the document's order. Cheap while all are
    known: a look-up per field of `value`, and per nested object a set comparison (C-level), which
    alone decides one without typed objects in it. A value of the wrong shape is its reader's."""
    found: tuple[Path, ...] = _NONE
    known, nested = type_.fields, type_.nested
    for name in value:
        sub = nested.get(name)
        if sub is None:
            if name not in known:
                found += ((name,),)
            continue
        v = value[name]
        if type(v) is dict:
            if not sub.flat.issuperset(v) and (inner := unknown_fields(v, sub)):  # (the usual case inline)
                found += tuple((name, *p) for p in inner)
        elif type(v) is list:
            flat = sub.flat
            for i, item in enumerate(v):
                if type(item) is dict and not flat.issuperset(item) and (inner := unknown_fields(item, sub)):
                    found += tuple((name, i, *p) for p in inner)
    return found


def field_type(root: Type, path: Path) -> Type:
    """The type holding the last field of `path` (a path within a `root` object)."""
    t = root
    for part in path[:-1]:
        if isinstance(part, str):
            t = t.nested[part]
    return t


def unknown_field_message(type_: Type, name: str) -> str:
    """What a warning says of a field `name` that `type_` does not have (and which known field it
    is probably a misspelling of)."""
    return f"unknown field of {type_.name}, ignored{did_you_mean(name, type_.fields)}; kubectl's strict field " \
           "validation would refuse it"


def did_you_mean(name: str, known: Iterable[str]) -> str:
    """' (did you mean X?)' for the known field `name` is probably a misspelling of, else ''."""
    by_lower = {f.lower(): f for f in sorted(known)}
    guess = difflib.get_close_matches(name.lower(), by_lower, n=1, cutoff=0.75)
    return f" (did you mean {by_lower[guess[0]]}?)" if guess else ""
