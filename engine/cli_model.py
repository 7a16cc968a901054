"""`strata model …`: write and inspect model checkpoints.

strata model init PATH --preset tiny|small [--seed N] [--model-type llama|mistral|qwen2|qwen3]
strata model info PATH
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence

from engine.config import ModelConfig
from engine.presets import PRESET_NAMES, VARIANTS


def build_parser(prog: str = "strata model") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description="Write and inspect model checkpoints.")
    sub = parser.add_subparsers(dest="command", required=True)
    init = sub.add_parser("init", help="write a random-weight checkpoint in the HF folder format")
    init.add_argument("path", help="folder to write (created if missing)")
    init.add_argument("--preset", choices=PRESET_NAMES, default="tiny")
    init.add_argument("--seed", type=int, default=0)
    init.add_argument("--model-type", choices=VARIANTS, default="llama")
    info = sub.add_parser("info", help="print a checkpoint's config and fingerprints")
    info.add_argument("path")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run `strata model` with `argv` (the arguments after `model`); returns the exit code."""
    args = build_parser().parse_args(argv)
    if args.command == "init":
        from engine.checkpoint import load_checkpoint
        from engine.presets import init_checkpoint

        result = init_checkpoint(args.path, args.preset, args.seed, model_type=args.model_type)
        c = result.config
        print(f"wrote {args.preset} {c.model_type} checkpoint to {result.path}")
        for name in result.files:
            print(f"  {name:24} {(result.path / name).stat().st_size:>12,} bytes")
        print(
            f"  {result.num_params:,} parameters: {c.num_hidden_layers} layers, hidden {c.hidden_size}, "
            f"{c.num_attention_heads} heads / {c.num_key_value_heads} KV heads x {c.head_dim}, "
            f"vocab {c.vocab_size}"
        )
        fp = load_checkpoint(result.path).fingerprints
        print(f"  weights {fp.weights}  tokenizer {fp.tokenizer}  config {fp.config}")
        return 0
    from engine.checkpoint import load_checkpoint

    ckpt = load_checkpoint(args.path)
    print(f"{ckpt.model_id} at {ckpt.path}")
    for field, value in _fields(ckpt.config):
        print(f"  {field:26} {value}")
    fp = ckpt.fingerprints
    print(f"  weights fingerprint        {fp.weights}")
    print(f"  tokenizer fingerprint      {fp.tokenizer}")
    print(f"  config fingerprint         {fp.config}")
    return 0


def _fields(config: ModelConfig) -> list[tuple[str, object]]:
    return [(f.name, getattr(config, f.name)) for f in dataclasses.fields(config)]
