"""The messages between the API server process and the engine process, and their wire format.

Each message is one msgpack array whose first element names its kind; the payloads are plain lists
of ints, floats and strings (no pickled objects on the step path). A step's outputs travel as one
message: for every request that changed, only what is new since the last message (token ids,
their logprobs), so a message stays small however long the outputs grow.

To the engine:   ("hello", server index)                    a further API server joins (index 0 is there
                                                            from the start)
                 ("add", server index, request_id, prompt_ids, params, lora)   params: SamplingParams as a
                                                            dict; lora: [name, id, path] of its LoRA adapter or
                                                            None; request_id is "<server index>/<its own id>"
                 ("abort", request_id, sample or None)
                 ("call", server index, call_id, name, args)   a named engine call (see CALLS), its
                                                            arguments a list
                 ("detach", server index)                   that server goes away (its requests are aborted)
                 ("shutdown",)                              from server 0 only
From the engine: ("ready", EngineFacts as a dict)
                 ("step", steps_completed, last_step_kind, [delta, ...], EngineSnapshot as a list,
                  its GC pauses [[generation, seconds], ...], the add messages carried out so far)
                 ("add_error", request_id, message)
                 ("call_result", call_id, ok, result or [error type name, message])
                 ("failed", message)                        the engine thread raised; the process ends
                 ("bye",)                                   after a shutdown: the last message

A delta: [request_id, finished, [num_cached_prompt_tokens, of which from the host tier], prompt_logprobs or None,
[[index, new_token_ids, finish_reason, stop_reason, cumulative_logprob, new_logprobs or None], ...]]
where new_logprobs holds one [[token_id, logprob, rank], ...] list per new token.
"""

from dataclasses import dataclass, field
from typing import Optional

from tokenmill.engine.outputs import Logprob
from tokenmill.engine.engine_snapshot import EngineSnapshot  # noqa: F401 (part of the wire format)
# The codecs shared with the tensor-parallel workers' wire (executor/step_wire.py) live below both.
from tokenmill.wire import lora_from_wire, lora_to_wire, pack, params_from_wire, params_to_wire, unpack  # noqa: F401

# Engine calls the API server may make by name (a callable cannot cross the process boundary); a
# LoRARequest argument travels as lora_to_wire's list.
CALLS = ("reset_prefix_cache", "add_lora", "remove_lora", "list_loras")


# ---- what the API server needs to know of the engine -----------------------------------------
@dataclass
class EngineFacts:
    """The engine's fixed facts, sent once when it is ready: what validation and the API need."""

    model_name: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    num_blocks: int
    block_size: int
    summary: str  # one line on what is served and how (the start-up log line)
    pid: int
    tokenizer: Optional[bytes] = None  # the tokenizer, pickled (once, at start-up)
    snapshot: Optional[list] = None  # the counters before any step (EngineSnapshot.to_wire)


# ---- outputs ----------------------------------------------------------------------------------
def logprobs_to_wire(entries: list[dict[int, Logprob]]) -> list:
    return [[[t, lp.logprob, lp.rank] for t, lp in entry.items()] for entry in entries]


def logprobs_from_wire(entries: list) -> list[dict[int, Logprob]]:
    return [{t: Logprob(lp, rank) for t, lp, rank in entry} for entry in entries]


def prompt_logprobs_to_wire(entries: list) -> list:
    return [None if e is None else [[t, lp.logprob, lp.rank] for t, lp in e.items()] for e in entries]


def prompt_logprobs_from_wire(entries: list) -> list:
    return [None if e is None else {t: Logprob(lp, rank) for t, lp, rank in e} for e in entries]


@dataclass
class SampleProgress:
    """What the engine process has sent of one sample."""

    tokens: int = 0
    logprobs: int = 0


@dataclass
class RequestProgress:
    samples: dict[int, SampleProgress] = field(default_factory=dict)
    prompt_logprobs_sent: bool = False


def output_delta(out, progress: RequestProgress) -> list:
    """The wire delta of a RequestOutput (cumulative) given what was sent before; updates progress."""
    samples = ((c.index, c.token_ids, c.logprobs, c.finish_reason, c.stop_reason, c.cumulative_logprob)
               for c in out.outputs)
    m = out.metrics
    cached = [m.num_cached_prompt_tokens, m.num_host_cached_prompt_tokens] if m is not None else [0, 0]
    return _delta(out.request_id, out.finished, cached, out.prompt_logprobs, samples, progress)


def state_delta(user, progress: RequestProgress) -> list:
    """The same from an unfinished request's live state (output_processor.UserRequestState), read
    in place: nothing is copied but what is new."""
    samples = []
    for s in user.samples:
        req = s.request
        done = s.finish_reason is not None
        samples.append((req.index, req.output_token_ids, s.logprobs, s.finish_reason,
                        req.stop_reason if done else None, s.cumulative_logprob))
    req = user.samples[0].request
    return _delta(user.request_id, user.finished, [req.num_cached_tokens, req.num_host_cached_tokens],
                  user.prompt_logprobs, samples, progress)


def _delta(request_id: str, finished: bool, cached: list, prompt_logprobs, samples, progress: RequestProgress) -> list:
    wire = []
    any_tokens = False
    for index, token_ids, logprobs, finish_reason, stop_reason, cumulative in samples:
        p = progress.samples.setdefault(index, SampleProgress())
        new_ids = token_ids[p.tokens:]
        new_lps = None
        if logprobs is not None:
            new_lps = logprobs_to_wire(logprobs[p.logprobs:])
            p.logprobs = len(logprobs)
        p.tokens = len(token_ids)
        any_tokens = any_tokens or p.tokens > 0
        wire.append([index, new_ids, finish_reason, stop_reason, cumulative, new_lps])
    prompt_lps = None
    if prompt_logprobs is not None and not progress.prompt_logprobs_sent and (finished or any_tokens):
        # Sent once, complete: with the first generated token (or the end), after every prompt chunk.
        prompt_lps = prompt_logprobs_to_wire(prompt_logprobs)
        progress.prompt_logprobs_sent = True
    return [request_id, finished, cached, prompt_lps, wire]
