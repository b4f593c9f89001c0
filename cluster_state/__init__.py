"""What Redis holds about the cluster, and how it is read and written.

``registry`` is the client (workers, leases, the prefix index), over one ``redis_link`` that rides out
outages; ``workers`` and ``worker_reader`` are the signed worker records, ``heartbeat`` keeps them alive,
``lease`` is the whole lease (the signed grant, its record in Redis, its end and deletion), and
``prefix_index`` with its ``publisher`` says which worker holds which block. Redis is advisory: no request
depends on it. This package sits beside ``rpc`` and ``transfer`` and imports neither (``security.auth`` only for
type hints: callers pass their credentials in).
"""
