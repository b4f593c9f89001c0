"""gRPC plumbing the three services share: server set-up (aio, health, reflection, TLS), the engine-loop
thread, proto converters, request validation and service flags. Who may call whom is ``security``.

Nothing here is user-facing: ``kvserve/`` (CLI, client, launcher) builds on it, never the other way round.
"""
