"""`strata profile --quick` on the tiny preset against a real store daemon: the JSON it writes
names its machine and checkpoint, holds the samples it measured, and its coefficients fit them;
`load_or_profile` measures once, then reuses the file (and adds pulls when a store appears)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import pytest
import torch

from engine.checkpoint import load_checkpoint
from engine.profile import default_path, load_or_profile, this_machine
from engine.profile_measure import QUICK
from engine.router.core.fit import fit_quality
from engine.router.core.timemodel import TimeModel
from loadtests.daemon import DaemonProcess

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]


def strata(*args: str, timeout: float = 180.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "strata_cli.main", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory):
    with DaemonProcess(tmp_path_factory.mktemp("store"), dram="256MiB", ssd="512MiB") as d:
        yield d


@pytest.fixture
def tiny(tiny_checkpoint: Path) -> Path:
    return tiny_checkpoint  # the session's `strata model init --preset tiny` checkpoint


@pytest.fixture
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # a steadier clock on a shared two-core machine
    yield
    torch.set_num_threads(before)


def test_profile_quick_writes_a_model_that_fits_its_samples(
    tiny: Path, tmp_path: Path, daemon: DaemonProcess
) -> None:
    out = tmp_path / "tiny.json"
    done = strata(
        "profile",
        "--model",
        str(tiny),
        "--quick",
        "--store",
        daemon.address,
        "--out",
        str(out),
        "--threads",
        "1",
    )
    assert done.returncode == 0, done.stderr
    assert f"wrote {out}" in done.stdout
    assert "profile: prefill 1/" in done.stderr  # progress goes to stderr

    model = TimeModel.load(out)
    prov = model.provenance
    ckpt = load_checkpoint(tiny)
    assert prov.checkpoint_fingerprint == ckpt.fingerprints.revision
    assert prov.checkpoint_path == str(tiny.resolve())
    assert prov.machine.cores == os.cpu_count() and prov.machine.torch_device == "cpu"
    assert prov.machine.cpu_model and prov.machine.hostname
    assert prov.store == daemon.address
    assert datetime.strptime(prov.created, "%Y-%m-%dT%H:%M:%SZ")

    s = model.samples
    assert len(s.prefill) == len(QUICK.prefill_new) * len(QUICK.prefill_cached)
    assert len(s.decode) == len(QUICK.decode_batch) * len(QUICK.decode_context)
    paths = {(p.tier, p.same_host) for p in s.pull}
    assert paths == {("dram", True), ("dram", False), ("ssd", True), ("ssd", False)}
    assert {(p.tier, p.same_host) for p in model.pulls} == paths
    page_bytes = min(p.nbytes for p in s.pull)
    assert all(p.nbytes % page_bytes == 0 and p.seconds > 0 for p in s.pull)

    # the coefficients are the least-squares fit of the samples in the file...
    refit = TimeModel.fit(s, prov)
    for got, want in zip(
        (*_values(refit.prefill), *_values(refit.decode)),
        (*_values(model.prefill), *_values(model.decode)),
        strict=True,
    ):
        assert got == pytest.approx(want, rel=1e-9, abs=1e-15)
    # ...and they predict them within a tolerance (a shared two-core machine is noisy: each
    # point is the fastest of its repetitions, still some go wide)
    quality = fit_quality(model)
    assert quality.prefill_median < 0.35 and quality.decode_median < 0.35
    assert quality.pull_median < 0.35
    # and more work costs more
    assert model.prefill_s(512, 0) > model.prefill_s(16, 0) > 0
    assert model.decode_step_s(12, 12 * 1536) > model.decode_step_s(1, 64) > 0
    many = max(QUICK.pull_pages) * page_bytes
    assert model.pull_s(many, "ssd", True) > model.pull_s(page_bytes, "ssd", True) > 0
    data = json.loads(out.read_text())
    assert data["format"] == "strata-timemodel" and "pulls" in data


def _values(coeffs: object) -> tuple[float, ...]:
    return tuple(getattr(coeffs, f) for f in coeffs.__slots__)  # type: ignore[attr-defined]


def test_load_or_profile_measures_once_then_reuses(
    tiny: Path,
    tmp_path: Path,
    daemon: DaemonProcess,
    monkeypatch: pytest.MonkeyPatch,
    one_thread: None,
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    heard: list[str] = []
    first = load_or_profile(tiny, progress=heard.append)
    target = default_path(load_checkpoint(tiny), this_machine())
    assert target.parent == tmp_path / "cache" / "strata" / "profiles" and target.exists()
    assert any("no time model" in m for m in heard) and any("prefill" in m for m in heard)
    assert first.samples.pull == ()
    heard.clear()
    again = load_or_profile(tiny, progress=heard.append)
    assert again == first and heard == []  # reused, silently
    # a store appears: the pulls are measured and merged, prefill and decode samples kept
    with_pulls = load_or_profile(tiny, store=daemon.address, progress=heard.append)
    assert with_pulls.samples.prefill == first.samples.prefill
    assert {p.tier for p in with_pulls.samples.pull} == {"dram", "ssd"}
    assert any("no pull timings" in m for m in heard)
    assert TimeModel.load(target) == with_pulls
    # a broken file is measured again, not an error
    target.write_text("{not json")
    heard.clear()
    redone = load_or_profile(tiny, progress=heard.append)
    assert redone.provenance.checkpoint_fingerprint == first.provenance.checkpoint_fingerprint
    assert heard and TimeModel.load(target) == redone


def test_profile_of_a_missing_model_is_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from engine.profile import main

    assert main(["--model", str(tmp_path / "nothing"), "--quick"]) == 2
    assert "cannot load" in capsys.readouterr().err
