"""What users touch: the ``kvserve`` command line, the client library (``Client``, ``AsyncClient``), the local
cluster launcher and the benchmarks (``kvserve.bench``)."""

from kvserve.client import AsyncClient, Client

__all__ = ["AsyncClient", "Client"]
