"""The `pagedserve` command: `serve` (all stages, supervised), `stage NAME` (one stage),
`probe` (a container health check), `simulate` (the scheduler on a simulated GPU,
`services/simulator`) and `keygen DIR` (the CURVE key pair of the internal sockets,
`shared/curve.py`).

Every stage's options are declared once, as option groups (services/stage_options.py,
shared/options.py), from which both `serve`'s flags and each stage's are built; the
launcher forwards them whole to each stage's command line. Each stage module
(`services/<name>/service.py`, a dash in the name an underscore there) runs with `run(args)`. `stage NAME` imports only that
stage's module and the other commands none, so a restarted scheduler or gateway is back
in a fraction of a second, and a probe answers at once, instead of importing torch first.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

STAGES = ("gateway", "tokenizer", "scheduler", "executor", "dynamo-worker")


def stage_module(name: str):
    return importlib.import_module(f"services.{name.replace('-', '_')}.service")


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedserve", description="PagedAttention LLM serving")
    sub = parser.add_subparsers(dest="command", required=True)

    from services import launcher
    from services.stage_options import add_stage_args

    launcher.add_args(sub.add_parser("serve", help="start every stage and supervise them"))

    stage = sub.add_parser("stage", help="run one stage alone, connecting by address")
    stage_sub = stage.add_subparsers(dest="stage", required=True)
    for name in STAGES:
        add_stage_args(stage_sub.add_parser(name), name)

    from services import probe

    probe.add_args(sub.add_parser("probe", help="exit 0 when this container's stage is healthy"))

    from services.simulator import cli as simulator_cli

    simulator_cli.add_args(sub.add_parser("simulate", help="the scheduler on a simulated GPU, per KV policy"))

    keygen = sub.add_parser("keygen", help="write a CURVE key pair for the internal sockets into DIR")
    keygen.add_argument("dir", help="directory for pagedserve.key (public) and pagedserve.key_secret")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser(argv).parse_args(argv)
    logging.basicConfig(
        level=getattr(args, "log_level", "INFO").upper(),
        format="%(asctime)s %(levelname)s [%(processName)s %(name)s] %(message)s",
    )
    if args.command == "serve":
        from services import launcher

        return launcher.run(args)
    if args.command == "probe":
        from services import probe

        return probe.run(args)
    if args.command == "keygen":
        from shared.curve import keygen

        public, secret = keygen(args.dir)
        print(f"wrote {public} and {secret}; give every stage --curve-key-file {secret}")
        return 0
    if args.command == "simulate":
        from services.simulator import cli as simulator_cli

        return simulator_cli.run(args)
    return stage_module(args.stage).run(args) or 0


if __name__ == "__main__":
    sys.exit(main())
