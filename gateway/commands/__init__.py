"""CLI subcommands, grouped by concern; `gateway.cli` wires them into one parser.

Contract: each module exposes `register(subparsers) -> None`, which adds argparse parsers
whose leaves call `set_defaults(func=handler)`. The CLI then calls
`handler(args, settings) -> int` (the exit code) with a `gateway.settings.Settings`.
Handlers print JSON to stdout, and a one-line message to stderr on failure.
"""
