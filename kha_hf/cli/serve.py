"""`kha serve MODEL`: serve a KHA (or any base) checkpoint through transformers' OpenAI-compatible server."""

from __future__ import annotations

from ._common import HelpFormatter, positive_int


def add_parser(sub) -> None:
    p = sub.add_parser(
        "serve",
        help="serve a checkpoint through transformers' OpenAI-compatible server (chat, completions, streaming)",
        description="Start transformers' own serving stack (FastAPI + uvicorn: /v1/chat/completions, /v1/completions, "
        "/v1/models, streaming) with MODEL preloaded. KHA checkpoints load through the installed kha_hf classes, so "
        "no code from the model folder runs. A KHA-Linear model can instead be folded (`kha fold`) and served by any "
        "engine. Needs the serving extras: pip install 'kha-hf[serve]'.",
        epilog="examples:\n"
        "  kha serve ./smollm2-kha --port 8000\n"
        "  kha serve ./smollm2-kha --continuous-batching --device cuda --dtype bfloat16\n"
        "then, from Python:\n"
        "  from openai import OpenAI\n"
        '  client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="none")\n'
        '  client.chat.completions.create(model="./smollm2-kha", messages=[{"role": "user", "content": "Hi"}])',
        formatter_class=HelpFormatter,
    )
    p.add_argument("model", metavar="MODEL", help="checkpoint folder or Hub id (KHA or a supported base)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (loopback by default)")
    p.add_argument("--port", type=positive_int, default=8000, help="port to listen on")
    p.add_argument(
        "--continuous-batching", action="store_true", help="paged attention with continuous batching (transformers)"
    )
    p.add_argument("--device", default="auto", help="device map: auto, cpu, cuda, cuda:N")
    p.add_argument("--dtype", default="auto", help="auto (from the weights), float32, bfloat16 or float16")
    p.add_argument(
        "--trust-remote-code", action="store_true", help="run model code shipped inside MODEL (never for KHA folders)"
    )
    p.add_argument("--ready-timeout", type=positive_int, default=300, help="seconds to wait for the model to load")
    p.set_defaults(func=run)


def run(args) -> int:
    from ..serving.server import serve

    serve(
        args.model,
        host=args.host,
        port=args.port,
        continuous_batching=args.continuous_batching,
        device=args.device,
        dtype=args.dtype,
        trust_remote_code=args.trust_remote_code,
        ready_timeout=args.ready_timeout,
    )
    return 0
