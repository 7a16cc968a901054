"""The model's shape and numerics, parsed from a Hugging Face `config.json` (DESIGN §8).

Supported: Llama 2/3 (`llama`), Mistral (`mistral`, full attention only), Qwen2/2.5 (`qwen2`,
bias on q/k/v) and Qwen3 (`qwen3`, RMSNorm per head on q and k). Anything else, or a config that
asks for a feature this decoder does not implement (sliding-window attention, MLP bias, an
activation other than SiLU, a RoPE scaling other than `linear`/`llama3`), is refused with
`UnsupportedModel` rather than run wrongly.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
TORCH_DTYPES = ("float32", "float16", "bfloat16")
_ROPE_TYPES = ("default", "linear", "llama3")

JsonValue = str | int | float | bool | None | list["JsonValue"] | dict[str, "JsonValue"]


class ConfigError(ValueError):
    """config.json is malformed: a required field is missing or has the wrong type or value."""


class UnsupportedModel(ConfigError):
    """config.json describes a model (or a feature of one) this decoder does not implement."""


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """RoPE frequency scaling. `rope_type` is "linear" (positions / factor) or "llama3".

    The llama3 fields (`low_freq_factor`, `high_freq_factor`, `original_max_position_embeddings`)
    are zero for "linear".
    """

    rope_type: str
    factor: float
    low_freq_factor: float = 0.0
    high_freq_factor: float = 0.0
    original_max_position_embeddings: int = 0


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Everything the decoder needs to know about a checkpoint. Frozen; built by `from_hf_dict`."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    torch_dtype: str
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{name} must be a positive int, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.torch_dtype not in TORCH_DTYPES:
            raise UnsupportedModel(f"torch_dtype {self.torch_dtype!r} is not one of {TORCH_DTYPES}")
        if not self.rms_norm_eps > 0 or not self.rope_theta > 0:
            raise ConfigError("rms_norm_eps and rope_theta must be positive")

    @property
    def num_queries_per_kv(self) -> int:
        """Query heads that share one KV head (1 without GQA)."""
        return self.num_attention_heads // self.num_key_value_heads

    @classmethod
    def from_hf_dict(cls, raw: Mapping[str, JsonValue]) -> ModelConfig:
        """Parse a loaded config.json; raises ConfigError / UnsupportedModel with the field's name."""
        return _parse(raw)

    @classmethod
    def from_file(cls, path: str | Path) -> ModelConfig:
        """Parse `path` (a config.json, or a folder holding one)."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"no config.json at {path}") from None
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path} is not valid JSON: {exc}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path} must hold a JSON object")
        return _parse(raw)

    def to_hf_dict(self) -> dict[str, JsonValue]:
        """The config.json this config would be parsed from (used by the presets)."""
        out: dict[str, JsonValue] = {
            "architectures": [_ARCHITECTURES[self.model_type]],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": None,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "torch_dtype": self.torch_dtype,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": (
                None
                if not self.eos_token_ids
                else self.eos_token_ids[0]
                if len(self.eos_token_ids) == 1
                else list(self.eos_token_ids)
            ),
        }
        if self.rope_scaling is not None:
            rs = self.rope_scaling
            scaling: dict[str, JsonValue] = {"rope_type": rs.rope_type, "factor": rs.factor}
            if rs.rope_type == "llama3":
                scaling.update(
                    low_freq_factor=rs.low_freq_factor,
                    high_freq_factor=rs.high_freq_factor,
                    original_max_position_embeddings=rs.original_max_position_embeddings,
                )
            out["rope_scaling"] = scaling
        return out


_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}

_MISSING = object()


def _get(
    raw: Mapping[str, JsonValue],
    name: str,
    kind: type | tuple[type, ...],
    default: object = _MISSING,
) -> object:
    value = raw.get(name, _MISSING)
    if value is _MISSING or value is None:
        if default is _MISSING:
            raise ConfigError(f"config.json is missing required field {name!r}")
        return default
    if isinstance(value, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,)):
        raise ConfigError(f"config field {name!r} must be {kind}, got {value!r}")
    if not isinstance(value, kind):
        raise ConfigError(f"config field {name!r} must be {kind}, got {value!r}")
    return value


def _int(raw: Mapping[str, JsonValue], name: str, default: object = _MISSING) -> int:
    value = _get(raw, name, int, default)
    assert isinstance(value, int)
    return value


def _float(raw: Mapping[str, JsonValue], name: str, default: object = _MISSING) -> float:
    value = _get(raw, name, (int, float), default)
    assert isinstance(value, int | float)
    return float(value)


def _bool(raw: Mapping[str, JsonValue], name: str, default: bool) -> bool:
    value = _get(raw, name, bool, default)
    assert isinstance(value, bool)
    return value


def _parse(raw: Mapping[str, JsonValue]) -> ModelConfig:
    model_type = raw.get("model_type")
    if not isinstance(model_type, str):
        raise ConfigError("config.json is missing required field 'model_type'")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModel(
            f"model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModel(f"hidden_act {act!r} is not supported (only silu)")
    if _bool(raw, "mlp_bias", False):
        raise UnsupportedModel("mlp_bias=true is not supported")

    hidden = _int(raw, "hidden_size")
    heads = _int(raw, "num_attention_heads")
    if heads <= 0:
        raise ConfigError(f"num_attention_heads must be positive, got {heads}")
    if hidden % heads and raw.get("head_dim") is None:
        raise ConfigError(f"hidden_size {hidden} is not divisible by num_attention_heads {heads}")
    max_pos = _int(raw, "max_position_embeddings")
    _check_full_attention(raw, model_type, max_pos)

    # transformers >= 5 nests rope_theta / rope_type in `rope_parameters`; older configs keep
    # `rope_theta` at the top level and the scaling dict in `rope_scaling`.
    rope_params = raw.get("rope_parameters")
    if isinstance(rope_params, dict):
        rope_theta = _float(rope_params, "rope_theta", _float(raw, "rope_theta", 10000.0))
        scaling_raw: JsonValue = rope_params
    else:
        rope_theta = _float(raw, "rope_theta", 10000.0)
        scaling_raw = raw.get("rope_scaling")

    dtype = raw.get("torch_dtype", raw.get("dtype", "float32"))
    if not isinstance(dtype, str):
        raise ConfigError(f"torch_dtype must be a string, got {dtype!r}")

    eos = raw.get("eos_token_id")
    if eos is None:
        eos_ids: tuple[int, ...] = ()
    elif isinstance(eos, int) and not isinstance(eos, bool):
        eos_ids = (eos,)
    elif isinstance(eos, list) and all(isinstance(e, int) and not isinstance(e, bool) for e in eos):
        eos_ids = tuple(e for e in eos if isinstance(e, int))
    else:
        raise ConfigError(f"eos_token_id must be an int or a list of ints, got {eos!r}")
    bos = raw.get("bos_token_id")
    if bos is not None and (not isinstance(bos, int) or isinstance(bos, bool)):
        raise ConfigError(f"bos_token_id must be an int, got {bos!r}")

    return ModelConfig(
        model_type=model_type,
        vocab_size=_int(raw, "vocab_size"),
        hidden_size=hidden,
        intermediate_size=_int(raw, "intermediate_size"),
        num_hidden_layers=_int(raw, "num_hidden_layers"),
        num_attention_heads=heads,
        num_key_value_heads=_int(raw, "num_key_value_heads", heads),
        head_dim=_int(raw, "head_dim", hidden // heads if heads > 0 else 0),
        rms_norm_eps=_float(raw, "rms_norm_eps", 1e-6),
        rope_theta=rope_theta,
        rope_scaling=_parse_rope_scaling(scaling_raw),
        max_position_embeddings=max_pos,
        tie_word_embeddings=_bool(raw, "tie_word_embeddings", False),
        # Qwen2 always has bias on q/k/v (and none on o); its config has no flag for it.
        attention_bias=True if model_type == "qwen2" else _bool(raw, "attention_bias", False),
        qk_norm=model_type == "qwen3",
        torch_dtype=dtype,
        bos_token_id=bos,
        eos_token_ids=eos_ids,
    )


def _check_full_attention(raw: Mapping[str, JsonValue], model_type: str, max_pos: int) -> None:
    """Refuse sliding-window attention: this decoder attends over the whole context."""
    window = raw.get("sliding_window")
    if model_type == "qwen2" or model_type == "qwen3":
        enabled = raw.get("use_sliding_window", False) is True
    else:
        enabled = window is not None
    if enabled and isinstance(window, int) and window < max_pos:
        raise UnsupportedModel(
            f"sliding_window={window} < max_position_embeddings={max_pos}: "
            "sliding-window attention is not supported"
        )


def _parse_rope_scaling(raw: JsonValue) -> RopeScaling | None:
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ConfigError(f"rope_scaling must be an object or null, got {raw!r}")
    rope_type = raw.get("rope_type", raw.get("type", "default"))
    if rope_type not in _ROPE_TYPES:
        raise UnsupportedModel(
            f"rope_scaling type {rope_type!r} is not supported; supported: {_ROPE_TYPES}"
        )
    if rope_type == "default":
        return None
    factor = _float(raw, "factor")
    if factor <= 0:
        raise ConfigError(f"rope_scaling.factor must be positive, got {factor}")
    if rope_type == "linear":
        return RopeScaling("linear", factor)
    low = _float(raw, "low_freq_factor")
    high = _float(raw, "high_freq_factor")
    if not 0 < low < high:
        raise ConfigError(
            f"rope_scaling needs 0 < low_freq_factor < high_freq_factor, got {low}, {high}"
        )
    return RopeScaling(
        "llama3",
        factor,
        low_freq_factor=low,
        high_freq_factor=high,
        original_max_position_embeddings=_int(raw, "original_max_position_embeddings"),
    )
