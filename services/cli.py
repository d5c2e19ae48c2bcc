"""The `pagedserve` command: `serve` (all stages, supervised) and `stage NAME` (one stage).

Each stage module (`services/<name>/service.py`) declares its own options with
`add_args(parser)` and runs with `run(args)`; the launcher passes the same options
through to each stage's command line.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

STAGES = ("gateway", "tokenizer", "scheduler", "executor")


def stage_module(name: str):
    return importlib.import_module(f"services.{name}.service")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedserve", description="PagedAttention LLM serving")
    sub = parser.add_subparsers(dest="command", required=True)

    from services import launcher

    launcher.add_args(sub.add_parser("serve", help="start every stage and supervise them"))

    stage = sub.add_parser("stage", help="run one stage alone, connecting by address")
    stage_sub = stage.add_subparsers(dest="stage", required=True)
    for name in STAGES:
        stage_module(name).add_args(stage_sub.add_parser(name))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=getattr(args, "log_level", "INFO").upper(),
        format="%(asctime)s %(levelname)s [%(processName)s %(name)s] %(message)s",
    )
    if args.command == "serve":
        from services import launcher

        return launcher.run(args)
    return stage_module(args.stage).run(args) or 0


if __name__ == "__main__":
    sys.exit(main())
