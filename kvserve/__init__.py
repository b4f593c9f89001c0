"""What users touch: the ``kvserve`` command line, benchmarks and (soon) the client library."""
