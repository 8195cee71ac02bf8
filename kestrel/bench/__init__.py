"""`kestrel bench throughput | latency | serve`: benchmarks that work as installed (benchmarks/ holds the
GPU-shape scripts of docs/benchmarks.md)."""
