"""service-reconciler: Kubernetes Services and EndpointSlices -> kernel load-balancing state.

Pipeline (one module per stage):
    sources/  -> SourceObject records (Service, EndpointSlice, Node) with their file locations
    desired   -> the canonical, backend-neutral DesiredState (all Kubernetes semantics decided here)
    backends/ -> render(DesiredState) -> kernel model; observe() -> kernel model; apply(plan)
    diff/plan -> minimal ordered operations, printed for people or machines
"""

__version__ = "0.1.0"


def quiet_library_loggers() -> None:
    """-v is our debug output: the root logger's handlers pass the libraries' records only from
    warnings up (pyroute2 logged every netlink message of each generation read, and sets its
    own loggers' levels when imported; asyncio its selector), urllib3's only from errors (it warns
    of every retry of a connection the API server refused, which the informers' own warning says
    once per attempt)."""
    import logging

    least = {"kubernetes": logging.WARNING, "watchfiles": logging.WARNING, "pyroute2": logging.WARNING,
             "asyncio": logging.WARNING, "urllib3": logging.ERROR}

    def passes(record: logging.LogRecord) -> bool:
        return record.levelno >= least.get(record.name.partition(".")[0], 0)

    for handler in logging.getLogger().handlers:
        handler.addFilter(passes)
