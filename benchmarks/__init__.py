"""GPU benchmarks on random-weight model shapes (docs/benchmarks.md). Each is a module run from the repository root,
`python -m benchmarks.NAME --help`, and imports its shared pieces as `from benchmarks.common import ...`;
`python -m benchmarks.suite --help` lists the stages that run them on the GPU machine."""
