"""Measuring and reading results: ``tidal bench``, ``tidal simulate``, ``tidal report``, ``tidal inspect``."""

from __future__ import annotations

from tidal.cli.common import one_line_errors, refuse_run_data
from tidal.config import ConfigError


def cmd_bench(args) -> int:
    from tidal.bench import run_benchmark

    return run_benchmark(args.name, args.set, args.out)


@one_line_errors
def cmd_simulate(args) -> int:
    """Predict sync / periodic / async throughput with the discrete-event simulator (docs/simulate.md)."""
    from tidal.sim.report import main as simulate_main

    simulate_main(args.set, args.out, args.plot)
    return 0


@one_line_errors
def cmd_report(args) -> int:
    """One run: (re)write its report.html. Several: one comparison report (their panels overlaid, config diff)."""
    from tidal.utils.report import write_report
    from tidal.utils.report_compare import write_comparison

    refuse_run_data(args.out, args.run_dirs)
    if len(args.run_dirs) == 1 and args.out is None:
        print(write_report(args.run_dirs[0]))
    else:
        print(write_comparison(args.run_dirs, args.out))
    return 0


@one_line_errors
def cmd_inspect(args) -> int:
    """Write the rollout inspector of one or more runs (docs/inspect.md); with --serve, serve it on loopback."""
    from tidal.inspector.page import write_inspector

    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port must be in 0-65535 (0: any free port), got {args.port}")
    refuse_run_data(args.out, args.run_dirs)
    out = write_inspector(args.run_dirs, args.out)
    print(out)
    if not args.serve:
        return 0
    from tidal.inspector.serve import make_server

    server = make_server(out, args.port)
    host, port = server.server_address[:2]
    print(f"serving http://{host}:{port}/ (Ctrl-C stops)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


def add_parsers(sub) -> None:
    """This group's subcommands: their options and handlers."""
    sp = sub.add_parser("bench", help="run a benchmark from benchmarks/")
    sp.add_argument("name")
    sp.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    sp.add_argument("--out", default=None, help="results directory (default benchmarks/results)")
    sp.set_defaults(fn=cmd_bench)

    sp = sub.add_parser("simulate", help="simulate sync/periodic/async RL throughput at any scale (docs/simulate.md)")
    sp.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="preset=cpu|areal, or a simulator key (costs.*, layout.*, workload.*, steps, ...)")
    sp.add_argument("--out", default="runs/simulate", help="where result.json and simulate.png go")
    sp.add_argument("--plot", choices=["eta", "devices", "none"], default="eta", help="PNG: throughput vs this")
    sp.set_defaults(fn=cmd_simulate)

    sp = sub.add_parser("report", help="(re)write report.html for a run directory; several: compare them")
    sp.add_argument("run_dirs", nargs="+", metavar="run_dir")
    sp.add_argument("--out", default=None, help="output file (default: RUN_DIR/report.html for one run, "
                    "compare.html here for several)")
    sp.set_defaults(fn=cmd_report)

    sp = sub.add_parser("inspect", help="write inspect.html: recorded rollouts, metric curves and config diff of "
                        "one or more runs (docs/inspect.md)")
    sp.add_argument("run_dirs", nargs="+", metavar="run_dir")
    sp.add_argument("--out", default=None, help="output file (default: RUN_DIR/inspect.html for one run, "
                    "inspect.html here for several)")
    sp.add_argument("--serve", action="store_true", help="then serve the page on 127.0.0.1 until Ctrl-C")
    sp.add_argument("--port", type=int, default=8000, help="port for --serve (0: any free port)")
    sp.set_defaults(fn=cmd_inspect)
