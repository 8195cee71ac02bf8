"""Stages vLLM 0.26's LLaVA path for the image benchmarks' vLLM server on the GPU machine (the `vsite` stage). Its
pixtral.py imports names that transformers 5.17 (the image's) renamed, so that server runs on transformers 5.5.3,
installed with blake3 and prometheus_fastapi_instrumentator (imported inside functions) from .whl2/
(scripts/device_wheels.sh fills it) into a folder that goes first on the server's PYTHONPATH. transformers 5.5.3
pins tokenizers <= 0.23.0 and the image has 0.23.2: the installed copy's pin is relaxed.

    python -m benchmarks.vllm_site --wheels .whl2 --target DIR"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

TOKENIZERS_PIN = ('"tokenizers>=0.22.0,<=0.23.0"', '"tokenizers>=0.22.0"')
CHECK = ("import transformers, vllm.model_executor.models.llava_next; "
         "print('vLLM LLaVA path imports with transformers', transformers.__version__)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--wheels", type=Path, default=Path(".whl2"))
    ap.add_argument("--target", type=Path, required=True)
    args = ap.parse_args(argv)
    wheels = sorted(args.wheels.glob("*.whl"))
    if not wheels:
        ap.error(f"no wheels in {args.wheels} (bash scripts/device_wheels.sh fills it; carry [\"{args.wheels}\"])")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                    "--no-cache-dir", "--upgrade", "--target", str(args.target), *map(str, wheels)], check=True)
    table = args.target / "transformers" / "dependency_versions_table.py"
    table.write_text(table.read_text().replace(*TOKENIZERS_PIN))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(args.target), os.environ.get("PYTHONPATH"))
                                                       if p)}
    return subprocess.run([sys.executable, "-c", CHECK], env=env).returncode


if __name__ == "__main__":
    sys.exit(main())
