"""Long-prompt prefill on the CPU: the C++ paged attention vs the SDPA path, and whole prefills.

`--attention` (the default part): one layer's attention of SmolLM2's shape (9 query heads,
3 KV heads, head_dim 64, block size 16, scattered blocks) for one chunk of q_len tokens,
starting at position 0 or after `--context` tokens of earlier context, through the C++
kernel alone, the backend with the SDPA path forced, and (bfloat16) the backend with each
chunk kernel that runs here forced (`kernels.cpu.chunk_kernels`: AMX, AVX512-BF16), alternated call by call so that load from other
processes slows all alike. Prints the median of each and their ratios to SDPA: where the
C++ kernel's crosses the chunk kernel's gives `kernels.cpu.backend.DENSE_MIN_ROWS` and
`DENSE_MIN_WORK`.

`--prefill N [--chunk C]`: one N-token prompt through `ModelRunner.execute` in chunks of C
(the scheduler's --max-num-batched-tokens), median of `--repeats` prompts, with tok/s and
the GFLOPS that implies, attention counted (causal: each query row against the keys up
to its own), against the rate of a [2048, 576] x [576, 1536] bfloat16 matmul (best of 20) timed here;
the backend with long chunks through a chunk kernel ("amx", "avx512_bf16"), through SDPA ("sdpa"), and with
its C++ kernel for every chunk ("c++", `--deterministic`'s), prompts alternating between them.

    python -m benchmarks.dense_prefill [--dtype bfloat16] [--lens 16 32 64 128 512 2048]
    python -m benchmarks.dense_prefill --prefill 2048 8192 --chunk 2048 [--paths sdpa c++] [--threads 1]

Figures only; never a test.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch

from kernels.cpu import chunk_kernels
from kernels.cpu.backend import make_backend
from kernels.cpu.build import load

HEADS, KV_HEADS, D, BS = 9, 3, 64, 16


def _median(fn, repeats: int) -> float:
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def one_chunk(ctx: int, q_len: int, dtype: torch.dtype) -> dict:
    """The paged attention inputs of one chunk: its context on blocks scattered in a pool twice its size."""
    blocks = -(-ctx // BS)
    k, v = (torch.randn(2 * blocks + 1, BS, KV_HEADS, D).to(dtype) for _ in range(2))
    return dict(query=torch.randn(q_len, HEADS, D).to(dtype), k_cache=k, v_cache=v,
                block_tables=torch.randperm(2 * blocks)[:blocks][None] + 1,
                query_start_loc=torch.tensor([0, q_len]), context_lens=torch.tensor([ctx]))


def attention(dtype: torch.dtype, lens: list[int], context: int, repeats: int) -> None:
    ext = load()
    paths = {"C++": make_backend(ext).row_invariant_paged_attention,
             "SDPA": make_backend(ext, dense_min_rows=1, dense_min_work=0, chunk=None).paged_attention}
    for name in chunk_kernels.KERNELS:
        if chunk_kernels.available(ext, name) and dtype == torch.bfloat16:
            paths[name.upper()] = make_backend(ext, dense_min_rows=1, dense_min_work=0, chunk=name).paged_attention
    print(f"one layer's attention, {dtype}, {torch.get_num_threads()} threads; ms, median of {repeats}, "
          f"and each path's time / SDPA's")
    print(f"{'q_len':>6} {'start':>6} " + " ".join(f"{name:>9}" for name in paths)
          + " " + " ".join(f"{name + '/SDPA':>10}" for name in paths if name != "SDPA"))
    for q_len in lens:
        for start in (0, context):
            inputs = one_chunk(start + q_len, q_len, dtype)
            times = {name: [] for name in paths}
            for _ in range(repeats):  # alternated
                for name, fn in paths.items():
                    times[name].append(_median(lambda fn=fn, inputs=inputs: fn(**inputs), 1))
            med = {name: statistics.median(ts) * 1e3 for name, ts in times.items()}
            print(f"{q_len:>6} {start:>6} " + " ".join(f"{med[name]:>9.3f}" for name in paths) + " "
                  + " ".join(f"{med[name] / med['SDPA']:>10.2f}" for name in paths if name != "SDPA"), flush=True)


def model_flops(n: int, start: int, layers: int, hidden: int, inter: int) -> float:
    """Multiply-adds x 2 of a chunk of n tokens after `start`: projections, MLP, causal attention."""
    qkv = hidden * (HEADS + 2 * KV_HEADS) * D
    proj = n * (qkv + HEADS * D * hidden + 3 * hidden * inter)
    keys = n * start + n * (n + 1) / 2  # causal: row i sees start + i + 1 keys
    attn = 2 * keys * HEADS * D  # QK^T and PV
    return 2 * layers * (proj + attn)


def prefill(lengths: list[int], chunk: int, repeats: int, names: list[str]) -> None:
    from benchmarks.executor_step import _seq
    from services.executor.model_runner import ModelRunner
    from shared.messages import ExecuteStep
    from shared.model_files import resolve_model

    a, b = torch.randn(2048, 576, dtype=torch.bfloat16), torch.randn(576, 1536, dtype=torch.bfloat16)
    a @ b
    gemm = min(_median(lambda: a @ b, 1) for _ in range(20))  # the machine's rate, not the other jobs' share
    peak = 2 * 2048 * 576 * 1536 / gemm / 1e9
    print(f"bf16 matmul [2048,576]x[576,1536]: {gemm * 1e3:.2f} ms = {peak:.0f} GFLOPS")
    longest = max(lengths)
    r = ModelRunner(resolve_model("smollm2"), num_kv_blocks=(repeats + 2) * (longest // BS + 2))
    cfg = r.model.config
    print(f"dtype {r.dtype}, backend {r.backend.name}, {torch.get_num_threads()} threads, chunk {chunk}")
    ext = load()
    def through(name: str):
        if name == "c++":
            return dataclasses.replace(r.model.backend, paged_attention=r.model.backend.row_invariant_paged_attention)
        chunk = None if name == "sdpa" else name
        if chunk and not chunk_kernels.available(ext, chunk):
            raise SystemExit(f"--paths {name}: that kernel does not run here")
        return dataclasses.replace(r.model.backend, paged_attention=make_backend(ext, chunk=chunk).paged_attention)

    paths = {name: through(name) for name in names}
    prompt = 0
    for n in lengths:
        def run(path: str, n=n):
            nonlocal prompt
            r.model.backend = paths[path]
            prompt += 1
            toks = torch.randint(100, 40000, (n,)).tolist()
            table = list(range(1 + (prompt % (repeats + 1)) * (longest // BS + 1),
                               1 + (prompt % (repeats + 1) + 1) * (longest // BS + 1)))
            for s in range(0, n, chunk):
                seq = _seq(prompt, toks[s : s + chunk], s, table, BS)
                seq.sample = s + chunk >= n
                r.execute(ExecuteStep(step_id=prompt, seqs=[seq]))
        flops = sum(model_flops(min(chunk, n - s), s, cfg.num_hidden_layers, cfg.hidden_size,
                                cfg.intermediate_size) for s in range(0, n, chunk))
        times = {path: [] for path in paths}
        if n == lengths[0]:
            for path in paths:
                run(path)  # warm-up
        for _ in range(repeats):
            for path in paths:
                times[path].append(_median(lambda path=path: run(path), 1))
        for path, ts in times.items():
            t = statistics.median(ts)
            rate = flops / t / 1e9
            print(f"prefill {n} tokens, {path:>4}: {t:.3f} s = {n / t:.0f} tok/s, {rate:.0f} GFLOPS "
                  f"({100 * rate / peak:.0f}% of the matmul's) {[round(x, 3) for x in ts]}", flush=True)
        if "sdpa" in paths:
            for path in paths:
                if path != "sdpa":
                    ratio = statistics.median(times[path]) / statistics.median(times["sdpa"])
                    print(f"prefill {n} tokens: {path}/sdpa time ratio {ratio:.2f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--lens", type=int, nargs="+", default=[8, 16, 32, 48, 64, 96, 128, 256, 512, 2048])
    p.add_argument("--context", type=int, default=2048, help="earlier context of the mid-prompt chunks")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, help="torch's threads (default: torch's own choice)")
    p.add_argument("--prefill", type=int, nargs="*", help="prompt lengths to prefill through the model instead")
    p.add_argument("--chunk", type=int, default=2048)
    p.add_argument("--paths", nargs="+", choices=[*chunk_kernels.KERNELS, "sdpa", "c++"],
                   help="a chunk kernel for long chunks (amx: needs AMX tiles; avx512_bf16: AVX512-BF16), SDPA, or "
                        "the C++ kernel for every chunk (default: the best chunk kernel here, sdpa and c++)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.prefill:
        best = chunk_kernels.best(load())
        prefill(args.prefill, args.chunk, args.repeats, args.paths or [*([best] if best else []), "sdpa", "c++"])
    else:
        attention(getattr(torch, args.dtype), args.lens, args.context, args.repeats)


if __name__ == "__main__":
    main()
