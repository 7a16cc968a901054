"""A thin wrapper over `tokenizers.Tokenizer` for a checkpoint folder's tokenizer.json."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import tokenizers


class Tokenizer:
    """Text ↔ token ids, plus the special ids an engine needs (BOS, EOS)."""

    def __init__(
        self,
        inner: tokenizers.Tokenizer,
        *,
        bos_id: int | None = None,
        eos_ids: Sequence[int] = (),
    ) -> None:
        self.inner = inner
        self.bos_id = bos_id
        self.eos_ids = tuple(eos_ids)

    @classmethod
    def from_dir(
        cls, path: str | Path, *, eos_ids: Sequence[int] = (), bos_id: int | None = None
    ) -> Tokenizer:
        """Load `path/tokenizer.json`; BOS/EOS come from `tokenizer_config.json` when it names them,
        else from `eos_ids` / `bos_id` (the model config's). Raises FileNotFoundError without it."""
        folder = Path(path)
        inner = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
        special: dict[str, int] = {}
        cfg_path = folder / "tokenizer_config.json"
        if cfg_path.exists():
            cfg = json.loads(cfg_path.read_text())
            for name in ("bos_token", "eos_token"):
                token = cfg.get(name)
                if isinstance(token, dict):
                    token = token.get("content")
                if isinstance(token, str) and (tid := inner.token_to_id(token)) is not None:
                    special[name] = tid
        eos = tuple(eos_ids)
        if "eos_token" in special and special["eos_token"] not in eos:
            eos = (special["eos_token"], *eos)
        return cls(inner, bos_id=special.get("bos_token", bos_id), eos_ids=eos)

    @property
    def eos_id(self) -> int | None:
        """The first EOS id (generation stops at any of `eos_ids`)."""
        return self.eos_ids[0] if self.eos_ids else None

    @property
    def vocab_size(self) -> int:
        return int(self.inner.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; `add_special_tokens` applies the tokenizer's template (e.g. BOS)."""
        return list(self.inner.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return str(self.inner.decode(list(ids), skip_special_tokens=skip_special_tokens))
