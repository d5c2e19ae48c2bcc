"""SmolLM2's greedy outputs on benchmarks.speculative's prompt sets, saved for offline replay.

    python -m benchmarks.greedy_outputs [--copy 16] [--sharegpt 12] [--output-len 256] [--out PATH]

Greedy speculation is lossless, so each request's output token sequence is fixed whatever the
proposer: `benchmarks.ngram_acceptance` replays these sequences to count what proposers would get
accepted, exactly and independent of the host's load. Each prompt is rendered as the gateway renders
a chat request (`benchmarks.speculative` sends chat): the model's chat template with the generation
prompt, encoded without added special tokens. The model is the float32 HF directory the engine
loads (`resolve_model`), decoded greedily token by token with a KV cache, ignoring EOS as the
benchmark's `ignore_eos` does. Writes JSON: per set, a list of {"prompt": ids, "output": ids}.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

DEFAULT_OUT = Path("/tmp/pagedserve-greedy-outputs.json")


def chat_ids(tokenizer, prompt: str) -> list[int]:
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                         tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def greedy(model, prompt: list[int], n: int) -> list[int]:
    import torch
    from transformers import DynamicCache

    cache = DynamicCache()
    ids = torch.tensor([prompt])
    out: list[int] = []
    with torch.inference_mode():
        for _ in range(n):
            logits = model(input_ids=ids, past_key_values=cache, use_cache=True).logits
            tok = int(logits[0, -1].argmax())
            out.append(tok)
            ids = torch.tensor([[tok]])
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--copy", type=int, default=16)
    parser.add_argument("--sharegpt", type=int, default=12)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    import torch
    from transformers import AutoModelForCausalLM

    from benchmarks.speculative import copy_requests, sharegpt_requests
    from loadgen.tokenizer import tokenizer_for
    from shared.model_files import load_tokenizer, resolve_model

    path = resolve_model(args.model)
    tokenizer = load_tokenizer(args.model)
    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    bench_tok = tokenizer_for(args.model)
    sets = {"copy": copy_requests(bench_tok, args.output_len)[: args.copy],
            "sharegpt": sharegpt_requests(bench_tok, args.output_len, args.sharegpt)}
    result: dict[str, list[dict]] = {}
    for name, requests in sets.items():
        result[name] = []
        for i, req in enumerate(requests):
            prompt = chat_ids(tokenizer, req.prompt)
            output = greedy(model, prompt, args.output_len)
            result[name].append({"prompt": prompt, "output": output})
            print(f"{name} {i}: {len(prompt)} prompt tokens: {tokenizer.decode(output[:60])!r}", file=sys.stderr,
                  flush=True)
    args.out.write_text(json.dumps(result))
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
