"""Loading a local Hugging Face checkpoint folder and naming its KV scope (DESIGN §3, §8).

A folder holds `config.json`, `*.safetensors` (one file, or shards listed by
`model.safetensors.index.json`) and `tokenizer.json`. `load_checkpoint` reads all three and
fingerprints them; `make_scope` turns the fingerprints into the `client.Scope` under which the
model's KV pages are keyed, so pages of different weights, configs or tokenizers never mix.

Fingerprints are xxh3-128 hex digests, stable across processes and hosts:
- weights: over the sorted safetensors file names, each length-prefixed, with its size and bytes
  (streamed, so a large checkpoint is never read into memory twice);
- tokenizer: over the bytes of tokenizer.json;
- config: over config.json re-serialised canonically (sorted keys, no whitespace).
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import safetensors.torch
import torch
import xxhash

from client import KVLayout, Scope, Shard
from engine.config import ConfigError, ModelConfig
from engine.kv_pool import kv_dtype_name
from engine.tokenizer import Tokenizer

INDEX_FILE = "model.safetensors.index.json"
_CHUNK_BYTES = 1 << 20


class CheckpointError(ValueError):
    """A checkpoint folder is missing a file, or its files disagree with one another."""


@dataclass(frozen=True, slots=True)
class Fingerprints:
    """xxh3-128 hex digests of a checkpoint's weights, tokenizer and config."""

    weights: str
    tokenizer: str
    config: str

    @property
    def revision(self) -> str:
        """The `Scope.weights_revision`: the weights and the config that interprets them (RoPE,
        norms, head layout); either one changing changes every KV page."""
        return f"{self.weights}-{self.config}"


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """A loaded checkpoint folder. `state_dict` holds CPU tensors under their HF names."""

    path: Path
    config: ModelConfig
    state_dict: dict[str, torch.Tensor]
    fingerprints: Fingerprints
    tokenizer: Tokenizer
    model_id: str


def load_checkpoint(path: str | Path) -> Checkpoint:
    """Read config, weights and tokenizer from `path`. Raises CheckpointError / ConfigError."""
    folder = Path(path)
    if not folder.is_dir():
        raise CheckpointError(f"checkpoint folder {folder} does not exist")
    config_path = folder / "config.json"
    try:
        raw_config = json.loads(config_path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{folder} has no config.json") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{config_path} is not valid JSON: {exc}") from None
    if not isinstance(raw_config, dict):
        raise ConfigError(f"{config_path} must hold a JSON object")
    config = ModelConfig.from_hf_dict(raw_config)

    files = weight_files(folder)
    state_dict: dict[str, torch.Tensor] = {}
    for file in files:
        for name, tensor in safetensors.torch.load_file(str(file)).items():
            if name in state_dict:
                raise CheckpointError(f"tensor {name} appears in more than one weight file")
            state_dict[name] = tensor
    _check_index(folder, state_dict)

    tokenizer_path = folder / "tokenizer.json"
    if not tokenizer_path.exists():
        raise CheckpointError(f"{folder} has no tokenizer.json")
    tokenizer = Tokenizer.from_dir(folder, eos_ids=config.eos_token_ids, bos_id=config.bos_token_id)

    fingerprints = Fingerprints(
        weights=weights_fingerprint(files),
        tokenizer=xxhash.xxh3_128_hexdigest(tokenizer_path.read_bytes()),
        config=xxhash.xxh3_128_hexdigest(
            json.dumps(raw_config, sort_keys=True, separators=(",", ":")).encode()
        ),
    )
    name_or_path = raw_config.get("_name_or_path")
    model_id = (
        name_or_path if isinstance(name_or_path, str) and name_or_path else folder.resolve().name
    )
    return Checkpoint(folder, config, state_dict, fingerprints, tokenizer, model_id)


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files of a checkpoint, sorted by name: the index's shards, or every file."""
    index_path = folder / INDEX_FILE
    if index_path.exists():
        index = json.loads(index_path.read_text())
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index_path} has no weight_map")
        names = sorted(set(weight_map.values()))
        missing = [n for n in names if not (folder / n).is_file()]
        if missing:
            raise CheckpointError(f"{index_path} names missing shard(s) {missing}")
        return [folder / n for n in names]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{folder} has no *.safetensors weight files")
    return files


def weights_fingerprint(files: list[Path]) -> str:
    """xxh3-128 hex over the files sorted by name: each name (length-prefixed), size, then bytes."""
    digest = xxhash.xxh3_128()
    for file in sorted(files, key=lambda p: p.name):
        name = file.name.encode()
        digest.update(struct.pack("<I", len(name)) + name + struct.pack("<Q", file.stat().st_size))
        with file.open("rb") as fh:
            while chunk := fh.read(_CHUNK_BYTES):
                digest.update(chunk)
    return str(digest.hexdigest())


def _check_index(folder: Path, state_dict: dict[str, torch.Tensor]) -> None:
    index_path = folder / INDEX_FILE
    if not index_path.exists():
        return
    listed = set(json.loads(index_path.read_text())["weight_map"])
    if listed != set(state_dict):
        missing = sorted(listed - set(state_dict))[:5]
        extra = sorted(set(state_dict) - listed)[:5]
        raise CheckpointError(
            f"{INDEX_FILE} disagrees with the shards: missing {missing}, unlisted {extra}"
        )


def make_scope(
    checkpoint: Checkpoint,
    *,
    page_tokens: int,
    kv_dtype: torch.dtype | str = torch.float32,
    namespace: str = "",
    adapter_id: str = "",
    adapter_fingerprint: str = "",
    shard: Shard | None = None,
    model_id: str | None = None,
) -> Scope:
    """The scope of this checkpoint's KV pages with `page_tokens` tokens a page, in `kv_dtype`.

    `model_id` defaults to the checkpoint's (its config's `_name_or_path`, else the folder name).
    Raises client.InvalidArgument for an unknown dtype or a bad layout.
    """
    c = checkpoint.config
    dtype = kv_dtype if isinstance(kv_dtype, str) else kv_dtype_name(kv_dtype)
    return Scope(
        model_id=model_id or checkpoint.model_id,
        weights_revision=checkpoint.fingerprints.revision,
        tokenizer_fingerprint=checkpoint.fingerprints.tokenizer,
        kv_dtype=dtype,
        layout=KVLayout(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, page_tokens),
        adapter_id=adapter_id,
        adapter_fingerprint=adapter_fingerprint,
        shard=shard or Shard(),
        namespace=namespace,
    )
