"""The command line: `nanovllm serve MODEL [--host] [--port] [--api-key] [engine options]`. The
engine options are LLM's own, as flags built from the Config dataclass (names and types)."""

import argparse
import dataclasses
import json
import os
import sys
import types

from nanovllm.config import Config, check_option_names, option_names
from nanovllm.serve.reasoning import REASONING_PARSERS
from nanovllm.serve.tools import TOOL_CALL_PARSERS

DEFAULT_PORT = 8000
API_KEY_ENV = "NANOVLLM_API_KEY"


def json_object(text: str) -> dict:
    """A flag's JSON object (vLLM's `--speculative-config '{"method": "ngram", ...}'`)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"not a JSON object: {text}")
    return value


def json_list(text: str) -> list:
    """A flag's JSON list of strings (vLLM's `--allowed-origins '["http://localhost:3000"]'`)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f"not a JSON list of strings: {text}")
    return value


def load_chat_template(value: str) -> str:
    """--chat-template's template: the file it names, or the text itself when it is Jinja; it
    must compile (ValueError naming the problem)."""
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    if os.path.isfile(value):
        with open(value) as f:
            value = f.read()
    elif not any(mark in value for mark in ("{{", "{%")):
        raise ValueError(f"--chat-template {value!r} is neither a file nor a Jinja template")
    try:
        ImmutableSandboxedEnvironment(extensions=[loopcontrols]).parse(value)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"--chat-template does not compile: {e} (line {e.lineno})") from None
    return value


def flag_type(annotation):
    """The argparse type of a Config field: int, float, str or bool (`X | None` is X); a field
    that takes a dict takes a JSON object."""
    if isinstance(annotation, types.UnionType):
        kinds = [a for a in annotation.__args__ if a is not type(None)]
        if dict in kinds:
            return json_object
        if len(kinds) == 1:
            annotation = kinds[0]
    if annotation in (int, float, str, bool):
        return annotation
    raise TypeError(f"no command-line flag for an option of type {annotation!r}")


def add_engine_options(parser: argparse.ArgumentParser):
    """One flag per engine option (`max_model_len` is `--max-model-len`); only the flags given
    reach LLM, so the defaults are Config's."""
    group = parser.add_argument_group("engine options (LLM(model, **options); docs: README.md)")
    fields = {f.name: f for f in dataclasses.fields(Config)}
    for name in option_names():
        field = fields[name]
        kind = flag_type(field.type)
        flag = "--" + name.replace("_", "-")
        help = f"default: {field.default!r}"
        if kind is bool:
            group.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction,
                               default=argparse.SUPPRESS, help=help)
        else:
            metavar = "JSON" if kind is json_object else kind.__name__.upper()
            group.add_argument(flag, dest=name, type=kind, default=argparse.SUPPRESS,
                               metavar=metavar, help=help)


def add_serve_arguments(parser: argparse.ArgumentParser):
    add = parser.add_argument
    add("model", help="checkpoint directory, .gguf file or Hugging Face repo id")
    add("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    add("--port", type=int, default=DEFAULT_PORT)
    add("--api-key", default=os.environ.get(API_KEY_ENV),
        help=f"require 'Authorization: Bearer KEY' on /v1 (default: ${API_KEY_ENV}, else none)")
    add("--served-model-name", default=None,
        help="the model's name in requests and /v1/models (default: MODEL as given)")
    add("--shutdown-timeout", type=float, default=30.0,
        help="on SIGTERM/SIGINT, seconds to let running requests finish before aborting them")
    add("--chat-template", default=None,
        help="a Jinja chat template (its file, or the template itself) to render chats with in "
             "place of the tokenizer's")
    add("--allowed-origins", type=json_list, default=["*"], metavar="JSON",
        help='CORS: origins a browser may call from (default: ["*"], as vLLM)')
    add("--allow-credentials", action="store_true", help="CORS: allow credentials")
    add("--allowed-methods", type=json_list, default=["*"], metavar="JSON",
        help="CORS: methods (default: [\"*\"])")
    add("--allowed-headers", type=json_list, default=["*"], metavar="JSON",
        help="CORS: headers (default: [\"*\"])")
    add("--enable-tokenizer-info-endpoint", action="store_true",
        help="serve GET /tokenizer_info (the tokenizer's config and chat template), which "
             "lm-eval's local-completions needs to tokenize through the server")
    add("--enable-auto-tool-choice", action="store_true",
        help='tool_choice "auto": read the model\'s own tool calls out of its text (needs '
             "--tool-call-parser)")
    add("--tool-call-parser", choices=TOOL_CALL_PARSERS, default=None,
        help="the format the model writes its tool calls in (hermes: Qwen2.5, Qwen3)")
    add("--reasoning-parser", choices=REASONING_PARSERS, default=None,
        help="a thinking model's <think> block goes to the message's `reasoning`, apart from "
             "its content (qwen3: Qwen3)")
    add("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    add_engine_options(parser)


def engine_options(args: argparse.Namespace) -> dict:
    """The engine options given on the command line, checked by Config's own name check."""
    options = {name: getattr(args, name) for name in option_names() if hasattr(args, name)}
    check_option_names(options)
    return options


def cors_options(args: argparse.Namespace) -> dict:
    """Starlette's CORSMiddleware arguments from the CORS flags."""
    return dict(allow_origins=args.allowed_origins, allow_credentials=args.allow_credentials,
                allow_methods=args.allowed_methods, allow_headers=args.allowed_headers)


def serve_parser(prog: str = "nanovllm serve") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog, description="An OpenAI-compatible server (/v1/completions, "
        "/v1/chat/completions, /v1/models, /health, /metrics, /tokenize, /detokenize) over one "
        "nanovllm engine.")
    add_serve_arguments(parser)
    return parser


def serve_main(argv: list[str] | None = None, prog: str = "python -m nanovllm.serve"):
    """Parse, start the engine process, serve until SIGTERM or SIGINT, then end the engine."""
    parser = serve_parser(prog)
    args = parser.parse_args(argv)
    from nanovllm.serve.engine_client import EngineClient
    from nanovllm.serve.server import make_server  # fastapi and uvicorn: the [serve] extra

    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        parser.error("--enable-auto-tool-choice needs --tool-call-parser")
    try:
        chat_template = args.chat_template and load_chat_template(args.chat_template)
        engine = EngineClient(args.model, engine_options(args))
    except (TypeError, ValueError, FileNotFoundError) as e:
        parser.error(str(e))
    with engine:
        server = make_server(engine, args.served_model_name or args.model, args.host, args.port,
                             api_key=args.api_key, shutdown_timeout=args.shutdown_timeout,
                             log_level=args.log_level,
                             tokenizer_info=args.enable_tokenizer_info_endpoint,
                             tool_parser=args.tool_call_parser if args.enable_auto_tool_choice
                             else None, reasoning_parser=args.reasoning_parser,
                             chat_template=chat_template, cors=cors_options(args))
        server.run()


def main(argv: list[str] | None = None):
    """The `nanovllm` console script; `nanovllm serve ...` is its one command."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] != "serve":
        print("usage: nanovllm serve MODEL [options]   (nanovllm serve --help for the options)",
              file=sys.stderr)
        sys.exit(2)
    serve_main(argv[1:], prog="nanovllm serve")
