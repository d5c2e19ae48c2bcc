"""Chooses how many rows the quantized weight copies serve, by timing real decode forward passes.

`quantization.calibrate` times the decoder's matmuls alone, one after another. There
the 4-bit weights (a quarter of the bfloat16 bytes) can stay in a large L3 between
calls, which a real step, whose attention and activations stream through the same
cache, does not allow: on one host an int4 matmul took 125 us in that loop and
475 us inside a step. So once the KV pool exists, the runner times whole decode
steps of m sequences both ways, int4 copies on and off (and then the int8 head on
and off), and keeps the largest m at which the quantized step is still faster. Steps of more
than MIXED_ABOVE rows are timed as a server runs them at that size: MIXED_ABOVE decode rows and
a prompt chunk, as C=64 runs them (decode-only steps of that size stood in before; on an AMX
Xeon the two kinds put the int4 tiles and the dense weights level within the host's noise). A
Q8_0 head's int8 copy on AMX tiles gets its own onset the same way. Where the
int4 copies can also run on AMX tiles (bfloat16), the smallest m from which that beats their
integer path is found first (`tiles_onset`).

The steps are forward passes only (no sampling), with every sequence at `context`
tokens read through its own blocks of the still empty pool, so attention reads as
much KV as it would in service; what the blocks hold does not change the time.
Both ways alternate and each keeps its best time, so a burst of load from another
process slows both alike. Calibration runs before the executor serves anything.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from services.executor.batch import BatchMetadata
from services.executor.quantization import ALL_ROWS, CALIBRATION_ROWS, rows_text
from shared.messages import ExecuteStep, ScheduledSeq, SeqSampling

log = logging.getLogger(__name__)

PREFILL_ROWS = 1024  # the prompt chunk timed once the quantized copies win at every decode size
PREFILL_REPS = 2  # timed rounds of that chunk each way
MIXED_ABOVE = 64  # larger int4 calibration steps: this many decode rows + a prompt chunk of the rest
TILES_ROWS = (16, 32, 64, 128)  # decode sizes tried for the int4 copies' AMX tiles, smallest first

GREEDY = SeqSampling(temperature=0.0, top_p=1.0, top_k=0, seed=None)


def decode_step(rows: int, context: int, block_size: int, num_blocks: int) -> ExecuteStep | None:
    """A decode step of `rows` sequences of `context` tokens on distinct blocks (block 0 left
    alone); None if the pool is too small for it."""
    per_seq = -(-context // block_size)
    if rows * per_seq > num_blocks - 1:
        return None
    seqs = []
    for i in range(rows):
        table = list(range(1 + i * per_seq, 1 + (i + 1) * per_seq))
        pos = context - 1
        slot = table[pos // block_size] * block_size + pos % block_size
        seqs.append(ScheduledSeq(request_id=f"calibration-{i}", token_ids=[1 + i], start_pos=pos,
                                 block_table=table, slot_mapping=[slot], sample=True, output_index=0,
                                 sampling=GREEDY))
    return ExecuteStep(step_id=0, seqs=seqs)


def mixed_step(decode_rows: int, chunk: int, context: int, block_size: int, num_blocks: int) -> ExecuteStep | None:
    """decode_step(decode_rows, context) and prefill_step(chunk) on blocks after theirs; None if the
    pool is too small."""
    step = decode_step(decode_rows, context, block_size, num_blocks)
    prompt = prefill_step(chunk, block_size, num_blocks, first_block=1 + decode_rows * -(-context // block_size))
    return None if step is None or prompt is None else ExecuteStep(step_id=0, seqs=[*step.seqs, *prompt.seqs])


def _forward_time(runner, meta: BatchMetadata) -> float:
    start = time.perf_counter()
    with torch.inference_mode():
        runner.model(meta, runner.kv_cache.k_caches, runner.kv_cache.v_caches)
    return time.perf_counter() - start


def _fitting_decode_step(runner, rows: int, context: int, mixed_above: int | None = None) -> ExecuteStep | None:
    """decode_step (or, past `mixed_above` rows, mixed_step with that many decode rows) with its
    context halved until it fits in the pool; None if never."""
    step, ctx = None, context
    while step is None and ctx >= 1:
        if mixed_above is not None and rows > mixed_above:
            step = mixed_step(mixed_above, rows - mixed_above, ctx, runner.block_size, runner.num_kv_blocks)
        else:
            step = decode_step(rows, ctx, runner.block_size, runner.num_kv_blocks)
        ctx //= 2
    return step


def _meta(runner, step: ExecuteStep) -> BatchMetadata:
    return BatchMetadata.from_step(step, runner.block_size, runner.num_kv_blocks, runner.device)


def _best_times(runner, meta, use: Callable[[bool], None], reps: int) -> tuple[float, float]:
    """Best forward time with use(False) and with use(True), alternating; the first round warms both."""
    off = on = float("inf")
    for rep in range(reps + 1):
        use(False)
        a = _forward_time(runner, meta)
        use(True)
        b = _forward_time(runner, meta)
        if rep:
            off, on = min(off, a), min(on, b)
    return off, on


def tiles_onset(runner, copies: list, context: int, rows: tuple[int, ...] = TILES_ROWS, reps: int = 3,
                label: str = "int4 linears") -> int:
    """Smallest m in `rows` from which a decode step of m sequences is faster with the copies (the int4
    linears', or the Q8_0 head's: `label`) on AMX tiles (q4_linear_tiles or q8_linear_tiles, from m rows
    on) than on their integer path, which is set as their `tiles_from`; ALL_ROWS (tiles never) if none is. The copies serve every step while it times. The
    onset is the model's: the tiles dequantize every weight once per call, which SmolLM2's shapes
    repay from ~28 rows and a 1B model's from between 32 and 64 (Xeon, benchmarks.quantized_linear_dram
    --tiles)."""
    for c in copies:
        c.max_rows = ALL_ROWS

    def use_tiles(m: int) -> None:
        for c in copies:
            c.tiles_from = m

    onset = ALL_ROWS
    for m in rows:
        step = _fitting_decode_step(runner, m, context)
        if step is None:
            break
        t_int, t_tiles = _best_times(runner, _meta(runner, step), lambda on, m=m: use_tiles(m if on else ALL_ROWS),
                                     reps if m <= 64 else 1)
        log.info("step calibration of %s' tiles: %d rows: integer %.2f ms, tiles %.2f ms", label, m,
                 t_int * 1e3, t_tiles * 1e3)
        if t_tiles < t_int:
            onset = m
            break
    use_tiles(onset)
    return onset


def crossover(runner, use_rows: Callable[[int], None], label: str, context: int,
              rows: tuple[int, ...] = CALIBRATION_ROWS, reps: int = 3, mixed_above: int | None = None) -> int:
    """Largest m in `rows` at which a step of m rows (decode rows; past `mixed_above`, that many
    decode rows and a prompt chunk of the rest) is faster with `use_rows(m)`
    (quantized copies serve m rows) than with `use_rows(0)` (dense); 0 if never; if faster at every
    m, ALL_ROWS when it is also faster on a prompt chunk of PREFILL_ROWS tokens, else the largest m
    (a calibration slowed by other load once extrapolated the int4 copies to 2048-token prefill
    chunks, where they ran ~4x slower than the dense matmul on an AMX host). Where m sequences of `context` tokens do not fit in the pool, their
    context is halved until they do (both ways read the same KV)."""
    best = 0
    for m in rows:
        step = _fitting_decode_step(runner, m, context, mixed_above)
        if step is None:
            break
        # steps of over 64 rows last long enough (0.05-0.7 s) that two timed rounds each way are
        # steady; more would add ~10 s to every start
        t_dense, t_quant = _best_times(runner, _meta(runner, step), lambda on, m=m: use_rows(m if on else 0),
                                       reps if m <= 64 else min(reps, 2))
        log.info("step calibration of %s: %d rows: dense %.2f ms, quantized %.2f ms", label, m,
                 t_dense * 1e3, t_quant * 1e3)
        if t_quant >= t_dense:
            break
        best = m
    else:
        best = 0
        if rows:
            best = ALL_ROWS if _faster_on_a_prompt_chunk(runner, use_rows, label) else rows[-1]
    use_rows(best)
    return best


def prefill_step(rows: int, block_size: int, num_blocks: int, first_block: int = 1) -> ExecuteStep | None:
    """One sequence's first prompt chunk of `rows` tokens on blocks first_block..; None if the pool is
    too small."""
    per_seq = -(-rows // block_size)
    if first_block + per_seq > num_blocks:
        return None
    table = list(range(first_block, first_block + per_seq))
    slots = [table[p // block_size] * block_size + p % block_size for p in range(rows)]
    seq = ScheduledSeq(request_id="calibration-prefill", token_ids=[1 + p % 1000 for p in range(rows)], start_pos=0,
                       block_table=table, slot_mapping=slots, sample=True, output_index=0, sampling=GREEDY)
    return ExecuteStep(step_id=0, seqs=[seq])


def _faster_on_a_prompt_chunk(runner, use_rows: Callable[[int], None], label: str) -> bool:
    """Whether the quantized copies (serving every step) beat the dense weights on a prompt chunk of
    PREFILL_ROWS tokens (fewer where the pool is smaller); one warm-up round, then the best of
    PREFILL_REPS timed rounds each way (with one, a 2-core AMX host gave the int4 tiles every step in
    one start of four: 215 against 242 ms, where alternated steps read 220-244 against 199-208)."""
    rows = PREFILL_ROWS
    step = prefill_step(rows, runner.block_size, runner.num_kv_blocks)
    while step is None and rows > 1:
        rows //= 2
        step = prefill_step(rows, runner.block_size, runner.num_kv_blocks)
    if step is None:
        return True
    dense, quantized = _best_times(runner, _meta(runner, step), lambda on: use_rows(ALL_ROWS if on else 0),
                                   PREFILL_REPS)
    log.info("step calibration of %s: a %d-token prompt chunk: dense %.2f ms, quantized %.2f ms", label, rows,
             dense * 1e3, quantized * 1e3)
    return quantized < dense


def calibrate_runner(runner, context: int = 128) -> list[str]:
    """Set the row limits of the runner's int4 linears and int8 head from timed decode steps;
    returns what was chosen, for the log. Leaves a model without quantized copies alone."""
    model = runner.model
    chosen = []
    copies = [m.int4 for m in model.decoder_linears() if m.int4 is not None]
    tiled = [c for c in copies if getattr(c, "tiles", None) is not None]
    if tiled and runner.dtype == torch.bfloat16:
        onset = tiles_onset(runner, tiled, context)
        chosen.append(f"int4 linears on AMX tiles (q4_linear_tiles) from {onset} rows (timed on decode steps)"
                      if onset < ALL_ROWS else "int4 linears never on AMX tiles (slower on every decode step timed)")
    if copies:
        def use_int4(m: int) -> None:
            for c in copies:
                c.max_rows = m

        rows = crossover(runner, use_int4, "int4 linears", context, mixed_above=MIXED_ABOVE)
        chosen.append(f"int4 linears serve {rows_text(rows)} (timed on decode steps, past {MIXED_ABOVE} rows "
                      "with a prompt chunk)")
    head = getattr(model, "head_int8", None)
    if head is not None and getattr(head, "tiles", None) is not None and runner.dtype == torch.bfloat16:
        onset = tiles_onset(runner, [head], context, label="int8 head")
        chosen.append(f"the int8 head on AMX tiles (q8_linear_tiles) from {onset} sampled rows (timed on decode "
                      "steps)" if onset < ALL_ROWS else "the int8 head never on AMX tiles (slower on every decode "
                      "step timed)")
    if head is not None:
        def use_head(m: int) -> None:
            head.max_rows = m

        rows = crossover(runner, use_head, "int8 head", context)
        chosen.append(f"the int8 head serves {rows_text(rows, 'sampled rows')} "
                      "(timed on decode steps)")
    return chosen
