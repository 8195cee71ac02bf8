"""Engine start-up: process start -> ready (weights, KV sizing, kernel warm-up, CUDA graphs), in this process.
Run it twice on a machine: the first start compiles every Triton kernel (cold), later ones load them from
Triton's cache (~/.triton/cache).      python -m benchmarks.startup --shape qwen3-0.6b"""
import time

T0 = time.perf_counter()

import argparse  # noqa: E402
import logging  # noqa: E402

from benchmarks.common import write_shape  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shape", default="qwen3-0.6b")
    ap.add_argument("--cprofile", action="store_true", help="print where the start-up's Python time goes")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(relativeCreated)7.0f ms %(name)s: %(message)s")
    from kestrel import LLM

    if args.cprofile:
        import cProfile
        import pstats
        prof = cProfile.Profile()
        prof.enable()
    llm = LLM(str(write_shape(args.shape)), load_format="dummy", dtype="bfloat16", max_num_seqs=256,
              max_num_batched_tokens=16384, enable_prefix_caching=False, progress=False)
    if args.cprofile:
        prof.disable()
        pstats.Stats(prof).sort_stats("cumtime").print_stats(45)
    print(f"start-up {args.shape}: {time.perf_counter() - T0:.1f} s (graph capture "
          f"{llm.engine.core.executor.runner.graph_capture_seconds:.1f} s)")


if __name__ == "__main__":
    main()
