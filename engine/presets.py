"""Random-weight checkpoints in the Hugging Face folder format, for tests and benchmarks (DESIGN §8).

`init_checkpoint(path, "tiny" | "small", seed)` writes config.json, model.safetensors,
tokenizer.json and tokenizer_config.json, so everything downstream runs the real loading code.
Same preset and seed → byte-identical files (and so identical fingerprints).

The tokenizer is a byte-level BPE trained here on a built-in, procedurally generated corpus: it
round-trips any text (every byte is in its alphabet) and is deterministic. Weights are scaled so
the residual stream stays O(1) and the logits are spread (std ≈ 3), so greedy output depends on
the input rather than collapsing onto one token.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

import safetensors.torch
import tokenizers
import torch
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from engine.config import ModelConfig, RopeScaling
from engine.model import DecoderModel

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
PRESET_NAMES = ("tiny", "small")
VARIANTS = ("llama", "mistral", "qwen2", "qwen3")
_LOGIT_STD = 3.0
# A plain role-tagged chat format (the router renders it for /v1/chat/completions).
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


@dataclass(frozen=True, slots=True)
class _Shape:
    target_vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    tie: bool


_SHAPES = {
    "tiny": _Shape(
        target_vocab=512, hidden=64, intermediate=192, layers=2, heads=4, kv_heads=2, tie=True
    ),
    "small": _Shape(
        target_vocab=8192, hidden=512, intermediate=1536, layers=8, heads=8, kv_heads=4, tie=False
    ),
}


@dataclass(frozen=True, slots=True)
class InitResult:
    """What `init_checkpoint` wrote."""

    path: Path
    files: tuple[str, ...]
    config: ModelConfig
    num_params: int


def init_checkpoint(
    path: str | Path,
    preset: str = "tiny",
    seed: int = 0,
    *,
    model_type: str = "llama",
    tie_word_embeddings: bool | None = None,
) -> InitResult:
    """Write a random-weight checkpoint of `preset` into folder `path` (created; files overwritten).

    `model_type` picks the family's variant: "qwen2" adds q/k/v bias, "qwen3" per-head q/k norms.
    Raises ValueError for an unknown preset or model type.
    """
    if preset not in _SHAPES:
        raise ValueError(f"unknown preset {preset!r}; known: {PRESET_NAMES}")
    if model_type not in VARIANTS:
        raise ValueError(f"unknown model type {model_type!r}; known: {VARIANTS}")
    shape = _SHAPES[preset]
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)

    tokenizer = build_tokenizer(shape.target_vocab)
    config = _config(shape, model_type, tokenizer)
    if tie_word_embeddings is not None:
        config = replace(config, tie_word_embeddings=tie_word_embeddings)
    weights = random_weights(config, seed)

    hf = config.to_hf_dict()
    hf["_name_or_path"] = f"strata-{preset}-{model_type}"
    (folder / "config.json").write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n")
    safetensors.torch.save_file(
        weights, str(folder / "model.safetensors"), metadata={"format": "pt"}
    )
    tokenizer.save(str(folder / "tokenizer.json"))
    tokenizer_config = {
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "model_max_length": config.max_position_embeddings,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    files = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
    return InitResult(folder, files, config, sum(t.numel() for t in weights.values()))


def _config(shape: _Shape, model_type: str, tokenizer: tokenizers.Tokenizer) -> ModelConfig:
    head_dim = shape.hidden // shape.heads
    return ModelConfig(
        model_type=model_type,
        vocab_size=tokenizer.get_vocab_size(with_added_tokens=True),
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        head_dim=head_dim,
        rms_norm_eps=1e-5,
        rope_theta=10000.0 if shape.hidden < 256 else 500000.0,
        # Llama 3.1's scaling; with these thetas every regime (kept, blended, divided) is used.
        rope_scaling=RopeScaling(
            "llama3",
            8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8192,
        ),
        max_position_embeddings=32768,
        tie_word_embeddings=shape.tie,
        attention_bias=model_type == "qwen2",
        qk_norm=model_type == "qwen3",
        torch_dtype="float32",
        bos_token_id=_special_id(tokenizer, BOS),
        eos_token_ids=(_special_id(tokenizer, EOS),),
    )


def _special_id(tokenizer: tokenizers.Tokenizer, token: str) -> int:
    tid = tokenizer.token_to_id(token)
    if tid is None:
        raise RuntimeError(f"tokenizer lost its special token {token!r}")
    return int(tid)


def random_weights(config: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """Deterministic random tensors, in HF names, for every parameter of `config`'s model."""
    with torch.device("meta"):
        shapes = {name: t.shape for name, t in DecoderModel(config).state_dict().items()}
    gen = torch.Generator().manual_seed(seed)
    depth_scale = 1.0 / math.sqrt(2 * config.num_hidden_layers)
    out: dict[str, torch.Tensor] = {}
    for name in sorted(shapes):
        shape = shapes[name]
        noise = torch.randn(shape, generator=gen, dtype=torch.float32)
        if name.endswith("norm.weight"):
            tensor = 1.0 + 0.1 * noise
        elif name.endswith(".bias"):
            tensor = 0.1 * noise
        elif name == "model.embed_tokens.weight":
            # Tied: the embeddings are the lm_head too, so scale them to the logit spread.
            std = _LOGIT_STD / math.sqrt(config.hidden_size) if config.tie_word_embeddings else 1.0
            tensor = std * noise
        elif name == "lm_head.weight":
            tensor = (_LOGIT_STD / math.sqrt(config.hidden_size)) * noise
        else:
            fan_in = shape[1]
            std = 1.0 / math.sqrt(fan_in)
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                std *= depth_scale
            tensor = std * noise
        out[name] = tensor.contiguous()
    return out


def build_tokenizer(target_vocab: int) -> tokenizers.Tokenizer:
    """A byte-level BPE of at most `target_vocab` ids, trained on `_corpus()`; BOS prepended on encode."""
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=target_vocab,
        special_tokens=[BOS, EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, bos_id)]
    )
    return tok


_TEXT = """\
The store keeps pages of attention keys and values so that a prompt prefix is computed once.
Engines publish full pages after prefill and pull them before decode; a miss is never an error.
def main(argv: list[str]) -> int:
    for i in range(10):
        print(f"step {i}: {i * i}")
    return 0
Numbers 0 1 2 3 4 5 6 7 8 9 10 42 100 256 1024 3.14159 2.71828; dates 2024-05-01, 12:30.
Punctuation: , . ; : ! ? ' " ( ) [ ] { } < > / \\ | - _ + = * & ^ % $ # @ ~ `
"""

_ONSETS = [
    "",
    "b",
    "c",
    "d",
    "f",
    "g",
    "h",
    "k",
    "l",
    "m",
    "n",
    "p",
    "r",
    "s",
    "t",
    "v",
    "w",
    "z",
    "br",
    "ch",
    "cl",
    "dr",
    "fl",
    "gr",
    "pl",
    "pr",
    "sh",
    "st",
    "th",
    "tr",
]
_VOWELS = ["a", "e", "i", "o", "u", "ai", "ea", "ee", "oo", "ou", "y"]
_CODAS = ["", "", "", "n", "r", "s", "t", "l", "m", "nd", "ng", "st", "ck"]


def _corpus() -> list[str]:
    """Deterministic text: the built-in paragraph, then pseudo-words with a Zipf-like frequency."""
    state = 0x5EED

    def rand(n: int) -> int:
        nonlocal state
        state = (state * 6364136223846793005 + 1442695040888963407) % (1 << 64)
        return (state >> 33) % n

    lexicon = []
    for _ in range(6000):
        syllables = 1 + rand(3)
        word = "".join(
            _ONSETS[rand(len(_ONSETS))] + _VOWELS[rand(len(_VOWELS))] + _CODAS[rand(len(_CODAS))]
            for _ in range(syllables)
        )
        lexicon.append(word)
    lines = _TEXT.splitlines() * 4
    for _ in range(3000):
        words = []
        for _ in range(8 + rand(8)):
            # rank ~ squared uniform: a few words are frequent, most are rare.
            rank = rand(len(lexicon)) * rand(len(lexicon)) // len(lexicon)
            word = lexicon[rank]
            words.append(word.capitalize() if rand(8) == 0 else word)
        lines.append(" ".join(words) + (". " if rand(2) else ", ") + str(rand(1000)))
    return lines
