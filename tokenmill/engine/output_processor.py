"""Turning sampled tokens into user-facing outputs: stop checks, detokenization, logprobs, and the
grouping of n parallel samples under one request id.

With `detokenize` off (the server) the engine makes only token ids and logprob values: no text, no
logprob pieces, no stop strings. RequestDetokenizer then does that text side, outside the engine
thread, the same way (SampleText), and says which samples a stop string has ended."""

import time
from dataclasses import dataclass
from typing import Optional


from tokenmill.engine.detokenizer import SampleText, token_piece
from tokenmill.engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from tokenmill.engine.request import Request, RequestStatus
from tokenmill.step_io import LogprobsArrays, PromptLogprobsArrays
from tokenmill.sampling_params import SamplingParams


@dataclass
class SampleState:
    """One of a request's n samples."""

    request: Request
    text: Optional[SampleText]
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
    prompt_logprobs: Optional[list] = None  # [None, then one dict per prompt token so far] if asked

    @property
    def finished(self) -> bool:
        return self.finished_samples == len(self.samples)


class OutputProcessor:
    def __init__(self, tokenizer, detokenize: bool = True):
        self.tokenizer = tokenizer
        self.detokenize = detokenize  # off: token ids and logprob values only (text is made elsewhere)
        self.states: dict[str, UserRequestState] = {}  # by user request id
        self.parent_of: dict[str, str] = {}  # sample request id -> user request id

    def add(self, request_id: str, prompt: Optional[str], prompt_ids: list[int], children: list[Request]) -> None:
        samples = []
        for child in children:
            p = child.params
            text = SampleText(self.tokenizer, prompt_ids, p) if self.tokenizer is not None and self.detokenize else None
            wants_logprobs = p.logprobs is not None
            samples.append(SampleState(child, text, [] if wants_logprobs else None, 0.0 if wants_logprobs else None))
            self.parent_of[child.request_id] = request_id
        self.states[request_id] = UserRequestState(request_id, prompt, prompt_ids, samples,
                                                   RequestMetrics(arrival_time=children[0].arrival_time),
                                                   prompt_logprobs=[None] if children[0].params.prompt_logprobs
                                                   is not None else None)

    def on_prompt_logprobs(self, lp: PromptLogprobsArrays) -> None:
        """Record a step's prompt logprobs. Positions come in order; one already recorded (computed
        again after a preemption, or by another of the n samples) keeps its first value."""
        rows = lp.rows
        for span in lp.spans:
            user = self.states.get(self.parent_of.get(span.req_id, ""))
            if user is None or user.prompt_logprobs is None:
                continue  # finished or aborted while its step was in flight
            recorded = user.prompt_logprobs
            k = user.samples[0].request.params.prompt_logprobs
            ids = user.prompt_token_ids
            first = len(recorded) - 1 - span.start  # the span's first position not yet recorded
            if first < 0:
                raise RuntimeError(f"prompt logprobs of {span.req_id} skipped positions (this is a bug)")
            for j in range(first, span.count):
                i = span.offset + j
                token = ids[span.start + j + 1]
                entry = {token: Logprob(float(rows.token_logprobs[i]), int(rows.token_ranks[i]), self._piece(token))}
                for rank, (tid, value) in enumerate(zip(rows.top_ids[i][:k].tolist(),
                                                        rows.top_logprobs[i][:k].tolist()), 1):
                    if tid not in entry:
                        entry[tid] = Logprob(float(value), rank, self._piece(tid))
                recorded.append(entry)

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
        stop_string = sample.text.add_token(token) if sample.text is not None else None  # from min_tokens on
        if num_out >= params.min_tokens and token in request.stop_ids:
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
        return token_piece(self.tokenizer, token) if self.detokenize else None

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
            text = sample.text.text(done) if sample.text is not None else ""
            outputs.append(CompletionOutput(
                index=req.index, text=text, token_ids=list(req.output_token_ids),
                cumulative_logprob=sample.cumulative_logprob,
                logprobs=list(sample.logprobs) if sample.logprobs is not None else None,
                finish_reason=sample.finish_reason, stop_reason=req.stop_reason if done else None,
            ))
        user.metrics.num_cached_prompt_tokens = user.samples[0].request.num_cached_tokens
        user.metrics.num_host_cached_prompt_tokens = user.samples[0].request.num_host_cached_tokens
        prompt_lp = list(user.prompt_logprobs) if user.prompt_logprobs is not None else None
        return RequestOutput(request_id, user.prompt, user.prompt_token_ids, outputs, user.finished, user.metrics,
                             prompt_lp)

    def release(self, request_id: str) -> None:
        user = self.states.pop(request_id, None)
        if user is not None:
            for sample in user.samples:
                self.parent_of.pop(sample.request.request_id, None)




@dataclass
class _ShownSample:
    """The text side of one sample, as the client sees it."""

    text: SampleText
    seen: int = 0  # output tokens taken in
    logprobs: Optional[list] = None
    cumulative_logprob: Optional[float] = None
    final: Optional[CompletionOutput] = None  # set once it has ended (its later outputs are this)


class RequestDetokenizer:
    """The text side of one engine request for the server, run outside the engine thread: takes the
    engine's outputs (token ids and logprob values, no text) in order and returns them as the
    offline engine would have made them: text, logprob pieces, stop strings. A sample a stop string
    ends is final from then on; the tokens the engine made after it (before it saw the abort) are
    dropped."""

    def __init__(self, tokenizer, prompt_token_ids: list[int], params: SamplingParams):
        self.tokenizer = tokenizer
        wants_logprobs = params.logprobs is not None
        self.samples = [_ShownSample(SampleText(tokenizer, prompt_token_ids, params), 0,
                                     [] if wants_logprobs else None, 0.0 if wants_logprobs else None)
                        for _ in range(params.n)]
        self.done = False  # a finished output has been returned
        self.prompt_logprobs: Optional[list] = None  # with their pieces, as far as they have come

    def process(self, out: RequestOutput) -> tuple[Optional[RequestOutput], list[int]]:
        """The output to show (None once a finished one was shown) and the indexes of the samples a
        stop string has just ended (the engine should abort them)."""
        if self.done:
            return None, []
        outputs, stopped = [], []
        for c in out.outputs:
            shown, ended_by_stop = self._advance(self.samples[c.index], c)
            outputs.append(shown)
            if ended_by_stop:
                stopped.append(c.index)
        self.done = all(s.final is not None for s in self.samples)
        return RequestOutput(out.request_id, out.prompt, out.prompt_token_ids, outputs, self.done, out.metrics,
                             self._prompt_logprobs(out.prompt_logprobs)), stopped

    def _prompt_logprobs(self, engine_lp: Optional[list]) -> Optional[list]:
        """The engine's prompt logprobs with their pieces (each position converted once)."""
        if engine_lp is None:
            return None
        shown = self.prompt_logprobs = self.prompt_logprobs or []
        for entry in engine_lp[len(shown):]:
            shown.append(None if entry is None else
                         {tid: Logprob(lp.logprob, lp.rank, token_piece(self.tokenizer, tid)) for tid, lp in entry.items()})
        return list(shown)

    def _advance(self, sample: _ShownSample, c: CompletionOutput) -> tuple[CompletionOutput, bool]:
        if sample.final is not None:
            return sample.final, False
        total = len(c.token_ids)
        for i in range(sample.seen, total):
            stop = sample.text.add_token(c.token_ids[i])
            self._add_logprobs(sample, c, i)
            sample.seen = i + 1
            # The engine checks its stop tokens before stop strings: its own stop on this token wins.
            if stop is not None and not (sample.seen == total and c.finish_reason == "stop"):
                sample.final = self._output(sample, c, "stop", stop)
                return sample.final, True
        shown = self._output(sample, c, c.finish_reason, c.stop_reason)
        if c.finish_reason is not None:
            sample.final = shown
        return shown, False

    def _add_logprobs(self, sample: _ShownSample, c: CompletionOutput, i: int) -> None:
        if sample.logprobs is None or c.logprobs is None or i >= len(c.logprobs):
            return
        entry = {tid: Logprob(lp.logprob, lp.rank, token_piece(self.tokenizer, tid))
                 for tid, lp in c.logprobs[i].items()}
        sample.logprobs.append(entry)
        sample.cumulative_logprob += entry[c.token_ids[i]].logprob

    @staticmethod
    def _output(sample: _ShownSample, c: CompletionOutput, finish_reason: Optional[str],
                stop_reason) -> CompletionOutput:
        token_ids = c.token_ids if sample.seen == len(c.token_ids) else c.token_ids[:sample.seen]
        return CompletionOutput(c.index, sample.text.text(finish_reason is not None), token_ids,
                                sample.cumulative_logprob,
                                list(sample.logprobs) if sample.logprobs is not None else None,
                                finish_reason, stop_reason)
