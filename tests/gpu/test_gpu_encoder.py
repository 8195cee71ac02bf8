"""GPU check of BERT-style encoder embeddings (skipped without CUDA): a tiny random BertModel with a
sentence-transformers mean-pooling config, served on CUDA (the reference attention backend: the Triton kernels
have no bidirectional mask), equals transformers' mean-pooled, normalised hidden states on the same weights:
cosine > 0.9999 in float32 and > 0.999 in bf16 (against transformers in float32). Startup (the memory profile and the
kernel warm-up over an encoder) is part of what this checks."""
import pytest
import torch

from kestrel import LLM
from tests.pooling_tiny import hf_encoder_embedding, make_encoder

pytestmark = pytest.mark.gpu
PROMPTS = ["hello world", "the cat sat on the mat and looked at the door", "a"]


@pytest.mark.parametrize("dtype,min_cosine", [("float32", 0.9999), ("bfloat16", 0.999)])
def test_bert_embeddings_on_cuda(tmp_path, tiny_tokenizer, dtype, min_cosine):
    path = make_encoder(tmp_path, tiny_tokenizer, "bert", pooling="mean")
    llm = LLM(str(path), dtype=dtype, progress=False, num_kv_blocks=256)
    assert llm.engine.core.executor.runner.backend.name == "torch_ref"
    for o in llm.embed(PROMPTS):
        ref = hf_encoder_embedding(path, o.prompt_token_ids, "mean")
        got = torch.tensor(o.outputs.embedding)
        assert torch.nn.functional.cosine_similarity(got, ref, dim=0) > min_cosine
