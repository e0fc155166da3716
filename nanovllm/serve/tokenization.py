"""vLLM's tokenizer endpoints: POST /tokenize (a prompt, or messages rendered as a chat completion
renders them), POST /detokenize and GET /tokenizer_info. lm-eval's local-completions looks for
them and, when they answer, tokenizes through the server: no local copy of the tokenizer."""

import json

from nanovllm.engine.requests import RequestLimits
from nanovllm.serve.protocol import (
    APIError,
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
    parse_request,
)
from nanovllm.serve.responses import chat_prompt

# tokenizer_config.json's fields that name local files: not the client's business.
FILE_FIELDS = ("vocab_file", "merges_file", "tokenizer_file")


def parse_tokenize(body: bytes) -> TokenizeCompletionRequest | TokenizeChatRequest:
    """The chat form when the body has `messages`, else the prompt form (vLLM's two bodies)."""
    try:
        data = json.loads(body)
    except ValueError:
        data = None  # parse_request names the JSON error
    chat = isinstance(data, dict) and "messages" in data
    return parse_request(TokenizeChatRequest if chat else TokenizeCompletionRequest, body)


def tokenize(body: TokenizeCompletionRequest | TokenizeChatRequest, tokenizer,
             limits: RequestLimits) -> TokenizeResponse:
    """The prompt's token ids, as a completion (or, with messages, a chat completion) reads it."""
    text = chat_prompt(body, tokenizer) if isinstance(body, TokenizeChatRequest) else body.prompt
    tokens = tokenizer.encode(text, add_special_tokens=body.add_special_tokens)
    strs = tokenizer.convert_ids_to_tokens(tokens) if body.return_token_strs else None
    return TokenizeResponse(count=len(tokens), max_model_len=limits.max_model_len, tokens=tokens,
                            token_strs=strs)


def detokenize(body: DetokenizeRequest, tokenizer, limits: RequestLimits) -> DetokenizeResponse:
    """The ids' text, special tokens included; a 400 naming an id outside the vocabulary."""
    for token_id in body.tokens:
        if not 0 <= token_id < limits.vocab_size:
            raise APIError(400, f"tokens: token id {token_id} is outside the vocabulary "
                           f"[0, {limits.vocab_size})", "tokens")
    return DetokenizeResponse(prompt=tokenizer.decode(body.tokens))


def tokenizer_info(tokenizer) -> dict:
    """The tokenizer's config as tokenizer_config.json has it (vLLM's /tokenizer_info): its
    special tokens as text, its chat template, its class; file paths left out."""
    info = {k: v for k, v in (getattr(tokenizer, "init_kwargs", None) or {}).items()
            if k not in FILE_FIELDS}
    info = _as_json(info)
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        info[name] = getattr(tokenizer, name, None)
    info["chat_template"] = getattr(tokenizer, "chat_template", None)
    info["tokenizer_class"] = type(tokenizer).__name__
    return info


def _as_json(value):
    """A config value as JSON can hold it: an added token as its text, keys as strings, any
    other object as its repr."""
    if hasattr(value, "content"):  # tokenizers' AddedToken
        return value.content
    if isinstance(value, dict):
        return {str(k): _as_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_as_json(v) for v in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return repr(value)
