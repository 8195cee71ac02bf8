"""The Triton bitmask apply (kestrel/kernels/triton_ops/token_bitmask.py) against the PyTorch path on random
masks over a subset of rows, with a model vocabulary wider than the grammar's. Runs on CUDA or under the Triton
interpreter on the CPU (make kernels-check); the sm_90 compile check needs only triton."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kestrel.platform import triton_gates as gates  # noqa: E402
from kestrel.structured_output.bitmask import apply_token_bitmask, bitmask_width  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
_ok, _why = gates.triton_runnable()


@pytest.mark.skipif(not _ok, reason=_why)
@pytest.mark.parametrize("rows,batch,vocab,grammar_vocab", [([2, 0, 5], 6, 5000, 4000), ([0], 1, 2048, 2048),
                                                             ([3, 1], 4, 3000, 100)])
def test_triton_apply_matches_torch(rows, batch, vocab, grammar_vocab):
    from kestrel.kernels.triton_ops.token_bitmask import apply_token_bitmask_triton

    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(batch, vocab, generator=g)
    mask = torch.randint(-2**31, 2**31 - 1, (len(rows), bitmask_width(grammar_vocab)), generator=g,
                         dtype=torch.int64).to(torch.int32)
    mask[0, :3] = 0  # whole words refused
    ref = apply_token_bitmask(logits.clone(), mask, rows)  # the torch path (CPU)
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    got = logits.to(DEVICE, dtype)
    apply_token_bitmask_triton(got, mask.to(DEVICE), torch.tensor(rows, dtype=torch.int32, device=DEVICE))
    got = got.float().cpu()
    assert torch.equal(torch.isinf(got), torch.isinf(ref))
    finite = torch.isfinite(ref)
    assert torch.equal(got[finite], logits.to(dtype).float()[finite])  # allowed logits untouched


@pytest.mark.skipif(gates.interpreter_mode(), reason="ahead-of-time compilation needs the real Triton, not the interpreter")
def test_triton_apply_compiles_for_sm90():
    from kestrel.kernels.triton_ops import token_bitmask
    from tests.attention.test_triton_compile import compile_ok

    fn = token_bitmask._apply_token_bitmask_kernel
    for logits in ("*bf16", "*fp32"):
        sig = {n: {"LOGITS": logits, "MASK": "*i32", "ROWS": "*i32"}.get(n, "i32") for n in fn.arg_names}
        compile_ok(fn, sig, dict(BLOCK=token_bitmask.BLOCK))
