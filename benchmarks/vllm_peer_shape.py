"""vLLM's side of a shape that /work/shared/peers/vllm/vllm_shapes.py does not list: the same run (256-request
workload + batch 1, dummy weights, max_model_len 4096) on a shape from benchmarks/common.py SHAPES.

    python benchmarks/vllm_peer_shape.py deepseek-v2-lite-dense OUT.json [--peer-dir shared/peers/vllm]"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import SHAPES  # noqa: E402

ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
ap.add_argument("shape", choices=sorted(SHAPES))
ap.add_argument("out")
ap.add_argument("--peer-dir", default="shared/peers/vllm")
args = ap.parse_args()
sys.path.insert(0, args.peer_dir)
import vllm_shapes  # noqa: E402

vllm_shapes.SHAPES.setdefault(args.shape, SHAPES[args.shape])
vllm_shapes.main(args.shape, args.out)
