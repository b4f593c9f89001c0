"""gRPC plumbing the three services share: server set-up (aio, health, reflection, TLS), the engine-loop
thread, proto converters, cluster authentication, request validation and service flags.

Nothing here is user-facing: ``kvserve/`` (CLI, client, launcher) builds on it, never the other way round.
"""
