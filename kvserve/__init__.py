"""What users touch: the client library (``Client``, ``AsyncClient``) and the ``kvserve`` command line (``cli``,
``demo``, ``healthcheck``, ``settings``). Rooms of their own hold the rest: ``launcher`` (the local cluster and its
supervisor), ``bench`` (the benchmarks) and ``testing`` (network namespaces, the multi-host cluster, random
models).

Importing the package loads nothing and sets nothing: ``from kvserve import Client`` loads the client (gRPC, no
torch) on first use, so the launcher can still switch gRPC's fork handlers off before grpc loads
(``kvserve.launcher``)."""

__all__ = ["AsyncClient", "Client"]


def __getattr__(name: str):  # noqa: ANN202 - the client's classes, loaded on first use (PEP 562)
    if name in __all__:
        from kvserve import client

        return getattr(client, name)
    raise AttributeError(f"module 'kvserve' has no attribute {name!r}")
