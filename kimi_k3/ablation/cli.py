"""``kimi-k3-ablate``: run an ablation matrix of training jobs and write its report.

    kimi-k3-ablate --preset quick                                    # ~25 min on 2 CPU cores
    kimi-k3-ablate --preset full --output_dir ablations/full         # hours; rerun the same command to continue
    kimi-k3-ablate --preset quick --rows sign-balancing adamw --seeds 0 --max_steps 10
    kimi-k3-ablate --preset quick --job_args '--save_steps 10'        # more kimi-k3-train options for every run
    kimi-k3-ablate --preset full --output_dir ablations/full --report_only  # the report of the runs so far
    kimi-k3-ablate --list                                            # the rows and what each changes

Bad input (an unknown preset or row, a row that cannot apply to the model) stops it with one line before any run.
"""

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

from kimi_k3.ablation.report import write_report
from kimi_k3.ablation.rows import PRESETS, ROWS, AblationError, baseline_config
from kimi_k3.ablation.runner import Matrix, plan, run_matrix, select
from kimi_k3.checkpoint import run_folder


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="kimi-k3-ablate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="quick", help=f"one of {', '.join(PRESETS)} (default quick)")
    parser.add_argument("--rows", nargs="+", help="rows to run (default: the preset's); the baseline always runs")
    parser.add_argument("--seeds", nargs="+", type=int, help="seeds (default: the preset's)")
    parser.add_argument("--max_steps", type=int, help="optimizer steps per run (default: the preset's)")
    parser.add_argument("--output_dir", help="folder of the runs and the report (default ablations/<preset>)")
    parser.add_argument("--data_files", nargs="+", help="the job's --data_files (default: its embedded corpus)")
    parser.add_argument("--config_overrides", help="JSON KimiK3Config fields over the preset's baseline model")
    parser.add_argument("--job_args", default="",
                        help="more kimi-k3-train options for every run, one string, e.g. '--save_steps 10'")
    parser.add_argument("--report_only", action="store_true",
                        help="write the report of the runs finished so far, train nothing")
    parser.add_argument("--list", action="store_true", help="print the rows and presets, run nothing")
    return parser.parse_args(argv)


def build_matrix(args: argparse.Namespace) -> Matrix:
    if args.preset not in PRESETS:
        raise AblationError(f"--preset {args.preset}: unknown preset; presets are {', '.join(PRESETS)}")
    preset = PRESETS[args.preset]
    model = dict(preset.model)
    if args.config_overrides:
        try:
            model |= json.loads(args.config_overrides)
        except (json.JSONDecodeError, TypeError) as error:
            raise AblationError(f"--config_overrides is not a JSON object ({error})") from None
    baseline_config(model)
    rows, seeds, max_steps = select(preset, args.rows, args.seeds, args.max_steps)
    output_dir = Path(args.output_dir or f"ablations/{args.preset}")
    return Matrix(preset, rows, seeds, max_steps, output_dir, model, args.data_files, tuple(shlex.split(args.job_args)))


def list_rows() -> None:
    for name, row in ROWS.items():
        print(f"{name:24} {row.family:11} {row.change}")
    for name, preset in PRESETS.items():
        print(f"--preset {name}: rows {', '.join(preset.rows)}; seeds {list(preset.seeds)}; {preset.max_steps} steps")


def main(argv: list[str] | None = None) -> int:
    """0 when every run finished, 1 when some failed (the report lists them), 2 on bad input."""
    start = time.perf_counter()
    args = parse_args(argv)
    if args.list:
        list_rows()
        return 0
    try:
        matrix = build_matrix(args)
        runs = plan(matrix)
        for run in runs:
            run.finished()  # a folder of other settings is refused here, before anything runs
        # Reading finished runs needs no lock (their results are written atomically): a report of a matrix that is
        # still training may be written beside it.
        lock = None if args.report_only else \
            run_folder.OutputFolderLock(matrix.output_dir, ".kimi-k3-ablate.lock").acquire()
    except ValueError as error:
        print(f"kimi-k3-ablate: error: {error}", file=sys.stderr)
        return 2
    try:
        failures = [] if args.report_only else run_matrix(matrix, runs)
        results, machines, unfinished = {}, [], []
        for run in runs:
            finished = run.finished()
            if finished is None:
                unfinished.append(f"{run.row.name} seed {run.seed}")
                continue
            results.setdefault(run.row.name, []).append({**finished["metrics"], "seed": run.seed})
            machines.append(finished.get("machine"))
        rows = [row for row in matrix.rows if row.name in results]
        command = shlex.join(["kimi-k3-ablate", *(sys.argv[1:] if argv is None else argv)])
        report = write_report(matrix.output_dir, command, rows, results, matrix.max_steps, failures,
                              time.perf_counter() - start, machines, unfinished)
    finally:
        if lock is not None:
            lock.release()
    print(f"kimi-k3-ablate: {len(runs) - len(unfinished)} of {len(runs)} runs finished; report in {report}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
