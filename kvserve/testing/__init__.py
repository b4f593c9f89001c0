"""What tests, benchmarks and ``kvserve model random`` build on, never a serving process: separate "hosts" in
network namespaces (``netns``), a cluster across them (``multihost``), random-weight models of real shapes
(``random_model``)."""
