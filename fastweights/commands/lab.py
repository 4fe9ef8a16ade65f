"""``fastweights lab``: interactive demos as a local web page (see :mod:`fastweights.lab`)."""

from __future__ import annotations


def add_parser(sub) -> None:
    p = sub.add_parser("lab", help="serve the interactive memory lab (interference, 2-D geometry, spotlight, "
                                   "memory calculator) on a local web page",
                       description="Serve the memory lab on a local web page; every number is computed by "
                                   "fastweights.ops. Prints the URL; opens a browser only with --open.")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8765, help="port (default 8765; 0 picks a free one)")
    p.add_argument("--open", action="store_true", help="open the page in the default browser")
    p.add_argument("--log", action="store_true", help="log every request to stderr")
    p.set_defaults(func=run)


def run(args) -> int:
    from ..lab.server import serve

    if not 0 <= args.port <= 65535:
        raise ValueError(f"`--port` must be in [0, 65535], got {args.port}")
    try:
        serve(args.host, args.port, open_browser=args.open, quiet=not args.log)
    except OSError as e:  # port taken, address not local, ...
        raise ValueError(f"cannot listen on {args.host}:{args.port}: {e.strerror or e}") from None
    return 0
