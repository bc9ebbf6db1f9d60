"""An HTTP generation server over a rollout engine: SGLang's native `/generate` and OpenAI's chat API.

    python -m verl.experimental.reward_loop.generation_server --model PATH --port 30000 --served-model-name genrm-demo

It is what upstream's reward loop puts behind `reward_router_address` for a generative reward model
(verl/experimental/reward_loop/reward_model.py starts one per replica), and a stand-in for the
`vllm serve` / `sglang.launch_server` a user points a remote-judge reward function at (verl-recipe's
genrm_remote and FAPO's `*_remote` scripts expect an OpenAI server at localhost:30000). The model runs
in any rollout engine (`--engine hf`, the built-in one, by default); concurrent requests are batched
by `MicroBatchEngine` (requests with the same sampling settings that arrive together share a batch).

Endpoints (JSON in, JSON out):
- `POST /generate` (SGLang's): `input_ids` (a list of ids, or a list of such lists for a batch) or
  `text` (tokenized here, no special tokens added), and `sampling_params` {`max_new_tokens` (default
  128, SGLang's), `temperature` (default 1.0; 0 is greedy), `top_p`, `top_k` (-1: off)}. Reply:
  `{"text", "output_ids", "meta_info": {"id", "prompt_tokens", "completion_tokens",
  "finish_reason": {"type": "stop" | "length"}}}` (a list of those for a batch); `text` is decoded
  without special tokens.
- `POST /v1/chat/completions` (OpenAI's): `messages` rendered with the model's chat template (generation
  prompt added), `max_tokens` / `max_completion_tokens` (default: what fits the context), `temperature`
  (default 1.0), `top_p`, `n` (default 1). Reply: `chat.completion` with `choices[i].message.content`,
  `finish_reason` and `usage`.
- `POST /v1/completions`: `prompt` (text or ids), `max_tokens` (default 16, OpenAI's), the same sampling
  keys. Reply: `text_completion` with `choices[i].text`.
- `GET /health`, `GET /v1/models`.

A request the server cannot serve gets HTTP 400 and `{"error": {"message": ...}}` saying what: a missing
or malformed field, an unknown sampling key, a prompt plus `max_new_tokens` longer than the model's
context (`max_position_embeddings`), `n` < 1. Streaming (`stream: true`), logprobs and stop strings
are refused the same way (not implemented).
"""

from __future__ import annotations

import argparse
import asyncio
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from verl.experimental.agent_loop.engine import AsyncRolloutEngine, TokenOutput

SGLANG_DEFAULT_MAX_NEW_TOKENS = 128
OPENAI_COMPLETIONS_DEFAULT_MAX_TOKENS = 16
_SAMPLING_KEYS = {"max_new_tokens", "temperature", "top_p", "top_k"}
# SGLang sampling keys that change nothing here when left at their neutral value
_NEUTRAL_SAMPLING = {
    "skip_special_tokens": True,
    "n": 1,
    "min_new_tokens": 0,
    "repetition_penalty": 1.0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "stop": None,
    "stop_token_ids": None,
    "no_stop_trim": False,
    "ignore_eos": False,
    "spaces_between_special_tokens": True,
}


class RequestError(ValueError):
    """A request this server cannot serve: answered with HTTP 400 and the message."""


def _sampling(temperature: Any, top_p: Any, top_k: Any) -> dict:
    """The rollout's sampling keys (`do_sample`, `temperature`, `top_p`, `top_k`) of an API request."""
    try:
        temperature = 1.0 if temperature is None else float(temperature)
        top_p = 1.0 if top_p is None else float(top_p)
        top_k = -1 if top_k is None else int(top_k)
    except (TypeError, ValueError) as e:
        raise RequestError(f"temperature, top_p and top_k must be numbers: {e}") from None
    if temperature < 0 or not 0 < top_p <= 1:
        raise RequestError(f"temperature={temperature} must be >= 0 and top_p={top_p} in (0, 1]")
    if temperature == 0:
        return {"do_sample": False}
    return {"do_sample": True, "temperature": temperature, "top_p": top_p, "top_k": top_k}


def _ids(value: Any, what: str) -> list[int]:
    if not isinstance(value, list) or not value or not all(isinstance(t, int) and t >= 0 for t in value):
        raise RequestError(f"{what} must be a non-empty list of token ids (non-negative integers)")
    return value


class GenerationServer:
    """The endpoints over `engine` (an `AsyncRolloutEngine`) and the model's `tokenizer`.

    context_length: prompt + new tokens of one request at most (the model's `max_position_embeddings`).
    stop_ids: the tokens that end a generation (the engine's); the OpenAI replies' text leaves them out.
    """

    def __init__(
        self, engine: AsyncRolloutEngine, tokenizer, model_name: str, context_length: int, stop_ids: Sequence[int]
    ):
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.context_length = int(context_length)
        self.stop_ids = frozenset(int(t) for t in stop_ids)
        self.num_requests = 0

    # ------------------------------------------------------------------------------ generation
    def _budget(self, prompt: list[int], max_new_tokens: Any, default: int | None) -> int:
        room = self.context_length - len(prompt)
        if max_new_tokens is None:
            max_new_tokens = room if default is None else min(default, room)
        try:
            max_new_tokens = int(max_new_tokens)
        except (TypeError, ValueError):
            raise RequestError(f"max_new_tokens / max_tokens={max_new_tokens!r} must be an integer") from None
        if max_new_tokens < 1:
            raise RequestError(
                f"no room to generate: max_new_tokens={max_new_tokens}, prompt of {len(prompt)} tokens, context "
                f"{self.context_length}"
            )
        if max_new_tokens > room:
            raise RequestError(
                f"prompt of {len(prompt)} tokens + max_new_tokens={max_new_tokens} exceeds the model's context of "
                f"{self.context_length} tokens; ask for at most {max(room, 0)} new tokens or shorten the prompt"
            )
        return max_new_tokens

    async def _generate(
        self, prompts: Sequence[list[int]], sampling: dict, budgets: Sequence[int]
    ) -> list[TokenOutput]:
        self.num_requests += len(prompts)

        async def one(prompt, budget):
            async with self.engine.client() as engine:
                return await engine.generate(prompt, sampling, budget)

        return list(await asyncio.gather(*(one(p, b) for p, b in zip(prompts, budgets, strict=True))))

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def _text(self, out: TokenOutput) -> str:
        """An OpenAI reply's text: the continuation without the stop token that ended it."""
        ids = list(out.token_ids)
        return self._decode(ids[:-1] if out.stopped and ids and ids[-1] in self.stop_ids else ids)

    # ------------------------------------------------------------------------------ endpoints
    async def generate(self, body: Mapping) -> dict | list[dict]:
        """SGLang's `/generate`."""
        params = dict(body.get("sampling_params") or {})
        unknown = set(params) - _SAMPLING_KEYS - set(_NEUTRAL_SAMPLING)
        if unknown:
            raise RequestError(
                f"sampling_params keys {sorted(unknown)} are not supported; use {sorted(_SAMPLING_KEYS)}"
            )
        for key, neutral in _NEUTRAL_SAMPLING.items():
            if key in params and params[key] != neutral:
                raise RequestError(f"sampling_params.{key}={params[key]!r} is not supported (only {neutral!r})")
        if ("input_ids" in body) == ("text" in body):
            raise RequestError("give exactly one of input_ids (token ids) and text")
        if "text" in body:
            texts = body["text"] if isinstance(body["text"], list) else [body["text"]]
            if not all(isinstance(t, str) and t for t in texts):
                raise RequestError("text must be a non-empty string or a list of them")
            prompts = [self.tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
            batched = isinstance(body["text"], list)
        else:
            raw = body["input_ids"]
            batched = isinstance(raw, list) and bool(raw) and isinstance(raw[0], list)
            prompts = [_ids(p, "input_ids[i]") for p in raw] if batched else [_ids(raw, "input_ids")]
        sampling = _sampling(params.get("temperature"), params.get("top_p"), params.get("top_k"))
        budgets = [self._budget(p, params.get("max_new_tokens"), SGLANG_DEFAULT_MAX_NEW_TOKENS) for p in prompts]
        outs = await self._generate(prompts, sampling, budgets)
        replies = [
            {
                "text": self._decode(out.token_ids),
                "output_ids": list(out.token_ids),
                "meta_info": {
                    "id": uuid.uuid4().hex,
                    "prompt_tokens": len(prompt),
                    "completion_tokens": len(out.token_ids),
                    "finish_reason": {"type": out.stop_reason},
                },
            }
            for prompt, out in zip(prompts, outs, strict=True)
        ]
        return replies if batched else replies[0]

    def _openai_common(self, body: Mapping) -> tuple[dict, int]:
        if body.get("stream"):
            raise RequestError("stream=true is not supported: ask for the whole completion")
        if body.get("logprobs") or body.get("top_logprobs"):
            raise RequestError("logprobs are not supported by this server")
        if body.get("stop"):
            raise RequestError("stop strings are not supported by this server (generation stops at the EOS token)")
        n = body.get("n", 1)
        if not isinstance(n, int) or n < 1:
            raise RequestError(f"n={n!r} must be a positive integer")
        return _sampling(body.get("temperature"), body.get("top_p"), body.get("top_k")), n

    def _openai_reply(self, kind: str, id_prefix: str, choices: list[dict], prompt: list[int], outs) -> dict:
        """OpenAI's reply envelope (`kind`: chat.completion or text_completion) around `choices`."""
        completion = sum(len(o.token_ids) for o in outs)
        return {
            "id": f"{id_prefix}-{uuid.uuid4().hex}",
            "object": kind,
            "created": int(time.time()),
            "model": self.model_name,
            "choices": choices,
            "usage": {
                "prompt_tokens": len(prompt),
                "completion_tokens": completion,
                "total_tokens": len(prompt) + completion,
            },
        }

    async def chat_completions(self, body: Mapping) -> dict:
        """OpenAI's `/v1/chat/completions`."""
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise RequestError("messages must be a non-empty list of {role, content} objects")
        sampling, n = self._openai_common(body)
        try:
            prompt = self.tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        except Exception as e:  # a template error names the message it could not render
            raise RequestError(f"the chat template cannot render these messages: {e}") from None
        prompt = list(prompt["input_ids"] if isinstance(prompt, Mapping) else prompt)
        budget = self._budget(prompt, body.get("max_completion_tokens", body.get("max_tokens")), None)
        outs = await self._generate([prompt] * n, sampling, [budget] * n)
        choices = [
            {"index": i, "message": {"role": "assistant", "content": self._text(out)}, "finish_reason": out.stop_reason}
            for i, out in enumerate(outs)
        ]
        return self._openai_reply("chat.completion", "chatcmpl", choices, prompt, outs)

    async def completions(self, body: Mapping) -> dict:
        """OpenAI's `/v1/completions`."""
        raw = body.get("prompt")
        if isinstance(raw, str) and raw:
            prompt = self.tokenizer(raw, add_special_tokens=False)["input_ids"]
        else:
            prompt = _ids(raw, "prompt (a string or a list of token ids)")
        sampling, n = self._openai_common(body)
        budget = self._budget(prompt, body.get("max_tokens"), OPENAI_COMPLETIONS_DEFAULT_MAX_TOKENS)
        outs = await self._generate([prompt] * n, sampling, [budget] * n)
        choices = [
            {"index": i, "text": self._text(out), "finish_reason": out.stop_reason} for i, out in enumerate(outs)
        ]
        return self._openai_reply("text_completion", "cmpl", choices, prompt, outs)

    # ------------------------------------------------------------------------------ aiohttp
    def app(self):
        from aiohttp import web

        def handler(fn):
            async def handle(request):
                try:
                    body = await request.json()
                except Exception:
                    return web.json_response({"error": {"message": "the body must be a JSON object"}}, status=400)
                if not isinstance(body, dict):
                    return web.json_response({"error": {"message": "the body must be a JSON object"}}, status=400)
                try:
                    return web.json_response(await fn(body))
                except RequestError as e:
                    return web.json_response({"error": {"message": str(e)}}, status=400)

            return handle

        async def health(_request):
            return web.json_response({"status": "ok", "num_requests": self.num_requests})

        async def models(_request):
            return web.json_response(
                {"object": "list", "data": [{"id": self.model_name, "object": "model", "owned_by": "verl"}]}
            )

        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/generate", handler(self.generate))
        app.router.add_post("/v1/chat/completions", handler(self.chat_completions))
        app.router.add_post("/v1/completions", handler(self.completions))
        app.router.add_get("/health", health)
        app.router.add_get("/v1/models", models)
        return app


class ServerThread:
    """A `GenerationServer`'s aiohttp app (any object with `app()`) running in a thread of its own (its own
    event loop), so a synchronous caller (a Ray actor, a test, the command line) can start it and go on."""

    def __init__(self, server, host: str = "127.0.0.1", port: int = 0):
        self.server, self.host, self._port = server, host, int(port)
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._runner = None
        self.port: int | None = None
        self._thread = threading.Thread(target=self._run, name="generation-server", daemon=True)

    def start(self, timeout_s: float = 60.0) -> ServerThread:
        self._thread.start()
        if not self._ready.wait(timeout_s):
            raise TimeoutError(f"the generation server did not start within {timeout_s} s")
        if self._error is not None:
            raise RuntimeError(f"the generation server could not start on {self.host}:{self._port}") from self._error
        return self

    @property
    def address(self) -> str:
        """`host:port`, the form upstream's `reward_router_address` takes."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    def _run(self) -> None:
        from aiohttp import web

        asyncio.set_event_loop(self._loop)

        async def start():
            self._runner = web.AppRunner(self.server.app())
            await self._runner.setup()
            site = web.TCPSite(self._runner, self.host, self._port)
            await site.start()
            self.port = site._server.sockets[0].getsockname()[1]

        try:
            self._loop.run_until_complete(start())
        except BaseException as e:  # reported by start()
            self._error = e
            self._ready.set()
            return
        self._ready.set()
        self._loop.run_forever()

    def stop(self) -> None:
        """Close the server and end every task of its loop (the engine's batching task too)."""

        async def shutdown():
            await self._runner.cleanup()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        if self._runner is not None and self._loop.is_running():
            asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(timeout=30)
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)


def context_length(hf_config) -> int:
    """What one request may span: the text model's `max_position_embeddings`."""
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    value = getattr(text, "max_position_embeddings", None)
    if not value:
        raise ValueError(f"the model config ({type(hf_config).__name__}) has no max_position_embeddings")
    return int(value)


def build_engine_server(
    model_path: str,
    rollout_config,
    model_name: str | None = None,
    trust_remote_code: bool = False,
    max_batch_size: int | None = None,
) -> GenerationServer:
    """The server of the model at `model_path` in the rollout engine `rollout_config.name`.

    rollout_config: a full rollout section (DictConfig of `RolloutConfig`'s keys); its sampling keys are
    the defaults every request overrides.
    """
    from verl.experimental.agent_loop.engine import MicroBatchEngine, rollout_batch_generator
    from verl.utils.model import get_generation_config, load_model_config
    from verl.utils.tokenizer import hf_tokenizer
    from verl.workers.rollout import get_rollout_class

    tokenizer = hf_tokenizer(model_path, trust_remote_code=trust_remote_code)
    hf_config = load_model_config(model_path, trust_remote_code)
    eos = get_generation_config(model_path, trust_remote_code).eos_token_id
    stop_ids = [int(e) for e in (eos if isinstance(eos, list | tuple) else [eos]) if e is not None]
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in stop_ids:
        stop_ids.append(int(tokenizer.eos_token_id))
    if not stop_ids:
        raise ValueError(f"the model at {model_path!r} names no EOS token (generation_config or tokenizer)")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop_ids[0]
    rollout = get_rollout_class(rollout_config.name)(model_path, config=rollout_config, tokenizer=tokenizer)
    engine = MicroBatchEngine(
        rollout_batch_generator(rollout, stop_ids, int(pad), with_logprobs=False), max_batch_size=max_batch_size
    )
    server = GenerationServer(engine, tokenizer, model_name or model_path, context_length(hf_config), stop_ids)
    server.rollout = rollout  # kept alive (and reachable for sleep / wake_up)
    return server


def serving_rollout_config(overrides: Mapping[str, Any] | None = None, base=None):
    """A full rollout section for a serving engine: `base` (a composed trainer config's
    `actor_rollout_ref.rollout`; default: the packaged defaults') with `overrides` on top (the keys of
    `reward_model.rollout`, or the command line's; None values and keys a rollout section lacks are dropped)."""
    from omegaconf import OmegaConf

    if base is None:  # the packaged rollout.yaml (its interpolations all have defaults of their own)
        from pathlib import Path

        import verl

        base = OmegaConf.load(Path(verl.__file__).parent / "trainer" / "config" / "rollout" / "rollout.yaml")
    if OmegaConf.is_config(base):
        base = OmegaConf.to_container(base, resolve=True, throw_on_missing=False)
    base = OmegaConf.create(base)
    keys = set(base.keys())
    chosen = {k: v for k, v in dict(overrides or {}).items() if k in keys and v is not None}
    return OmegaConf.merge(base, OmegaConf.create(chosen))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="Hugging Face model directory")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--served-model-name", default=None, help="the `model` the replies name (default: --model)")
    parser.add_argument("--engine", default="hf", help="rollout engine: hf (built-in), vllm, sglang")
    parser.add_argument("--dtype", default=None, help="engine dtype (default: the engine's)")
    parser.add_argument("--trust-remote-code", action="store_true")
    args = parser.parse_args(argv)
    overrides = {"name": args.engine, "dtype": args.dtype}
    server = build_engine_server(
        args.model, serving_rollout_config(overrides), args.served_model_name, args.trust_remote_code
    )
    thread = ServerThread(server, args.host, args.port).start()
    print(f"serving {server.model_name} ({args.engine}) on http://{thread.address}", flush=True)
    try:
        thread._thread.join()
    except KeyboardInterrupt:
        thread.stop()


if __name__ == "__main__":
    main()
