"""Who may call whom: the cluster's keys (``keys``), member identities and their certificates (``identity``,
``certs``, ``cluster_tls``), the caller check every internal server runs (``interceptor``) and the credentials a
process holds (``auth``). The trust model is in ``auth``'s docstring.

A leaf: it imports no other package of kvserve, so the layers that check callers or sign records (``transfer``,
``cluster_state``, ``rpc``, the services, the launcher) all import it, and none of them imports another to get it.
"""
