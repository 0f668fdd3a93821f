"""Request and response models of the OpenAI-compatible API (pydantic v2; they make the OpenAPI schema).

Requests are validated strictly (`strict=True`): a string where a number belongs, a number where a
boolean belongs, NaN or infinity, or a value outside its range is a 400 with an OpenAI-style error
body, never a coercion. An unknown top-level field is a 400 naming it (OpenAI's behaviour: a
misspelled `max_token` must not silently run to the context end); OpenAI fields that change nothing
here (`user`, `store`, `metadata`, `parallel_tool_calls`, `service_tier`) are taken and ignored, and
parameters ignis cannot honour (n > 1, logit_bias, non-text response formats, echo, suffix) are
refused by name rather than silently dropped. Message objects keep their extra fields (they go to the
chat template), and `stream_options` ignores unknown keys. `tools`, `tool_choice`,
`parallel_tool_calls` and `response_format` are served (`ignis.runtime.server.agents`).

Extensions beyond OpenAI, as in vLLM: `top_k`, `min_tokens`, `repetition_penalty`, `stop_token_ids`,
`ignore_eos`, `return_token_ids`
(generated ids in `choices[i].token_ids`, prompt ids in `choices[i].prompt_token_ids`),
`chat_template_kwargs`, `add_generation_prompt`, `continue_final_message`, `add_special_tokens`,
`parse_special_tokens` (chat: encode special-token text in the messages as control tokens; off by
default, so content cannot forge a turn); and `/v1/completions` takes the prompt as a list of token
ids.

Streaming responses are server-sent events, one token per chunk (`ChatCompletionChunk`,
`CompletionChunk`), then `data: [DONE]`. The chunk that carries `finish_reason` also carries `usage`;
with `stream_options.include_usage` a last chunk with empty `choices` and `usage` follows, as OpenAI
sends it.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "MAX_SEED",
    "ChatCompletionChunk",
    "ChatCompletionRequest",
    "ChatCompletionResponse",
    "ChatMessage",
    "CompletionChunk",
    "CompletionRequest",
    "CompletionResponse",
    "ErrorResponse",
    "HealthResponse",
    "ModelCard",
    "ModelList",
    "StreamOptions",
    "Usage",
]

MAX_SEED = 2**64 - 1  # seeds are 0 <= seed < 2**64 (a lane's torch.Generator)
MAX_STOP_STRINGS = 16  # stop strings per request (each is searched after every token)
MAX_STOP_STRING_CHARS = 256  # characters per stop string

_REQUEST = ConfigDict(strict=True, extra="forbid")
_RESPONSE = ConfigDict(extra="allow")

NonNegFloat = Annotated[float, Field(ge=0, allow_inf_nan=False)]
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_STRING_CHARS)]
TokenId = Annotated[int, Field(ge=0)]


# ---------------------------------------------------------------- requests


class StreamOptions(BaseModel):
    """OpenAI `stream_options` (unknown keys, e.g. newer OpenAI options, are ignored)."""

    model_config = ConfigDict(strict=True, extra="ignore")

    include_usage: bool | None = Field(
        None, description="Send a last chunk with empty `choices` and the request's `usage`."
    )


class TextContentPart(BaseModel):
    """One part of a message's content; only text parts are served."""

    model_config = ConfigDict(strict=True, extra="allow")

    type: str = Field(description='"text" (other part types are refused: the model reads text only).')
    text: str | None = Field(None, description="The text of a text part.")


class ChatMessage(BaseModel):
    """One message of a conversation, handed to the model's chat template.

    Extra fields (e.g. `reasoning_content`, `tool_calls`) are kept and passed to the template.
    """

    model_config = ConfigDict(strict=True, extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"] = Field(description="Who wrote it.")
    content: str | list[TextContentPart] | None = Field(
        None, description="The text, or a list of text parts (joined in order)."
    )
    name: str | None = Field(None, description="An optional participant name.")
    tool_call_id: str | None = Field(None, description="For role tool: the call this answers.")


class _SamplingFields(BaseModel):
    """The sampling and stopping fields both endpoints share (vLLM's names and meanings)."""

    model_config = _REQUEST

    model: str | None = Field(
        None, description="The served model's id (see /v1/models); omitted means the served model."
    )
    temperature: NonNegFloat | None = Field(
        None,
        description="Sampling temperature >= 0 (default 1). 0 is greedy decoding; values in (0, 0.01) "
        "are raised to 0.01 (as vLLM does) to keep the distribution finite.",
    )
    top_p: float | None = Field(
        None, gt=0, le=1, allow_inf_nan=False, description="Nucleus mass in (0, 1]; 1 = off (default)."
    )
    top_k: int | None = Field(
        None, ge=-1, description="Keep the k most likely tokens; 0 or -1 = off (default)."
    )
    seed: int | None = Field(
        None, ge=0, le=MAX_SEED, description="Seeds the request's random stream (0 <= seed < 2**64)."
    )
    stop: StopString | list[StopString] | None = Field(
        None,
        max_length=MAX_STOP_STRINGS,
        description=f"Up to {MAX_STOP_STRINGS} stop strings; the output ends before the first one.",
    )
    stop_token_ids: list[TokenId] | None = Field(
        None, max_length=256, description="Token ids that end the output (the stop token is counted)."
    )
    ignore_eos: bool = Field(False, description="Keep generating past the model's end-of-sequence tokens.")
    stream: bool = Field(False, description="Stream server-sent events, one token per chunk.")
    stream_options: StreamOptions | None = Field(None, description="Streaming options.")
    n: int = Field(1, ge=1, description="Number of choices; only 1 is served (others are refused by name).")
    return_token_ids: bool = Field(
        False,
        description="Return the generated token ids in choices[0].token_ids and the prompt's in "
        "choices[0].prompt_token_ids (streamed: each chunk's token id).",
    )
    presence_penalty: float | None = Field(
        None,
        ge=-2,
        le=2,
        allow_inf_nan=False,
        description="In [-2, 2]: subtracted from the logit of every token already in the output (0 = off).",
    )
    frequency_penalty: float | None = Field(
        None,
        ge=-2,
        le=2,
        allow_inf_nan=False,
        description="In [-2, 2]: times a token's count in the output, subtracted from its logit (0 = off).",
    )
    repetition_penalty: float | None = Field(
        None,
        ge=0.01,
        le=100,
        allow_inf_nan=False,
        description="In [0.01, 100] (vLLM): a token of the prompt or output has its logit divided by it when "
        "positive, multiplied otherwise (1 = off).",
    )
    min_tokens: int | None = Field(
        None,
        ge=0,
        description="(vLLM) EOS and stop_token_ids cannot end the output, nor stop strings, before this many "
        "output tokens (0 = off).",
    )
    logit_bias: dict[str, float] | None = Field(None, description="Only an empty bias is served.")
    user: str | None = Field(None, description="Ignored.")
    store: bool | None = Field(None, description="Ignored (ignis stores no completions).")
    metadata: dict[str, str] | None = Field(None, description="Ignored.")
    service_tier: str | None = Field(None, description="Ignored (one tier).")


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(
        min_length=1, description="The conversation, rendered with the model's chat template."
    )
    max_tokens: int | None = Field(
        None, ge=1, description="Most output tokens (>= 1); omitted means until the context end."
    )
    max_completion_tokens: int | None = Field(
        None, ge=1, description="OpenAI's newer name for max_tokens (wins when both are given)."
    )
    logprobs: bool | None = Field(
        None, description="Return each output token's logprob (the model's own, speculation on or off)."
    )
    top_logprobs: int | None = Field(
        None, ge=0, le=20, description="With logprobs: also the N most likely tokens at each position."
    )
    response_format: dict[str, Any] | None = Field(
        None,
        description='{"type": "text"} (default), {"type": "json_object"} or {"type": "json_schema", '
        '"json_schema": {"name": ..., "schema": {...}}}: JSON output enforced by grammar-constrained '
        "decoding.",
    )
    tools: list[dict[str, Any]] | None = Field(
        None,
        description="Function tools (OpenAI's shape), shown to the chat template; the model's calls are "
        "returned as message.tool_calls.",
    )
    tool_choice: str | dict[str, Any] | None = Field(
        None,
        description='"none", "auto" (default with tools), "required" or {"type": "function", "function": '
        '{"name": ...}}; required and named calls are enforced by a grammar.',
    )
    parallel_tool_calls: bool | None = Field(
        None, description="false: at most one tool call per reply (default: several allowed)."
    )
    parallel_tool_calls: bool | None = Field(None, description="Ignored (tool calls are returned as text).")
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="Extra variables for the chat template (e.g. enable_thinking)."
    )
    add_generation_prompt: bool = Field(True, description="Append the assistant header to the prompt.")
    continue_final_message: bool = Field(
        False, description="Leave the last (assistant) message open and continue it."
    )
    parse_special_tokens: bool = Field(
        False,
        description="Encode special-token text in the messages, tools and chat_template_kwargs (e.g. "
        '"<|im_start|>") as control tokens, as HF apply_chat_template does. By default it is encoded as '
        "plain text, so only the chat template writes control tokens and content cannot forge a turn.",
    )


class CompletionRequest(_SamplingFields):
    """POST /v1/completions. The prompt is one text or one list of token ids."""

    prompt: str | list[TokenId] | list[str] | list[list[TokenId]] = Field(
        description="A text, or a list of token ids; a list holding exactly one of these is accepted too."
    )
    max_tokens: int | None = Field(16, ge=1, description="Most output tokens (>= 1; default 16, as OpenAI).")
    logprobs: int | None = Field(
        None, ge=0, le=20, description="Return each output token's logprob and the N most likely tokens."
    )
    echo: bool = Field(False, description="Not served: only false.")
    suffix: str | None = Field(None, description="Not served: only null.")
    best_of: int | None = Field(None, ge=1, description="Only 1 is served (others are refused by name).")
    add_special_tokens: bool = Field(
        True, description="Let the tokenizer add its special tokens (e.g. BOS) to a text prompt."
    )


# ---------------------------------------------------------------- responses


class PromptTokensDetails(BaseModel):
    """Where the prompt's tokens came from (OpenAI's `usage.prompt_tokens_details`)."""

    model_config = _RESPONSE

    cached_tokens: int = Field(
        0, description="Prompt tokens restored from a prompt checkpoint instead of prefilled."
    )


class Usage(BaseModel):
    """Token counts of one request (the stop token is a completion token)."""

    model_config = _RESPONSE

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class ChatCompletionMessage(BaseModel):
    """The assistant's reply."""

    model_config = _RESPONSE

    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[dict[str, Any]] | None = Field(
        None, description="The model's tool calls: {id, type: function, function: {name, arguments}}."
    )
    tool_call_errors: list[str] | None = Field(
        None, description="Why each malformed tool call (left in content as text) did not parse."
    )


class _ChoiceEnd(BaseModel):
    """The fields every choice ends with, whole or streamed, chat or text."""

    model_config = _RESPONSE

    index: int
    finish_reason: str | None = Field(
        None, description='"stop", "length" or "abort" on the last token; null before it.'
    )
    stop_reason: int | str | None = Field(None, description="The stop token id or stop string, else null.")
    logprobs: dict[str, Any] | None = Field(None, description="With logprobs: the output tokens' logprobs.")
    token_ids: list[int] | None = Field(
        None, description="Generated ids (with return_token_ids; streamed: the chunk's token)."
    )


class _Head(BaseModel):
    """The fields every completion, whole or streamed, starts with."""

    model_config = _RESPONSE

    id: str
    created: int = Field(description="Unix time (seconds) of the request.")
    model: str


class ChatChoice(_ChoiceEnd):
    """One choice of a chat completion."""

    message: ChatCompletionMessage
    prompt_token_ids: list[int] | None = Field(None, description="Prompt ids (with return_token_ids).")


class ChatCompletionResponse(_Head):
    """Body of a non-streamed chat completion."""

    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    """What one chunk adds to the reply (the role comes with the first token)."""

    model_config = _RESPONSE

    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = Field(
        None,
        description='Tool call deltas: {index, id, type, function: {name, arguments: ""}} first, then '
        "{index, function: {arguments}} fragments.",
    )


class ChatChunkChoice(_ChoiceEnd):
    """One choice of a streamed chunk."""

    delta: ChatDelta


class ChatCompletionChunk(_Head):
    """One server-sent event of a streamed chat completion (one token)."""

    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionChoice(_ChoiceEnd):
    """One choice of a (non-streamed or streamed) completion."""

    text: str
    prompt_token_ids: list[int] | None = Field(
        None, description="Prompt ids (with return_token_ids; streamed: in the first chunk)."
    )


class CompletionResponse(_Head):
    """Body of a non-streamed completion."""

    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: Usage


class CompletionChunk(_Head):
    """One server-sent event of a streamed completion (one token)."""

    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    """One served model."""

    model_config = _RESPONSE

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "ignis"
    max_model_len: int | None = Field(None, description="Context limit in tokens (prompt + output).")


class ModelList(BaseModel):
    """GET /v1/models."""

    model_config = _RESPONSE

    object: Literal["list"] = "list"
    data: list[ModelCard]


class HealthResponse(BaseModel):
    """GET /health."""

    model_config = _RESPONSE

    status: Literal["ok"] = "ok"
    lanes_active: int
    requests_waiting: int


class ErrorDetail(BaseModel):
    """The OpenAI error object."""

    model_config = _RESPONSE

    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    """Body of every 4xx and 5xx response."""

    model_config = _RESPONSE

    error: ErrorDetail
