"""Mixture-of-experts layers: router, fused experts (kernel chosen once), shared experts fused or separate."""
from kestrel.layers.moe.fse import (FSE_MODES, FseDecision, FseError, SharedExperts, check_fse_consistency,
                                    resolve_fused_shared_experts)
from kestrel.layers.moe.layer import FusedExperts, SharedMLP, SparseMoeBlock, StackedExperts
from kestrel.layers.moe.router import Router, RouterConfig, select_experts

__all__ = ["FSE_MODES", "FseDecision", "FseError", "FusedExperts", "Router", "RouterConfig", "SharedExperts",
           "SharedMLP", "SparseMoeBlock", "StackedExperts", "check_fse_consistency", "resolve_fused_shared_experts", "select_experts"]
