"""service-reconciler: Kubernetes Services and EndpointSlices -> kernel load-balancing state.

Pipeline (one module per stage):
    sources/  -> SourceObject records (Service, EndpointSlice, Node) with their file locations
    desired   -> the canonical, backend-neutral DesiredState (all Kubernetes semantics decided here)
    backends/ -> render(DesiredState) -> kernel model; observe() -> kernel model; apply(plan)
    diff/plan -> minimal ordered operations, printed for people or machines
"""

__version__ = "0.1.0"
