"""Megatron's text-generation server for a checkpoint of pretrain_gpt.py, on the standard
library's HTTP server.

The library of tools/run_text_generation_server.py (its flags, `build_parser`; its entry,
`main`): `parse_request` reads Megatron's `PUT /api` request, naming the field a bad one gets
wrong (400); `GenerationServer` answers it with the checkpoint's TextGenerator
(gpt_pretraining.generation), on threads, one generation at a time.
"""

from __future__ import annotations

import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Dict, List, Optional, Tuple

from gpt_pretraining.generation import (
    OneLineErrorParser,
    add_model_args,
    generator_from_model_args,
)
from megatron.errors import UserError
from megatron.inference import SamplingOptions, TextGenerator

DEFAULT_TOKENS_TO_GENERATE = 64
MAX_PROMPTS = 128  # Megatron's limit per request
MAX_BODY_BYTES = 16 * 1024 * 1024


class BadRequest(Exception):
    """A request the client must fix: answered 400 with this message."""


def parse_request(body: bytes) -> Tuple[List[str], int, SamplingOptions]:
    """(prompts, tokens_to_generate, sampling) of a request body; BadRequest naming the field."""
    try:
        request = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise BadRequest(f"the body is not JSON ({error}); send a JSON object") from None
    if not isinstance(request, dict):
        raise BadRequest('the body must be a JSON object such as {"prompts": ["..."]}')
    prompts = request.get("prompts")
    if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
        raise BadRequest('"prompts" must be a list of strings')
    if not 1 <= len(prompts) <= MAX_PROMPTS:
        raise BadRequest(f'"prompts" must hold 1 to {MAX_PROMPTS} prompts, not {len(prompts)}')
    tokens = _number(request, "tokens_to_generate", int, DEFAULT_TOKENS_TO_GENERATE, 0)
    temperature = _number(request, "temperature", float, 1.0, 0.0)
    if temperature == 0.0:
        raise BadRequest('"temperature" must be > 0 (use "top_k": 1 for greedy decoding)')
    top_k = _number(request, "top_k", int, 0, 0)
    top_p = _number(request, "top_p", float, 0.0, 0.0)
    if top_p > 1.0:
        raise BadRequest(f'"top_p" {top_p} must lie in [0, 1]')
    seed = request.get("random_seed")
    if seed is not None:
        seed = _number(request, "random_seed", int, 0, 0)
    # top_k 1 is Megatron's greedy decoding; taken as argmax, it needs no random draws.
    sampling = SamplingOptions(
        greedy=top_k == 1, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed
    )
    return prompts, tokens, sampling


def _number(request: Dict[str, Any], field: str, kind: type, default: Any, minimum: float) -> Any:
    value = request.get(field, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BadRequest(f'"{field}" must be a number, got {json.dumps(value)}')
    if kind is int and value != int(value):
        raise BadRequest(f'"{field}" must be an integer, got {value}')
    if value < minimum:
        raise BadRequest(f'"{field}" must be >= {minimum}, got {value}')
    return kind(value)


class GenerationServer(ThreadingHTTPServer):
    """Serves `PUT /api` with `generator`, one generation at a time."""

    daemon_threads = True

    def __init__(self, address: Tuple[str, int], generator: TextGenerator) -> None:
        super().__init__(address, _Handler)
        self.generator = generator
        self.lock = threading.Lock()

    def answer(self, body: bytes) -> Dict[str, Any]:
        """The response to a request body; BadRequest for one the client must fix."""
        prompts, tokens_to_generate, sampling = parse_request(body)
        with self.lock:
            try:
                completions = self.generator.complete(prompts, tokens_to_generate, sampling)
            except ValueError as error:  # e.g. a prompt too long for the model's positions
                raise BadRequest(str(error)) from None
        detokenize = self.generator.tokenizer.detokenize
        tokens = [c.prompt_tokens + c.tokens for c in completions]
        return {
            "text": [c.full_text for c in completions],
            "segments": [[detokenize([token]) for token in row] for row in tokens],
            "tokens": tokens,
        }


class _Handler(BaseHTTPRequestHandler):
    server: GenerationServer

    def do_PUT(self) -> None:  # noqa: N802 (http.server's name)
        if self.path.rstrip("/") != "/api":
            self._reply(404, {"message": f"no endpoint {self.path}; use PUT /api"})
            return
        try:
            length = int(self.headers.get("Content-Length", "0"))
        except ValueError:
            length = -1
        if not 0 < length <= MAX_BODY_BYTES:
            self._reply(400, {"message": "send a JSON body with a Content-Length header"})
            return
        try:
            response = self.server.answer(self.rfile.read(length))
        except BadRequest as error:
            self._reply(400, {"message": str(error)})
            return
        except Exception as error:  # the server stays up; the client learns what failed
            self._reply(500, {"message": f"generation failed: {type(error).__name__}: {error}"})
            raise
        self._reply(200, response)

    def do_GET(self) -> None:  # noqa: N802
        self._reply(405, {"message": "use PUT /api with a JSON body"})

    do_POST = do_GET  # noqa: N815

    def _reply(self, status: int, payload: Dict[str, Any]) -> None:
        body = json.dumps(payload, ensure_ascii=False).encode("utf-8")
        self.send_response(status)
        self.send_header("Content-Type", "application/json; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (http.server's name)
        sys.stderr.write(f"{self.address_string()} {format % args}\n")


def build_parser() -> OneLineErrorParser:
    """The server's flags: the checkpoint and device flags of tools/generate.py, the address."""
    parser = OneLineErrorParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    add_model_args(parser)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=5000, help="0 picks a free port")
    parser.add_argument("--max-batch-size", type=int, default=32, help="prompts per batch")
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    """Load the checkpoint and serve until interrupted; 1 with one `error:` line on bad input."""
    args = build_parser().parse_args(argv)
    try:
        if args.max_batch_size < 1:
            raise UserError(f"--max-batch-size {args.max_batch_size} must be >= 1")
        generator = generator_from_model_args(args, args.max_batch_size)
        try:
            server = GenerationServer((args.host, args.port), generator)
        except OSError as error:
            raise UserError(
                f"cannot listen on --host {args.host} --port {args.port} ({error}); pick "
                "another --port (0: any free one) or --host"
            ) from None
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    host, port = server.server_address[:2]
    _log(f"serving PUT http://{host}:{port}/api")
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


def _log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
