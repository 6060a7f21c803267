"""`servetwin validate DIR`: run every published case under DIR, print published vs predicted."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from servetwin.experiments.validate.published import group_medians, render_table, validate_cases


def _cmd_validate(args: argparse.Namespace) -> int:
    log = (lambda msg: print(msg, file=sys.stderr)) if not args.quiet else (lambda msg: None)
    results = validate_cases(args.dir, hardware=args.hardware, only=args.case or None,
                             overrides=args.set or None, log=log)
    table = render_table(results)
    print(table)
    if args.output:
        out = Path(args.output)
        out.parent.mkdir(parents=True, exist_ok=True)
        header = (f"# Published vLLM measurements vs servetwin predictions\n\n"
                  f"Command: `servetwin validate {args.dir}"
                  + (f" --hardware {args.hardware}" if args.hardware else "") + "`\n\n")
        out.write_text(header + table + "\n", encoding="utf-8")
        print(f"wrote {out}", file=sys.stderr)
    med = group_medians(results)
    return 0 if all(r.error is None for r in results) and any(v is not None for v in med.values()) else 1


def register(subparsers) -> None:
    p = subparsers.add_parser("validate", help="predict published vLLM runs (DIR/cases/*.yaml + DIR/published.json) "
                                               "and print the signed error per metric")
    p.add_argument("dir", help="case directory: cases/NAME.yaml experiments and published.json")
    p.add_argument("--hardware", help="run every case on this hardware preset or YAML file instead of its own")
    p.add_argument("--case", action="append", help="only this case (repeatable)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config field in every case")
    p.add_argument("-o", "--output", help="also write the table as Markdown to this file")
    p.add_argument("-q", "--quiet", action="store_true", help="no per-case progress lines")
    p.set_defaults(func=_cmd_validate)
