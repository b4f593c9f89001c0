"""The decode worker: owns a paged KV pool and runs the continuous-batching loop."""
