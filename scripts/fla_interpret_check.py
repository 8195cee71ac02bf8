"""Check fla-core's chunk_kda conventions against kestrel/kernels/kda_ref.py on the CPU, under the Triton
interpreter, at tiny sizes: the varlen call that kestrel/kernels/fla_kda.py makes (precomputed log decay, L2 norm
in the kernel, scale after it, [N, H, K, V] float32 states, cu_seqlens) and its in-kernel gate form, against the
reference run per request. Never in the project's venv (transformers 5.17 binds fla there and breaks on CPU):

    python3 -m venv /tmp/flavenv
    echo $PWD/.venv/lib/python3.11/site-packages > /tmp/flavenv/lib/python3.11/site-packages/kestrel-venv.pth
    /tmp/flavenv/bin/pip install --no-deps fla-core==0.6.0 einops
    TRITON_INTERPRET=1 PYTHONPATH=$PWD /tmp/flavenv/bin/python scripts/fla_interpret_check.py

The interpreter needs four workarounds (applied below, the last one by editing the throwaway venv's fla file):
no benchmarker for fla's autotuners (keep each one's first config), tl.gather not callable from fla's kernels
(take fla's load branch), numpy 2.4 refusing int() of a one-element array in loop bounds, and a loop index that
the interpreter gives as a Python int where fla calls `.to(tl.int64)` on it. Prints the largest errors; exits 1
above 1e-5."""
import importlib.util
import os
import re
import sys

import numpy as np
import torch
import triton.runtime.autotuner as autotuner
import triton.runtime.interpreter as interpreter

if os.environ.get("TRITON_INTERPRET") != "1":
    sys.exit("run with TRITON_INTERPRET=1")

_init = autotuner.Autotuner.__init__
autotuner.Autotuner.__init__ = lambda self, fn, names, configs, *a, **kw: _init(self, fn, names, configs[:1], *a, **kw)
_patch_tensor = interpreter._patch_lang_tensor


def _patch_lang_tensor(tensor, scope):
    _patch_tensor(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))


interpreter._patch_lang_tensor = _patch_lang_tensor
path = importlib.util.find_spec("fla").submodule_search_locations[0] + "/ops/common/chunk_delta_h.py"
src = open(path).read()
if "i_t.to(tl.int64)" in src:
    open(path, "w").write(re.sub(r"i_t\.to\(tl\.int64\)", "(i_t + tl.zeros([], tl.int64))", src))

import fla.ops.kda.chunk_intra as chunk_intra  # noqa: E402

chunk_intra.IS_GATHER_SUPPORTED = False
from fla.ops.kda import chunk_kda  # noqa: E402

from kestrel.kernels import kda_ref  # noqa: E402
from kestrel.kernels.fla_kda import chunk_kda_varlen  # noqa: E402

torch.manual_seed(0)
H, D, LENS = 2, 16, [5, 19, 3, 70]
T = sum(LENS)
q, k, v = torch.randn(T, 3, H, D).unbind(1)
f, a_log, dt_bias = torch.randn(T, H * D), torch.randn(H) * 0.5, torch.randn(H * D) * 0.5
g = kda_ref.forget_gate(f, a_log, dt_bias, D)
beta = torch.sigmoid(torch.randn(T, H))
h0 = torch.randn(len(LENS), H, D, D) * 0.1
cu = torch.tensor([0] + torch.tensor(LENS).cumsum(0).tolist())
o, ht = chunk_kda_varlen(q, k, v, g, beta, h0, cu, cu, D ** -0.5)
want, want_ht = kda_ref.delta_rule_varlen(q, k, v, g, beta, h0, cu, cu, D ** -0.5)
o_gate, ht_gate = chunk_kda(q[None].contiguous(), k[None].contiguous(), v[None].contiguous(),
                            f.view(1, T, H, D), beta[None].contiguous(), scale=D ** -0.5, initial_state=h0.clone(),
                            output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=cu,
                            use_gate_in_kernel=True, A_log=a_log, dt_bias=dt_bias)
errors = {"output": (o - want).abs().max().item(), "final states": (ht - want_ht).abs().max().item(),
          "in-kernel gate output": (o_gate[0] - want).abs().max().item(),
          "in-kernel gate states": (ht_gate - want_ht).abs().max().item()}
print(f"output scale {want.abs().max().item():.3f}; max abs errors: {errors}")
sys.exit(0 if max(errors.values()) < 1e-5 else 1)
