"""The MoE block: router -> routed experts (one kernel call) + shared experts (fused into that call, or a separate
MLP), with explicit constructor arguments so a model context can wrap it.

Checkpoint names under the block's prefix (experts are per-expert tensors on disk, fused [E, 2I, H] / [E, H, I]
in memory):
  gate.weight, gate.e_score_correction_bias
  experts.{j}.{gate_proj|w1, up_proj|w3, down_proj|w2}.{weight, weight_scale_inv}, or experts.{gate_up_proj,
  down_proj}[_bias|_blocks|_scales] (all experts stacked, laid out as `StackedExperts` says)
  {shared_expert|shared_experts}.{gate_proj, up_proj, down_proj}.{weight, ...}, shared_expert_gate.weight
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

from kestrel import kernels
from kestrel.distributed import ParallelInfo
from kestrel.kernels.moe import MoESpec
from kestrel.layers.activation import SiluAndMul
from kestrel.layers.linear import Linear, materialize
from kestrel.layers.moe.fse import FseDecision, SharedExperts, resolve_fused_shared_experts
from kestrel.layers.moe.router import Router, RouterConfig

# checkpoint projection name -> (fused parameter, shard of w13 or None)
EXPERT_PROJ = {"gate_proj": ("w13", 0), "w1": ("w13", 0), "up_proj": ("w13", 1), "w3": ("w13", 1),
               "down_proj": ("w2", None), "w2": ("w2", None)}
SHARED_NAMES = ("shared_expert", "shared_experts", "shared_mlp")
# other checkpoints' names for the router's tensors
ROUTER_NAMES = {"gate.wg.weight": "gate.weight",  # Hunyuan
                "router.weight": "gate.weight",  # Llama 4
                "moe_statics.e_score_correction_bias": "gate.e_score_correction_bias",  # ERNIE 4.5, [1, E]
                "e_score_correction_bias": "gate.e_score_correction_bias",  # MiniMax-M2: beside the gate
                "router.bias": "gate.bias"}  # gpt-oss
# a stacked expert tensor's name -> (projection, what it holds)
STACKED_NAME = re.compile(r"(gate_up_proj|down_proj)(?:_(bias|blocks|scales))?")
# the checkpoint's per-expert tensor kinds -> the kernel parameter's suffix
@dataclass(frozen=True)
class StackedExperts:
    """How a checkpoint that stores all experts in one tensor lays them out. `transposed`: weights are
    [E, in, out] (gpt-oss's bf16 experts; block-quantized `_blocks` / `_scales` are [E, out, ...] whatever this
    says). `interleaved`: gate_up rows alternate gate, up, gate, ... (gpt-oss) instead of all gate rows first."""
    transposed: bool = False
    interleaved: bool = False


class FusedExperts(nn.Module):
    """The routed experts (plus fused shared-expert slots): parameters and compute belong to the kernel."""

    def __init__(self, spec: MoESpec, backend: str = "auto", platform=None):
        super().__init__()
        self.kernel = kernels.select("moe", spec, backend, platform)
        self.spec = spec
        self.kernel.create_weights(self)

    @property
    def kernel_name(self) -> str:
        return self.kernel.name

    def process_weights_after_loading(self) -> None:
        self.kernel.process_weights_after_loading(self)

    def forward(self, x, topk_weights, topk_ids):
        return self.kernel.apply(self, x, topk_weights, topk_ids)


class SharedMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, dtype, prefix: str, quant_config, linear_backend,
                 tp: ParallelInfo | None = None):
        super().__init__()
        lin = dict(params_dtype=dtype, quant_config=quant_config, backend=linear_backend, tp=tp)
        self.gate_up_proj = Linear(hidden_size, [intermediate_size] * 2, prefix=f"{prefix}.gate_up_proj",
                                   parallel="column", **lin)
        self.down_proj = Linear(intermediate_size, hidden_size, prefix=f"{prefix}.down_proj", parallel="row", **lin)
        self.act = SiluAndMul()

    def forward(self, x):
        return self.down_proj(self.act(self.gate_up_proj(x)))


class SparseMoeBlock(nn.Module):
    def __init__(self, *, prefix: str, hidden_size: int, moe_intermediate_size: int, router: RouterConfig,
                 dtype: torch.dtype, shared_intermediate_size: int = 0, shared_gated: bool = False,
                 shared_name: str = "shared_experts", quant_config=None, moe_backend: str = "auto",
                 linear_backend: str = "auto", fuse_shared_experts: str = "auto", platform=None,
                 tp: ParallelInfo | None = None, weights_on_input: bool = False, activation: str = "silu",
                 expert_bias: bool = False, stacked: StackedExperts = StackedExperts()):
        """With tensor parallelism (`tp`) every rank routes alike and holds its slice of every expert's
        intermediate dim (gate/up rows, down columns); the expert outputs are all-reduced. Shared experts run as a
        separate column/row-parallel MLP then (not fused into the expert kernel). `weights_on_input` (Llama 4,
        top-1 only): the routing weight scales the expert's input instead of its output (the shared experts, fed
        the unscaled input, then run separately). `activation` (MOE_ACTIVATIONS) and `expert_bias` go to the
        expert kernel; `stacked`: the layout of stacked expert tensors in the checkpoint."""
        super().__init__()
        self.prefix = prefix
        self.tp = tp or ParallelInfo()
        self.gate = Router(hidden_size, router, dtype)
        quant = quant_config.for_layer(f"{prefix}.experts") if quant_config is not None else None
        self.inter_range = self.tp.shard(moe_intermediate_size, f"{prefix} moe_intermediate_size")
        if weights_on_input and router.top_k != 1:
            raise ValueError(f"{prefix}: routing weights on the expert input need top-1 routing, not "
                             f"top-{router.top_k}")
        self.weights_on_input = weights_on_input
        if expert_bias and self.tp.size > 1:
            raise NotImplementedError(f"{prefix}: expert biases under tensor parallelism are not supported yet")
        self.stacked = stacked
        if self.tp.size > 1 or weights_on_input:
            fuse_shared_experts = "off"
        spec = MoESpec(f"{prefix}.experts", router.num_experts, router.top_k, hidden_size, self.inter_range[1],
                       dtype, activation, quant, bias=expert_bias)
        shared = None
        if shared_intermediate_size:
            sq = quant_config.for_layer(f"{prefix}.{shared_name}.gate_up_proj") if quant_config is not None else None
            shared = SharedExperts(shared_intermediate_size, shared_gated, sq)
        kernel_cls = type(kernels.select("moe", spec, moe_backend, platform))
        if self.tp.size > 1 and not kernel_cls.supports_tensor_parallel:
            raise NotImplementedError(f"{prefix}: {kernel_cls.name} experts cannot be split across "
                                      f"{self.tp.size} tensor-parallel ranks yet")
        self.fse: FseDecision = resolve_fused_shared_experts(spec, shared, kernel_cls, fuse_shared_experts)
        self.experts = FusedExperts(spec.with_shared(self.fse.slots), moe_backend, platform)
        self.shared_name = shared_name
        if shared is not None and not self.fse.fused:
            setattr(self, shared_name, SharedMLP(hidden_size, shared_intermediate_size, dtype,
                                                 f"{prefix}.{shared_name}", quant_config, linear_backend, self.tp))
        self.shared_expert_gate = (Linear(hidden_size, 1, params_dtype=dtype, prefix=f"{prefix}.shared_expert_gate",
                                          backend=linear_backend) if shared_gated else None)

    @property
    def shared_mlp(self) -> SharedMLP | None:
        return self._modules.get(self.shared_name)  # (Hunyuan's checkpoint name is this property's own)

    def forward(self, x: torch.Tensor, router_input: torch.Tensor | None = None) -> torch.Tensor:
        """`router_input`: what the router sees where it is not the experts' input (Gemma 4: the residual stream,
        the experts its normed form)."""
        gate_logit = self.shared_expert_gate(x) if self.shared_expert_gate is not None else None
        route = x if router_input is None else router_input
        weights, ids = self.gate(route, self.fse.slots if self.fse.fused else 0, gate_logit)
        xe = x
        if self.weights_on_input:
            xe, weights = (x * weights.to(x.dtype)), torch.ones_like(weights)
        out = self.tp.all_reduce(self.experts(xe, weights, ids))
        mlp = self.shared_mlp
        if mlp is not None:
            s = mlp(x)
            out = out + (s * torch.sigmoid(gate_logit).to(s.dtype) if gate_logit is not None else s)
        return out

    # ---- weights
    def load_weight(self, name: str, tensor: torch.Tensor, fse: FseDecision) -> None:
        """`name` relative to this block. `fse` is the decision the model recorded at construction: the loader's
        only source for where shared-expert weights go."""
        name = ROUTER_NAMES.get(name, name)
        parts = name.split(".")
        stacked = STACKED_NAME.fullmatch(parts[1]) if parts[0] == "experts" and len(parts) == 2 else None
        if stacked:  # all experts in one tensor
            self._load_stacked_experts(stacked[1], stacked[2] or "weight", materialize(tensor), fse)
            return
        if parts[0] == "experts" and parts[2] in EXPERT_PROJ:
            tensor = self._rank_part(EXPERT_PROJ[parts[2]][0], parts[3], tensor)
        elif parts[0] not in SHARED_NAMES + ("shared_expert_gate",):  # Linear layers read their own part
            tensor = materialize(tensor)
        if parts[0] == "gate":
            param = getattr(self.gate, parts[1])
            if param is not None and param.numel() == tensor.numel():
                tensor = tensor.reshape(param.shape)
            if param is None or param.shape != tensor.shape:
                raise ValueError(f"{self.prefix}.{name}: unexpected tensor {tuple(tensor.shape)}")
            param.data.copy_(tensor)
        elif parts[0] == "shared_expert_gate":
            self.shared_expert_gate.load_weight(parts[1], tensor)
        elif parts[0] == "experts":
            slot, (param, shard) = int(parts[1]), EXPERT_PROJ[parts[2]]
            self.experts.kernel.load_expert(self.experts, self._param_name(param, parts[3]), slot, shard, tensor)
        elif parts[0] in SHARED_NAMES:
            proj, pname = parts[1], parts[2]
            if fse.fused:
                self._load_shared_into_experts(proj, pname, materialize(tensor), fse.slots)
            else:
                mlp = self.shared_mlp
                if mlp is None:
                    raise ValueError(f"{self.prefix}.{name}: the recorded decision says the shared experts are "
                                     "separate, but this block has no shared MLP")
                target, shard = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
                                 "down_proj": ("down_proj", None)}[proj]
                getattr(mlp, target).load_weight(pname, tensor, shard)
        else:
            raise KeyError(f"{self.prefix}.{name}: not an MoE block tensor")

    def _load_stacked_experts(self, proj: str, kind: str, tensor: torch.Tensor, fse: FseDecision) -> None:
        """All experts in one tensor (Mistral 4: transformers' in-memory layout, gate_up_proj [E, 2I, H] with the
        gate rows first, down_proj [E, H, I]; gpt-oss: see StackedExperts), `kind` weight, bias, blocks or scales;
        loaded expert by expert."""
        if kind == "weight" and self.stacked.transposed:
            tensor = tensor.transpose(1, 2)
        if proj == "gate_up_proj":
            halves = (tensor[:, 0::2], tensor[:, 1::2]) if self.stacked.interleaved else tensor.chunk(2, dim=1)
            names = ("gate_proj", "up_proj")
        else:
            halves, names = (tensor,), ("down_proj",)
        for j in range(tensor.shape[0]):
            for ckpt_proj, half in zip(names, halves):
                self.load_weight(f"experts.{j}.{ckpt_proj}.{kind}", half[j], fse)

    def _rank_part(self, param: str, kind: str, tensor):
        """This rank's slice of an expert tensor along the intermediate dim: rows of gate/up, columns of down."""
        if self.tp.size == 1:
            return materialize(tensor)
        if kind in ("bias", "blocks", "scales"):
            raise NotImplementedError(f"{self.prefix}: expert {kind} under tensor parallelism are not supported yet")
        return tensor.narrow(1 if param == "w2" else 0, *self.inter_range)

    def _param_name(self, param: str, ckpt_param: str) -> str:
        suffix = self.experts.kernel.checkpoint_params.get(ckpt_param)
        if suffix is None:
            raise KeyError(f"{self.prefix}: expert tensor {ckpt_param!r} is not supported by "
                           f"{self.experts.kernel_name}")
        return param + suffix

    def _load_shared_into_experts(self, proj: str, ckpt_param: str, tensor: torch.Tensor, slots: int) -> None:
        """Split a shared MLP tensor into `slots` expert-sized chunks along its intermediate dim: rows of
        gate/up (and of their block scales), columns of down."""
        param, shard = EXPERT_PROJ[proj]
        dim = 1 if param == "w2" else 0
        size = tensor.shape[dim] // slots
        if size * slots != tensor.shape[dim]:
            raise ValueError(f"{self.prefix}.{proj}.{ckpt_param}: dim {dim} of {tuple(tensor.shape)} does not split "
                             f"into {slots} experts")
        base = self.experts.spec.num_experts
        for c in range(slots):
            self.experts.kernel.load_expert(self.experts, self._param_name(param, ckpt_param), base + c, shard,
                                            tensor.narrow(dim, c * size, size))
