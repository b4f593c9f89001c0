"""Moving KV between processes and hosts.

* ``backend``: the transports by name (``Backend``) and the one function that picks one for a pair of
  workers (``choose_backend``);
* ``interface``: the one interface the prefill side uses to reach a decode worker's pool (``KVTransport``);
  implemented by ``shm``, ``cuda_ipc``, ``grpc_stream`` (which also holds the decode worker's receiving
  end, ``KVReceiver``) and ``nixl`` (which also holds the decode worker's registered pool, ``NixlPool``);
  ``registry`` holds those served here and finds the one a destination's backend names;
* ``blocks``: a pool's blocks as bytes, and the checksum both ends of every hand-off compare.

This process's own pool file is memory, not transfer: ``kvstore.shared_pool``; the KV layout's fingerprint
is ``kvstore.layout``. Importing the package loads none of its modules: ``backend`` needs nothing else, so
the lease check can name a backend without pulling in the transports.
"""
