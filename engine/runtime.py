"""A checkpoint loaded to serve: the model on its device, its tokenizer, the page size and
context limit every worker of a process shares, and the scopes its KV pages are keyed under."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path

import torch

from client import Scope
from engine.checkpoint import Checkpoint, load_checkpoint, make_scope
from engine.errors import InvalidRequest
from engine.kv_pool import PagedKVPool
from engine.model import DecoderModel
from engine.requests import validate_prompt
from engine.tokenizer import Tokenizer

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_MAX_SCOPES = 1024


class ModelRuntime:
    """The model and what goes with it. Thread-safe to read; the model itself is not
    re-entrant per pool (each worker drives its own pool from one thread).

    `dtype` None runs float32 on CPU and the checkpoint's dtype elsewhere. `max_context` None
    is the model's `max_position_embeddings`; a larger value is cut to it. Raises ValueError
    (CheckpointError, ConfigError) for a checkpoint that does not load.
    """

    def __init__(
        self,
        checkpoint: Checkpoint | str | Path,
        *,
        page_tokens: int = 16,
        max_context: int | None = None,
        device: torch.device | str = "cpu",
        dtype: torch.dtype | None = None,
    ) -> None:
        ckpt = checkpoint if isinstance(checkpoint, Checkpoint) else load_checkpoint(checkpoint)
        if page_tokens <= 0:
            raise ValueError(f"page_tokens must be positive, got {page_tokens}")
        self.checkpoint = ckpt
        self.device = torch.device(device)
        if dtype is None:
            dtype = torch.float32 if self.device.type == "cpu" else _DTYPES[ckpt.config.torch_dtype]
        self.model = DecoderModel.from_state_dict(
            ckpt.config, ckpt.state_dict, dtype=dtype, device=self.device
        )
        self.page_tokens = page_tokens
        limit = ckpt.config.max_position_embeddings
        self.max_context = min(max_context or limit, limit)
        if self.max_context < 2:
            raise ValueError(f"max_context must be at least 2, got {self.max_context}")
        self._scopes: dict[str, Scope] = {}
        self._lock = threading.Lock()

    @property
    def tokenizer(self) -> Tokenizer:
        return self.checkpoint.tokenizer

    @property
    def vocab_size(self) -> int:
        return self.checkpoint.config.vocab_size

    @property
    def eos_ids(self) -> tuple[int, ...]:
        return self.tokenizer.eos_ids

    def scope(self, namespace: str = "") -> Scope:
        """The scope of this model's pages in `namespace` (a tenant or a cache salt)."""
        if not isinstance(namespace, str):
            raise InvalidRequest(f"namespace must be a str, got {type(namespace).__name__}")
        with self._lock:
            scope = self._scopes.get(namespace)
            if scope is None:
                scope = make_scope(
                    self.checkpoint,
                    page_tokens=self.page_tokens,
                    kv_dtype=self.model.dtype,
                    namespace=namespace,
                )
                if len(self._scopes) >= _MAX_SCOPES:
                    self._scopes.clear()
                self._scopes[namespace] = scope
            return scope

    def new_pool(self, num_pages: int) -> PagedKVPool:
        """An empty KV pool of `num_pages` pages for this model, on its device."""
        return PagedKVPool(
            self.model.kv_layout(self.page_tokens), num_pages, self.model.dtype, self.device
        )

    def prompt_ids(self, token_ids: Sequence[int] = (), text: str = "") -> list[int]:
        """The prompt as token ids: `token_ids`, or `text` tokenized. InvalidRequest for both or
        neither, or a prompt `validate_prompt` refuses."""
        if token_ids and text:
            raise InvalidRequest("give the prompt as token ids or as text, not both")
        ids = self.tokenizer.encode(text) if text else list(token_ids)
        return validate_prompt(ids, vocab_size=self.vocab_size, max_context=self.max_context)

    def synchronize(self) -> None:
        """Wait for queued device work (so wall-clock timings mean something on CUDA)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def as_runtime(
    model: ModelRuntime | Checkpoint | str | Path,
    *,
    page_tokens: int | None = None,
    max_context: int | None = None,
    device: torch.device | str | None = None,
) -> ModelRuntime:
    """`model` itself when it is a ModelRuntime (then the other arguments must be None or agree
    with it; ValueError otherwise), else a new runtime (page_tokens default 16, device cpu)."""
    if isinstance(model, ModelRuntime):
        clash = [
            name
            for name, want, have in (
                ("page_tokens", page_tokens, model.page_tokens),
                ("max_context", max_context, model.max_context),
                ("device", None if device is None else torch.device(device), model.device),
            )
            if want is not None and want != have
        ]
        if clash:
            raise ValueError(f"{', '.join(clash)} given, and different from the runtime's")
        return model
    return ModelRuntime(
        model,
        page_tokens=page_tokens or 16,
        max_context=max_context,
        device=device if device is not None else "cpu",
    )
