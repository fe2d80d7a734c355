"""`switchboard serve`: run the engine behind a minimal OpenAI-compatible HTTP API."""

from __future__ import annotations

import argparse
import logging


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="switchboard")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve the engine over an OpenAI-compatible API")
    serve.add_argument("--model", default=None, help="HF folder or .gguf (default: SmolLM2)")
    serve.add_argument("--served-model-name", default="smollm2-135m-instruct")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--device", default=None)
    serve.add_argument("--dtype", default=None)
    serve.add_argument("--kv-cache-memory", type=int, default=None, help="bytes")
    serve.add_argument("--max-num-seqs", type=int, default=128)
    serve.add_argument("--max-num-batched-tokens", type=int, default=1024)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")

    import uvicorn

    from workers.async_engine import AsyncLLMEngine
    from workers.server import create_app

    engine = AsyncLLMEngine(
        args.model, device=args.device, dtype=args.dtype, kv_cache_memory=args.kv_cache_memory,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
    )
    app = create_app(engine, args.served_model_name)
    uvicorn.run(app, host=args.host, port=args.port, log_level="info")


if __name__ == "__main__":
    main()
