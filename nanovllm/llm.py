"""LLM: the front users call. It checks every request and hands it to one engine in this process
(engine/) or to engine replicas on Ray (ray/); both build outputs one way (engine/outputs.py)."""

import inspect
from collections.abc import Callable, Iterator
from itertools import count
from time import perf_counter

from tqdm.auto import tqdm

from nanovllm.engine.llm_engine import LLMEngine, StepResult
from nanovllm.engine.outputs import StreamOutput
from nanovllm.engine.requests import Request, make_requests
from nanovllm.outputs import RequestOutput
from nanovllm.ray.data_parallel import DATA_PARALLEL_OPTIONS, DataParallelEngine, uses_ray
from nanovllm.sampling_params import SamplingParams

PROGRESS_REFRESH_SECONDS = 0.1


def _is_conversation(messages) -> bool:
    return isinstance(messages, (list, tuple)) and bool(messages) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in messages)


def conversation_texts(tokenizer, messages, chat_template: str | None = None,
                       add_generation_prompt: bool = True, continue_final_message: bool = False,
                       chat_template_kwargs: dict | None = None,
                       tools: list[dict] | None = None) -> list[str]:
    """One conversation (a list of {"role", "content"} dicts) or a list of them, rendered as text
    by the chat template (the tokenizer's, or `chat_template`): the assistant's turn opened, or
    with `continue_final_message` the last message left open; `chat_template_kwargs` reach the
    template (Qwen3's {"enable_thinking": False}), and so do `tools` (OpenAI's function tools)."""
    is_one = isinstance(messages, list) and messages and isinstance(messages[0], dict)
    conversations = [messages] if is_one else messages
    if not isinstance(conversations, (list, tuple)) or not conversations:
        raise TypeError("messages must be a conversation (a list of message dicts) or a "
                        f"non-empty list of them, got {messages!r}")
    for i, conversation in enumerate(conversations):
        if not _is_conversation(conversation):
            raise TypeError(f"conversation {i} must be a non-empty list of "
                            f"{{'role': str, 'content': str}} dicts, got {conversation!r}")
    if add_generation_prompt and continue_final_message:
        raise ValueError("add_generation_prompt and continue_final_message cannot both be true: "
                         "continuing the last message opens no new turn")
    kwargs = _template_kwargs(tokenizer, chat_template_kwargs)
    return [tokenizer.apply_chat_template(
        list(c), chat_template=chat_template, tokenize=False,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message, tools=tools, **kwargs)
        for c in conversations]


def conversation_prompts(tokenizer, messages, **options) -> list[list[int]]:
    """conversation_texts (same options) as token ids."""
    # The chat template places the special tokens, so encoding adds none (as vLLM).
    return [tokenizer.encode(text, add_special_tokens=False)
            for text in conversation_texts(tokenizer, messages, **options)]


def _template_kwargs(tokenizer, chat_template_kwargs) -> dict:
    """chat_template_kwargs checked: a dict of names the template reads, none of them one of
    apply_chat_template's own arguments."""
    if chat_template_kwargs is None:
        return {}
    if not isinstance(chat_template_kwargs, dict) or not all(
            isinstance(k, str) for k in chat_template_kwargs):
        raise TypeError("chat_template_kwargs must be a dict of str -> value, got "
                        f"{chat_template_kwargs!r}")
    own = set(inspect.signature(tokenizer.apply_chat_template).parameters) - {"kwargs"}
    if taken := sorted(own & set(chat_template_kwargs)):
        raise ValueError(f"chat_template_kwargs {taken} are apply_chat_template's own arguments, "
                         "not the template's; pass them by their own names")
    return chat_template_kwargs


def _as_token_prompts(prompt_token_ids) -> list:
    """generate(prompt_token_ids=...): one token-id list or a list of them, as TokensPrompts."""
    ids = prompt_token_ids.tolist() if hasattr(prompt_token_ids, "tolist") else prompt_token_ids
    if not isinstance(ids, (list, tuple)) or not ids:
        raise TypeError(f"prompt_token_ids must be a token-id list or a list of them, got "
                        f"{prompt_token_ids!r}")
    batch = ids if isinstance(ids[0], (list, tuple)) or hasattr(ids[0], "tolist") else [ids]
    return [{"prompt_token_ids": p} for p in batch]


def throughput_postfix(prefill_tokens: int, prefill_seconds: float, decode_tokens: int,
                       decode_seconds: float) -> dict[str, str]:
    """The progress bar's rates: each kind of token over the seconds of the steps that ran it."""
    return {"prefill": f"{prefill_tokens / max(prefill_seconds, 1e-9):.0f} tok/s",
            "decode": f"{decode_tokens / max(decode_seconds, 1e-9):.0f} tok/s"}


class _Progress:
    """A call's progress bar: prompts completed, and the prefill and decode rates of its steps."""

    def __init__(self, use_tqdm: bool | Callable[..., tqdm], total: int):
        make_bar = use_tqdm if callable(use_tqdm) else tqdm
        self.bar = make_bar(total=total, desc="Generating", unit="req", dynamic_ncols=True,
                            disable=not use_tqdm)
        self.enabled = bool(use_tqdm)
        self.tokens = [0, 0]  # prefill, decode
        self.seconds = [0.0, 0.0]
        self.last_refresh = perf_counter()

    def on_step(self, result: StepResult):
        """Count a step (each is all prefill or all decode) and its seconds."""
        if result.num_prefill_tokens or result.num_decode_tokens:
            kind = 0 if result.num_prefill_tokens else 1
            self.tokens[kind] += result.num_prefill_tokens or result.num_decode_tokens
            self.seconds[kind] += result.seconds
            self._refresh(force=False)

    def completed(self):
        self.bar.update(1)
        self._refresh(force=self.bar.n == self.bar.total)

    def _refresh(self, force: bool):
        now = perf_counter()
        if self.enabled and (force or now - self.last_refresh >= PROGRESS_REFRESH_SECONDS):
            self.last_refresh = now
            self.bar.set_postfix(throughput_postfix(self.tokens[0], self.seconds[0],
                                                    self.tokens[1], self.seconds[1]))


class LLM:
    """`LLM(model, **options).generate(prompts, sampling_params)`, as vLLM's offline API. With
    `data_parallel_size > 1` the engines are Ray actors; the calls and outputs are the same."""

    def __init__(self, model: str, **options):
        self._request_ids = count()
        if uses_ray(options):
            self.llm_engine = DataParallelEngine(model, **options)
        else:
            for name in DATA_PARALLEL_OPTIONS:  # checked by uses_ray: one in-process engine
                options.pop(name, None)
            self.llm_engine = LLMEngine(model, **options)

    @property
    def tokenizer(self):
        return self.llm_engine.tokenizer

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def make_requests(self, prompts, sampling_params, stream: bool = False) -> list[Request]:
        """A batch tokenized and checked as generate checks it, not queued: `prompts` as generate
        takes them; `sampling_params` one or one per prompt."""
        self.llm_engine.check_alive()
        return make_requests(prompts, sampling_params, self.tokenizer, self.llm_engine.limits,
                             self._request_ids, stream, getattr(self.llm_engine, "grammars", None))

    def get_default_sampling_params(self) -> SamplingParams:
        return SamplingParams()

    def generate(self, prompts=None, sampling_params=None,
                 use_tqdm: bool | Callable[..., tqdm] = True, lora_request=None, *,
                 prompt_token_ids=None) -> list[RequestOutput]:
        """Run a batch to completion: a RequestOutput per prompt, in input order. `prompts`: a
        str, a token-id list, a TextPrompt / TokensPrompt dict, or a list mixing them (older
        vLLM: `prompt_token_ids=`); `sampling_params`: one, one per prompt, or None for the
        defaults. Other callers' requests share the steps. `use_tqdm` may be a tqdm factory."""
        prompts = self._prompts(prompts, prompt_token_ids, lora_request)
        outputs = dict(self.as_completed(prompts, sampling_params, use_tqdm))
        return [outputs[i] for i in range(len(outputs))]

    @staticmethod
    def _prompts(prompts, prompt_token_ids, lora_request):
        if lora_request is not None:
            raise ValueError("lora_request is not supported: this engine serves one model")
        if prompt_token_ids is None:
            if prompts is None:
                raise TypeError("generate() needs prompts (or prompt_token_ids=)")
            return prompts
        if prompts is not None:
            raise TypeError("pass prompts or prompt_token_ids=, not both")
        return _as_token_prompts(prompt_token_ids)

    def as_completed(self, prompts, sampling_params=None,
                     use_tqdm: bool | Callable[..., tqdm] = False,
                     ) -> Iterator[tuple[int, RequestOutput]]:
        """generate's outputs as each prompt's completes: (its index, its RequestOutput). The
        batch is checked now; closing the iterator early aborts the prompts not yet completed."""
        requests = self.make_requests(prompts, sampling_params)
        progress = _Progress(use_tqdm, len(requests))  # before anything is queued
        return self._as_completed(requests, progress)

    def _as_completed(self, requests: list[Request], progress: _Progress):
        try:
            for completed in self.llm_engine.as_completed(requests, progress.on_step):
                progress.completed()
                yield completed
        finally:
            progress.bar.close()

    def chat(self, messages, sampling_params=None,
             use_tqdm: bool | Callable[..., tqdm] = True, lora_request=None,
             chat_template: str | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, chat_template_kwargs: dict | None = None,
             tools: list[dict] | None = None) -> list[RequestOutput]:
        """Reply to one conversation (a list of {"role", "content"} dicts) or a list of them;
        the template's options as conversation_texts takes them."""
        self.llm_engine.check_alive()
        prompts = conversation_prompts(self.tokenizer, messages, chat_template=chat_template,
                                       add_generation_prompt=add_generation_prompt,
                                       continue_final_message=continue_final_message,
                                       chat_template_kwargs=chat_template_kwargs, tools=tools)
        return self.generate(prompts, sampling_params, use_tqdm, lora_request)

    def stream(self, prompts, sampling_params) -> Iterator[StreamOutput]:
        """Like generate (checked now, queued on iteration), yielding each step's new output."""
        return self.llm_engine.stream(self.make_requests(prompts, sampling_params, stream=True))

    def add_request(self, prompt, sampling_params) -> int:
        """Queue one request; returns its (first sample's) sequence id; samples 1.. of n follow."""
        engine = self._local("add_request")
        return engine.add(self.make_requests([prompt], [sampling_params]))[0].seq_id

    def step(self) -> StepResult:
        return self._local("step").step()

    def is_finished(self) -> bool:
        return self._local("is_finished").is_finished()

    def _local(self, method: str) -> LLMEngine:
        if not isinstance(self.llm_engine, LLMEngine):
            raise NotImplementedError(f"LLM.{method} steps one engine; with data-parallel "
                                      "replicas use generate, as_completed or chat")
        return self.llm_engine

    def update_weights(self, weights) -> None:
        """Copy (name, tensor) pairs or a state dict (checkpoint names, any subset, any device)
        into the weights in place, all checked first; refused while requests are unfinished."""
        self.llm_engine.update_weights(weights)

    def update_weights_from_path(self, path: str) -> None:
        """update_weights with the tensors of `path`/*.safetensors, checked from the headers."""
        self.llm_engine.update_weights_from_path(path)

    def sleep(self, level: int = 1) -> None:
        """Free the KV cache; level 1 keeps the weights in pinned host memory, level 2 discards
        them (reload them with update_weights() after wake_up())."""
        self.llm_engine.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Restore what sleep() freed: everything, or only tags ["weights"] or ["kv_cache"]
        (vLLM's order for RL: weights, update them, then the KV cache). A no-op when awake."""
        self.llm_engine.wake_up(tags)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; running requests are not affected. True (as vLLM: done)."""
        return self.llm_engine.reset_prefix_cache()

    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None) -> list:
        """vLLM's call on every worker, for the methods RL trainers call: "reload_weights" (the
        checkpoint's weights again) and "reset_prefix_cache"; one result per engine."""
        return self.llm_engine.collective_rpc(method, args, kwargs or {})

    def exit(self):
        """Stop the engines and release the GPUs, workers and shared memory. Idempotent."""
        self.llm_engine.exit()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.exit()
