"""Turning sampled tokens into user-facing outputs: stop checks, detokenization, logprobs, and the
grouping of n parallel samples under one request id."""

import time
from dataclasses import dataclass, field
from typing import Optional


from tokenmill.engine.detokenizer import IncrementalDetokenizer
from tokenmill.engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from tokenmill.engine.request import Request, RequestStatus
from tokenmill.messages import LogprobsArrays


@dataclass
class SampleState:
    """One of a request's n samples."""

    request: Request
    detokenizer: Optional[IncrementalDetokenizer]
    logprobs: Optional[list] = None
    cumulative_logprob: Optional[float] = None
    finish_reason: Optional[str] = None


@dataclass
class UserRequestState:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    samples: list[SampleState]
    metrics: RequestMetrics
    finished_samples: int = 0

    @property
    def finished(self) -> bool:
        return self.finished_samples == len(self.samples)


class OutputProcessor:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.states: dict[str, UserRequestState] = {}  # by user request id
        self.parent_of: dict[str, str] = {}  # sample request id -> user request id

    def add(self, request_id: str, prompt: Optional[str], prompt_ids: list[int], children: list[Request]) -> None:
        samples = []
        for child in children:
            p = child.params
            detok = None
            if self.tokenizer is not None:
                detok = IncrementalDetokenizer(self.tokenizer, prompt_ids, p.skip_special_tokens, p.stop_strings,
                                               p.include_stop_str_in_output)
            wants_logprobs = p.logprobs is not None
            samples.append(SampleState(child, detok, [] if wants_logprobs else None, 0.0 if wants_logprobs else None))
            self.parent_of[child.request_id] = request_id
        self.states[request_id] = UserRequestState(request_id, prompt, prompt_ids, samples,
                                                   RequestMetrics(arrival_time=children[0].arrival_time))

    def on_token(self, request: Request, token: int, batch_index: int, logprobs: Optional[LogprobsArrays]
                 ) -> Optional[RequestStatus]:
        """Record one sampled token; returns the finish status if the sample is now done."""
        user = self.states[self.parent_of[request.request_id]]
        sample = user.samples[request.index]
        now = time.monotonic()
        if user.metrics.first_token_time is None:
            user.metrics.first_token_time = now
        user.metrics.last_token_time = now
        if sample.logprobs is not None and logprobs is not None:
            self._record_logprobs(sample, token, batch_index, logprobs, request.params.logprobs)
        params = request.params
        num_out = len(request.output_token_ids)
        stop_string = sample.detokenizer.add_token(token) if sample.detokenizer is not None else None
        if num_out >= params.min_tokens:
            if token in request.stop_ids:
                request.stop_reason = None if token not in params.stop_token_ids else token
                return RequestStatus.FINISHED_STOPPED
            if stop_string is not None:
                request.stop_reason = stop_string
                return RequestStatus.FINISHED_STOPPED
        if num_out >= request.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _record_logprobs(self, sample: SampleState, token: int, i: int, lp: LogprobsArrays, k: int) -> None:
        entry = {token: Logprob(float(lp.token_logprobs[i]), int(lp.token_ranks[i]), self._piece(token))}
        for rank, (tid, value) in enumerate(zip(lp.top_ids[i][:k].tolist(), lp.top_logprobs[i][:k].tolist()), 1):
            if tid not in entry:
                entry[tid] = Logprob(float(value), rank, self._piece(tid))
        sample.logprobs.append(entry)
        sample.cumulative_logprob += float(lp.token_logprobs[i])

    def _piece(self, token: int) -> Optional[str]:
        return self.tokenizer.decode([token]) if self.tokenizer is not None else None

    def on_finished(self, request: Request, status: RequestStatus) -> None:
        user = self.states.get(self.parent_of.get(request.request_id, ""))
        if user is None:
            return
        sample = user.samples[request.index]
        if sample.finish_reason is None:
            sample.finish_reason = status.value
            user.finished_samples += 1
            if user.finished:
                user.metrics.finished_time = time.monotonic()

    def make_output(self, request_id: str) -> RequestOutput:
        user = self.states[request_id]
        outputs = []
        for sample in user.samples:
            req = sample.request
            done = sample.finish_reason is not None
            if sample.detokenizer is None:
                text = ""
            else:
                text = sample.detokenizer.text if done else sample.detokenizer.safe_text()
            outputs.append(CompletionOutput(
                index=req.index, text=text, token_ids=list(req.output_token_ids),
                cumulative_logprob=sample.cumulative_logprob,
                logprobs=list(sample.logprobs) if sample.logprobs is not None else None,
                finish_reason=sample.finish_reason, stop_reason=req.stop_reason if done else None,
            ))
        user.metrics.num_cached_prompt_tokens = user.samples[0].request.num_cached_tokens
        return RequestOutput(request_id, user.prompt, user.prompt_token_ids, outputs, user.finished, user.metrics)

    def release(self, request_id: str) -> None:
        user = self.states.pop(request_id, None)
        if user is not None:
            for sample in user.samples:
                self.parent_of.pop(sample.request.request_id, None)

    def user_request_of(self, sample_request_id: str) -> Optional[str]:
        return self.parent_of.get(sample_request_id)

