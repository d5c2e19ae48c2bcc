"""How long one step of OPT-13B takes on one A100-40GB (fp16), as a linear model.

    step = fixed + prefill_token * (prompt tokens computed)
                 + decode_seq * (decoding sequences) + context_token * (their context)

- fixed 30 ms: reading 26 GB of weights at ~1.5 TB/s is ~17 ms per step, plus
  kernel launches and the framework's per-step work;
- prefill_token 0.15 ms: ~26 GFLOP per token at ~175 TFLOP/s achieved;
- decode_seq 0.3 ms: a decode token's share of the GEMMs once the batch is large,
  plus per-sequence sampling and bookkeeping in a 2023-era Python engine. This is
  the least certain constant; 0.3 ms puts the paged policy's batch sizes near the
  paper's Figure 13 (by Little's law, batched = rate x time per request);
- context_token 0.5 us: attention reads ~800 KB of K/V per context token
  (40 layers x 5120 x 2 x fp16) at ~1.5 TB/s.

A chunk of one token after the prompt is a decode; any other chunk is prefill
(including the recompute of a preempted sequence).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from services.scheduler.scheduler import ScheduledChunk


@dataclass(frozen=True)
class StepTimeModel:
    fixed_s: float = 0.030
    prefill_token_s: float = 0.15e-3
    decode_seq_s: float = 0.3e-3
    context_token_s: float = 0.5e-6

    def __call__(self, chunks: Iterable[ScheduledChunk]) -> float:
        """Seconds for a step, from its chunks as scheduled (before results apply)."""
        prefill = decode = context = 0
        for c in chunks:
            req = c.sequence
            if c.num_tokens == 1 and req.num_computed_tokens >= req.num_prompt_tokens:
                decode += 1
                context += req.num_computed_tokens + 1
            else:
                prefill += c.num_tokens
        return (
            self.fixed_s
            + self.prefill_token_s * prefill
            + self.decode_seq_s * decode
            + self.context_token_s * context
        )
