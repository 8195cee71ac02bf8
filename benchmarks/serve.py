"""Serving load benchmark; the code lives in the package (kestrel/bench/serve.py) so `kestrel bench serve` works
as installed. python -m benchmarks.serve --help"""
import sys

from kestrel.bench.serve import main

if __name__ == "__main__":
    sys.exit(main())
