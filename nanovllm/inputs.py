"""Prompts as vLLM writes them: `TextPrompt` ({"prompt": str}) and `TokensPrompt`
({"prompt_token_ids": [int, ...]}), plain dicts at run time."""

from typing import TypedDict


class TextPrompt(TypedDict):
    prompt: str


class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]


PromptType = str | list[int] | TextPrompt | TokensPrompt
