"""Every check a request passes before any engine sees it, in one place: the router's gRPC ``Generate``, the
OpenAI HTTP API and the workers (which re-check what they receive) all call these functions.

Each raises ``ValueError`` with a message that names the field, the limit and the value, for the caller to
send back as INVALID_ARGUMENT (HTTP 400). The rules:

* ``request_id``: at most ``MAX_REQUEST_ID_CHARS`` characters (it is echoed in every streamed message);
* prompt: exactly one of text, token ids or chat messages, not empty; text and chat contents (with their
  tool calls and tools) at most ``MAX_PROMPT_BYTES`` of UTF-8 before tokenizing (longer never fits a context
  we serve, and tokenizing it would cost the router about a second per MiB); chat messages and tools as
  ``rpc.chat`` requires them (roles, tool call ids, function names, JSON) and fewer messages than context
  tokens; token ids inside the vocabulary; fewer tokens than the model's context, so that at least one can
  be generated;
* sampling: what ``SamplingParams.validate`` requires (finite numbers, temperature 0 or at least
  ``engine.sampling_params.MIN_TEMPERATURE``, top_p in (0, 1], repetition_penalty > 0, ...), plus at
  most ``MAX_STOP_STRINGS`` stop strings of at most ``MAX_STOP_CHARS`` characters and at most
  ``MAX_STOP_TOKEN_IDS`` stop token ids, all inside the vocabulary, and at most ``MAX_LOGIT_BIAS`` logit_bias
  entries, on token ids of the vocabulary; a structured output (``engine.structured_output``) of at most
  ``MAX_STRUCTURED_BYTES`` whose schema, regex, choice list or grammar parses (xgrammar parses it here,
  without the tokenizer: the worker compiles it against the vocabulary);
* resume (a stream a client received part of through another router, ``GenerateRequest.resume``): n = 1, and
  what a decode worker's continuation takes (``engine.continuation.check_continuation``): 1 to max_tokens - 1
  output tokens inside the vocabulary that leave room in the context, and a character count >= 0;
* length: like vLLM and OpenAI, an explicit ``max_tokens`` that does not fit beside the prompt in the
  context is refused rather than silently cut; an unset one is, as vLLM's two endpoints have it, the rest of
  the context for chat messages and 16 for text or token ids (lowered to the room left). A
  request that sets ``streaming_window`` (StreamingLLM: its KV stays the same size however long it runs)
  has no context bound on its prompt nor on ``max_tokens``; the worker checks its window against its block
  size and pool.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.continuation import Continuation, check_continuation
from engine.priorities import check_priority
from engine.sampling_params import SamplingParams, check_token_ids
from engine.tokenizer import Tokenizer
from kvstore.ring import UNBOUNDED
from protos.kvserve.v1 import kvserve_pb2 as pb
from rpc.chat import chat_messages, chat_texts, encode_chat
from rpc.convert import sampling_from_proto

MAX_REQUEST_ID_CHARS = 256
MAX_PROMPT_BYTES = 1 << 20  # 128 bytes per token of an 8k context; the bundled model's longest token has 81
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 256  # the engine checks every new token against this list
MAX_LOGIT_BIAS = 1024  # entries: each is one more index in the sampler's step
MAX_STRUCTURED_BYTES = 1 << 16  # a structured output's schema, regex, choices or grammar, as sent


def validate_generate(
    request: pb.GenerateRequest,
    tokenizer: Tokenizer | None,
    vocab_size: int,
    max_context: int,
) -> tuple[list[int], SamplingParams]:
    """A public request's prompt token ids and its ``SamplingParams``, or ``ValueError``.

    Tokenizing may take a while for long text: call it off the event loop.
    """
    validate_request_id(request.request_id)
    if is_streaming(request.sampling):
        max_context = UNBOUNDED
    ids = validate_token_ids(_prompt_ids(request, tokenizer, max_context), vocab_size, max_context)
    chat = request.WhichOneof("prompt") == "chat"
    return ids, validate_sampling(request.sampling, vocab_size, len(ids), max_context, fill_context=chat)


def validate_resume(request: pb.GenerateRequest, num_prompt_tokens: int, params: SamplingParams, vocab_size: int,
                    max_context: int) -> Continuation | None:  # fmt: skip
    """The continuation a request resumes (``GenerateRequest.resume``), checked; None when it resumes nothing."""
    if not request.HasField("resume"):
        return None
    if params.n > 1:
        raise ValueError(f"resume continues one stream; it cannot have n={params.n} choices")
    resume = request.resume
    if resume.num_chars < 0:
        raise ValueError(f"resume.num_chars must be >= 0, got {resume.num_chars}")
    continuation = Continuation(tuple(resume.output_token_ids), resume.num_chars)
    context = UNBOUNDED if is_streaming(request.sampling) else max_context
    check_continuation(continuation, num_prompt_tokens, params, vocab_size, context)
    return continuation


def is_streaming(opts: pb.SamplingOptions) -> bool:
    """Whether a request asks for StreamingLLM's window (then no context bounds its length)."""
    return opts.HasField("streaming_window") and opts.streaming_window > 0


def validate_request_id(request_id: str) -> None:
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        raise ValueError(f"request_id has {len(request_id)} characters; at most {MAX_REQUEST_ID_CHARS} are allowed")


def validate_token_ids(ids: Sequence[int], vocab_size: int, max_context: int) -> list[int]:
    """A prompt's ids as a list: not empty, shorter than the context (checked first: it is cheap), in the vocabulary."""
    if not ids:
        raise ValueError("prompt token_ids is empty")
    if len(ids) >= max_context:
        raise ValueError(f"prompt has {len(ids)} tokens; the model's context is {max_context} "
                         "(and at least one token must be generated)")  # fmt: skip
    ids = list(ids)
    check_token_ids(ids, vocab_size, "prompt token ids")
    return ids


def validate_sampling(
    opts: pb.SamplingOptions,
    vocab_size: int,
    num_prompt_tokens: int = 0,
    max_context: int | None = None,
    fill_context: bool = False,
) -> SamplingParams:
    """``opts`` as ``SamplingParams``; with ``max_context``, the prompt and ``max_tokens`` must fit in it, and
    an unset ``max_tokens`` is the room left when ``fill_context``, else at most ``SamplingParams``' 16."""
    if len(opts.stop) > MAX_STOP_STRINGS:
        raise ValueError(f"{len(opts.stop)} stop strings; at most {MAX_STOP_STRINGS} are allowed")
    long = [i for i, s in enumerate(opts.stop) if len(s) > MAX_STOP_CHARS]
    if long:
        raise ValueError(f"stop string {long[0]} has {len(opts.stop[long[0]])} characters; "
                         f"at most {MAX_STOP_CHARS} are allowed")  # fmt: skip
    if len(opts.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise ValueError(f"{len(opts.stop_token_ids)} stop_token_ids; at most {MAX_STOP_TOKEN_IDS} are allowed")
    if len(opts.logit_bias) > MAX_LOGIT_BIAS:
        raise ValueError(f"logit_bias has {len(opts.logit_bias)} entries; at most {MAX_LOGIT_BIAS} are allowed")
    if opts.HasField("structured_output") and opts.structured_output.ByteSize() > MAX_STRUCTURED_BYTES:
        raise ValueError(f"structured_output is {opts.structured_output.ByteSize()} bytes; at most "
                         f"{MAX_STRUCTURED_BYTES} are allowed")  # fmt: skip
    if opts.HasField("priority"):
        check_priority(opts.priority)
    params = sampling_from_proto(opts)
    params.validate(vocab_size)
    if max_context is not None and not is_streaming(opts):
        room = max_context - num_prompt_tokens
        if not opts.HasField("max_tokens"):
            params.max_tokens = room if fill_context else min(params.max_tokens, room)
        elif params.max_tokens > room:
            raise ValueError(f"prompt ({num_prompt_tokens} tokens) + max_tokens ({params.max_tokens}) exceed the "
                             f"model's context of {max_context} tokens; ask for at most {room} new tokens")  # fmt: skip
    return params


def _prompt_ids(request: pb.GenerateRequest, tokenizer: Tokenizer | None, max_context: int) -> Sequence[int]:
    kind = request.WhichOneof("prompt")
    if kind is None:
        raise ValueError("the request has no prompt: set text, token_ids or chat")
    if kind == "token_ids":
        return request.token_ids.ids
    if tokenizer is None:
        raise ValueError(f"this cluster's model has no tokenizer (--skip-tokenizer-init): send token_ids, not {kind}")
    if kind == "text":
        if not request.text:
            raise ValueError("prompt text is empty")
        _check_prompt_bytes(len(request.text.encode()), "prompt text is")
        return tokenizer.encode(request.text)
    _check_prompt_bytes(sum(len(t.encode()) for t in chat_texts(request.chat)), "chat messages' contents are")
    messages, tools = chat_messages(request.chat, max_context)
    return encode_chat(tokenizer, messages, tools)


def _check_prompt_bytes(num_bytes: int, what_is: str) -> None:
    if num_bytes > MAX_PROMPT_BYTES:
        raise ValueError(f"{what_is} {num_bytes} bytes long (UTF-8); at most {MAX_PROMPT_BYTES} bytes are allowed")
