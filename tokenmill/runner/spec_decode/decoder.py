"""Speculative decoding in the runner: verify a proposer's drafts in the target's step.

A speculating request's decode step computes its last sampled token plus up to k drafts (the
scheduler reserved 1 + k KV slots). Its position cannot come from the host: the previous step, still
in flight when this one was scheduled, may accept any number of drafts. So this module keeps each
row's count of known tokens on the device (`known`): input preparation for speculating entries reads
it (input ids: `last_sampled`, then the row's drafts), every logits row of such an entry is sampled
(draft positions, then the bonus position), the rejection sampler decides how many drafts stand, and
the post-update appends the emitted tokens to the device token table and advances `known`. Then the
proposer drafts the next tokens from that table. Nothing here reads a device value on the host.

Requests that do not speculate share the path: one logits row each, no drafts, which the rejection
sampler turns into exactly the plain sampler's token. The module exists only when the engine was
started with a speculative_config, so an engine without one pays nothing.

The proposer follows the config's method (`build_proposer`): n-gram lookup reads only the token
table; a draft model (draft_model.py) and the target's first layers (layer_truncated.py) also get
the step's inputs, the block table, each entry's slot limit (the KV slots its row holds, a host
count uploaded with the step's plan) and which entries' drafts will be verified, and write K/V; the
runner sizes, allocates and captures for them through `kv_bytes_per_block`, `bind_kv_cache`,
`profile_run` and `capture_cuda_graphs`.
"""

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from tokenmill.config import SpeculativeConfig
from tokenmill.kernels.input_prep import post_update
from tokenmill.step_io import NewRequestData
from tokenmill.runner.request_states import RequestStates, RowState
from tokenmill.runner.sample import RejectionSampler, Sampler
from tokenmill.runner.sample.logprobs import DeviceLogprobs
from tokenmill.layers.forward_context import AttentionMetadata
from tokenmill.logger import init_logger
from tokenmill.runner.spec_decode.ngram import NgramProposer
from tokenmill.runner.spec_decode.proposer import Proposer, ProposerInputs
from tokenmill.runner.staged_write import to_device

logger = init_logger(__name__)


@dataclass(frozen=True)
class ProposerContext:
    """What proposers other than n-gram need to be built: the target model, a draft model (method
    draft_model) and the runner's shapes."""

    target: torch.nn.Module
    draft: Optional[torch.nn.Module]
    max_model_len: int
    block_size: int
    small_batch_fusion: bool = True


def build_proposer(config: SpeculativeConfig, max_num_reqs: int, device: torch.device,
                   context: Optional[ProposerContext]) -> Proposer:
    """The proposer of config.method (ngram, draft_model or layer_truncated)."""
    k = config.num_speculative_tokens
    if config.method == "ngram":
        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max, max_num_reqs, k, device)
    if context is None:
        raise ValueError(f"speculative method {config.method} needs the target model (a ProposerContext)")
    shapes = (k, max_num_reqs, context.max_model_len, context.block_size, device, context.small_batch_fusion)
    logger.info("speculative decoding: %s drafts of %d tokens", config.method, k)
    if config.method == "draft_model":
        from tokenmill.runner.spec_decode.draft_model import DraftModelProposer

        if context.draft is None:
            raise ValueError("speculative method draft_model needs the loaded draft model")
        return DraftModelProposer(context.draft, context.target.config.vocab_size, *shapes)
    if config.method == "layer_truncated":
        from tokenmill.runner.spec_decode.layer_truncated import LayerTruncatedProposer

        return LayerTruncatedProposer(context.target, config.num_draft_layers, *shapes)
    raise ValueError(f"unknown speculative method {config.method!r}")


@dataclass(frozen=True)
class VerifyPlan:
    """One step's logits rows: entry b owns rows cu[b]..cu[b+1]-1 (every token of a speculating
    entry, the last token of any other). Host arrays and their device copies."""

    expanded_rows: np.ndarray  # [num_logits] request row of each logits row
    logit_index: torch.Tensor  # [num_logits] token index within the step of each logits row
    expanded_idx: torch.Tensor  # [num_logits] expanded_rows on the device
    cu_num_logits: torch.Tensor  # [B + 1]
    # For proposers that write K/V (Proposer.needs_step_inputs); None / 0 otherwise:
    slot_limit: Optional[torch.Tensor] = None  # [B] KV slots each entry's row holds
    num_tokens: int = 0  # the step's tokens
    max_query_len: int = 0
    max_seq_len: int = 0  # host upper bound (speculating entries' positions come from the device)
    # [num_logits] each logits row's index within its entry's rows, when some row has a grammar
    # (its masks are per draft position: SampleBatch.offsets); None otherwise.
    offsets: Optional[torch.Tensor] = None


@dataclass
class VerifyOutput:
    sampled: torch.Tensor  # [B, 1 + k] int64: the emitted tokens, then -1
    num_emitted: torch.Tensor  # [B] int32
    num_drafts: torch.Tensor  # [B] int32: the drafts each entry verified
    next_num_drafts: torch.Tensor  # [B] int32: the drafts proposed for each entry's next step
    logprobs: Optional[DeviceLogprobs]
    draft_ids: Optional[torch.Tensor] = None  # [B, k] those drafts, when a grammar row needs them on the host


class SpeculativeDecoder(RowState):
    def __init__(self, config: SpeculativeConfig, sampler: Sampler, max_num_reqs: int, device: torch.device,
                 context: Optional[ProposerContext] = None):
        self.k = config.num_speculative_tokens
        self.device = device
        self.sampler = sampler
        self.rejection = RejectionSampler(sampler.gumbel, config.synthetic_acceptance)
        self.synthetic = config.synthetic_acceptance is not None  # then every step drafts k tokens
        self.proposer = build_proposer(config, max_num_reqs, device, context)
        self.known = torch.zeros(max_num_reqs, dtype=torch.int32, device=device)
        self.drafts = torch.full((max_num_reqs, self.k), -1, dtype=torch.int64, device=device)
        self.num_drafts = torch.zeros(max_num_reqs, dtype=torch.int32, device=device)
        self.speculating = torch.zeros(max_num_reqs, dtype=torch.bool, device=device)  # per row: eligible()
        self._all_k = torch.full((max_num_reqs,), self.k, dtype=torch.int32, device=device)
        self._admitted: list[tuple[int, int, int]] = []  # (row, known tokens, speculates) staged for the device

    # ---- rows ------------------------------------------------------------------------------
    def add_request(self, row: int, new: NewRequestData) -> None:
        self._admitted.append((row, len(new.token_ids), int(self.eligible(new.params))))
        self.proposer.add_request(row, new)

    def apply_staged(self) -> None:
        if self._admitted:
            rows = to_device(np.asarray(self._admitted, dtype=np.int64), self.device)
            self.known[rows[:, 0]] = rows[:, 1].to(torch.int32)
            self.num_drafts[rows[:, 0]] = (rows[:, 1] * 0).to(torch.int32)  # a tensor: a scalar here would sync
            self.speculating[rows[:, 0]] = rows[:, 2].bool()
            self._admitted = []

    # ---- the proposer's KV cache and graphs (the runner's set-up calls these) ---------------
    def kv_bytes_per_block(self) -> int:
        """The proposer's own KV bytes per block (a draft model's cache), beside the target's."""
        return self.proposer.kv_bytes_per_block()

    def bind_kv_cache(self, num_blocks: int, target_kv_caches) -> None:
        self.proposer.bind_kv_cache(num_blocks, target_kv_caches)

    def profile_run(self, buffers, num_tokens: int, num_reqs: int) -> None:
        self.proposer.profile_run(buffers, num_tokens, num_reqs)

    def capture_cuda_graphs(self, max_batch: int) -> None:
        """CUDA graphs of the proposer's draft steps, if it has any (after the KV cache exists)."""
        self.proposer.capture_cuda_graphs(max_batch)

    # ---- the step: inputs ------------------------------------------------------------------
    @staticmethod
    def eligible(params) -> bool:
        """Penalties, logprobs and bad words of several tokens read each emitted token's own step,
        so such requests decode plainly. A grammar speculates: the engine sends a mask for each draft
        position (the grammar's state after the drafts before it)."""
        penalised = (params.repetition_penalty != 1.0 or params.frequency_penalty != 0.0
                     or params.presence_penalty != 0.0)
        return not penalised and params.logprobs is None and not params.multi_token_bad_words

    def prepare(self, buffers, states: RequestStates, batch, rows: np.ndarray, q_lens: np.ndarray) -> VerifyPlan:
        """After the plain input preparation: the speculating entries' inputs, and the step's logits rows."""
        speculative = np.fromiter((e.speculative for e in batch), dtype=bool, count=len(batch))
        self.prepare_inputs(buffers, states, rows, q_lens, speculative)
        counts = np.where(speculative, q_lens, 1)
        cu = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(counts, out=cu[1:])
        qsl = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(q_lens, out=qsl[1:])
        first = np.where(speculative, qsl[:-1], qsl[1:] - 1)  # each entry's first logits row
        logit_rows = np.repeat(first - cu[:-1], counts) + np.arange(cu[-1])
        expanded = np.repeat(rows, counts)
        n, b = len(logit_rows), len(rows)
        # Grammar masks are per draft position: each logits row's index within its entry's rows.
        offsets = (np.arange(n) - np.repeat(cu[:-1], counts)) if self.sampler.grammar.needed(rows) else None
        parts = [logit_rows, expanded, cu] + ([offsets] if offsets is not None else [])
        if self.proposer.needs_step_inputs:  # blocks were appended for this step already
            parts.append(states.num_blocks[rows] * states.block_size)
        packed = to_device(np.concatenate(parts).astype(np.int64), self.device)
        logit_index, expanded_idx, cu_dev = packed[:n], packed[n:2 * n], packed[2 * n:2 * n + b + 1]
        rest = packed[2 * n + b + 1:]
        offsets_dev = None
        if offsets is not None:
            offsets_dev, rest = rest[:n], rest[n:]
        if not self.proposer.needs_step_inputs:
            return VerifyPlan(expanded, logit_index, expanded_idx, cu_dev, offsets=offsets_dev)
        start = np.fromiter((e.start_pos for e in batch), dtype=np.int64, count=b)
        return VerifyPlan(expanded, logit_index, expanded_idx, cu_dev, rest, int(q_lens.sum()), int(q_lens.max()),
                          int((start + q_lens).max()), offsets_dev)

    def prepare_inputs(self, buffers, states: RequestStates, rows: np.ndarray, q_lens: np.ndarray,
                       speculative: np.ndarray) -> None:
        """Rewrite the speculating entries' inputs in the step buffers from the device counts:
        positions from `known`, input ids `last_sampled` then the drafts, their slots and seq lens."""
        ent = np.flatnonzero(speculative)
        if len(ent) == 0:
            return
        qsl = np.zeros(len(q_lens) + 1, dtype=np.int64)
        np.cumsum(q_lens, out=qsl[1:])
        tok_ent = np.repeat(ent, q_lens[ent])
        offset = np.arange(len(tok_ent)) - np.repeat(np.cumsum(q_lens[ent]) - q_lens[ent], q_lens[ent])
        host = np.concatenate([qsl[tok_ent] + offset, rows[tok_ent], offset, ent, rows[ent], q_lens[ent]])
        packed = to_device(host.astype(np.int64), self.device)
        t, e = len(tok_ent), len(ent)
        tok, tok_row, j = packed[:t], packed[t:2 * t], packed[2 * t:3 * t]
        ent_idx, ent_row, ent_q = packed[3 * t:3 * t + e], packed[3 * t + e:3 * t + 2 * e], packed[3 * t + 2 * e:]
        pos = self.known[tok_row].long() - 1 + j
        draft = self.drafts[tok_row, (j - 1).clamp(min=0)].clamp(min=0)
        buffers.input_ids[tok] = torch.where(j == 0, states.last_sampled[tok_row], draft)
        buffers.positions[tok] = pos
        bs = states.block_size
        blocks = states.block_table.gpu[tok_row, pos // bs].long()
        buffers.slot_mapping[tok] = blocks * bs + pos % bs
        buffers.seq_lens[ent_idx] = (self.known[ent_row].long() - 1 + ent_q).to(buffers.seq_lens.dtype)

    # ---- the step: sampling and the post-update ----------------------------------------------
    def sample_and_update(self, logits: torch.Tensor, plan: VerifyPlan, buffers, idx: torch.Tensor,
                          rows: np.ndarray, states: RequestStates) -> VerifyOutput:
        """logits [num_logits, V] in plan order; idx [B] the entries' rows on the device."""
        b = len(rows)
        positions = buffers.positions[plan.logit_index] + 1  # the position each row's token takes
        processed = self.sampler.process(logits, plan.expanded_rows, plan.expanded_idx, positions, plan.offsets)
        cu, entry_rows = plan.cu_num_logits, idx[:b].long()
        num_drafts = torch.minimum(self.num_drafts[entry_rows], (cu[1:] - cu[:-1] - 1).to(torch.int32))
        out = self.rejection.sample(processed.logits, processed.batch, processed.noise, cu,
                                    self.drafts[entry_rows], None, num_drafts)
        emitted = out.num_emitted.long()
        last = out.sampled.gather(1, (emitted - 1)[:, None])[:, 0]  # each entry's last emitted token
        logprobs = None  # from each entry's last emitted row; only rows that do not speculate ask
        if self.sampler.logprobs.needed(rows):
            logprobs = self.sampler.logprobs.read(logits[cu[:-1] + emitted - 1], last, rows)
        sample_mask = buffers.sample_mask[:b]
        post_update(idx, last, sample_mask, b, states.last_sampled, processed.output_counts)
        self._append(out.sampled, emitted * sample_mask.long(), entry_rows, states)
        drafts = self.proposer.propose(self._proposer_inputs(plan, buffers, idx, b, states, entry_rows))
        if self.synthetic:  # k drafts every step: those not found are token 0 (any token will do)
            self.drafts[entry_rows] = drafts.draft_ids.long().clamp(min=0)
            self.num_drafts[entry_rows] = self._all_k[:b]  # (a device tensor: a Python scalar here syncs)
        else:
            self.drafts[entry_rows] = drafts.draft_ids.long()
            self.num_drafts[entry_rows] = drafts.num_drafts
        grammar = plan.offsets is not None  # the engine walks its matchers through the next drafts
        return VerifyOutput(out.sampled, out.num_emitted, num_drafts, self.num_drafts[entry_rows], logprobs,
                            self.drafts[entry_rows] if grammar else None)

    def _proposer_inputs(self, plan: VerifyPlan, buffers, idx: torch.Tensor, b: int, states: RequestStates,
                         entry_rows: torch.Tensor) -> ProposerInputs:
        if not self.proposer.needs_step_inputs:
            return ProposerInputs(idx, b, states.token_table.gpu, self.known, self.k)
        t = plan.num_tokens
        meta = AttentionMetadata(buffers.query_start_loc[: b + 1], buffers.seq_lens[:b], buffers.block_tables[:b],
                                 buffers.slot_mapping[:t], max_query_len=plan.max_query_len,
                                 max_seq_len=plan.max_seq_len)
        wants = buffers.sample_mask[:b].bool() & self.speculating[entry_rows]
        return ProposerInputs(idx, b, states.token_table.gpu, self.known, self.k, positions=buffers.positions[:t],
                              input_ids=buffers.input_ids[:t], attn_metadata=meta, block_table=states.block_table.gpu,
                              block_size=states.block_size, slot_limit=plan.slot_limit, draft_mask=wants)

    def _append(self, sampled: torch.Tensor, emitted: torch.Tensor, entry_rows: torch.Tensor,
                states: RequestStates) -> None:
        """The emitted tokens into the device token table after each row's known ones; `known` advances."""
        base = self.known[entry_rows].long()
        # Columns past `known` hold nothing yet, so writing every slot (unused ones too) is safe;
        # the table has 1 + k spare columns for it.
        cols = base[:, None] + torch.arange(self.k + 1, device=self.device)
        states.token_table.gpu[entry_rows[:, None].expand_as(cols), cols] = sampled.to(torch.int32)
        self.known[entry_rows] = (base + emitted).to(torch.int32)
