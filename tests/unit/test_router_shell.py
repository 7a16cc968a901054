"""The router shell's pure pieces: store strings, the config file, the one error table, request
models, the chat template; and the shell (HTTP edge, registry, dispatch) never loads torch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from engine.router.chat import ChatTemplateMissing, ModelText
from engine.router.config import load_router_config
from engine.router.core.errors import ErrorKind
from engine.router.http_errors import STATUS, HttpError, error_body, headers_of, sse_error
from engine.router.protocol import ChatCompletionRequest, CompletionRequest
from engine.store_spec import StoreSpec, parse_store

pytestmark = pytest.mark.unit


def test_store_strings() -> None:
    assert parse_store("") is None
    assert parse_store("127.0.0.1:7700") == StoreSpec(addresses=("127.0.0.1:7700",))
    assert parse_store("127.0.0.1:7700").single  # type: ignore[union-attr]
    two = parse_store("a:1, b:2")
    assert two == StoreSpec(addresses=("a:1", "b:2")) and not two.single
    etcd = parse_store("etcd://h1:2379,h2:2379/prod")
    assert etcd == StoreSpec(etcd_endpoints=("http://h1:2379", "http://h2:2379"), cluster="prod")
    assert parse_store("etcd://h1:2379").cluster == "default"  # type: ignore[union-attr]
    for bad in ("nohost", "a:0", "a:99999", "a:1,a:1", "etcd://", "etcd://h:1/a/b", ":5"):
        with pytest.raises(ValueError):
            parse_store(bad)


def test_router_config_file_then_flags(tmp_path: Path) -> None:
    path = tmp_path / "router.toml"
    path.write_text(
        '[router]\nworkers = ["h:1", "h:2"]\npolicy = "least_load"\nport = 9000\n'
        '[admission]\ndefault_class = "gold"\n'
        '[[admission.classes]]\nname = "gold"\nttft_s = 0.5\n'
    )
    config = load_router_config(path, {"port": 9100, "policy": None, "workers": None})
    assert (config.workers, config.policy, config.port) == (("h:1", "h:2"), "least_load", 9100)
    assert config.admission.default_class == "gold"
    assert config.admission.by_name("gold").ttft_s == 0.5  # type: ignore[union-attr]
    assert load_router_config(None, {"workers": "a:1,b:2"}).workers == ("a:1", "b:2")
    path.write_text("[router]\nwrokers = []\n")
    with pytest.raises(ValueError, match="wrokers"):
        load_router_config(path)
    path.write_text("[routr]\n")
    with pytest.raises(ValueError, match="routr"):
        load_router_config(path)
    for bad in ({"policy": "fastest"}, {"workers": "nocolon"}, {"store": "x"}, {"port": 70000}):
        with pytest.raises(ValueError):
            load_router_config(None, bad)


def test_one_table_maps_every_error_kind() -> None:
    assert set(STATUS) == set(ErrorKind)
    want = {
        ErrorKind.invalid_request: 400,
        ErrorKind.context_length: 400,
        ErrorKind.unknown_model: 404,
        ErrorKind.rate_limited: 429,
        ErrorKind.no_worker: 503,
        ErrorKind.overloaded: 503,
    }
    assert {k: STATUS[k][0] for k in want} == want
    error = HttpError(ErrorKind.rate_limited, "slow down", retry_after_s=1.2, param="x")
    assert headers_of(error) == {"Retry-After": "2"}
    assert headers_of(HttpError(ErrorKind.no_worker, "none", retry_after_s=0.01)) == {
        "Retry-After": "1"
    }
    assert headers_of(HttpError(ErrorKind.invalid_request, "bad")) == {}
    body = error_body(error)
    assert body == {
        "error": {
            "message": "slow down",
            "type": "rate_limit_error",
            "param": "x",
            "code": "rate_limit_exceeded",
        }
    }
    events = sse_error(error).split("\n\n")
    assert json.loads(events[0].removeprefix("data: ")) == body
    assert events[1] == "data: [DONE]"


def test_request_models_refuse_what_cannot_be_served() -> None:
    ok = {"model": "m", "prompt": "hi"}
    assert CompletionRequest.model_validate({**ok, "unknown_field": 1}).prompt == "hi"
    for bad in (
        {"n": 2},
        {"prompt": ""},
        {"prompt": []},
        {"prompt": [-1]},
        {"temperature": -0.5},
        {"top_p": 0},
        {"top_p": 1.5},
        {"max_tokens": 0},
        {"stop": [""]},
        {"stop": ["s"] * 17},
        {"model": ""},
    ):
        with pytest.raises(ValidationError):
            CompletionRequest.model_validate({**ok, **bad})
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    chat = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": parts}]}
    )
    assert chat.messages[0].text() == "ab"
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate(
            {"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}
        )
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate({"model": "m", "messages": []})
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate(
            {"model": "m", "messages": [{"role": "wizard", "content": "x"}]}
        )


def test_chat_template_of_the_preset(tiny_checkpoint: Path) -> None:
    from engine.checkpoint import load_checkpoint

    text = ModelText.from_dir(tiny_checkpoint)
    assert text.fingerprint == load_checkpoint(tiny_checkpoint).fingerprints.tokenizer
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    rendered = text.render_chat("m", messages)
    assert rendered == "<|bos|><|system|>\nBe brief.\n<|user|>\nHi\n<|assistant|>\n"
    ids = text.chat_ids("m", messages)
    assert ids[0] == text.inner.token_to_id("<|bos|>") and ids.count(ids[0]) == 1
    bare = ModelText((tiny_checkpoint / "tokenizer.json").read_bytes())
    with pytest.raises(ChatTemplateMissing):
        bare.render_chat("m", messages)
    # a chat_template.jinja beside the config wins over it
    apart = ModelText((tiny_checkpoint / "tokenizer.json").read_bytes(), b"{}", "{{ 'x' }}")
    assert apart.render_chat("m", messages) == "x"


def test_encode_gives_the_tokenizers_own_ids(tiny_checkpoint: Path) -> None:
    """`ModelText.encode` (the offset-free fast path) gives exactly `Tokenizer.encode`'s ids,
    special tokens or not, for text with spaces, newlines and multi-byte characters."""
    text = ModelText.from_dir(tiny_checkpoint)
    for s in ("", "hello world", "  two  spaces\n\tand tabs", "héllo ✓ 日本語 " * 20):
        for special in (True, False):
            want = list(text.inner.encode(s, add_special_tokens=special).ids)
            assert text.encode(s, add_special_tokens=special) == want
    assert text.encode("hello world") != text.encode("hello world", add_special_tokens=False)


def test_the_shell_never_loads_torch() -> None:
    code = (
        "import sys\n"
        "import engine.router.app, engine.router.service, engine.router.cli\n"
        "import engine.router.dispatch, engine.router.registry, engine.router.up\n"
        "heavy = sorted(m for m in ('torch', 'triton') if m in sys.modules)\n"
        "print(','.join(heavy))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert done.stdout.strip() == ""


def test_drifted_predictions_are_logged_once_per_change(caplog: pytest.LogCaptureFixture) -> None:
    import logging

    from engine.router.core.admission import Admission
    from engine.router.core.policies import build_policy
    from engine.router.core.prediction import PredictionTracker
    from engine.router.core.router import RouterCore
    from engine.router.core.timemodel import DecodeCoeffs, PrefillCoeffs, TimeModel
    from engine.router.dispatch import Dispatcher
    from engine.router.lookup import StoreLookup
    from engine.router.registry import Registry

    model = TimeModel(PrefillCoeffs(0.01, 0, 0, 0), DecodeCoeffs(0.01, 0, 0))
    tracker = PredictionTracker(min_samples=3)
    core = RouterCore(build_policy("round_robin"), Admission(), model, tracker=tracker)
    dispatcher = Dispatcher(Registry(), StoreLookup(None), core)
    with caplog.at_level(logging.INFO, logger="engine.router.dispatch"):
        for i in range(5):  # observed 3x the prediction: off
            tracker.record("ttft", 0.1, 0.3, now=float(i))
            dispatcher._check_drift(float(i))
        for i in range(5, 600):  # on target again (the old pairs leave the window)
            tracker.record("ttft", 0.1, 0.1, now=float(i))
        dispatcher._check_drift(600.0)
    lines = [r.getMessage() for r in caplog.records]
    assert sum("TTFT predictions are off" in line for line in lines) == 1
    assert sum("TTFT predictions are back on target" in line for line in lines) == 1
    assert not any("TPOT" in line for line in lines)


def test_a_drift_check_soon_after_the_last_is_deferred_not_lost(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Requests that end within DRIFT_CHECK_S of the last check skip it; one deferred check on
    the loop still logs a change when no further request comes."""
    import asyncio
    import logging

    from engine.router import dispatch as dispatch_mod
    from engine.router.core.admission import Admission
    from engine.router.core.policies import build_policy
    from engine.router.core.prediction import PredictionTracker
    from engine.router.core.router import RouterCore
    from engine.router.core.timemodel import DecodeCoeffs, PrefillCoeffs, TimeModel
    from engine.router.dispatch import Dispatcher
    from engine.router.lookup import StoreLookup
    from engine.router.registry import Registry

    monkeypatch.setattr(dispatch_mod, "DRIFT_CHECK_S", 0.05)
    model = TimeModel(PrefillCoeffs(0.01, 0, 0, 0), DecodeCoeffs(0.01, 0, 0))
    tracker = PredictionTracker(min_samples=3)
    core = RouterCore(build_policy("round_robin"), Admission(), model, tracker=tracker)
    now = [0.0]
    dispatcher = Dispatcher(Registry(), StoreLookup(None), core, clock=lambda: now[0])
    fired: list[float] = []
    done = asyncio.Event()
    deferred = dispatcher._deferred_drift_check

    def counted() -> None:
        fired.append(now[0])
        deferred()
        done.set()

    dispatcher._deferred_drift_check = counted  # type: ignore[method-assign]

    def off_lines() -> int:
        return sum("TTFT predictions are off" in r.getMessage() for r in caplog.records)

    async def run() -> None:
        tracker.record("ttft", 0.1, 0.3, now=0.0)
        tracker.record("ttft", 0.1, 0.3, now=0.0)
        dispatcher._check_drift(0.0)  # checked: too few pairs, no drift
        tracker.record("ttft", 0.1, 0.3, now=0.01)  # now drifted
        dispatcher._check_drift(0.01)  # too soon: deferred
        dispatcher._check_drift(0.02)  # too soon, one deferred check already pending
        assert off_lines() == 0
        now[0] = 0.06
        await asyncio.wait_for(done.wait(), 10)  # due 40 ms after the deferral

    with caplog.at_level(logging.INFO, logger="engine.router.dispatch"):
        asyncio.run(run())
    assert fired == [0.06]
    assert off_lines() == 1


def test_store_lookup_runs_inline_until_the_store_fails_stalls_or_is_slow() -> None:
    """`StoreLookup.find`: the first call (it connects) on a thread, then inline on the loop; a
    failure, one stalled call or three slow ones in a row send lookups to a thread again."""
    import asyncio
    import threading
    import time
    from types import SimpleNamespace

    from client import LookupResult, Scope, StoreClient, Unavailable
    from client.contract.scope import KVLayout
    from engine.router.lookup import StoreLookup

    class FakeStore(StoreClient):
        def __init__(self) -> None:  # no connection: answers from here
            self.delay_s, self.fail, self.on_loop = 0.0, False, []

        def connect(self) -> SimpleNamespace:  # type: ignore[override]
            return SimpleNamespace(host_id="host-a")

        def lookup(self, scope: object, keys: object) -> LookupResult:  # type: ignore[override]
            self.on_loop.append(threading.current_thread() is threading.main_thread())
            if self.fail:
                raise Unavailable("store down")
            time.sleep(self.delay_s)  # a slow store, not a wait for work
            return LookupResult(hit_count=1, tiers=(1,))  # type: ignore[arg-type]

        def close(self) -> None:
            pass

    scope = Scope("m", "r", "t", "bfloat16", KVLayout(2, 2, 8, 16))
    lookup = StoreLookup(None, inline_budget_s=0.005, slow_calls=3, stall_s=0.05)
    store = FakeStore()
    lookup._client = store

    def find() -> int:
        return asyncio.run(lookup.find(scope, list(range(32)))).hit_pages

    def reset() -> None:
        lookup._threaded_until = 0.0

    assert find() == 1 and store.on_loop == [False]  # connects on a thread
    assert (find(), find()) == (1, 1) and store.on_loop[1:] == [True, True]  # then inline
    store.fail = True
    assert find() == 0 and store.on_loop[-1] is True  # a failure is a miss...
    store.fail = False
    assert find() == 1 and store.on_loop[-1] is False  # ...and sends lookups to a thread
    reset()
    store.delay_s = 0.06
    find()
    assert store.on_loop[-1] is True
    store.delay_s = 0.0
    find()
    assert store.on_loop[-1] is False  # one stalled call is enough
    reset()
    store.delay_s = 0.01  # slow, not stalled: three in a row
    for _ in range(3):
        find()
    assert store.on_loop[-3:] == [True, True, True]
    find()
    assert store.on_loop[-1] is False
    assert (lookup.inline, lookup.threaded) == (7, 4)
