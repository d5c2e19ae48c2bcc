"""`transformers serve` on 127.0.0.1 with SmolLM2's weights, with or without continuous batching.

Runs inside the peers' venv (see setup_venv.sh). The weights are the Hugging Face directory
pagedserve itself loads (`shared.model_files.resolve_model`, converted once from the GGUF);
pass `--model-dir` to reuse the directory pagedserve's own venv converted.

With continuous batching on a CPU, transformers sizes its paged KV cache from the free
RAM (gigabytes here) and plans batches of 8192 tokens, which makes every step crawl; the
defaults below give it a cache like llama.cpp's peer (16384 tokens) and pagedserve's
2048-token batches instead.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, default=8101)
    parser.add_argument("--model-dir", type=Path, default=None, help="HF model directory (default: smollm2's)")
    parser.add_argument("--continuous-batching", action="store_true")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    parser.add_argument("--cb-block-size", type=int, default=32)
    parser.add_argument("--cb-num-blocks", type=int, default=512)
    parser.add_argument("--cb-max-batch-tokens", type=int, default=2048)
    return parser.parse_args(argv)


def serve_command(args: argparse.Namespace, model_dir: Path) -> list[str]:
    exe = Path(sys.executable).with_name("transformers")
    cmd = [str(exe), "serve", str(model_dir), "--host", "127.0.0.1", "--port", str(args.port),
           "--device", "cpu", "--dtype", args.dtype, "--log-level", "warning",
           "--continuous-batching" if args.continuous_batching else "--no-continuous-batching"]
    if args.continuous_batching:
        cmd += ["--cb-block-size", str(args.cb_block_size), "--cb-num-blocks", str(args.cb_num_blocks),
                "--cb-max-batch-tokens", str(args.cb_max_batch_tokens)]
    return cmd


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model_dir = args.model_dir
    if model_dir is None:
        from shared.model_files import resolve_model

        model_dir = resolve_model("smollm2")
    cmd = serve_command(args, model_dir)
    if args.threads is not None:
        os.environ["OMP_NUM_THREADS"] = str(args.threads)  # torch's intra-op pool reads it at start
    print(" ".join(cmd), flush=True)
    os.execv(cmd[0], cmd)


if __name__ == "__main__":
    raise SystemExit(main())
