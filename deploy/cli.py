"""`m3serve <command>`: the one command-line entry point.

Subcommands live with their owners, each module exposing `add_arguments(parser)` and `run(args) -> int`:
`checkpoint` (here), `serve` (deploy/serve_cmd.py), `bench` (deploy/bench.py). They are imported lazily so a
missing or heavy module costs nothing until its command runs.
"""
from __future__ import annotations

import argparse
import importlib
import sys
from types import ModuleType
from typing import Callable, Sequence

# command -> module implementing it (None: defined in this file)
SUBCOMMANDS: dict[str, str | None] = {
    "checkpoint": None,
    "serve": "deploy.serve_cmd",
    "bench": "deploy.bench",
}
HELP = {
    "checkpoint": "write a random MiniMax-M3 checkpoint (weights, config, tokenizer) from a model preset",
    "serve": "serve a model with Ray Serve (OpenAI-compatible HTTP API)",
    "bench": "benchmark a running server or an engine",
}
NOT_IMPLEMENTED = 2


def add_checkpoint_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default="tiny", help="model preset in configs/models/ (default: tiny)")
    parser.add_argument("--out", required=True, help="output directory (created)")
    parser.add_argument("--seed", type=int, default=0, help="random seed of the weights (default: 0)")
    parser.add_argument("--layout", choices=("hub", "transformers"), default="hub",
                        help="hub: the original release layout; transformers: what save_pretrained writes")
    parser.add_argument("--num-shards", type=int, default=2, help="number of safetensors shards (default: 2)")
    parser.add_argument("--device", default="cpu", help="where to draw the random numbers (cuda is faster)")


def run_checkpoint(args: argparse.Namespace) -> int:
    from workers.models import write_preset_checkpoint

    if args.num_shards < 1:
        print("checkpoint: --num-shards: must be >= 1", file=sys.stderr)
        return 2
    out = write_preset_checkpoint(args.preset, args.out, seed=args.seed, layout=args.layout,
                                  num_shards=args.num_shards, device=args.device)
    print(f"wrote {args.layout} checkpoint of preset {args.preset!r} (seed {args.seed}) to {out}")
    return 0


def _load(module_name: str) -> ModuleType | None:
    """The subcommand's module, or None if it does not exist yet (a real import error inside it still raises)."""
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name == module_name:
            return None
        raise


def _not_implemented(cmd: str) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        print(f"{cmd}: not implemented yet", file=sys.stderr)
        return NOT_IMPLEMENTED
    return run


def build_parser(argv: Sequence[str]) -> argparse.ArgumentParser:
    """Only the module of the command actually named in `argv` is imported."""
    parser = argparse.ArgumentParser(prog="m3serve", description="Serve MiniMax-M3 with Ray Serve.")
    subs = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    wanted = next((a for a in argv if not a.startswith("-")), None)
    for cmd, module_name in SUBCOMMANDS.items():
        sub = subs.add_parser(cmd, help=HELP[cmd], description=HELP[cmd])
        if module_name is None:
            add_checkpoint_arguments(sub)
            sub.set_defaults(run=run_checkpoint)
            continue
        module = _load(module_name) if cmd == wanted else None
        if module is not None:
            module.add_arguments(sub)
            sub.set_defaults(run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    wanted = next((a for a in argv if not a.startswith("-")), None)
    module_name = SUBCOMMANDS.get(wanted or "")
    if module_name is not None and _load(module_name) is None:
        # The owner's module has not landed yet: say so whatever arguments were given.
        return _not_implemented(wanted)(argparse.Namespace())
    args = build_parser(argv).parse_args(argv)
    return int(args.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
