"""The driver's messages to the tensor-parallel workers, as compact msgpack arrays.

Each step the driver (rank 0, where the engine and scheduler run) sends every worker what its
runner needs to run the same step: the SchedulerOutput ("exec"), then, after the forward pass was
launched, the step's grammar masks if any ("sample"). Dataclasses travel as lists of their fields in
order, sampling parameters as dicts (with the fields validation derives, so no worker re-derives
them), arrays as raw bytes: nothing is pickled per step.

    ("exec", SchedulerOutput)       ("sample", GrammarBitmask or None)      ("release", [req_id, ...])
    ("call", name, [args])          a runner method every rank runs at once (set-up, dummy runs)
    ("shutdown",)
"""

import dataclasses
from typing import Optional

import msgpack
import numpy as np

from tokenmill.wire import lora_from_wire, lora_to_wire, params_from_wire, params_to_wire
from tokenmill.step_io import GrammarBitmask, NewRequestData, ScheduledRequest, SchedulerOutput
from tokenmill.sampling_params import SamplingParams

_ENTRY = [f.name for f in dataclasses.fields(ScheduledRequest)]
_NEW = [f.name for f in dataclasses.fields(NewRequestData)]
_DERIVED = [f.name for f in dataclasses.fields(SamplingParams) if not f.init]


def _params(p: SamplingParams) -> list:
    return [params_to_wire(p), [getattr(p, name) for name in _DERIVED]]


def _params_back(data: list) -> SamplingParams:
    p = params_from_wire(data[0])
    for name, value in zip(_DERIVED, data[1]):
        setattr(p, name, value)
    return p


def _new(n: NewRequestData) -> list:
    out = []
    for name in _NEW:
        value = getattr(n, name)
        if name == "params":
            value = _params(value)
        elif name == "lora_request":
            value = lora_to_wire(value)
        out.append(value)
    return out


def _new_back(data: list) -> NewRequestData:
    kw = dict(zip(_NEW, data))
    kw["params"] = _params_back(kw["params"])
    kw["lora_request"] = lora_from_wire(kw.get("lora_request"))
    return NewRequestData(**kw)


def encode_exec(out: SchedulerOutput) -> bytes:
    batch = [[getattr(e, name) for name in _ENTRY] for e in out.batch]
    return msgpack.packb(["exec", batch, [_new(n) for n in out.new_requests], list(out.freed_req_ids),
                          out.num_decodes], use_bin_type=True)


def encode_sample(bitmask: Optional[GrammarBitmask]) -> bytes:
    if bitmask is None:
        return msgpack.packb(["sample", None], use_bin_type=True)
    mask = np.ascontiguousarray(bitmask.mask, dtype=np.int32)
    offsets = None if bitmask.offsets is None else np.ascontiguousarray(bitmask.offsets, dtype=np.int64).tobytes()
    return msgpack.packb(["sample", [list(bitmask.req_ids), list(mask.shape), mask.tobytes(), offsets]],
                         use_bin_type=True)


def encode(kind: str, *args) -> bytes:
    """Any other message: ("release", ids), ("call", name, args), ("shutdown",)."""
    return msgpack.packb([kind, *args], use_bin_type=True)


def decode(data: bytes) -> list:
    """The message as [kind, ...] with its dataclasses rebuilt."""
    msg = msgpack.unpackb(data, raw=False, strict_map_key=False)
    if msg[0] == "exec":
        _, batch, new, freed, num_decodes = msg
        return ["exec", SchedulerOutput(batch=[ScheduledRequest(**dict(zip(_ENTRY, e))) for e in batch],
                                        new_requests=[_new_back(n) for n in new], freed_req_ids=freed,
                                        num_decodes=num_decodes)]
    if msg[0] == "sample":
        if msg[1] is None:
            return ["sample", None]
        req_ids, shape, mask, offsets = msg[1]
        return ["sample", GrammarBitmask(req_ids, np.frombuffer(mask, dtype=np.int32).reshape(shape).copy(),
                                         None if offsets is None else np.frombuffer(offsets, dtype=np.int64).copy())]
    return msg
