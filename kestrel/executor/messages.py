"""The engine <-> worker wire format: ZeroMQ multipart frames with msgspec msgpack payloads (never pickle).

engine -> every worker: [method, payload(, grammar bitmask: int32 masks, int32 rows they constrain)]
                        (method: b"step", b"describe", b"num_blocks", b"init_cache", b"precompile", b"control",
                        b"shutdown"; a control payload is [name, args], see kestrel/worker/control.py)
worker -> engine:       [rank, status, payload]   (status b"ok" or b"err": the worker failed and exits; a step is
                        answered by rank 0 only; a control call by every rank, b"ctl_ok" with its result or
                        b"ctl_fail" with [is the input bad, message]: the call failed, the worker goes on)

KV-cache specs carry torch dtypes: they travel as the spec's class name, its fields and the dtype's name."""
from __future__ import annotations

import dataclasses

import msgspec
import torch

from kestrel.core import kv_spec
from kestrel.core.kv_spec import KVCacheGroup
from kestrel.core.step import RunnerOutput, StepInput

STEP, DESCRIBE, START_UP, CONTROL, SHUTDOWN = (b"step", b"describe", b"start_up", b"control", b"shutdown")
OK, ERR, CTL_OK, CTL_FAIL = b"ok", b"err", b"ctl_ok", b"ctl_fail"

encoder = msgspec.msgpack.Encoder()
step_decoder = msgspec.msgpack.Decoder(StepInput)
output_decoder = msgspec.msgpack.Decoder(RunnerOutput)
any_decoder = msgspec.msgpack.Decoder()


def encode_groups(groups: list[KVCacheGroup]) -> list[dict]:
    out = []
    for g in groups:
        fields = {f.name: getattr(g.spec, f.name) for f in dataclasses.fields(g.spec)}
        dtypes = [name for name, value in fields.items() if isinstance(value, torch.dtype)]
        fields.update({name: str(fields[name]).removeprefix("torch.") for name in dtypes})
        out.append({"group_id": g.group_id, "spec": type(g.spec).__name__, "fields": fields, "dtypes": dtypes,
                    "layer_names": list(g.layer_names)})
    return out


def decode_groups(data: list[dict]) -> list[KVCacheGroup]:
    groups = []
    for d in data:
        spec_cls = getattr(kv_spec, d["spec"])
        if not (isinstance(spec_cls, type) and issubclass(spec_cls, kv_spec.KVCacheSpec)):
            raise ValueError(f"unknown KV cache spec {d['spec']!r}")
        fields = dict(d["fields"])
        fields.update({name: getattr(torch, fields[name]) for name in d["dtypes"]})
        groups.append(KVCacheGroup(d["group_id"], spec_cls(**fields), list(d["layer_names"])))
    return groups
