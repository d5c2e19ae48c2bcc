"""Every message that crosses a socket, one msgspec Struct per type, grouped by channel.

Each channel has a tagged union of the messages allowed on it; `shared.transport`
decodes a frame only into that union, so a stage never sees a type it did not expect.
Stages never import each other: this module is their whole contract.
"""

from __future__ import annotations

from typing import Any

from msgspec import Struct


class StructuredOutput(Struct, frozen=True):
    """A constraint on the output, enforced by a grammar engine token by token.
    kind: "json" (any JSON object), "json_schema", "regex", "choice" (spec: a JSON array of
    strings) or "grammar" (xgrammar's EBNF); spec: its text. JSON numbers are bounded to what
    a float64 / int64 holds (shared.json_grammar) unless unbounded_numbers."""

    kind: str
    spec: str = ""
    unbounded_numbers: bool = False


POOLING_KINDS = ("mean", "last", "cls")


class LoraAdapter(Struct, frozen=True):
    """A LoRA adapter (PEFT's files in `path`) a request runs under: the gateway's registry
    resolves a request's `model` to it. digest: SHA-256 of its files as registered; it keys
    the prefix cache (shared.block_digest) and the executor refuses files changed since."""

    name: str
    path: str
    digest: str


class SamplingParams(Struct, frozen=True):
    """What the user asked for; validated by the gateway, carried end to end."""

    max_tokens: int | None = 16  # None: the rest of the context (the tokenizer stage resolves it)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k cut
    seed: int | None = None
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    n: int = 1  # parallel samples: sequences that share the prompt's KV blocks
    use_beam_search: bool = False  # then n best of beam_width beams, greedy and deterministic
    beam_width: int = 4
    length_penalty: float = 1.0
    min_p: float = 0.0
    presence_penalty: float = 0.0  # OpenAI's: on the tokens generated so far
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # transformers' / vLLM's: on the prompt and the output
    logit_bias: list[tuple[int, float]] = []  # (token id, bias added to its logit)
    min_tokens: int = 0  # EOS and stop_token_ids are masked until this many tokens are out
    allowed_token_ids: list[int] = []  # empty: every token
    logprobs: int | None = None  # per output token: its logprob and this many top candidates
    prompt_logprobs: int | None = None  # the same for every prompt token but the first
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    echo: bool = False  # the tokenizer stage sends the prompt's text back with the first delta
    structured: StructuredOutput | None = None
    bad_words: list[str] = []  # never generated (the tokenizer stage fills bad_words_ids)
    bad_words_ids: list[list[int]] = []
    cache_salt: str | None = None  # requests with different salts never share cached blocks
    # an embedding request (POOLING_KINDS: "mean", "last", "cls"): prefill only, it ends with its
    # prompt's pooled last hidden state (a PooledOutput) instead of sampled tokens; max_tokens 1
    pooling: str | None = None
    lora: LoraAdapter | None = None  # run under this adapter (None: the base model)
    # False: never speculated (--speculative), whatever the engine's setting; the output is the same
    # either way (speculation is lossless), so this only trades the engine's speed for this request's
    speculative: bool = True


class ChatOptions(Struct, frozen=True):
    """How chat messages become a prompt (vLLM's chat fields)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    template_kwargs: dict[str, Any] = {}  # chat_template_kwargs, passed to the template
    tools: list[dict[str, Any]] = []  # OpenAI tool definitions, rendered by the template


class TokenLogprob(Struct, array_like=True, gc=False):
    """One token's log-probability (log-softmax of the model's raw logits), its rank in the
    vocabulary (1 = most likely), and the top candidates at its position, best first.
    token and bytes are filled in by the gateway."""

    token_id: int
    logprob: float
    rank: int = 0
    top: list[TokenLogprob] = []
    token: str = ""
    bytes: list[int] = []


class ToolCall(Struct, frozen=True):
    """A function call an assistant message made (OpenAI's tool_calls[i])."""

    id: str
    name: str
    arguments: str  # JSON text


class ChatMessage(Struct, frozen=True):
    role: str
    content: str
    tool_calls: list[ToolCall] = []  # an assistant message's calls
    tool_call_id: str | None = None  # a tool message: the call it answers
    name: str | None = None


# --- gateway -> tokenizer -------------------------------------------------------------
# A tokenizer replica is a stateless worker: it answers each message, keeping nothing per
# request once it answered (a grammar being compiled is all it holds meanwhile).


class GenerateRequest(Struct, tag=True):
    """A new request, to be made into a TokenizedRequest. Exactly one of prompt,
    prompt_token_ids, messages is set."""

    request_id: str
    params: SamplingParams
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[ChatMessage] | None = None
    chat: ChatOptions | None = None
    add_special_tokens: bool | None = None  # None: the default for the prompt's kind
    priority: int = 0  # lower is served first (--scheduling-policy priority); copied into the TokenizedRequest


class AbortRequest(Struct, tag=True):
    """The request must stop: to the scheduler that runs it (its blocks are freed), or to the
    tokenizer replica compiling its grammar (the compile is cancelled)."""

    request_id: str


class TokenizeRequest(Struct, tag=True):
    """/tokenize (and /v1/models' max_model_len): a prompt or chat messages to token ids,
    as a GenerateRequest of them would be; answered with a TokenizeResult."""

    request_id: str
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    chat: ChatOptions | None = None
    add_special_tokens: bool | None = None
    return_token_strs: bool = False


class DetokenizeRequest(Struct, tag=True):
    """/detokenize: token ids to text; answered with a TokenizeResult holding the text."""

    request_id: str
    token_ids: list[int]


GatewayToTokenizer = GenerateRequest | AbortRequest | TokenizeRequest | DetokenizeRequest


# --- tokenizer -> gateway -------------------------------------------------------------


class TokenizedRequest(Struct, tag=True):
    """A request ready for an engine: the tokenizer replica's answer to a GenerateRequest,
    which the gateway passes on to the scheduler of the engine it picks."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams  # max_tokens resolved, bad_words_ids filled
    eos_token_ids: list[int]
    arrival_time: float
    # params.structured compiled by the tokenizer stage (xgrammar's serialize_json), for the executor
    compiled_grammar: str = ""
    # A resumed request (its first engine was lost): the output its one sequence had produced,
    # which the client has. The scheduler recomputes prompt + these and generates on after
    # them, as after a preemption; set by the gateway, never by a tokenizer replica.
    output_token_ids: list[int] = []
    # the request's `priority` (GenerateRequest.priority): lower is scheduled first, under
    # --scheduling-policy priority; under fcfs only 0 is accepted
    priority: int = 0


class RequestError(Struct, tag=True):
    """A request ends with an error. status follows HTTP (400 bad input, 500 internal)."""

    request_id: str
    status: int
    message: str
    error_type: str = "invalid_request_error"
    param: str | None = None


class TokenizeResult(Struct, tag=True):
    request_id: str
    token_ids: list[int]
    max_model_len: int
    token_strs: list[str] | None = None
    text: str | None = None  # a DetokenizeRequest's answer


TokenizerToGateway = TokenizedRequest | RequestError | TokenizeResult


# --- gateway -> scheduler -------------------------------------------------------------
# Each gateway connects a DEALER to every engine's scheduler (its identity names it), so a
# request, its abort and its stop are sent in order on one pipe; the scheduler sends each
# step's tokens straight back to the gateway that sent the request.


class FinishRequest(Struct, tag=True):
    """The gateway's detokenizer found a stop string: end the sequence as finished, not
    aborted (only the sample seq_index when set, else every sequence of the request)."""

    request_id: str
    reason: str = "stop"
    seq_index: int | None = None


class WatchPool(Struct, tag=True):
    """A dashboard page is open: the scheduler sends a PoolSnapshot on the status
    channel every interval_s until ttl_s after it received this message. The gateway
    renews it while a page watches, so nothing is sent once nobody does."""

    interval_s: float = 0.25
    ttl_s: float = 3.0


class GatewayBeat(Struct, tag=True):
    """The gateway is alive: sent to every scheduler every GATEWAY_BEAT_S, so a scheduler
    aborts the requests of a gateway that died (`services.scheduler.gateway_watch`)."""

    instance: str


GatewayToScheduler = TokenizedRequest | AbortRequest | FinishRequest | WatchPool | GatewayBeat


# --- scheduler -> gateway -------------------------------------------------------------


class TokenDelta(Struct, tag=True):
    """Tokens one sequence of a request generated in one step; finish_reason set on its
    last one. seq_index tells the request's parallel samples (n > 1) apart."""

    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    finish_reason: str | None = None
    seq_index: int = 0
    logprobs: list[TokenLogprob] = []  # one per token_ids entry, when asked
    stop_token_id: int | None = None  # the token that ended it with "stop"
    num_cached_tokens: int = 0  # prompt tokens the prefix cache supplied (first delta)
    prompt_logprobs: list[TokenLogprob] = []  # prompt tokens 1.., on the request's first delta


class StepDeltas(Struct, tag=True):
    """The TokenDeltas of one step for one gateway, in one frame (one per step, not one
    per sequence); the gateway handles them in order, as if they had come one by one."""

    deltas: list[TokenDelta]


class PooledOutput(Struct, tag=True):
    """An embedding request's answer, in place of its TokenDeltas: the pooled last hidden state
    of its prompt (SamplingParams.pooling), unit length, as little-endian float32 bytes."""

    request_id: str
    embedding: bytes
    num_prompt_tokens: int
    num_cached_tokens: int = 0  # prompt tokens the prefix cache supplied


SchedulerToGateway = TokenDelta | RequestError | StepDeltas | PooledOutput


# --- scheduler -> executor ------------------------------------------------------------


class SeqSampling(Struct, frozen=True):
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: list[tuple[int, float]] = []
    allowed_token_ids: list[int] = []
    min_tokens: int = 0
    min_tokens_mask: list[int] = []  # tokens masked while output_index < min_tokens (EOS, stop ids)
    logprobs: int | None = None  # return the sampled token's logprob and this many top ones
    structured: StructuredOutput | None = None
    bad_words_ids: list[list[int]] = []  # a word's last token is masked after the rest of it
    compiled_grammar: str = ""  # structured, as the tokenizer stage compiled it (serialize_json)

    @property
    def needs_history(self) -> bool:
        """The penalties read the tokens generated so far."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def needs_output(self) -> bool:
        """The executor must see the tokens generated so far (penalties, a grammar's state)."""
        return self.needs_history or self.structured is not None or bool(self.bad_words_ids)


# A step built before the result of the step in flight (async scheduling) does not know
# the tokens that step samples: token_ids == [PREVIOUS_TOKEN] stands for the token this
# sequence (request_id, seq_index) sampled in the step the executor ran just before.
PREVIOUS_TOKEN = -1


class ScheduledSeq(Struct):
    """One sequence's share of a step: its new tokens and where their KV goes.

    token_ids are the tokens to run at positions start_pos..start_pos+len-1 (or
    [PREVIOUS_TOKEN]); the sequence attends over start_pos + len tokens of context
    through block_table; slot_mapping gives each new token's flat slot (block *
    block_size + offset). When sample is set, the last token's logits are sampled;
    output_index is the index of the token being produced, which seeds it reproducibly.

    What does not change between steps travels once (vLLM's new/cached request data):
    `sampling` (and `prompt_token_ids` when repetition_penalty reads them) only on the
    first step that names a request the executor holds nothing of; the executor keeps
    them per request (services/executor/seq_states.py) and fills them in on receipt.
    Another sequence of a held request brings only its `seed`. `output_token_ids` are the
    output tokens from index `output_start` on (the ones the executor has not been sent;
    empty when the sampling reads no output). A sender that sets `sampling` every step,
    with output_start 0 and the whole output, needs no state on either side.
    """

    request_id: str
    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    slot_mapping: list[int]
    sample: bool
    output_index: int
    sampling: SeqSampling | None = None  # None: the one the executor holds for this request
    num_logprobs: int = 0  # also return this many top (token, logprob) candidates (beams)
    # the tokens generated so far (when the penalties need them), and the prompt too for
    # repetition_penalty
    output_token_ids: list[int] = []
    prompt_token_ids: list[int] = []
    # prompt scoring: the first len(score_targets) new tokens' positions are scored against
    # these next tokens, with prompt_logprobs top candidates each
    score_targets: list[int] = []
    prompt_logprobs: int = 0
    seq_index: int = 0  # which sample of its request (a grammar's state is kept per sequence)
    seed: int | None = None  # this sequence's sampling seed (its request's held sampling, reseeded)
    output_start: int = 0  # output_token_ids start at this output index
    lora_slot: int = -1  # the executor's LoRA slot (ExecuteStep.lora_slots) this row runs under; -1: none
    # speculative decoding: proposed tokens that follow token_ids[0], also in token_ids (whose last
    # len(draft_token_ids) entries they are); the executor samples every one of those positions and
    # accepts the longest prefix it agrees with (StepResult.num_accepted)
    draft_token_ids: list[int] = []
    # speculative decoding with a draft model (--speculative draft): the executor's draft proposes this
    # many tokens after token_ids (theirs are the last num_proposals slots of slot_mapping) and puts
    # them in draft_token_ids and token_ids before the step runs (StepResult.proposed says which)
    num_proposals: int = 0


class ExecuteStep(Struct, tag=True):
    step_id: int
    seqs: list[ScheduledSeq]
    block_copies: list[tuple[int, int]] = []  # (src, dst) copy-on-write copies
    swap_out: list[tuple[int, int]] = []  # (device block, host block), done first
    swap_in: list[tuple[int, int]] = []  # (host block, device block), after swap_out
    # the executor forgets what it holds of these (request id, seq index) sequences (finished,
    # aborted, preempted), and first of everything it holds when reset_states (a new executor
    # session: after a restart or a lost step the scheduler sends every state again)
    released: list[tuple[str, int]] = []
    reset_states: bool = False
    # the rows of embedding requests (SamplingParams.pooling): (index in seqs, pooling kind, whether
    # the chunk ends the prompt, so that the result carries its pooled vector); empty otherwise
    pooling: list[tuple[int, str, bool]] = []
    # (slot, adapter) of every LoRA slot a row of this step names (at most --max-loras): the executor
    # loads an adapter into its slot when the slot holds another (services.executor.lora_slots)
    lora_slots: list[tuple[int, LoraAdapter]] = []


class SchedulerHello(Struct, tag=True):
    """A scheduler (re)started without a pool: the executor answers with ExecutorReady."""

    instance: str


SchedulerToExecutor = ExecuteStep | SchedulerHello


# --- executor -> scheduler ------------------------------------------------------------


class ExecutorReady(Struct, tag=True):
    """Sent when an executor (re)starts: the pool it allocated and the model's limits."""

    executor_id: str
    num_kv_blocks: int
    block_size: int
    max_model_len: int
    num_swap_blocks: int = 0  # host-memory blocks for swapped-out sequences
    # the executor process's instance id: a repeat from the same instance (an answer to a
    # SchedulerHello) is not a restart
    instance: str = ""
    vocab_size: int = 0  # token ids from peers are checked against it (0: not checked)
    # the step limits the executor was sized for (profiling pass, largest CUDA graph or compiled
    # batch); the scheduler schedules within them (0: not reported)
    max_num_seqs: int = 0
    max_num_batched_tokens: int = 0


class FailedRow(Struct, array_like=True):
    """One sequence of a step whose own computation failed (its grammar, processors, sampling,
    logprobs): it alone ends, with this status (400: its own constraints leave no token)."""

    index: int  # in the step's seqs
    status: int
    message: str


class StepResult(Struct, tag=True):
    """sampled[i] is the token of seqs[i] of the step, or -1 where it was not sampled or failed.
    A sequence with draft tokens produced its first num_accepted drafts, then sampled[i]."""

    step_id: int
    sampled: list[int]
    forward_s: float
    # top candidates of the seqs that asked (num_logprobs > 0), in step order, best first
    top_logprobs: list[list[tuple[int, float]]] = []
    # the sampled token's logprob, by sampled seq whose sampling asks (logprobs set), in step order
    logprobs: list[TokenLogprob] = []
    # the scored positions of the seqs with score_targets, in step order
    prompt_logprobs: list[list[TokenLogprob]] = []
    # sequences that failed alone (sampled -1); their entries in the lists above are placeholders
    failed: list[FailedRow] = []
    # the pooled vectors (float32 little-endian, unit length) of the step's pooling rows that end
    # their prompt, in step order (b"" for a failed one)
    embeddings: list[bytes] = []
    # of each seq with draft_token_ids, in step order: how many of its drafts were accepted (their
    # logprobs, when asked, come before its sampled token's in `logprobs`)
    num_accepted: list[int] = []
    # of each seq with num_proposals, in step order: the tokens the executor's draft model proposed
    # (its draft_token_ids, of which num_accepted counts the accepted)
    proposed: list[list[int]] = []


class StepFailed(Struct, tag=True):
    step_id: int
    message: str


ExecutorToScheduler = ExecutorReady | StepResult | StepFailed


# --- executor rank 0 -> the other ranks of its tensor-parallel group ------------------
# (broadcast over torch.distributed as msgspec bytes, services/executor/tp_group.py)


class RankKeepalive(Struct, tag=True):
    """Rank 0 is idle and alive: sent between steps so a dead peer is noticed."""


class RankStop(Struct, tag=True):
    """Rank 0 is stopping: the other ranks stop too."""


RankZeroToRanks = ExecuteStep | RankKeepalive | RankStop


# --- every stage -> gateway (status) --------------------------------------------------


class SchedulerStats(Struct):
    num_running: int = 0
    num_waiting: int = 0
    kv_blocks_total: int = 0
    block_size: int = 16
    kv_blocks_used: int = 0
    num_preemptions_total: int = 0
    num_steps_total: int = 0
    kv_blocks_cached: int = 0  # cached blocks no request holds
    kv_blocks_saved_by_sharing: int = 0  # block-table entries minus blocks held
    prefix_cache_queries_total: int = 0  # prompt tokens looked up
    prefix_cache_hits_total: int = 0  # of which found cached
    num_swapped_out_total: int = 0  # preemptions that moved KV to host memory
    num_swapped_in_total: int = 0
    # the KV pool by the paper's Figure 2 categories, in token slots
    kv_slots_token_states: int = 0
    kv_slots_reserved: int = 0  # reserved for tokens a request will still produce
    kv_slots_internal_frag: int = 0  # allocated but never to be used
    kv_slots_external_frag: int = 0  # free but unusable by the next waiting request
    # decode-only steps: wall time from scheduling to results applied, and the part of it
    # the executor spent in the model's forward pass
    decode_steps_total: int = 0
    decode_step_seconds_total: float = 0.0
    decode_forward_seconds_total: float = 0.0
    # LoRA adapters: running and waiting requests by adapter name, and the engine's --max-loras
    lora_running: dict[str, int] = {}
    lora_waiting: dict[str, int] = {}
    max_loras: int = 0
    # speculative decoding: steps of a sequence with proposed tokens, the tokens proposed, and of
    # them the ones accepted
    spec_decode_num_drafts_total: int = 0
    spec_decode_num_draft_tokens_total: int = 0
    spec_decode_num_accepted_tokens_total: int = 0


class Heartbeat(Struct, tag=True):
    stage: str
    replica: str
    pid: int
    state: str  # "ready", or what it waits for
    sent_at: float
    scheduler: SchedulerStats | None = None
    instance: str = ""  # new for every process, so a restart shows even under the same name
    engine: str = "engine-0"  # the engine a scheduler or executor belongs to (data parallelism)


# A block's state in PoolSnapshot.states: the byte is the index in BLOCK_STATES.
# free: holds nothing worth keeping; owned: one sequence holds it; shared: several do
# (reference count > 1: parallel samples, beams, prefix-cache hits); cached: kept by the
# prefix cache, held by nobody, evictable; swapped: a host swap-space block holding a
# swapped-out sequence's KV (swap_states only); reserved: part of a contiguous
# chunk no block table lists (--kv-policy reserve-*): held for a fork that has not
# started, or the buddy allocator's rounding past a reservation.
BLOCK_STATES = ("free", "owned", "shared", "cached", "swapped", "reserved")
BLOCK_FREE, BLOCK_OWNED, BLOCK_SHARED, BLOCK_CACHED, BLOCK_SWAPPED, BLOCK_RESERVED = range(6)


class PoolRow(Struct):
    """One sequence the scheduler knows: status "running", "waiting" or "swapped"."""

    request_id: str
    seq_index: int
    status: str
    num_prompt_tokens: int
    num_output_tokens: int
    num_computed_tokens: int
    max_tokens: int
    num_preemptions: int
    block_table: list[int]  # device blocks, logical order
    swapped_blocks: list[int] = []  # host swap-space blocks while swapped out


class PoolSnapshot(Struct, tag=True):
    """The KV pool of one scheduler, sent while a dashboard watches (see WatchPool).

    Per-block arrays are packed, one entry per block in block order: states one byte
    (an index in BLOCK_STATES); owners little-endian uint32, 1 + the index in rows of
    the first listed sequence holding the block, 0 for none or an unlisted one;
    ref_counts and fill little-endian uint16 (holders, capped at 65535; slots holding
    computed tokens). swap_states and swap_owners describe the host swap space the
    same way. rows lists running sequences first, at most a few hundred of
    num_rows_total. The kv_slots_* fields are the Figure 2 accounting of kv_policy.
    """

    engine: str
    instance: str
    sent_at: float
    kv_policy: str
    block_size: int
    num_blocks: int
    states: bytes
    owners: bytes
    ref_counts: bytes
    fill: bytes
    rows: list[PoolRow]
    num_rows_total: int
    num_swap_blocks: int = 0
    swap_states: bytes = b""
    swap_owners: bytes = b""
    num_running: int = 0
    num_waiting: int = 0
    num_swapped: int = 0
    num_preemptions_total: int = 0
    num_swapped_out_total: int = 0
    num_swapped_in_total: int = 0
    prefix_cache_queries_total: int = 0
    prefix_cache_hits_total: int = 0
    kv_slots_token_states: int = 0
    kv_slots_reserved: int = 0
    kv_slots_internal_frag: int = 0
    kv_slots_external_frag: int = 0
    kv_slots_free: int = 0


StatusToGateway = Heartbeat | PoolSnapshot
