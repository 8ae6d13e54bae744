"""P6: end-to-end training throughput of the default `KimiK3Config()` model against transformers' native
`KimiLinearForCausalLM` at matched width, depth, heads, experts and top-k; bf16 autocast on/off; the step as
`kimi-k3-train` runs it and its matmul floor; peak memory of a training step; `torch.compile` training steps on request
(compilation takes minutes on CPU).

A training step is forward + causal-LM loss + backward + AdamW step; the job's step uses Per-Head Muon with Quantile
Balancing and QK-Clip instead (`step_profile.job_training_step`, at this script's batch). Its floor is the step's own
matrix products (forward, backward, Newton–Schulz: recorded in order, with where each operand lay) replayed back to back
on operands laid out as in the step (`step_profile.MatmulFloor`), in the job's dtype and, where this CPU multiplies bf16
natively, in bf16; its FLOP rate is those products' FLOPs over the step's
time, as a share of one large fp32 GEMM's rate. Throughput candidates and floors run interleaved in one process (min of
the repetitions); peak memory is the resident-set high-water mark of a fresh process per variant, reported on top of
the process after building the model, so the numbers do not bleed into each other.

    python benchmarks/bench_e2e.py              # batch 4 x 256 tokens
    python benchmarks/bench_e2e.py --quick      # batch 2 x 128 tokens
    python benchmarks/bench_e2e.py --compile    # also torch.compile(model) steps (compilation takes minutes)
"""

import contextlib
import multiprocessing
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

# benchmarks.common first: it sets HF_HUB_OFFLINE before transformers is loaded.
from benchmarks.common import bench_arguments, in_fresh_process, report, time_interleaved  # noqa: E402
from benchmarks.step_profile import job_training_step, large_gemm_rate, record_matmuls  # noqa: E402
import torch  # noqa: E402
from transformers import KimiLinearConfig, KimiLinearForCausalLM  # noqa: E402
from transformers.utils import logging  # noqa: E402
from configuration_kimi_k3 import KimiK3Config  # noqa: E402
from kimi_k3.kernels.compiled import isa_safe_compile_caches  # noqa: E402
from kimi_k3.kernels.training import use_fused_kernels  # noqa: E402
from kimi_k3.optim.precision import cpu_has_native_bf16  # noqa: E402
from modeling_kimi_k3 import KimiK3ForCausalLM  # noqa: E402

VARIANTS = {  # name -> (model family, bf16 autocast)
    "Kimi K3 fp32": ("k3", False),
    "Kimi K3 bf16 autocast": ("k3", True),
    "KimiLinear (HF) fp32": ("kimi_linear", False),
    "KimiLinear (HF) bf16 autocast": ("kimi_linear", True),
}
JOB_STEP = "Kimi K3 as kimi-k3-train (Per-Head Muon, QB, QK-Clip) fp32"
BASELINE = "KimiLinear (HF) fp32"
COMPILE_TIMEOUT_S = 900
COMPILED_STEPS = 4


def kimi_linear_config(config: KimiK3Config) -> KimiLinearConfig:
    """transformers' Kimi Linear with our width, depth, heads, layer pattern, MLA ranks, experts and top-k.

    What cannot match: its experts run at full width (no latent projection), its decay gate is the softplus form,
    its activation is SiLU, and it has no Block Attention Residuals.
    """
    return KimiLinearConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        moe_intermediate_size=config.moe_intermediate_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        n_shared_experts=config.num_shared_experts,
        kv_lora_rank=config.kv_lora_rank,
        q_lora_rank=config.q_lora_rank,
        qk_rope_head_dim=config.qk_rope_head_dim,
        qk_nope_head_dim=config.qk_nope_head_dim,
        v_head_dim=config.v_head_dim,
        num_local_experts=config.num_experts,
        num_experts_per_tok=config.num_experts_per_token,
        routed_scaling_factor=config.routed_scaling_factor,
        layer_types=list(config.layer_types),
        linear_num_heads=config.linear_num_heads,
        linear_head_dim=config.linear_head_dim,
        linear_conv_kernel_dim=config.linear_conv_kernel_dim,
        first_k_dense_replace=config.first_k_dense_replace,
        max_position_embeddings=config.max_position_embeddings,
        pad_token_id=config.pad_token_id,
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
    )


def build(family: str) -> torch.nn.Module:
    torch.manual_seed(0)
    config = KimiK3Config()
    if family != "k3":
        return KimiLinearForCausalLM(kimi_linear_config(config)).train()
    model = KimiK3ForCausalLM(config)
    use_fused_kernels(model)  # as the training job does
    return model.train()


def training_step(model: torch.nn.Module, input_ids: torch.Tensor, autocast: bool):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext():
            loss = model(input_ids=input_ids, labels=input_ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def batch(quick: bool) -> torch.Tensor:
    batch_size, seq_len = (2, 128) if quick else (4, 256)
    vocab_size = KimiK3Config().vocab_size
    return torch.randint(3, vocab_size, (batch_size, seq_len), generator=torch.Generator().manual_seed(0))


def throughput(quick: bool, repeats: int) -> tuple[list[dict], dict]:
    """Rows of the AdamW variants and the job's step, and the job step's floor: all timed interleaved in one run."""
    input_ids = batch(quick)
    floor = record_matmuls(*input_ids.shape)
    models = {family: build(family) for family in ("k3", "kimi_linear")}
    steps = {name: training_step(models[family], input_ids, autocast) for name, (family, autocast) in VARIANTS.items()}
    job_step = job_training_step(*input_ids.shape)
    steps[JOB_STEP] = job_step
    floors = {"job step matmul floor, fp32": floor.replay()}
    if cpu_has_native_bf16():
        floors["job step matmul floor, bf16"] = floor.replay(torch.bfloat16)
    times = time_interleaved({**steps, **floors}, repeats=repeats)
    rows = []
    for name in steps:
        parameters = job_step.model.parameters() if name == JOB_STEP else models[VARIANTS[name][0]].parameters()
        rows.append(
            {
                "variant": name,
                "params M": sum(p.numel() for p in parameters) / 1e6,
                "step ms": 1e3 * times[name],
                "tokens/s": input_ids.numel() / times[name],
                f"vs {BASELINE}": times[BASELINE] / times[name],
            }
        )
    gemm = large_gemm_rate()
    floor_row = {
        "job step ms": 1e3 * times[JOB_STEP],
        **{f"{name} ms": 1e3 * times[name] for name in floors},
        "step / fp32 floor": times[JOB_STEP] / times["job step matmul floor, fp32"],
        "matmul GFLOP / step": floor.flops / 1e9,
        "matmul calls / step": floor.count,
        "step GFLOP/s": floor.flops / times[JOB_STEP] / 1e9,
        "large fp32 GEMM GFLOP/s": gemm / 1e9,
        "share of large-GEMM rate %": 100 * floor.flops / times[JOB_STEP] / gemm,
        f"job step vs {BASELINE}": times[BASELINE] / times[JOB_STEP],
    }
    return rows, floor_row


def _resident_mib(field: str) -> float:
    """VmRSS (current) or VmHWM (high-water mark) of this process, in MiB."""
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith(field + ":")) / 2**10


def _peak_memory_child(family: str, autocast: bool, quick: bool, queue) -> None:
    model = build(family)
    step = training_step(model, batch(quick), autocast)
    built = _resident_mib("VmRSS")
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")  # reset the high-water mark to the current resident set
    for _ in range(2):  # the second step has the optimizer state allocated
        step()
    queue.put((built, _resident_mib("VmHWM") - built))


def peak_memory(family: str, autocast: bool, quick: bool) -> tuple[float, float]:
    """(MiB resident after building the model, peak MiB added by two training steps), in a fresh process.

    A spawned process has a fresh address space, so its high-water mark starts clean (unlike ru_maxrss, which
    Linux carries over from the parent).
    """
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    process = context.Process(target=_peak_memory_child, args=(family, autocast, quick, queue))
    process.start()
    result = queue.get()
    process.join()
    return result


def _compile_child(quick: bool, queue) -> None:
    try:
        model = build("k3")
        compiled_step = training_step(torch.compile(model), batch(quick), autocast=False)
        step_seconds = []
        with isa_safe_compile_caches():  # see benchmarks.common.compiled_for_these_kernels
            for _ in range(COMPILED_STEPS):
                start = time.perf_counter()
                compiled_step()
                step_seconds.append(time.perf_counter() - start)
        queue.put({"compiled step s (first = compilation)": [round(s, 2) for s in step_seconds]})
    except Exception as error:  # report why compilation is not usable here, whatever the failure
        queue.put({"error": f"{type(error).__name__}: {str(error).splitlines()[0][:300]}",
                   "where": traceback.format_exc().strip().splitlines()[-3][:200]})


def try_compile(quick: bool) -> dict:
    """torch.compile(model) training steps in a fresh process with a deadline, or why it is not usable on CPU."""
    return in_fresh_process(_compile_child, (quick,), COMPILE_TIMEOUT_S)


def run(quick: bool = False, repeats: int | None = None, compile_model: bool = False) -> dict:
    logging.set_verbosity_error()  # kimi_linear warns once that flash-linear-attention is absent
    repeats = repeats or 3
    rows, floor = throughput(quick, repeats)
    for row in rows:
        if row["variant"] in VARIANTS:
            row["after build MiB"], row["step peak +MiB"] = peak_memory(*VARIANTS[row["variant"]], quick)
    tables = [{"caption": f"Training step (batch {tuple(batch(quick).shape)}), AdamW unless noted; speedup vs "
                          f"{BASELINE}.", "columns": list(dict.fromkeys(key for row in rows for key in row)),
               "rows": rows},
              {"caption": "The job's step against its own matmul floor (the same products back to back), and its "
                          "FLOP rate as a share of a large GEMM's.", "columns": list(floor), "rows": [floor]}]
    notes = ["KimiLinear runs its experts at full width (ours in the 128-wide latent), uses the softplus decay "
             "gate, SiLU and no Block Attention Residuals, and its KDA is transformers' torch fallback kernel."]
    if compile_model:
        compiled = try_compile(quick)
        notes.append(f"torch.compile(model) (inductor, CPU, fp32, own process): {compiled}")
    return {"title": "P6 - end-to-end training throughput (default KimiK3Config())", "tables": tables, "notes": notes}


def main() -> None:
    args = bench_arguments(__doc__, extra=lambda parser: parser.add_argument(
        "--compile", action="store_true", help=f"also time torch.compile(model) steps (up to {COMPILE_TIMEOUT_S} s)"
    ))
    report("e2e", run(args.quick, args.repeats, args.compile), args.json)


if __name__ == "__main__":
    main()
