"""Codecs shared by the two wire formats, the engine process's (serve/core_wire.py) and the
tensor-parallel workers' (executor/step_wire.py): msgpack framing, sampling parameters and LoRA
requests as plain lists and dicts (nothing pickled)."""

import dataclasses
from typing import Optional

import msgpack

from tokenmill.lora.request import LoRARequest
from tokenmill.sampling_params import SamplingParams
from tokenmill.structured_outputs import StructuredOutputsParams


def pack(message) -> bytes:
    return msgpack.packb(message, use_bin_type=True)


def unpack(data: bytes):
    # Integer map keys: logit_bias is {token id: bias}.
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


def lora_to_wire(lora: Optional[LoRARequest]) -> Optional[list]:
    return None if lora is None else [lora.lora_name, lora.lora_int_id, lora.lora_path]


def lora_from_wire(data: Optional[list]) -> Optional[LoRARequest]:
    return None if data is None else LoRARequest(data[0], int(data[1]), data[2])


def params_to_wire(params: SamplingParams) -> dict:
    out = {}
    for f in dataclasses.fields(params):
        if not f.init:
            continue  # derived on validation (bad words' token ids, stop strings), again in the engine
        value = getattr(params, f.name)
        if isinstance(value, StructuredOutputsParams):
            value = {g.name: getattr(value, g.name) for g in dataclasses.fields(value)}
        out[f.name] = value
    return out


def params_from_wire(d: dict) -> SamplingParams:
    d = dict(d)
    spec = d.get("structured_outputs")
    if spec is not None:
        d["structured_outputs"] = StructuredOutputsParams(**spec)
    return SamplingParams(**d)
