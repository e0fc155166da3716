"""The OpenAI wire format: request bodies (validated strictly from JSON, unknown fields ignored as
OpenAI and vLLM do), response bodies and the error body."""

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError


class _Request(BaseModel):
    # strict: "5" is not an int and 1.5 is not a bool; an int is still a valid float.
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Request):
    include_usage: bool = False


class _SamplingFields(_Request):
    """The sampling fields completions and chat share (OpenAI's, then vLLM's extensions)."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None  # token id (a string, as JSON keys are) -> bias
    # Not supported: refused with a 400 when set, rather than silently ignored.
    best_of: int | None = None
    # vLLM's extensions.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    structured_outputs: dict[str, Any] | None = None  # StructuredOutputsParams' fields
    return_token_ids: bool = False  # each choice (or chunk) also carries its token ids


class CompletionRequest(_SamplingFields):
    """POST /v1/completions: a prompt as text, token ids, or a list of either."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # the arguments as JSON text


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDefinition(_Request):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments


class Tool(_Request):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatMessage(_Request):
    role: str
    # A string, or OpenAI's list of parts of which only {"type": "text", "text": ...} are read.
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool's answer: to which call
    name: str | None = None


class _ChatTemplateFields(_Request):
    """How the chat template renders the messages (vLLM's fields; LLM.chat's arguments)."""

    messages: list[ChatMessage]
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # the last message left open, for the model to go on
    chat_template_kwargs: dict[str, Any] | None = None  # read by the template
    tools: list[Tool] | None = None  # rendered by the template


class ChatCompletionRequest(_SamplingFields, _ChatTemplateFields):
    """POST /v1/chat/completions: messages rendered by the model's chat template."""

    max_tokens: int | None = None  # default: the rest of the context
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens
    logprobs: bool = False
    top_logprobs: int | None = None
    # Default: "auto" with tools, else "none" (as OpenAI and vLLM).
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    response_format: dict[str, Any] | None = None


class TokenizeCompletionRequest(_Request):
    """POST /tokenize with a prompt (vLLM's endpoint)."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(_ChatTemplateFields):
    """POST /tokenize with messages: the prompt a chat completion would be given."""

    model: str | None = None
    add_special_tokens: bool = False  # the template places them
    return_token_strs: bool = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Request):
    """POST /detokenize (vLLM's endpoint)."""

    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # found in the prefix cache, not computed again


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning: str | None = None  # a thinking model's, with --reasoning-parser (vLLM's name)
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ToolCallDelta(ToolCall):
    index: int  # the call's place among the choice's calls


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: Delta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "nanovllm"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class APIError(Exception):
    """A request refused with an HTTP status and OpenAI's error body."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
             500: "internal_server_error", 503: "service_unavailable"}

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "error"),
                          "param": self.param, "code": self.code}}


def parse_request(model: type[BaseModel], body: bytes) -> BaseModel:
    """`body` as a `model`, or an APIError(400) naming the first invalid field."""
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        errors = e.errors(include_url=False)
        error = errors[0]
        if error["type"] == "json_invalid":
            raise APIError(400, f"the body is not valid JSON: {error['msg']}") from None
        param = str(error["loc"][0]) if error["loc"] else None
        value = f", got {error['input']!r}" if error["type"] != "missing" else ""
        # A union's alternatives each fail: name them rather than the first one's complaint.
        alternatives = [str(e["loc"][1]) for e in errors if len(e["loc"]) > 1
                        and e["loc"][0] == param and e["input"] is error["input"]]
        if len(alternatives) > 1:
            raise APIError(400, f"{param} must be one of {', '.join(alternatives)}{value}",
                           param) from None
        where = ".".join(str(part) for part in error["loc"]) or "body"
        raise APIError(400, f"{where}: {error['msg']}{value}", param) from None
