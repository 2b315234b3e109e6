"""A frozen model served over the OpenAI API, for any client: talk to a trained policy, point a judge at it,
evaluate it with the ecosystem's tools.

  python -m arealjax.serve --model=DIR [--host=127.0.0.1] [--port=8000] [--api-key-env=NAME]
  python -m arealjax.serve --config=configs/x.py --workdir=RUN        # a run's latest checkpoint (LoRA too)

`/v1/models`, `/v1/chat/completions` (tools, n, stop, logprobs, stream) and `/v1/responses`: the routes, rendering
and refusals agents are trained against (workflows/routes.py, one implementation), over the generator's continuous
batching, which every concurrent request shares. Sizes come from `--config` (a recipe: `generator.*`, its dtype
and `lora.generator`), else from configs/default.py with a context of the checkpoint's (at most `--max-len`) and
`--slots` sequences at once. Loopback by default; bound elsewhere it needs a key (`--api-key-env`: the variable that
holds it). Bodies are bounded (413), requests in flight too (`--max-pending`: 429, which the SDK retries); SIGTERM
or Ctrl-C stops listening, lets requests in flight finish (`--grace` seconds) and exits.

A request samples with its own `seed` when it sends one (the same seed, prompt and settings give the same tokens),
else with a fresh one. `stream` sends the reply in a few events once it is generated (workflows/chat.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import secrets
import signal
import uuid
from pathlib import Path
from typing import Any

from arealjax.api import RolloutBackend, SamplingParams
from arealjax.tokenizer import Tokenizer
from arealjax.workflows.base import Episode, Prompt
from arealjax.workflows.chat import APIError, ChatSession
from arealjax.workflows.endpoint import Grant, HTTPServer, refuse

MAX_N = 16  # choices per request (the chat route's bound on `n`)


class ServedSession(ChatSession):
    """One request's session: nothing carries over between requests (each renders its messages afresh), and
    `seed` is honoured."""

    async def chat_completions(self, body: Any) -> dict:
        if isinstance(body, dict) and "seed" in body:
            seed = body["seed"]
            if seed is not None:
                if not isinstance(seed, int) or isinstance(seed, bool):
                    raise APIError(f"'seed' = {seed!r}: expected an integer", "seed")
                self.ep.sampling = dataclasses.replace(self.ep.sampling, seed=seed % 2**32)
            body = {k: v for k, v in body.items() if k != "seed"}
        return await super().chat_completions(body)


class ModelServer(HTTPServer):
    """The server: every request a `ServedSession` over `backend`, its key checked when one is set; `sampling`:
    the defaults of what a request does not set."""

    refusal = "missing or wrong API key (Authorization: Bearer <the key the server was started with>)"

    def __init__(self, backend: RolloutBackend, tokenizer: Tokenizer, name: str, *, host: str = "127.0.0.1",
                 port: int = 0, key: str = "", max_pending: int = 256, shutdown_seconds: float = 30.0,
                 sampling: SamplingParams | None = None):
        if not key and not loopback(host):
            raise ValueError(f"--host={host} is reachable from other machines: give the server a key "
                             "(--api-key-env=NAME, the variable holding it)")
        super().__init__(host, port, shutdown_seconds)
        self.backend, self.tokenizer, self.name, self.key = backend, tokenizer, name, key
        self.max_pending, self.pending, self.stopping = max_pending, 0, False
        # what a request leaves unsaid: OpenAI's defaults (T = 1, no cap but the context), stopping at end of turn
        self.sampling = sampling or SamplingParams(max_new_tokens=backend.max_len,
                                                   stop_token_ids=tuple(tokenizer.eos_ids))

    def grant(self, key: str) -> Grant | None:
        if self.key and not secrets.compare_digest(key.encode(), self.key.encode()):
            return None
        rid = f"serve-{uuid.uuid4().hex}"
        ep = Episode(Prompt(rid, [], {}), 0, rid, self.backend, None, self.tokenizer,
                     dataclasses.replace(self.sampling, seed=secrets.randbits(32)), self.backend.max_len)
        return Grant(key, ServedSession(ep, self.name, max_calls=MAX_N))

    async def _handle(self, request):
        refused = (APIError("the server is stopping", None, 503, "server_error") if self.stopping else
                   APIError(f"{self.pending} requests in flight, the server's bound (--max-pending); retry later",
                            None, 429, "rate_limit_error") if self.pending >= self.max_pending else None)
        if refused is not None:
            return refuse(refused)
        self.pending += 1
        try:
            return await super()._handle(request)
        finally:
            self.pending -= 1

    async def close(self) -> None:
        self.stopping = True
        await super().close()


def underscored(argv: list[str]) -> list[str]:
    """--api-key-env=X as --api_key_env=X: both spellings of a flag (absl knows the second)."""
    def one(a: str) -> str:
        name, eq, value = a.partition("=")
        return name.replace("-", "_").replace("__", "--", 1) + eq + value if a.startswith("--") else a
    return [one(a) for a in argv]


def loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


def default_config(model: str, max_len: int, slots: int) -> Any:
    """configs/default.py serving `model`: a context of the checkpoint's (at most `max_len`), `slots` sequences."""
    from arealjax.models import hf
    from configs.default import get_config

    cfg, _ = hf.read_config(model)
    config = get_config()
    config.model_path = model
    config.generator.max_len = min(max_len, cfg.max_position_embeddings)
    config.generator.slots = slots
    config.trainer.max_tokens = config.generator.max_len  # nothing trains; the checks ask a row to hold a sequence
    return config


async def serve(server: ModelServer, ready=None) -> None:
    """Runs `server` until SIGTERM or SIGINT, then stops it (requests in flight finish first)."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await server.start()
    print(f"serving {server.name} at {server.base_url} ({server.backend.max_len} tokens of context)", flush=True)
    if ready is not None:
        ready(server)
    await stop.wait()
    print(f"stopping: {server.pending} requests in flight", flush=True)
    await server.close()


def main(argv: list[str]) -> None:
    from absl import flags

    from arealjax import runtime

    f = flags.FLAGS
    if len(argv) > 1:
        runtime.fail(f"unexpected arguments: {argv[1:]}", 2)
    if not f.model and not f.workdir:
        runtime.fail("give --model=DIR (a Hugging Face directory) or --config=... --workdir=RUN", 2)
    key = ""
    if f.api_key_env:
        key = os.environ.get(f.api_key_env, "")
        if not key:
            runtime.fail(f"--api-key-env={f.api_key_env}: the variable is unset or empty", 2)
    if not key and not loopback(f.host):
        runtime.fail(f"--host={f.host} is reachable from other machines: give the server a key (--api-key-env=NAME, "
                     "the variable holding it)", 2)
    if f.workdir and f.config is None:
        runtime.fail("--workdir needs the run's --config (its model, LoRA and sizes)", 2)
    if f.model and (Path(f.model) / "adapter_config.json").is_file():
        runtime.fail(f"--model={f.model} holds LoRA adapters only (PEFT): serve the run's checkpoint instead "
                     "(--config=... --workdir=RUN; --config.lora.generator=on_the_fly keeps them unmerged), or "
                     "export it merged (--config.lora.export=merged)", 2)

    def body():
        config = f.config if f.config is not None else default_config(f.model, f.max_len, f.slots)
        runtime.setup(config)
        from arealjax.evaluate import frozen, served

        config = served(config, f.model, f.workdir)
        name = f.name or Path(f.model or f.workdir).resolve().name
        with frozen(config, f.workdir) as (backend, tokenizer):
            server = ModelServer(backend, tokenizer, name, host=f.host, port=f.port, key=key,
                                 max_pending=f.max_pending, shutdown_seconds=f.grace)
            asyncio.run(serve(server))

    runtime.guarded(body, f.debug, "server stopped")


if __name__ == "__main__":
    from absl import app, flags
    from ml_collections import config_flags

    from arealjax import runtime

    config_flags.DEFINE_config_file("config", None, "A recipe (generator sizes, dtype, LoRA); default: "
                                    "configs/default.py fitted to --model.", lock_config=True)
    flags.DEFINE_string("model", "", "A Hugging Face directory (config.json, safetensors, tokenizer).")
    flags.DEFINE_string("workdir", "", "Serve this run's latest checkpoint (with the run's --config).")
    flags.DEFINE_string("name", "", "The model's name in /v1/models (default: the directory's).")
    flags.DEFINE_string("host", "127.0.0.1", "Where to listen (loopback unless a key is given).")
    flags.DEFINE_integer("port", 8000, "The port (0: a free one, printed).")
    flags.DEFINE_string("api_key_env", "", "The environment variable holding the key clients must send.")
    flags.DEFINE_integer("max_pending", 256, "Requests in flight at most; more get 429 (the SDK retries).")
    flags.DEFINE_integer("max_len", 4096, "Without --config: tokens of context at most (prompt + reply).")
    flags.DEFINE_integer("slots", 16, "Without --config: sequences generated at once.")
    flags.DEFINE_float("grace", 30.0, "Seconds requests in flight get to finish on SIGTERM.")
    flags.DEFINE_bool("debug", False, "Show the traceback of an error.")
    app.run(main, flags_parser=lambda argv: runtime.parse_flags(underscored(argv), "python -m arealjax.serve"))
