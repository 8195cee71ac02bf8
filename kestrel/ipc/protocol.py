"""The wire between the frontend and the engine core processes: request framing, utility calls and the msgspec
encoders/decoders (never pickle). The messages themselves are the engine core's (kestrel/engine/messages.py)."""
from __future__ import annotations

import enum

import msgspec

from kestrel.engine.messages import (EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, SchedulerStats,  # noqa: F401
                                     UtilityOutput)


class RequestType(enum.Enum):
    ADD = b"\x00"
    ABORT = b"\x01"
    UTILITY = b"\x02"
    SHUTDOWN = b"\x03"


class UtilityRequest(msgspec.Struct):
    call_id: int
    method: str
    args: list = []


encoder = msgspec.msgpack.Encoder()
output_decoder = msgspec.msgpack.Decoder(EngineCoreOutputs)
add_decoder = msgspec.msgpack.Decoder(EngineCoreRequest)
abort_decoder = msgspec.msgpack.Decoder(list[str])
utility_decoder = msgspec.msgpack.Decoder(UtilityRequest)
