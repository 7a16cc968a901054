"""The engine workers' edges without a server: message conversions (engine.wire), the layered
worker configuration (engine.worker_config), the CLI's refusals, and the background publisher's
bounded queue."""

from __future__ import annotations

import signal
import threading
from pathlib import Path

import pytest

from client import KVLayout, Scope
from engine.cli_engine import main as worker_main
from engine.errors import InvalidRequest
from engine.publisher import Publisher, PublishJob
from engine.requests import DecodeStats, FinishReason, TierTokens, TokenEvent
from engine.sampling import SamplingError, SamplingParams
from engine.wire import (
    decode_stats_from_proto,
    sampling_from_proto,
    sampling_to_proto,
    token_event_to_proto,
    unpack_page_keys,
)
from engine.worker_config import WorkerConfig, load_worker_config
from kvstore_pb import engine_pb2 as pb

pytestmark = pytest.mark.unit


def test_sampling_defaults_and_round_trip() -> None:
    assert sampling_from_proto(pb.SamplingParams()) == SamplingParams()
    params = SamplingParams(
        temperature=0.5,
        top_p=0.5,
        top_k=7,
        seed=2**63 + 5,
        max_tokens=99,
        stop_token_ids=(1, 2),
        stop=("\n\n",),
        ignore_eos=True,
    )
    assert sampling_from_proto(sampling_to_proto(params)) == params
    with pytest.raises(SamplingError, match="top_p"):
        sampling_from_proto(pb.SamplingParams(top_p=0.0))  # set to 0: not "unset"
    with pytest.raises(SamplingError, match="max_tokens"):
        sampling_from_proto(pb.SamplingParams(max_tokens=0))


def test_events_and_keys() -> None:
    plain = token_event_to_proto(TokenEvent(3, 42, "ab"))
    assert (plain.index, plain.token_id, plain.text, plain.finish_reason) == (3, 42, "ab", "")
    assert not plain.HasField("stats")
    stats = DecodeStats(hit_tokens=TierTokens(0, 32, 16), computed_tokens=5, published_pages=2)
    last = token_event_to_proto(TokenEvent(4, None, "", FinishReason.CANCELLED, stats))
    assert not last.HasField("token_id") and last.finish_reason == "cancelled"
    assert decode_stats_from_proto(last.stats) == stats
    keys = [bytes([i]) * 16 for i in range(3)]
    assert unpack_page_keys(b"".join(keys)) == keys
    with pytest.raises(InvalidRequest):
        unpack_page_keys(b"x" * 17)


def test_worker_config_layers() -> None:
    env = {
        "STRATA_ENGINE_PAGE_TOKENS": "32",
        "STRATA_ENGINE_MODEL": "/m",
        "OTHER": "x",
        "STRATA_ENGINE_STORE_TIMEOUT_S": "2.5",
    }
    config = load_worker_config("decode", env=env, overrides={"page_tokens": 64, "port": None})
    assert (config.model, config.page_tokens, config.store_timeout_s) == ("/m", 64, 2.5)
    assert config.bind_port == 7720 and config.max_batch == 32
    assert (
        load_worker_config("prefill", env={}, overrides={"model": "/m", "port": 0}).bind_port == 0
    )
    with pytest.raises(
        ValueError, match=r"\$STRATA_ENGINE_MAX_BATCH: max_batch must be an integer"
    ):
        load_worker_config("decode", env={**env, "STRATA_ENGINE_MAX_BATCH": "many"})
    with pytest.raises(ValueError, match="model checkpoint folder is required"):
        load_worker_config("decode", env={})
    with pytest.raises(ValueError, match="unknown worker setting"):
        load_worker_config("decode", env=env, overrides={"colour": "red"})
    with pytest.raises(ValueError, match="chunk_tokens must be positive"):
        WorkerConfig("prefill", "/m", chunk_tokens=0)
    with pytest.raises(ValueError, match="role"):
        WorkerConfig("router", "/m")


def test_cli_refuses_a_bad_setup(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    handler = signal.getsignal(signal.SIGTERM)
    assert worker_main("decode", ["--model", str(tmp_path / "missing"), "--port", "0"]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert worker_main("prefill", ["--port", "0"]) == 2
    assert "model checkpoint folder is required" in capsys.readouterr().err
    assert signal.getsignal(signal.SIGTERM) is handler  # the handlers it set are undone


def _job(pages: int) -> PublishJob:
    scope = Scope("m", "w", "t", "float32", KVLayout(1, 1, 2, 2))
    payload = bytes(scope.page_payload_bytes)
    tokens = tuple((i, i + 1) for i in range(pages))
    return PublishJob(scope, scope.digest, tokens, (payload,) * pages)


def test_the_publisher_drops_rather_than_blocks_when_behind() -> None:
    release = threading.Event()
    seen: list[int] = []

    def slow_put(job: PublishJob) -> tuple[int, int]:
        release.wait(10)
        assert [p.header.tokens for p in job.pages()] == list(job.tokens)
        seen.append(len(job.payloads))
        return len(job.payloads), 0

    publisher = Publisher(slow_put, max_pending_pages=5)
    first, second = publisher.submit(_job(3)), publisher.submit(_job(2))
    dropped = publisher.submit(_job(1))  # 6 pages would be pending: dropped at once
    assert first.queued and second.queued and not dropped.queued and dropped.done
    assert not publisher.drain(0.05)
    release.set()
    assert publisher.drain(10) and first.wait(1) and second.wait(1)
    assert (first.stored, second.stored, dropped.stored) == (3, 2, 0)
    assert seen == [3, 2] and publisher.counts() == (5, 1)
    publisher.close(1)
    assert not publisher.submit(_job(1)).queued
