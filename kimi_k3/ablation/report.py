"""The matrix's report: ``README.md`` (the command, machine, versions and date; a table of every metric as mean ± std
over seeds; each row's difference to the baseline, flagged where it exceeds twice the seed spread) and the loss and
MaxVio curves as PNG, averaged over seeds at each logged step.

The seed spread of a difference is the pooled standard deviation sqrt((s_row² + s_baseline²) / 2) of the two rows'
seeds; with one seed there is none, and nothing is flagged. A seed fixes the job's data order (and, where the row keeps
the model's shapes, its initial weights), so a row and the baseline trained with the same seed are paired: the paired
table compares the per-seed differences d_s = row_s − baseline_s with their own spread, which leaves out what the seeds
share and so sees smaller effects than the unpaired one.
"""

import collections
import importlib.metadata
import io
import math
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from kimi_k3.ablation.rows import BASELINE
from kimi_k3.job.expert_load import PLOT_EXTRA, matplotlib_available, new_figure, plot_max_vio

REPORT_NAME = "README.md"  # the report is what a browser of the output folder shows first
LOSS_PNG, MAX_VIO_PNG = "loss_curves.png", "max_vio_curves.png"
# (metric, column title, format) of the table, in its order.
SHOWN = [
    ("eval_loss", "eval loss", "{:.4f}"),
    ("eval_perplexity", "eval perplexity", "{:.1f}"),
    ("final_max_vio", "final MaxVio", "{:.3f}"),
    ("mean_max_vio", "mean MaxVio", "{:.3f}"),
    ("dead_experts", "dead experts", "{:.1f}"),
    ("max_expert_activation", "max expert activation", "{:.3g}"),
    ("max_expert_output", "max expert latent output", "{:.3g}"),
    ("max_attention_logit", "max attention logit", "{:.3g}"),
    ("step_time_s", "step s", "{:.3f}"),
    ("tokens_per_s", "tokens/s", "{:.0f}"),
]
# The metrics whose differences to the baseline the report tests against the seed spread.
COMPARED = [metric for metric in SHOWN if metric[0] in
            ("eval_loss", "final_max_vio", "mean_max_vio", "max_expert_activation", "max_attention_logit")]


# A metric a run could not measure (NaN in its .json) is shown as this, and compared with nothing.
NOT_MEASURED = "n/a"


def measured(values: list[float]) -> bool:
    return not any(math.isnan(value) for value in values)


def spread(values: list[float]) -> float:
    return statistics.stdev(values) if len(values) > 1 else math.nan


def mean_and_std(values: list[float], form: str) -> str:
    if not measured(values):
        return NOT_MEASURED
    mean, std = statistics.fmean(values), spread(values)
    return form.format(mean) + ("" if math.isnan(std) else " ± " + form.format(std))


def difference(row: list[float], baseline: list[float], form: str) -> str:
    """The difference of the means, and whether it exceeds twice the pooled seed spread."""
    if not measured(row + baseline):
        return NOT_MEASURED
    delta = statistics.fmean(row) - statistics.fmean(baseline)
    pooled = math.sqrt((spread(row) ** 2 + spread(baseline) ** 2) / 2)
    text = ("+" if delta >= 0 else "") + form.format(delta)
    if math.isnan(pooled):
        return text
    return text + (" **yes**" if abs(delta) > 2 * pooled else " no")


def cpu_name() -> str:
    """The CPU's model name and, where Linux gives them, its family and model numbers: an "AMD EPYC" can be any of
    several generations, which differ in speed and may differ in what they run fast. (Not `torch.utils.collect_env`:
    it gives lscpu's whole report, without the family and model on one line, after running pip, conda, lscpu and
    nvidia-smi as subprocesses.)"""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        first = {}
        for line in cpuinfo.read_text().splitlines():
            key, _, value = line.partition(":")
            first.setdefault(key.strip(), value.strip())
        if first.get("model name"):
            numbers = (f" (family {first['cpu family']} model {first['model']})"
                       if first.get("cpu family") and first.get("model") else "")
            return first["model name"] + numbers
    return platform.processor() or platform.machine()


RESTRICTIONS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")


def run_machine() -> str:
    """What a run's numbers depend on besides its settings: a CPU kind rounds differently (its kernels dispatch on
    the instruction set, which the variables in ``RESTRICTIONS`` can lower), and so may another thread count."""
    restricted = " ".join(f"{name}={os.environ[name]}" for name in RESTRICTIONS if os.environ.get(name))
    return (f"{cpu_name()}, torch CPU capability {torch.backends.cpu.get_cpu_capability()}"
            f"{f' ({restricted})' if restricted else ''}, {torch.get_num_threads()} threads")


def machine() -> str:
    load = f", load average {os.getloadavg()[0]:.1f}" if hasattr(os, "getloadavg") else ""
    return f"{cpu_name()}, {os.cpu_count()} cores visible, torch CPU capability " \
        f"{torch.backends.cpu.get_cpu_capability()}{load} when the report was written"


def run_machines(machines: list[str | None]) -> list[str]:
    """A line per machine the runs were measured on, with how many runs each; a matrix resumed elsewhere says so."""
    counts = collections.Counter(name or "not recorded" for name in machines)
    if len(counts) == 1:
        return [f"- the runs were trained on: {next(iter(counts))}"]
    return ["- the runs were trained on different machines (a CPU kind rounds differently, so differences of that "
            "order between rows do not mean anything):", *(f"  - {count} runs: {name}" for name, count in counts.items())]


def versions() -> str:
    names = ("torch", "transformers", "accelerate", "kimi-k3")
    return ", ".join(f"{name} {importlib.metadata.version(name)}" for name in names) + \
        f", Python {platform.python_version()}"


def run_minutes(results: dict[str, list[dict]]) -> float:
    return sum(run["wall_time_s"] for runs in results.values() for run in runs) / 60


def table(rows: list, results: dict[str, list[dict]]) -> list[str]:
    header = ["row", "change", "seeds"] + [title for _, title, _ in SHOWN] + ["parameters (active)"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * 3 + "---:|" * (len(header) - 3)]
    for row in rows:
        runs = results[row.name]
        cells = [f"`{row.name}`", row.change, str(len(runs))]
        cells += [mean_and_std([run[key] for run in runs], form) for key, _, form in SHOWN]
        cells.append(f"{runs[0]['total_parameters']:,} ({runs[0]['active_parameters']:,})")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def differences(rows: list, results: dict[str, list[dict]]) -> list[str]:
    header = ["row"] + [f"Δ {title}" for _, title, _ in COMPARED]
    lines = ["| " + " | ".join(header) + " |", "|---|" + "---:|" * len(COMPARED)]
    baseline = results[BASELINE]
    for row in rows:
        if row.name == BASELINE:
            continue
        cells = [f"`{row.name}`"] + [
            difference([run[key] for run in results[row.name]], [run[key] for run in baseline], form)
            for key, _, form in COMPARED
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def paired_difference(row: dict[int, float], baseline: dict[int, float], form: str) -> str:
    """The mean of the per-seed differences over the seeds both ran, ± their standard deviation, and whether the mean
    exceeds twice that deviation (the unpaired test's rule, on the paired spread)."""
    deltas = [row[seed] - baseline[seed] for seed in sorted(row.keys() & baseline.keys())]
    if not deltas:
        return "no common seed"
    if not measured(deltas):
        return NOT_MEASURED
    mean, std = statistics.fmean(deltas), spread(deltas)
    text = ("+" if mean >= 0 else "") + form.format(mean)
    if math.isnan(std):
        return text
    return f"{text} ± {form.format(std)}" + (" **yes**" if abs(mean) > 2 * std else " no")


def paired_differences(rows: list, results: dict[str, list[dict]]) -> list[str]:
    header = ["row", "seeds"] + [f"Δ {title}, paired" for _, title, _ in COMPARED]
    lines = ["| " + " | ".join(header) + " |", "|---|---:|" + "---:|" * len(COMPARED)]
    by_seed = {name: {run["seed"]: run for run in runs} for name, runs in results.items()}
    baseline = by_seed[BASELINE]
    for row in rows:
        if row.name == BASELINE:
            continue
        common = sorted(by_seed[row.name].keys() & baseline.keys())
        cells = [f"`{row.name}`", ", ".join(map(str, common))] + [
            paired_difference({seed: run[key] for seed, run in by_seed[row.name].items()},
                              {seed: run[key] for seed, run in baseline.items()}, form)
            for key, _, form in COMPARED
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def mean_curve(runs: list[dict], key: str) -> list[tuple[int, float]]:
    """The curve averaged over seeds at each step all of them logged."""
    by_step = [dict((step, value) for step, value in run[key]) for run in runs]
    steps = sorted(set.intersection(*(set(curve) for curve in by_step))) if by_step else []
    return [(step, statistics.fmean(curve[step] for curve in by_step)) for step in steps]


def curves_png(rows: list, results: dict[str, list[dict]], key: str, ylabel: str) -> bytes:
    import matplotlib  # the plot extra, checked by the caller
    from cycler import cycler

    figure = new_figure(figsize=(9, 5.5))
    axis = figure.subplots()
    # matplotlib's colours solid, then dashed: twenty rows each with a line of its own (its cycle repeats after ten).
    axis.set_prop_cycle(cycler(linestyle=["-", "--"]) * matplotlib.rcParams["axes.prop_cycle"])
    curves = {row.name: mean_curve(results[row.name], key) for row in rows}
    if key == "max_vio_curve":
        plot_max_vio(axis, curves)
    else:
        for name, points in curves.items():
            axis.plot([step for step, _ in points], [value for _, value in points], label=name)
        axis.set(xlabel="optimizer step", ylabel=ylabel)
    axis.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1))  # beside the curves, not over them
    axis.set_title(f"{ylabel}, mean over seeds")
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=100, bbox_inches="tight")
    return buffer.getvalue()


def write_report(output_dir: Path, command: str, rows: list, results: dict[str, list[dict]], steps: int,
                 failures: list[str], wall_time_s: float, machines: list[str | None],
                 unfinished: list[str]) -> Path:
    """``README.md`` and, with matplotlib, the two PNGs, in ``output_dir``; returns the report's path. ``machines``
    holds each finished run's `run_machine`, ``unfinished`` names the runs of the matrix not trained yet."""
    lines = [
        "# Ablation report", "",
        f"- command: `{command}`",
        f"- date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        f"- machine: {machine()}",
        f"- versions: {versions()}",
        *run_machines(machines),
        f"- {steps} optimizer steps per run; the runs' jobs took {run_minutes(results):.1f} min in all (their own "
        f"clocks, across resumes); this invocation of kimi-k3-ablate took {wall_time_s / 60:.1f} min",
        "",
        "Eval loss is the token-mean cross-entropy of the final model over the job's validation blocks; MaxVio is "
        "the worst MoE layer's max load / mean load - 1 at each logged training step (final: the last one, mean: "
        "over all of them); dead experts count routed experts that no validation token reached, over all layers; "
        "the maxima are over the validation pass (the routed experts' GLU output and their combined latent output "
        "before the latent norm; MLA logits over causal pairs); step time is the time inside optimizer steps.",
        "",
        *table(rows, results), "",
    ]  # fmt: skip
    if BASELINE in results:
        lines += ["Differences to the baseline (mean of the row - mean of the baseline); **yes** where the difference "
                  "exceeds twice the pooled seed spread:", "", *differences(rows, results), "",
                  "Paired by seed (the mean of row_s - baseline_s over the seeds both trained ± its standard "
                  "deviation); **yes** where the mean exceeds twice that deviation:", "",
                  *paired_differences(rows, results), ""]
    if matplotlib_available():
        (output_dir / LOSS_PNG).write_bytes(curves_png(rows, results, "loss_curve", "training loss"))
        (output_dir / MAX_VIO_PNG).write_bytes(curves_png(rows, results, "max_vio_curve", "MaxVio"))
        lines += [f"![training loss]({LOSS_PNG})", "", f"![MaxVio]({MAX_VIO_PNG})", ""]
    else:
        lines += [f"No curves: matplotlib is not installed ({PLOT_EXTRA}).", ""]
    if unfinished:
        lines += [f"Runs not finished (the same command without --report_only trains them): {', '.join(unfinished)}.",
                  ""]
    if failures:
        lines += ["Failed runs (not in the table):", "", *(f"- {failure}" for failure in failures), ""]
    path = output_dir / REPORT_NAME
    path.write_text("\n".join(lines))
    return path
