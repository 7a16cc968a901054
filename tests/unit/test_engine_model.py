"""The model half of the engines (DESIGN §8): config parsing, checkpoints and fingerprints, RoPE,
and the paged model checked against the dense, cache-free reference forward."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
import safetensors.torch
import torch

from client import KVLayout
from engine.checkpoint import CheckpointError, load_checkpoint, make_scope
from engine.cli_model import main as model_cli
from engine.config import ConfigError, ModelConfig, RopeScaling, UnsupportedModel
from engine.kv_pool import PagedKVPool
from engine.model import DecoderModel
from engine.presets import init_checkpoint, random_weights
from engine.reference import dense_logits, greedy_generate
from engine.rope import inverse_frequencies

pytestmark = pytest.mark.unit

ATOL = 2e-4


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny")
    init_checkpoint(path, "tiny", seed=0)
    return path


@pytest.fixture(scope="module")
def tiny(tiny_dir: Path) -> DecoderModel:
    ckpt = load_checkpoint(tiny_dir)
    return DecoderModel.from_state_dict(ckpt.config, ckpt.state_dict)


def _ids(count: int, vocab: int, seed: int) -> torch.Tensor:
    return torch.randint(3, vocab, (count,), generator=torch.Generator().manual_seed(seed))


def _shuffled_table(pool: PagedKVPool, tokens: int, seed: int) -> list[int]:
    """A block table of scattered pages, so paging bugs cannot hide behind a contiguous layout."""
    pages = pool.allocate(pool.pages_for(tokens))
    random.Random(seed).shuffle(pages)
    return pages


def test_tiny_checkpoint_loads_back(tiny_dir: Path) -> None:
    ckpt = load_checkpoint(tiny_dir)
    c = ckpt.config
    assert (c.model_type, c.num_hidden_layers, c.hidden_size) == ("llama", 2, 64)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (4, 2, 16)
    assert 512 >= c.vocab_size >= 256 + 3 and c.tie_word_embeddings
    assert "lm_head.weight" not in ckpt.state_dict
    expected = random_weights(c, seed=0)
    assert sorted(ckpt.state_dict) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(ckpt.state_dict[name], tensor), name
    assert ckpt.model_id == "strata-tiny-llama"
    text = "Prefix caching: 42 pages, é and 中 too!\n\tdone."
    ids = ckpt.tokenizer.encode(text)
    assert ids[0] == ckpt.tokenizer.bos_id == c.bos_token_id
    assert ckpt.tokenizer.decode(ids) == text
    assert ckpt.tokenizer.eos_id == c.eos_token_ids[0]
    assert max(ids) < c.vocab_size == ckpt.tokenizer.vocab_size


def test_fingerprints_are_stable_and_track_the_weights(tmp_path: Path, tiny_dir: Path) -> None:
    base = load_checkpoint(tiny_dir).fingerprints
    init_checkpoint(tmp_path / "same", "tiny", seed=0)
    assert load_checkpoint(tmp_path / "same").fingerprints == base
    assert len(base.weights) == len(base.tokenizer) == len(base.config) == 32

    init_checkpoint(tmp_path / "other", "tiny", seed=1)
    other = load_checkpoint(tmp_path / "other").fingerprints
    assert other.weights != base.weights
    assert (other.tokenizer, other.config) == (base.tokenizer, base.config)

    # One weight nudged in place: only the weights fingerprint moves.
    edited = tmp_path / "edited"
    init_checkpoint(edited, "tiny", seed=0)
    tensors = safetensors.torch.load_file(str(edited / "model.safetensors"))
    tensors["model.norm.weight"][0] += 1e-3
    safetensors.torch.save_file(
        tensors, str(edited / "model.safetensors"), metadata={"format": "pt"}
    )
    nudged = load_checkpoint(edited).fingerprints
    assert nudged.weights != base.weights and nudged.tokenizer == base.tokenizer

    # A config edit that changes KV values changes the scope even though the weights do not.
    cfg = json.loads((edited / "config.json").read_text())
    cfg["rope_theta"] = 20000.0
    (edited / "config.json").write_text(json.dumps(cfg))
    retheta = load_checkpoint(edited)
    assert retheta.fingerprints.weights == nudged.weights
    assert retheta.fingerprints.config != nudged.config


def test_make_scope(tiny_dir: Path) -> None:
    ckpt = load_checkpoint(tiny_dir)
    scope = make_scope(ckpt, page_tokens=16, namespace="tenant-a")
    assert scope.model_id == "strata-tiny-llama"
    assert scope.weights_revision == f"{ckpt.fingerprints.weights}-{ckpt.fingerprints.config}"
    assert scope.tokenizer_fingerprint == ckpt.fingerprints.tokenizer
    assert (scope.layout.num_layers, scope.layout.num_kv_heads, scope.layout.head_dim) == (2, 2, 16)
    assert scope.layout.page_tokens == 16 and scope.kv_dtype == "float32"
    assert scope.page_payload_bytes == 2 * 2 * 16 * 2 * 16 * 4
    again = make_scope(load_checkpoint(tiny_dir), page_tokens=16, namespace="tenant-a")
    assert again.digest == scope.digest
    assert make_scope(ckpt, page_tokens=16, namespace="tenant-b").digest != scope.digest
    assert make_scope(ckpt, page_tokens=16, kv_dtype=torch.bfloat16).kv_dtype == "bfloat16"


def test_sharded_checkpoint_loads_like_a_single_file(tmp_path: Path, tiny_dir: Path) -> None:
    single = load_checkpoint(tiny_dir)
    names = sorted(single.state_dict)
    shards = {
        "model-00001-of-00002.safetensors": names[::2],
        "model-00002-of-00002.safetensors": names[1::2],
    }
    for fname in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / fname).write_bytes((tiny_dir / fname).read_bytes())
    weight_map = {}
    for fname, keys in shards.items():
        safetensors.torch.save_file({k: single.state_dict[k] for k in keys}, str(tmp_path / fname))
        weight_map.update(dict.fromkeys(keys, fname))
    index = {"metadata": {}, "weight_map": weight_map}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    sharded = load_checkpoint(tmp_path)
    assert sharded.config == single.config
    assert all(torch.equal(sharded.state_dict[n], single.state_dict[n]) for n in names)
    assert sharded.fingerprints.tokenizer == single.fingerprints.tokenizer

    index["weight_map"]["lm_head.weight"] = "model-00003-of-00002.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="missing shard"):
        load_checkpoint(tmp_path)


def test_checkpoint_errors(tmp_path: Path, tiny_dir: Path) -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "nope")
    (tmp_path / "config.json").write_bytes((tiny_dir / "config.json").read_bytes())
    with pytest.raises(CheckpointError, match="safetensors"):
        load_checkpoint(tmp_path)
    ckpt = load_checkpoint(tiny_dir)
    broken = dict(ckpt.state_dict)
    del broken["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(ValueError, match="up_proj"):
        DecoderModel.from_state_dict(ckpt.config, broken)


def _llama31_8b() -> dict[str, object]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 128256,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
        "max_position_embeddings": 131072,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": 128000,
        "eos_token_id": [128001, 128008, 128009],
    }


def test_config_parses_llama31() -> None:
    c = ModelConfig.from_hf_dict(_llama31_8b())
    assert c.head_dim == 128 and c.num_queries_per_kv == 4
    assert c.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)
    assert c.eos_token_ids == (128001, 128008, 128009) and c.bos_token_id == 128000
    assert (c.attention_bias, c.qk_norm, c.torch_dtype) == (False, False, "bfloat16")
    assert ModelConfig.from_hf_dict(c.to_hf_dict()) == c


def test_config_family_flags() -> None:
    qwen2 = {
        **_llama31_8b(),
        "model_type": "qwen2",
        "rope_scaling": None,
        "use_sliding_window": False,
        "sliding_window": 4096,
    }
    qwen2.pop("attention_bias")
    c2 = ModelConfig.from_hf_dict(qwen2)
    assert c2.attention_bias and not c2.qk_norm and c2.rope_scaling is None
    qwen3 = {**_llama31_8b(), "model_type": "qwen3", "head_dim": 96, "rope_scaling": None}
    c3 = ModelConfig.from_hf_dict(qwen3)
    assert c3.qk_norm and not c3.attention_bias and c3.head_dim == 96
    mistral = {
        **_llama31_8b(),
        "model_type": "mistral",
        "sliding_window": None,
        "rope_scaling": None,
    }
    assert ModelConfig.from_hf_dict(mistral).model_type == "mistral"
    nested = {**_llama31_8b(), "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}
    del nested["rope_theta"], nested["rope_scaling"]
    cn = ModelConfig.from_hf_dict(nested)
    assert cn.rope_theta == 1e6 and cn.rope_scaling is None


@pytest.mark.parametrize(
    ("edit", "error", "match"),
    [
        ({"model_type": "gpt2"}, UnsupportedModel, "gpt2"),
        ({"model_type": "qwen2_moe"}, UnsupportedModel, "qwen2_moe"),
        ({"hidden_size": None}, ConfigError, "hidden_size"),
        ({"num_hidden_layers": "32"}, ConfigError, "num_hidden_layers"),
        ({"hidden_act": "gelu"}, UnsupportedModel, "gelu"),
        ({"mlp_bias": True}, UnsupportedModel, "mlp_bias"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, UnsupportedModel, "yarn"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, ConfigError, "low_freq_factor"),
        ({"model_type": "mistral", "sliding_window": 4096}, UnsupportedModel, "sliding"),
        ({"num_key_value_heads": 5}, ConfigError, "multiple"),
        ({"torch_dtype": "float64"}, UnsupportedModel, "float64"),
    ],
)
def test_config_errors(edit: dict[str, object], error: type[Exception], match: str) -> None:
    raw = {**_llama31_8b(), **edit}
    with pytest.raises(error, match=match):
        ModelConfig.from_hf_dict({k: v for k, v in raw.items() if v is not None})


def test_llama3_rope_scaling_by_hand() -> None:
    inv = inverse_frequencies(128, 500000.0, RopeScaling("llama3", 8.0, 1.0, 4.0, 8192))
    plain = inverse_frequencies(128, 500000.0, None)
    # i = 30: theta^(60/128) = 469.237, wavelength 2948.30 lies between 8192/4 and 8192/1,
    # so it is blended: smooth = (8192 / 2948.30 - 1) / 3 = 0.59285,
    # inv_freq = (1 - 0.59285) * 0.00213112 / 8 + 0.59285 * 0.00213112 = 0.00137189.
    base = 500000.0 ** (-60 / 128)
    wavelength = 2 * math.pi / base
    assert 2048 < wavelength < 8192
    smooth = (8192 / wavelength - 1.0) / (4.0 - 1.0)
    expected = (1 - smooth) * base / 8.0 + smooth * base
    assert inv[30].item() == pytest.approx(expected, rel=1e-12)
    assert inv[30].item() == pytest.approx(1.37189e-3, rel=1e-5)
    assert inv[0].item() == plain[0].item() == 1.0  # short wavelength: kept
    assert inv[63].item() == pytest.approx(plain[63].item() / 8.0, rel=1e-12)  # long: divided


def test_one_shot_prefill_matches_dense(tiny: DecoderModel) -> None:
    ids = _ids(45, tiny.config.vocab_size, seed=1)
    pool = PagedKVPool(tiny.kv_layout(8), 16)
    table = _shuffled_table(pool, 45, seed=1)
    got = tiny(ids, None, pool, table, 0, all_logits=True)
    want = dense_logits(tiny, ids)
    assert got.shape == (45, tiny.config.vocab_size)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    last = tiny(ids, None, PagedKVPool(tiny.kv_layout(8), 16), list(range(6)), 0)
    torch.testing.assert_close(last, want[-1], atol=ATOL, rtol=0)
    assert want.std() > 1.0  # logits are spread, not degenerate


def test_chunked_prefill_across_page_boundaries(tiny: DecoderModel) -> None:
    ids = _ids(70, tiny.config.vocab_size, seed=2)
    want = dense_logits(tiny, ids)
    one_shot = PagedKVPool(tiny.kv_layout(8), 12)
    one_table = one_shot.allocate(9)
    tiny(ids, None, one_shot, one_table, 0)

    pool = PagedKVPool(tiny.kv_layout(8), 12)
    table = _shuffled_table(pool, 70, seed=2)
    chunks, start = [], 0
    for size in (3, 5, 8, 1, 16, 20, 17):  # ends mid-page, on a boundary, spanning several
        chunks.append(tiny(ids[start : start + size], None, pool, table, start, all_logits=True))
        start += size
    assert start == 70
    torch.testing.assert_close(torch.cat(chunks), want, atol=ATOL, rtol=0)
    # Same K/V in the pool, page for page, as a one-shot prefill.
    torch.testing.assert_close(pool.tensor[table], one_shot.tensor[one_table], atol=1e-5, rtol=0)


def test_prefill_then_batched_decode(tiny: DecoderModel) -> None:
    vocab = tiny.config.vocab_size
    prompts = [_ids(13, vocab, seed=3), _ids(24, vocab, seed=4), _ids(1, vocab, seed=5)]
    steps = 6
    pool = PagedKVPool(tiny.kv_layout(8), 24)
    tables = [_shuffled_table(pool, len(p) + steps, seed=i) for i, p in enumerate(prompts)]
    seqs = [p.tolist() for p in prompts]
    next_tokens = []
    for prompt, table in zip(prompts, tables, strict=True):
        next_tokens.append(int(tiny(prompt, None, pool, table, 0).argmax()))
    for _ in range(steps):
        ctx = [len(s) for s in seqs]
        for s, tok in zip(seqs, next_tokens, strict=True):
            s.append(tok)
        logits = tiny.decode_step(torch.tensor(next_tokens), None, pool, tables, ctx)
        assert logits.shape == (3, vocab)
        for b, s in enumerate(seqs):
            torch.testing.assert_close(
                logits[b], dense_logits(tiny, torch.tensor(s))[-1], atol=ATOL, rtol=0
            )
        next_tokens = [int(t) for t in logits.argmax(dim=-1)]
    generated = [[*s[len(p) :], t] for s, p, t in zip(seqs, prompts, next_tokens, strict=True)]
    for prompt, gen in zip(prompts, generated, strict=True):
        assert gen == greedy_generate(tiny, prompt.tolist(), steps + 1)


def test_greedy_output_depends_on_the_input(tiny: DecoderModel) -> None:
    vocab = tiny.config.vocab_size
    firsts = {int(dense_logits(tiny, _ids(12, vocab, seed=s))[-1].argmax()) for s in range(8)}
    assert len(firsts) >= 4


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3"])
def test_qwen_variants_load_and_match_dense(tmp_path: Path, model_type: str) -> None:
    init_checkpoint(tmp_path, "tiny", seed=7, model_type=model_type, tie_word_embeddings=False)
    ckpt = load_checkpoint(tmp_path)
    c = ckpt.config
    assert (c.attention_bias, c.qk_norm) == (model_type == "qwen2", model_type == "qwen3")
    extra = "self_attn.q_proj.bias" if model_type == "qwen2" else "self_attn.q_norm.weight"
    assert f"model.layers.0.{extra}" in ckpt.state_dict and "lm_head.weight" in ckpt.state_dict
    model = DecoderModel.from_state_dict(c, ckpt.state_dict)
    ids = _ids(30, c.vocab_size, seed=8)
    pool = PagedKVPool(model.kv_layout(8), 8)
    table = _shuffled_table(pool, 30, seed=8)
    first = model(ids[:11], None, pool, table, 0, all_logits=True)
    rest = model(ids[11:], None, pool, table, 11, all_logits=True)
    want = dense_logits(model, ids)
    torch.testing.assert_close(torch.cat([first, rest]), want, atol=ATOL, rtol=0)
    # The variant's extra tensors are used: zeroing them changes the output.
    changed = dict(ckpt.state_dict)
    for name in changed:
        if name.endswith(extra.split(".", 1)[1]):
            changed[name] = (
                torch.zeros_like(changed[name]) if model_type == "qwen2" else 2 * changed[name]
            )
    other = DecoderModel.from_state_dict(c, changed)
    assert (dense_logits(other, ids) - want).abs().max() > 1e-2


def test_pool_must_fit_the_model(tiny: DecoderModel) -> None:
    ids = _ids(10, tiny.config.vocab_size, seed=9)
    wrong = PagedKVPool(KVLayout(3, 2, 16, 8), 4)
    with pytest.raises(ValueError, match="layout"):
        tiny(ids, None, wrong, [0, 1], 0)
    pool = PagedKVPool(tiny.kv_layout(8), 4)
    with pytest.raises(ValueError, match="block table"):
        tiny(ids, None, pool, [0], 0)
    with pytest.raises(ValueError, match="no slot"):
        tiny.decode_step(torch.tensor([5]), None, pool, [[0]], [8])


def test_cli_init_writes_a_loadable_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert model_cli(["init", str(tmp_path / "ck"), "--preset", "tiny", "--seed", "3"]) == 0
    out = capsys.readouterr().out
    assert "wrote tiny llama checkpoint" in out and "model.safetensors" in out
    ckpt = load_checkpoint(tmp_path / "ck")
    assert ckpt.fingerprints.weights in out
    assert model_cli(["info", str(tmp_path / "ck")]) == 0
    assert ckpt.fingerprints.tokenizer in capsys.readouterr().out
