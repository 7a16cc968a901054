"""`strata prefill` and `strata decode` as child processes next to a `strata serve` daemon: they
print where they serve, generate the reference's tokens across processes, drain a stream in
flight on SIGTERM and exit 0, and a decode worker killed with SIGKILL mid-stream is replaced by
another that resumes from the tokens streamed so far. Only processes started here are signalled,
each by its PID."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

import grpc
import pytest

from engine.checkpoint import load_checkpoint
from engine.model import DecoderModel
from engine.reference import greedy_generate
from kvstore_pb import engine_pb2 as pb
from kvstore_pb.engine_pb2_grpc import DecodeStub, PrefillStub
from loadtests.daemon import DaemonProcess

pytestmark = pytest.mark.e2e

_ADDRESS = re.compile(r"^strata \w+ serving on (\S+)")


class WorkerProcess:
    """A `strata <role>` child on loopback, port 0. `start()` returns at once; `ready()` waits
    for its whole start-up banner (address, model, store)."""

    def __init__(self, role: str, model: Path, store: str, extra: Sequence[str] = ()) -> None:
        self.role = role
        self.args = [
            sys.executable,
            "-m",
            "strata_cli.main",
            role,
            "--model",
            str(model),
            "--store",
            store,
            "--port",
            "0",
            "--page-tokens",
            "16",
            "--max-context",
            "1024",
            *extra,
        ]
        self.proc: subprocess.Popen[str] | None = None
        self.output: list[str] = []
        self.address = ""
        self._ready = threading.Event()

    def start(self) -> WorkerProcess:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            self.args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
        )
        threading.Thread(target=self._pump, name=f"{self.role}-output", daemon=True).start()
        return self

    def _pump(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            self.output.append(line.rstrip())
            if not self.address and (m := _ADDRESS.search(line)):
                self.address = m.group(1)
            if self.address and "stop with Ctrl-C" in line:  # the banner's last line
                self._ready.set()
        self._ready.set()

    def ready(self, timeout_s: float = 90.0) -> str:
        if not self._ready.wait(timeout_s) or not self.address:
            raise RuntimeError(f"{self.role} did not start:\n" + "\n".join(self.output[-30:]))
        return self.address

    def signal(self, signum: int) -> None:
        """Send `signum` to this child's PID."""
        assert self.proc is not None
        self.proc.send_signal(signum)

    def wait(self, timeout_s: float = 60.0) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout_s)

    def terminate(self, timeout_s: float = 60.0) -> int:
        """SIGTERM to this child's PID; its exit code."""
        self.signal(signal.SIGTERM)
        return self.wait(timeout_s)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)

    def text(self) -> str:
        return "\n".join(self.output)


@pytest.fixture
def processes() -> Iterator[list[WorkerProcess]]:
    """Workers a test starts; any still running at the end are killed (by PID)."""
    started: list[WorkerProcess] = []
    yield started
    for worker in started:
        worker.kill()


@pytest.fixture(scope="module")
def model(tiny_checkpoint: Path) -> DecoderModel:
    ckpt = load_checkpoint(tiny_checkpoint)
    return DecoderModel.from_state_dict(ckpt.config, ckpt.state_dict)


def greedy(count: int) -> pb.SamplingParams:
    return pb.SamplingParams(max_tokens=count, ignore_eos=True)


def test_workers_serve_and_drain_on_sigterm(
    tmp_path: Path, tiny_checkpoint: Path, model: DecoderModel, processes: list[WorkerProcess]
) -> None:
    with DaemonProcess(tmp_path / "data", dram="64MiB", ssd="64MiB") as store:
        prefill = WorkerProcess("prefill", tiny_checkpoint, store.address).start()
        decode = WorkerProcess("decode", tiny_checkpoint, store.address).start()
        processes += [prefill, decode]
        with (
            grpc.insecure_channel(prefill.ready()) as pch,
            grpc.insecure_channel(decode.ready()) as dch,
        ):
            assert "store: " + store.address in prefill.text()
            text = "Engines publish full pages after prefill and pull them before decode."
            first = PrefillStub(pch).Prefill(
                pb.PrefillRequest(prompt_text=text, sampling=greedy(500)), timeout=60
            )
            prompt = list(first.prompt_token_ids)
            assert first.published_pages == len(prompt) // 16 > 0
            call = DecodeStub(dch).Decode(
                pb.DecodeRequest(
                    prompt_token_ids=prompt,
                    output_token_ids=[first.first_token],
                    sampling=greedy(500),
                ),
                timeout=120,
            )
            events = [next(call)]
            decode.signal(signal.SIGTERM)  # with the stream in flight
            events += list(call)
            assert decode.wait() == 0
        assert len(events) == 499 and events[-1].finish_reason == "length"
        assert events[-1].stats.hit_tokens.dram == len(prompt) // 16 * 16
        want = greedy_generate(model, prompt, 40)
        assert [first.first_token, *(e.token_id for e in events[:39])] == want
        assert "stopping: 1 request(s) in flight" in decode.text(), decode.text()
        assert "strata decode stopped" in decode.text() and "timed out" not in decode.text()
        assert prefill.terminate() == 0
        assert "stopping: 0 request(s) in flight" in prefill.text()


def test_a_killed_decode_worker_is_replaced(
    tmp_path: Path, tiny_checkpoint: Path, model: DecoderModel, processes: list[WorkerProcess]
) -> None:
    prompt = [1, *range(40, 80)]
    want = greedy_generate(model, prompt, 150)  # first: it would compete with the start-ups
    with DaemonProcess(tmp_path / "data", dram="64MiB", ssd="64MiB") as store:
        doomed = WorkerProcess("decode", tiny_checkpoint, store.address).start()
        spare = WorkerProcess("decode", tiny_checkpoint, store.address).start()
        processes += [doomed, spare]
        with (
            grpc.insecure_channel(doomed.ready()) as dch,
            grpc.insecure_channel(spare.ready()) as sch,
        ):
            # no prefill worker here: a decode worker given no output token computes the
            # prompt itself (and publishes its pages as they fill)
            produced: list[int] = []
            call = DecodeStub(dch).Decode(
                pb.DecodeRequest(
                    prompt_token_ids=prompt, output_token_ids=produced, sampling=greedy(150)
                ),
                timeout=120,
            )
            for event in call:
                produced.append(event.token_id)
                if len(produced) == 60:
                    break
            doomed.kill()  # SIGKILL, mid-stream
            with pytest.raises(grpc.RpcError):
                list(call)
            rest = list(
                DecodeStub(sch).Decode(
                    pb.DecodeRequest(
                        prompt_token_ids=prompt, output_token_ids=produced, sampling=greedy(150)
                    ),
                    timeout=120,
                )
            )
        assert produced + [e.token_id for e in rest] == want
        assert rest[0].index == 60 and rest[-1].finish_reason == "length"
        # the replacement pulled at least the prompt's pages (and whatever generated pages the
        # killed worker had published by then) and recomputed the rest
        stats = rest[-1].stats
        assert stats.hit_tokens.dram >= 32
        assert stats.hit_tokens.dram + stats.computed_tokens == len(prompt) + 60
        assert spare.terminate() == 0
