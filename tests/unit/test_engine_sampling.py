"""Per-request sampling (engine.sampling) and the produced text with its stop conditions
(engine.output): validation, the draws, and text that is the same whichever worker produced it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.errors import InvalidRequest
from engine.output import OutputText
from engine.requests import FinishReason, validate_prompt
from engine.sampling import Sampler, SamplingError, SamplingParams, sample_tokens, step_seed
from engine.tokenizer import Tokenizer

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoint: Path) -> Tokenizer:
    return Tokenizer.from_dir(tiny_checkpoint)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"temperature": -0.5}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": float("nan")}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"seed": -1}, "seed"),
        ({"seed": 1 << 64}, "seed"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"stop_token_ids": (3, -2)}, "stop_token_ids"),
        ({"stop": ("",)}, "stop string"),
        ({"stop": ("x" * 300,)}, "stop string"),
        ({"stop": tuple(str(i) for i in range(17))}, "stop strings"),
    ],
)
def test_bad_sampling_values_are_refused_by_name(fields: dict[str, object], message: str) -> None:
    with pytest.raises(SamplingError, match=message) as info:
        SamplingParams(**fields)  # type: ignore[arg-type]
    assert isinstance(info.value, InvalidRequest) and isinstance(info.value, ValueError)


def test_defaults_and_vocab_check() -> None:
    params = SamplingParams()
    assert params.greedy and params.max_tokens == 16 and params.top_p == 1.0
    SamplingParams(stop_token_ids=(5,)).check_vocab(6)
    with pytest.raises(SamplingError, match=r"\[6\] are outside the vocabulary"):
        SamplingParams(stop_token_ids=(5, 6)).check_vocab(6)


def test_validate_prompt() -> None:
    assert validate_prompt((1, 2, 3), vocab_size=10, max_context=4) == [1, 2, 3]
    with pytest.raises(InvalidRequest, match="empty"):
        validate_prompt([], vocab_size=10, max_context=8)
    with pytest.raises(InvalidRequest, match="4 tokens; the context holds 4"):
        validate_prompt([1, 2, 3, 4], vocab_size=10, max_context=4)
    with pytest.raises(InvalidRequest, match="token id 10 is outside"):
        validate_prompt([1, 10], vocab_size=10, max_context=8)


def test_greedy_and_top_k_1_take_the_argmax() -> None:
    logits = torch.randn(300, generator=torch.Generator().manual_seed(1))
    best = int(logits.argmax())
    assert Sampler(SamplingParams()).sample(logits, 0) == best
    hot = Sampler(SamplingParams(temperature=5.0, top_k=1, seed=3))
    assert {hot.sample(logits, step) for step in range(20)} == {best}
    narrow = Sampler(SamplingParams(temperature=5.0, top_p=1e-6, seed=3))
    assert {narrow.sample(logits, step) for step in range(20)} == {best}


def test_seeded_draws_depend_on_seed_and_step_only() -> None:
    logits = torch.randn(300, generator=torch.Generator().manual_seed(2))
    params = SamplingParams(temperature=1.5, seed=1234)
    one, two = Sampler(params), Sampler(params)
    forward = [one.sample(logits, s) for s in range(30)]
    backward = [two.sample(logits, s) for s in reversed(range(30))][::-1]
    assert forward == backward  # a draw does not depend on the draws before it
    assert len(set(forward)) > 5  # and the steps differ
    other = Sampler(SamplingParams(temperature=1.5, seed=1235))
    assert [other.sample(logits, s) for s in range(30)] != forward
    # pinned: workers of every version must draw the same for the same seed and step
    assert step_seed(0, 0) == 0xE220A8397B1DCDAF
    assert step_seed(1234, 7) == step_seed(1234, 7) != step_seed(1234, 8)


def test_top_k_and_top_p_restrict_the_support() -> None:
    logits = torch.tensor([4.0, 3.9, 3.8, 0.0, -1.0, -2.0] + [-9.0] * 50)
    top3 = Sampler(SamplingParams(temperature=2.0, top_k=3, seed=5))
    assert {top3.sample(logits, s) for s in range(200)} == {0, 1, 2}
    probs = torch.softmax(logits, dim=-1)
    assert probs[:3].sum() > 0.9 > probs[:2].sum()
    nucleus = Sampler(SamplingParams(temperature=1.0, top_p=0.9, seed=5))
    assert {nucleus.sample(logits, s) for s in range(200)} == {0, 1, 2}


def test_batched_draws_equal_single_draws_whatever_the_batch() -> None:
    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(7)) * 3
    params = [
        SamplingParams(),
        SamplingParams(temperature=0.7, seed=1),
        SamplingParams(temperature=1.3, top_k=5, seed=2),
        SamplingParams(temperature=1.0, top_p=0.8, seed=3),
        SamplingParams(temperature=2.0, top_k=40, top_p=0.9, seed=4),
        SamplingParams(temperature=0.5, seed=1),
    ]
    samplers = [Sampler(p) for p in params]
    steps = [0, 3, 1, 4, 1, 3]
    together = sample_tokens(logits, samplers, steps)
    assert together == [s.sample(logits[b], steps[b]) for b, s in enumerate(samplers)]
    assert together[0] == int(logits[0].argmax())
    order = [5, 2, 0, 4, 1, 3]  # another batch order: every row draws the same
    shuffled = sample_tokens(logits[order], [samplers[i] for i in order], [steps[i] for i in order])
    assert shuffled == [together[i] for i in order]
    assert sample_tokens(logits[[3]], [samplers[3]], [steps[3]]) == [together[3]]
    with pytest.raises(ValueError, match="2 samplers, 1 steps"):
        sample_tokens(logits[:2], samplers[:2], steps[:1])


def test_draws_follow_the_distribution() -> None:
    logits = torch.tensor([2.0, 1.0, 0.0, -0.5] + [-30.0] * 60)
    n = 4000
    for params, support in [
        (SamplingParams(temperature=1.0, seed=11), 4),
        (SamplingParams(temperature=1.0, top_k=2, seed=12), 2),
        (SamplingParams(temperature=0.5, top_p=0.95, seed=13), 2),
    ]:
        sampler = Sampler(params)
        tokens = sample_tokens(logits.expand(n, -1), [sampler] * n, list(range(n)))
        counts = torch.bincount(torch.tensor(tokens), minlength=logits.numel()).float() / n
        want = torch.softmax(logits[:support] / params.temperature, dim=-1)
        assert counts[support:].sum() == 0  # nothing outside the kept support
        torch.testing.assert_close(counts[:support], want, atol=0.03, rtol=0)


def _run(text: OutputText, tokens: list[int]) -> tuple[list[str], FinishReason | None]:
    pieces = []
    reason = None
    for token in tokens:
        piece, reason = text.append(token)
        pieces.append(piece)
        if reason is not None:
            break
    return pieces, reason


def test_text_pieces_add_up_to_the_decoded_text(tokenizer: Tokenizer) -> None:
    source = "Prefix caching: é and 中 too, 42 pages! done."
    tokens = tokenizer.encode(source, add_special_tokens=False)
    params = SamplingParams(max_tokens=len(tokens))
    pieces, reason = _run(OutputText(tokenizer, params, limit=len(tokens)), tokens)
    assert reason is FinishReason.LENGTH and "".join(pieces) == source
    assert all("\ufffd" not in p for p in pieces)
    # cut short inside a multi-byte character: released with replacement characters
    cut = next(i for i in range(1, len(tokens)) if tokenizer.decode(tokens[:i]).endswith("\ufffd"))
    pieces, reason = _run(OutputText(tokenizer, params, limit=cut), tokens)
    assert reason is FinishReason.LENGTH and "".join(pieces) == tokenizer.decode(tokens[:cut])


def test_stop_strings_are_held_back_and_cut(tokenizer: Tokenizer) -> None:
    tokens = tokenizer.encode("step 1: done. step 2: more", add_special_tokens=False)
    params = SamplingParams(stop=("done.", "xyz"), max_tokens=100)
    text = OutputText(tokenizer, params, limit=100)
    pieces, reason = _run(text, tokens)
    assert reason is FinishReason.STOP
    assert "".join(pieces) == text.text == "step 1: "
    assert text.tokens == tokens[: len(text.tokens)] and len(text.tokens) < len(tokens)
    # a partial match that does not complete is released when it turns out not to be a stop
    params = SamplingParams(stop=("step 3",), max_tokens=100)
    pieces, reason = _run(OutputText(tokenizer, params, limit=len(tokens)), tokens)
    assert reason is FinishReason.LENGTH and "".join(pieces) == "step 1: done. step 2: more"
    held = [p for p in pieces if p.endswith("step")]
    assert not held  # "step" was held back each time until the next character showed otherwise


def test_stop_tokens_and_eos(tokenizer: Tokenizer) -> None:
    eos = tokenizer.eos_id
    assert eos is not None
    body = tokenizer.encode("hello there", add_special_tokens=False)
    text = OutputText(tokenizer, SamplingParams(), limit=50, eos_ids=(eos,))
    pieces, reason = _run(text, [*body, eos, *body])
    assert reason is FinishReason.STOP and "".join(pieces) == "hello there"
    assert text.tokens == [*body, eos]
    ignoring = OutputText(tokenizer, SamplingParams(ignore_eos=True), limit=50, eos_ids=(eos,))
    assert _run(ignoring, [*body, eos])[1] is None
    by_id = OutputText(tokenizer, SamplingParams(stop_token_ids=(body[1],)), limit=50)
    pieces, reason = _run(by_id, body)
    assert reason is FinishReason.STOP and "".join(pieces) == tokenizer.decode(body[:1])


def test_replay_resumes_exactly(tokenizer: Tokenizer) -> None:
    """A worker that replays the first k tokens releases, from then on, exactly what one that
    produced them all would have (the text after token k is a function of the k tokens)."""
    tokens = tokenizer.encode("Ab é 中 x: stop here? no, go on: done", add_special_tokens=False)
    params = SamplingParams(stop=("here?!", "go on"), max_tokens=len(tokens))
    whole = OutputText(tokenizer, params, limit=len(tokens))
    all_pieces, all_reason = _run(whole, tokens)
    for k in range(len(all_pieces)):
        resumed = OutputText(tokenizer, params, limit=len(tokens))
        assert resumed.replay(tokens[:k]) is None
        assert resumed.text == "".join(all_pieces[:k])
        rest, reason = _run(resumed, tokens[k:])
        assert rest == all_pieces[k:] and reason is all_reason
    finished = OutputText(tokenizer, params, limit=len(tokens))
    assert finished.replay(tokens) is FinishReason.STOP
    full = OutputText(tokenizer, SamplingParams(max_tokens=3), limit=3)
    assert full.replay(tokens[:3]) is FinishReason.LENGTH
    with pytest.raises(RuntimeError):
        full.append(tokens[3])


def test_a_stop_string_spanning_a_resume_still_stops_unseen(tokenizer: Tokenizer) -> None:
    """A decode resumed while part of a stop string is held back: the new worker holds the same
    part back, the stop completes on its side, and no character of it is ever returned."""
    tokens = tokenizer.encode("the answer is: 42 END more text", add_special_tokens=False)
    params = SamplingParams(stop=(" END",), max_tokens=len(tokens))
    spans = 0
    for k in range(1, len(tokens)):
        before = OutputText(tokenizer, params, limit=len(tokens))
        sent, reason = _run(before, tokens[:k])
        if reason is not None:
            break
        produced = tokenizer.decode(tokens[:k])
        held = produced.removeprefix("".join(sent))
        if not held:
            continue  # nothing held back at this point
        assert " END".startswith(held)  # part of the stop string, produced and held back
        spans += 1
        resumed = OutputText(tokenizer, params, limit=len(tokens))
        assert resumed.replay(tokens[:k]) is None
        rest, reason = _run(resumed, tokens[k:])
        assert reason is FinishReason.STOP
        assert "".join(sent) + "".join(rest) == "the answer is: 42"
    assert spans >= 1, "no resume point fell inside the stop string"
