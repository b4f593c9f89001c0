"""The ``kvserve`` command line."""

from __future__ import annotations

import argparse
import sys


def _model_prepare(args: argparse.Namespace) -> None:
    from engine.bundled import resolve_model

    print(resolve_model(args.model))


def _demo(args: argparse.Namespace) -> None:
    from kvserve.demo import main as demo_main

    demo_main(args.model)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:2] == ["bench", "offline"]:
        from kvserve.bench_offline import main as bench_main

        bench_main(argv[2:])
        return
    parser = argparse.ArgumentParser(prog="kvserve", description="Disaggregated LLM serving.")
    sub = parser.add_subparsers(dest="command", required=True)

    model = sub.add_parser("model", help="manage model files").add_subparsers(dest="action", required=True)
    prepare = model.add_parser("prepare", help="convert the bundled model (or check a model directory) once")
    prepare.add_argument("--model", default="default", help="'default' or a local Hugging Face model directory")
    prepare.set_defaults(func=_model_prepare)

    demo = sub.add_parser("demo", help="answer a few chat prompts with the offline engine")
    demo.add_argument("--model", default="default")
    demo.set_defaults(func=_demo)

    sub.add_parser("bench", help="benchmarks: 'kvserve bench offline --help'")

    args = parser.parse_args(argv)
    if args.command == "bench":
        parser.error("use 'kvserve bench offline [options]'")
    try:
        args.func(args)
    except ValueError as err:
        print(f"kvserve: {err}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
