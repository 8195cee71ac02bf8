"""HF `quant_method: "mxfp4"` checkpoints (gpt-oss): the MoE experts alone are MXFP4 (kestrel/kernels/mxfp4.py);
every other layer, and those named in `modules_to_not_convert`, stays unquantized."""
from __future__ import annotations

from typing import Iterable, Mapping

from kestrel.kernels.mxfp4 import Mxfp4Scheme
from kestrel.layers.quant.fp8 import QuantConfigBase


class Mxfp4Config(QuantConfigBase):
    name = "mxfp4"

    def __init__(self, ignore: Iterable[str] = (), packed_modules=None):
        super().__init__(ignore, packed_modules)
        self.scheme = Mxfp4Scheme()

    def for_layer(self, prefix: str) -> Mxfp4Scheme | None:
        if prefix.rpartition(".")[2] != "experts" or self.is_ignored(prefix):
            return None
        return self.scheme

    @classmethod
    def from_hf(cls, qc: Mapping) -> "Mxfp4Config":
        # the released checkpoints name modules as globs ("model.layers.*.self_attn"): whole-component regexes
        ignore = [f"re:{p.replace('.', r'[.]').replace('*', r'[^.]+')}([.]|$)"
                  for p in qc.get("modules_to_not_convert") or []]
        return cls(ignore)
