"""GPU (skipped without CUDA): the tensor-parallel worker path with NCCL. On one GPU, TP = 1 through the mp
executor (a worker process on cuda:0, an NCCL group of one with its start-up all-reduce, CUDA graphs captured in
the worker, the step channel, pipelined decode) gives the tokens of the in-process runner (CUDA graphs too); with
two or more GPUs, TP = 2 gives the tokens of TP = 1 in float32. At TP = 1 the layers take their one-rank paths:
the collectives inside the forward (and NCCL under graph capture) run only in the TP = 2 test."""
import pytest
import torch

from kestrel.config import EngineConfig
from kestrel.engine.frontend import LLMEngine
from tests.tp import greedy, prompts

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory, tiny_tokenizer):
    from tests.tiny import make_checkpoint

    return make_checkpoint("qwen3", tmp_path_factory.mktemp("gpu_tp"), tokenizer=tiny_tokenizer, head_dim=64,
                           hidden_size=256, intermediate_size=512, logit_scale=4.0)


def run(path, tp: int, backend: str, dtype: str = "auto") -> list[list[int]]:
    cfg = EngineConfig.create(model=str(path), dtype=dtype, device="cuda", tensor_parallel_size=tp,
                              distributed_executor_backend=backend, num_kv_blocks=1024, max_num_seqs=16)
    eng = LLMEngine(cfg, progress=False)
    try:
        core, ex = eng.core, eng.core.executor
        assert core.device.type == "cuda" and core.pipelined
        if backend == "uni":
            assert core.runner.graphs is not None and core.runner.graphs.sizes
        else:
            assert type(ex).__name__ == "MPExecutor" and core.runner is None
            assert ex.dist_backend == "nccl"
            assert len(ex.cuda_graph_sizes) == tp and all(ex.cuda_graph_sizes), ex.cuda_graph_sizes
        return greedy(eng, prompts())
    finally:
        eng.core.shutdown()


def test_mp_executor_tp1_nccl_matches_in_process(qwen3):
    assert run(qwen3, 1, "mp") == run(qwen3, 1, "uni")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_tp2_matches_tp1_float32(qwen3):
    assert run(qwen3, 2, "mp", "float32") == run(qwen3, 1, "uni", "float32")
