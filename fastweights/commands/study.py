"""``fastweights study <name>``: run one of the studies of :mod:`fastweights.studies`.

Every study takes ``--full`` (the whole sweep instead of the quick default; ``--quick``
names the default explicitly),
``--root-seed`` (everything random derives from it), ``--out DIR`` (where the
JSON, CSV and PNG files go), ``--quiet`` (no progress bars) and ``--resume``
(continue from the cells a killed or interrupted run saved in
``DIR/<study>.partial.json``), plus its own options (``fastweights study capacity --help``).
"""

from __future__ import annotations

import time


def add_parser(sub) -> None:
    from ..studies import STUDIES, get_study

    p = sub.add_parser("study", help="run the experiments: print a table, write JSON/CSV and PNG plots")
    studies = p.add_subparsers(dest="study", metavar="STUDY")
    studies.required = True
    for name in STUDIES:
        module = get_study(name)
        sp = studies.add_parser(name, help=module.HELP, description=module.HELP)
        size = sp.add_mutually_exclusive_group()
        size.add_argument("--full", action="store_true", help="the whole sweep instead of the quick default")
        size.add_argument("--quick", action="store_true", help="the quick default (what runs without --full)")
        sp.add_argument("--root-seed", type=int, default=0, help="root seed of every random draw (default 0)")
        sp.add_argument("--out", default=f"study_{name}", help=f"output folder (default ./study_{name})")
        sp.add_argument("--quiet", action="store_true", help="no progress bars")
        sp.add_argument("--resume", action="store_true",
                        help="reuse the finished cells an interrupted run saved in OUT/<study>.partial.json")
        module.add_arguments(sp)
        sp.set_defaults(func=run, study_name=name)


def run(args) -> int:
    from ..studies import get_study

    module = get_study(args.study_name)
    if args.root_seed < 0:
        raise SystemExit(f"fastweights study: `--root-seed` must be >= 0, got {args.root_seed}")
    try:
        config = module.config_from_args(args)
    except ValueError as e:
        raise SystemExit(f"fastweights study {args.study_name}: {e}") from None
    start = time.perf_counter()
    result = module.run(config, out_dir=args.out, progress=not args.quiet, resume=args.resume)
    print(module.report(result))
    print(f"\nwrote {', '.join(result['files'])}  ({time.perf_counter() - start:.1f} s)")
    return int(result.get("exit_code", 0))
