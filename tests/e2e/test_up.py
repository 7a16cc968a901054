"""`strata up --preset tiny` (and `--model PATH`) as a child process: on first run it writes the
checkpoint and profiles the worker, starts the store, a prefill and a decode worker (or a
co-located one with --colocated) and the router, prints the base URL and the examples, serves a
completion, and on SIGTERM stops everything, leaving no process and no shared-memory segment. The
second run has two co-located workers (`--decode 2`) and stops on Ctrl-C (SIGINT). A taken port
is a clear message before anything starts."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.e2e


def _children(pid: int) -> set[int]:
    """Direct children of `pid`, from /proc."""
    out: set[int] = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        text = (task / "children").read_text().split()
        out.update(int(p) for p in text)
    return out


def _gone(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True
    return "\nState:\tZ" in status


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One data folder for the module: the first run writes the checkpoint and the profile, the
    second reuses both."""
    return tmp_path_factory.mktemp("up-data")


@pytest.mark.parametrize("colocated", [False, True], ids=["first-run", "colocated-reuse"])
def test_up_serves_and_stops_clean(data_dir: Path, colocated: bool) -> None:
    tmp_path = data_dir
    args = [sys.executable, "-m", "strata_cli.main", "up", "--preset", "tiny", "--port", "0"]
    args += ["--data-dir", str(tmp_path), "--max-context", "1024", "--ssd", "0"]
    if colocated:  # and SLO classes from a router config file
        config = tmp_path / "router.toml"
        config.write_text(
            '[admission]\ndefault_class = "std"\n[[admission.classes]]\nname = "std"\n'
            '[[admission.classes]]\nname = "impossible"\nttft_s = 0.000001\n'
        )
        args += ["--colocated", "--decode", "2", "--router-config", str(config)]
    proc = subprocess.Popen(
        args,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    lines: list[str] = []
    up = threading.Event()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line.rstrip())
            if "stop with Ctrl-C" in line:
                up.set()
        up.set()

    threading.Thread(target=pump, daemon=True).start()
    try:
        assert up.wait(300) and proc.poll() is None, "\n".join(lines[-40:])
        text = "\n".join(lines)
        first_run = not colocated
        # the first run shows its progress; the second reuses the checkpoint and the profile
        assert ("writing the tiny preset checkpoint" in text) == first_run
        assert ("measuring this machine" in text) == first_run
        match = re.search(r"Strata is up at (http://127\.0\.0\.1:\d+/v1)\s+model: (\S+)", text)
        assert match, text
        base, model = match.groups()
        assert "curl " in text and "OpenAI(base_url=" in text and "no API keys" in text
        assert "(open: no store tokens, on 127.0.0.1 only)" in text
        reply = httpx.post(
            f"{base}/completions",
            json={"model": model, "prompt": "The store keeps pages", "max_tokens": 4},
            timeout=60,
        )
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] == 4
        same = reply.headers["x-strata-prefill"] == reply.headers["x-strata-decode"]
        assert same == colocated
        if colocated:
            refused = httpx.post(
                f"{base}/completions",
                json={"model": model, "prompt": "x", "slo_class": "impossible"},
                timeout=60,
            )
            assert refused.status_code == 429 and refused.headers["retry-after"]
        health = httpx.get(base.removesuffix("/v1") + "/health", timeout=30).json()
        roles = (health["prefill"], health["decode"], health["colocated"])
        assert roles == ((0, 0, 2) if colocated else (1, 1, 0))  # --colocated --decode 2
        children = _children(proc.pid)
        assert len(children) == 4  # store, workers, router
        store_log = (tmp_path / "up" / "logs" / "store.log").read_text()
        segments = re.findall(r"shared memory: /dev/shm/(\S+)", store_log)
        segment = re.search(r"(\S+)", segments[-1]) if segments else None  # this run's store
        assert segment and Path(f"/dev/shm/{segment.group(1)}").exists()
        # Ctrl-C on the second run, SIGTERM on the first
        proc.send_signal(signal.SIGINT if colocated else signal.SIGTERM)
        assert proc.wait(90) == 0, "\n".join(lines[-20:])
        assert "no process or shared-memory segment left" in "\n".join(lines)
        deadline = time.monotonic() + 10
        while not all(_gone(pid) for pid in children) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert all(_gone(pid) for pid in children)
        assert not Path(f"/dev/shm/{segment.group(1)}").exists()
        assert "cleaned up after" not in "\n".join(lines)  # the children stopped cleanly
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)


def test_up_reports_a_taken_port(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "strata_cli.main",
                "up",
                "--preset",
                "tiny",
                "--port",
                str(port),
                "--data-dir",
                str(tmp_path),
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert done.returncode == 2
    assert f"port {port} on 127.0.0.1 is already in use" in done.stderr
    assert not (tmp_path / "models").exists()  # nothing was started or written


def test_up_serves_a_hugging_face_checkpoint_folder(tmp_path: Path) -> None:
    """`strata up --model PATH` on a folder in Hugging Face's layout: `strata model init` writes
    one (config.json with architectures, rope_scaling, tie_word_embeddings, torch_dtype;
    model.safetensors; tokenizer.json; tokenizer_config.json), here given the keys a real Qwen2
    checkpoint's config also carries and a ChatML template in its tokenizer config. The router
    names the model after the folder's config and renders chats with that template."""
    import json

    from router_processes import write_profile

    folder = tmp_path / "Qwen2-tiny"
    init = ["model", "init", str(folder), "--preset", "tiny", "--model-type", "qwen2"]
    made = subprocess.run(
        [sys.executable, "-m", "strata_cli.main", *init],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert made.returncode == 0, made.stderr
    config = json.loads((folder / "config.json").read_text())
    assert {"architectures", "rope_scaling", "tie_word_embeddings", "torch_dtype"} <= set(config)
    config.update(
        transformers_version="4.43.1",
        use_cache=True,
        use_sliding_window=False,
        sliding_window=32768,
        max_window_layers=28,
        initializer_range=0.02,
        attention_dropout=0.0,
    )
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    tok_config = json.loads((folder / "tokenizer_config.json").read_text())
    tok_config["chat_template"] = (
        "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
        "message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2))
    args = [sys.executable, "-m", "strata_cli.main", "up", "--model", str(folder), "--colocated"]
    args += ["--port", "0", "--data-dir", str(tmp_path / "data"), "--max-context", "1024"]
    args += ["--ssd", "0", "--profile", str(write_profile(tmp_path / "profile.json"))]
    proc = subprocess.Popen(
        args,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    lines: list[str] = []
    up = threading.Event()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line.rstrip())
            if "stop with Ctrl-C" in line:
                up.set()
        up.set()

    threading.Thread(target=pump, daemon=True).start()
    try:
        assert up.wait(240) and proc.poll() is None, "\n".join(lines[-40:])
        text = "\n".join(lines)
        assert f"model: {folder}" in text and "writing the" not in text
        match = re.search(r"Strata is up at (http://127\.0\.0\.1:\d+/v1)\s+model: (\S+)", text)
        assert match, text
        base, model = match.groups()
        listed = httpx.get(f"{base}/models", timeout=30).json()["data"]
        assert [m["id"] for m in listed] == [model]
        chat = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        reply = httpx.post(f"{base}/chat/completions", json=chat, timeout=60)
        assert reply.status_code == 200, reply.text
        usage = reply.json()["usage"]
        # the prompt is the ChatML rendering of the one message, tokenized by the folder's tokenizer
        from engine.tokenizer import Tokenizer

        rendered = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
        tokenizer = Tokenizer.from_dir(folder)
        assert usage["prompt_tokens"] == len(tokenizer.encode(rendered, add_special_tokens=False))
        assert usage["completion_tokens"] == 3
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(90) == 0, "\n".join(lines[-20:])
        assert "no process or shared-memory segment left" in "\n".join(lines)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
