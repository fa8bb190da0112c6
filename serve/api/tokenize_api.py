"""The tokenizer over HTTP in vLLM's shapes, so harnesses that look for a server-side tokenizer use it:

  POST /tokenize     {"prompt": str} or {"messages": [...], "add_generation_prompt": true}
                     (+ "return_token_strs", "add_special_tokens": GPT-2 adds none either way)
                     -> {"count", "max_model_len", "tokens"[, "token_strs"]}
  POST /detokenize   {"tokens": [ids]} -> {"prompt": str}
  GET  /tokenizer_info -> {"tokenizer_class", "vocab_size", "bos_token", "eos_token", "model_max_length",
                           "chat_template"}

Messages are rendered by the chat route's template (serve.api.chat), so /tokenize of messages gives exactly the
prompt ids /v1/chat/completions runs. max_model_len is the longest prompt plus the most output tokens a
request may ask for (--max_prompt_tokens + --max_tokens): GLA and sliding-window states have no context limit
of their own; with attention layers it is at most --max_context.
"""

from __future__ import annotations

import asyncio

from aiohttp import web

from serve.api import chat, completions, protocol
from serve.api.protocol import ApiError


def _flag(obj, name, default):
  return protocol.get_field(obj, name, default, lambda v: isinstance(v, bool), "true or false")


def _check_model(obj, limits):
  model = obj.get("model")
  if model is not None and model != limits.model_name:
    raise ApiError(
      404,
      f"model {protocol.show(model)} is not served here: this server serves "
      f"'{limits.model_name}' (GET /v1/models).",
      "model",
    )


class TokenizerRoutes:
  """The three routes over a Server and its chat template: `TokenizerRoutes(server, template).register(app)`."""

  def __init__(self, server, template: chat.ChatTemplate):
    self.server, self.template = server, template

  def register(self, app: web.Application):
    app.router.add_post("/tokenize", self.tokenize)
    app.router.add_post("/detokenize", self.detokenize)
    app.router.add_get("/tokenizer_info", self.info)

  @property
  def max_model_len(self) -> int:
    most = self.server.limits.max_prompt_tokens + self.server.limits.max_tokens
    config = getattr(self.server.engine, "config", None)  # (an EngineConfig; a stub engine may have none)
    context = None if config is None else config.max_context  # attention layers' KV cache per slot
    return most if context is None else min(most, context)

  def _tokenize(self, obj: dict) -> dict:
    _check_model(obj, self.server.limits)
    _flag(obj, "add_special_tokens", True)  # checked, no effect: the GPT-2 tokenizer adds no special tokens
    strs = _flag(obj, "return_token_strs", False)
    if ("prompt" in obj) == ("messages" in obj):
      raise ApiError(400, "send exactly one of 'prompt' (a string) and 'messages' (chat messages).", "prompt")
    if "prompt" in obj:
      if not isinstance(obj["prompt"], str):
        raise ApiError(400, f"'prompt' is a {type(obj['prompt']).__name__}: expected a string.", "prompt")
      ids = self.server.tok.encode(obj["prompt"])
    else:
      gen = _flag(obj, "add_generation_prompt", True)
      ids = self.template.encode(self.template.render(chat.parse_messages(obj), gen))
    if len(ids) > self.max_model_len:
      raise ApiError(
        400,
        f"the {'prompt' if 'prompt' in obj else 'rendered messages'} hold {len(ids)} tokens: at "
        f"most {self.max_model_len} (max_model_len: --max_prompt_tokens + --max_tokens, at most "
        "--max_context) are tokenized per request.",
        "prompt" if "prompt" in obj else "messages",
      )
    out = {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids}
    if strs:
      out["token_strs"] = [self.server.tok.token_bytes([t]).decode("utf-8", "replace") for t in ids]
    return out

  def _detokenize(self, obj: dict) -> dict:
    _check_model(obj, self.server.limits)
    ids, vocab, most = obj.get("tokens"), self.server.limits.vocab_size, self.max_model_len
    if not (
      isinstance(ids, list) and len(ids) <= most and all(protocol.is_int(t) and 0 <= t < vocab for t in ids)
    ):
      raise ApiError(
        400,
        f"'tokens' is {protocol.show(ids)}: expected a list of at most {most} token ids in [0, {vocab}).",
        "tokens",
      )
    return {"prompt": self.server.tok.token_bytes(ids).decode("utf-8", "replace")}

  async def _run(self, request, fn):
    self.server.check_key(request)
    obj = await completions.read_json(request)
    out = await asyncio.get_running_loop().run_in_executor(None, lambda: fn(obj))
    return web.json_response(out)

  async def tokenize(self, request):
    return await self._run(request, self._tokenize)

  async def detokenize(self, request):
    return await self._run(request, self._detokenize)

  async def info(self, request):
    self.server.check_key(request)
    eos = self.template.eos
    return web.json_response(
      {
        "tokenizer_class": "GPT2Tokenizer",
        "vocab_size": self.server.limits.vocab_size,
        "bos_token": eos,
        "eos_token": eos,
        "model_max_length": self.max_model_len,
        "chat_template": self.template.source,
      }
    )
