"""Conversions between the engine wire messages (kvstore_pb.engine_pb2) and the engine's types.

Pure functions, no I/O: the servicers in `engine.server` call them and map errors to status
codes. A bad value raises InvalidRequest (→ INVALID_ARGUMENT) naming the field.
"""

from __future__ import annotations

from engine.errors import InvalidRequest
from engine.requests import (
    DecodeRequest,
    DecodeStats,
    PrefillResult,
    TierTokens,
    TokenEvent,
)
from engine.runtime import ModelRuntime
from engine.sampling import DEFAULT_MAX_TOKENS, SamplingParams
from kvstore_pb import engine_pb2 as pb

KEY_BYTES = 16


def sampling_from_proto(msg: pb.SamplingParams) -> SamplingParams:
    """SamplingParams of a request; unset optional fields take the engine defaults."""
    return SamplingParams(
        temperature=float(msg.temperature),
        top_p=float(msg.top_p) if msg.HasField("top_p") else 1.0,
        top_k=int(msg.top_k),
        seed=int(msg.seed) if msg.HasField("seed") else None,
        max_tokens=int(msg.max_tokens) if msg.HasField("max_tokens") else DEFAULT_MAX_TOKENS,
        stop_token_ids=tuple(int(t) for t in msg.stop_token_ids),
        stop=tuple(msg.stop),
        ignore_eos=bool(msg.ignore_eos),
    )


def sampling_to_proto(params: SamplingParams) -> pb.SamplingParams:
    msg = pb.SamplingParams(
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        max_tokens=params.max_tokens,
        stop_token_ids=list(params.stop_token_ids),
        stop=list(params.stop),
        ignore_eos=params.ignore_eos,
    )
    if params.seed is not None:
        msg.seed = params.seed
    return msg


def tier_tokens_to_proto(tokens: TierTokens) -> pb.TierTokens:
    return pb.TierTokens(gpu=tokens.gpu, dram=tokens.dram, ssd=tokens.ssd)


def tier_tokens_from_proto(msg: pb.TierTokens) -> TierTokens:
    return TierTokens(gpu=msg.gpu, dram=msg.dram, ssd=msg.ssd)


def prefill_response(result: PrefillResult, *, with_prompt_ids: bool) -> pb.PrefillResponse:
    t = result.timings
    return pb.PrefillResponse(
        request_id=result.request_id,
        first_token=result.first_token,
        first_text=result.first_text,
        finish_reason=result.finish_reason.value if result.finish_reason is not None else "",
        page_keys=b"".join(result.page_keys),
        prompt_tokens=result.prompt_tokens,
        hit_tokens=tier_tokens_to_proto(result.hit_tokens),
        computed_tokens=result.computed_tokens,
        published_pages=result.published_pages,
        timings=pb.PrefillTimings(
            queue_s=t.queue_s,
            lookup_s=t.lookup_s,
            pull_s=t.pull_s,
            compute_s=t.compute_s,
            sample_s=t.sample_s,
            publish_wait_s=t.publish_wait_s,
            total_s=t.total_s,
        ),
        prompt_token_ids=list(result.prompt_token_ids) if with_prompt_ids else [],
    )


def unpack_page_keys(packed: bytes) -> list[bytes]:
    """The 16-byte keys of a PrefillResponse; InvalidRequest on a ragged field."""
    if len(packed) % KEY_BYTES:
        raise InvalidRequest(f"page_keys is {len(packed)} bytes, not a multiple of {KEY_BYTES}")
    return [packed[i : i + KEY_BYTES] for i in range(0, len(packed), KEY_BYTES)]


def decode_request_from_proto(msg: pb.DecodeRequest, runtime: ModelRuntime) -> DecodeRequest:
    """The request, its prompt tokenized when it came as text."""
    if msg.prompt_text and msg.prompt_token_ids:
        raise InvalidRequest("give the prompt as token ids or as text, not both")
    prompt = (
        runtime.tokenizer.encode(msg.prompt_text) if msg.prompt_text else list(msg.prompt_token_ids)
    )
    return DecodeRequest(
        prompt_token_ids=tuple(prompt),
        output_token_ids=tuple(msg.output_token_ids),
        sampling=sampling_from_proto(msg.sampling),
        namespace=msg.namespace,
        request_id=msg.request_id,
    )


def token_event_to_proto(event: TokenEvent) -> pb.TokenEvent:
    msg = pb.TokenEvent(index=event.index, text=event.text)
    if event.token_id is not None:
        msg.token_id = event.token_id
    if event.finish_reason is not None:
        msg.finish_reason = event.finish_reason.value
    if event.stats is not None:
        s = event.stats
        msg.stats.CopyFrom(
            pb.DecodeStats(
                hit_tokens=tier_tokens_to_proto(s.hit_tokens),
                computed_tokens=s.computed_tokens,
                published_pages=s.published_pages,
                queue_s=s.queue_s,
                pull_s=s.pull_s,
            )
        )
    return msg


def decode_stats_from_proto(msg: pb.DecodeStats) -> DecodeStats:
    return DecodeStats(
        hit_tokens=tier_tokens_from_proto(msg.hit_tokens),
        computed_tokens=msg.computed_tokens,
        published_pages=msg.published_pages,
        queue_s=msg.queue_s,
        pull_s=msg.pull_s,
    )
