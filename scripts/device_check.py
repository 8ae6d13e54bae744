"""One check of the project on a device: the device tests, a short training run, the training step's throughput
against transformers' `KimiLinearForCausalLM`, and KDA through the model's seam against fla's own `chunk_kda`.

Meant for a person with one CUDA GPU and no network (`scripts/device_check.sh` installs the carried wheels first);
``--device cpu --quick`` runs every part end to end on a CPU in a minute or two, which CI does. Prints one table and
writes it as JSON (``--out``).

    python scripts/device_check.py                      # cuda: ~100 M-active K3, 50 training steps, 8 minutes at most
    python scripts/device_check.py --device cpu --quick  # the default small model, a few steps

Parts:
- tests: ``pytest -m "device and not distributed"`` with ``KIMI_K3_TEST_DEVICE`` set (``--quick``: tests/test_kda.py).
- train: ``kimi-k3-train`` for 50 steps (``--quick``: 8 smaller ones, eager kernels) in bf16 where the device multiplies bf16 natively; the loss
  must be finite and fall (mean of the last fifth below the first fifth's).
- step: tokens/s and MFU of forward + loss + backward + AdamW for `K3_100M_ACTIVE` (99 M parameters touched per token)
  and `KimiLinearForCausalLM` at the same width, depth, heads, experts and top-k (each with fla when it is installed).
  FLOPs per token are 6 x the parameters a token touches (all but the input embedding, routed experts at top-k/n);
  attention's and KDA's sequence terms are left out. MFU is against the GPU's dense bf16 peak from its data sheet
  (`PEAK_BF16_FLOPS`) or, for other devices, against one large GEMM measured here (said in the row).
- kda: forward + backward of `chunk_kimi_delta_attention` (the seam) against fla's `chunk_kda` called directly with the
  same arguments, and the torch body; the seam's largest difference from the torch body.
"""

import argparse
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from benchmarks.bench_e2e import kimi_linear_config  # noqa: E402
from benchmarks.common import machine_description, markdown_table  # noqa: E402
from configuration_kimi_k3 import KimiK3Config  # noqa: E402
from kimi_k3.optim.precision import has_fast_bf16_matmul  # noqa: E402
from modeling_kimi_k3 import (  # noqa: E402
    KimiK3ForCausalLM,
    chunk_kimi_delta_attention,
    package_kernel_runs,
    torch_chunk_kimi_delta_attention,
)

# ~100 M parameters touched per token (416 M in all): 12 layers (KDA, KDA, KDA, MLA) x 3, 64 experts top-4 in a
# 384-wide latent, a 32 k vocabulary.
K3_100M_ACTIVE = {
    "vocab_size": 32768, "hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 6,
    "num_key_value_heads": 6, "q_lora_rank": 384, "kv_lora_rank": 256, "qk_nope_head_dim": 64, "qk_rope_head_dim": 32,
    "v_head_dim": 64, "linear_num_heads": 6, "linear_head_dim": 128, "intermediate_size": 2048, "num_experts": 64,
    "num_experts_per_token": 4, "moe_intermediate_size": 384, "routed_expert_hidden_size": 384,
    "num_shared_experts": 1, "max_position_embeddings": 4096,
}
# Dense bf16 tensor-core peaks from NVIDIA's data sheets (SXM parts), matched on the device name in this order.
PEAK_BF16_FLOPS = (("H100 PCIe", 756e12), ("H100", 989e12), ("H200", 989e12), ("GH200", 989e12), ("A100", 312e12))
TIME_LIMIT_S = 8 * 60


def main(argv: list[str] | None = None) -> int:
    args = parse_arguments(argv)
    device = torch.device(args.device)
    started = time.monotonic()
    rows = [check_tests(args, device), check_training(args, device)]
    rows += check_step_throughput(args, device)
    rows += check_kda_seam(args, device)
    seconds = time.monotonic() - started
    rows.append(row("whole check", seconds <= TIME_LIMIT_S if device.type != "cpu" else None, f"{seconds:.0f} s",
                    f"limit {TIME_LIMIT_S} s on an accelerator"))
    result = {"device": describe_device(device), "machine": machine_description(), "quick": args.quick,
              "rows": rows}
    print(markdown_table(rows, ["check", "result", "value", "detail"]))
    print(result["device"])
    args.out.write_text(json.dumps(result, indent=1))
    print(f"written to {args.out}")
    return 0 if all(row["result"] != "FAIL" for row in rows) else 1


def parse_arguments(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", help="torch device to check (default cuda)")
    parser.add_argument("--quick", action="store_true", help="small sizes and few steps: the whole script in minutes")
    parser.add_argument("--out", type=Path, default=Path("device_check.json"), help="where the JSON table goes")
    args = parser.parse_args(argv)
    try:
        device = torch.device(args.device)
    except RuntimeError as error:
        parser.error(f"--device {args.device!r}: {error}")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: torch {torch.__version__} sees no CUDA device (use --device cpu)")
    return args


def describe_device(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} (torch {torch.__version__}, CUDA {torch.version.cuda})"
    return f"{device.type}, CPU capability {torch.backends.cpu.get_cpu_capability()} (torch {torch.__version__})"


def row(check: str, passed: bool | None, value, detail: str) -> dict:
    """One table row; ``passed=None`` reports a measurement, which has no pass/fail."""
    result = "measured" if passed is None else ("ok" if passed else "FAIL")
    return {"check": check, "result": result, "value": value, "detail": detail}


def run_command(command: list[str], environ: dict, timeout_s: float) -> tuple[int, str]:
    try:
        done = subprocess.run(command, cwd=ROOT, env={**os.environ, **environ}, capture_output=True, text=True,
                              timeout=timeout_s)
    except subprocess.TimeoutExpired as expired:
        return -1, f"timed out after {timeout_s:.0f} s\n{expired.stdout or ''}"
    return done.returncode, done.stdout + done.stderr


# ------------------------------------------------------------------------------------------------------------- tests
def check_tests(args, device: torch.device) -> dict:
    selection = ["tests/test_kda.py"] if args.quick else ["-m", "device and not distributed", "tests/"]
    code, output = run_command([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *selection],
                               {"KIMI_K3_TEST_DEVICE": str(device)}, timeout_s=240)
    summary = next((line for line in reversed(output.splitlines()) if re.search(r"\d+ (passed|failed)", line)),
                   output.strip().splitlines()[-1] if output.strip() else "no output")
    return row("device tests", code == 0, summary.strip("= "), " ".join(selection))


# ---------------------------------------------------------------------------------------------------------- training
def check_training(args, device: torch.device) -> dict:
    steps = 8 if args.quick else 50
    bf16 = has_fast_bf16_matmul(device)
    # Quick: smaller batches and the eager kernels (compiling the fused ones takes a minute on a busy CPU).
    quick = ["--per_device_train_batch_size", "4", "--block_size", "64", "--warmup_steps", "1",
             "--fused_situ", "False", "--fused_attention_residuals", "False"] if args.quick else []
    with tempfile.TemporaryDirectory() as folder:
        command = [sys.executable, "-m", "kimi_k3.job", "--output_dir", folder, "--max_steps", str(steps),
                   "--logging_steps", "1", "--eval_strategy", "no", "--save_strategy", "no",
                   "--bf16", str(bf16), "--use_cpu", str(device.type == "cpu"), *quick]
        code, output = run_command(command, {}, timeout_s=150 if device.type != "cpu" else 600)
    losses = [float(value) for value in re.findall(r"'loss': '?([-+\w.]+)'?", output)]
    detail = f"kimi-k3-train, {steps} steps, {'bf16' if bf16 else 'fp32'}"
    if code != 0 or len(losses) < steps:
        return row("training run", False, f"exit {code}, {len(losses)} losses", f"{detail}: {output[-300:]!r}")
    fifth = max(1, len(losses) // 5)
    first, last = sum(losses[:fifth]) / fifth, sum(losses[-fifth:]) / fifth
    passed = all(math.isfinite(loss) for loss in losses) and last < first
    return row("training run", passed, f"loss {first:.3f} -> {last:.3f}", detail)


# ------------------------------------------------------------------------------------------------------- step speed
def active_parameters(model: torch.nn.Module, config) -> int:
    """Parameters a token touches: all but the input embedding, the routed experts' at top-k / n."""
    share = config.num_experts_per_token if hasattr(config, "num_experts_per_token") else config.num_experts_per_tok
    experts = config.num_experts if hasattr(config, "num_experts_per_token") else config.num_local_experts
    total = 0.0
    for name, parameter in model.named_parameters():
        if "embed_tokens" not in name:
            total += parameter.numel() * (share / experts if ".experts." in name else 1)
    return int(total)


def synchronized(device: torch.device) -> Callable[[], None]:
    return torch.cuda.synchronize if device.type == "cuda" else (lambda: None)


def best_seconds(run: Callable[[], object], device: torch.device, repeats: int, warmup: int = 2) -> float:
    sync = synchronized(device)
    for _ in range(warmup):
        run()
    best = math.inf
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        run()
        sync()
        best = min(best, time.perf_counter() - start)
    return best


def peak_flops(device: torch.device, dtype: torch.dtype) -> tuple[float, str]:
    """The device's dense peak for ``dtype`` products: a data-sheet figure for known GPUs, else one large GEMM."""
    if device.type == "cuda" and dtype == torch.bfloat16:
        name = torch.cuda.get_device_name(device)
        for part, flops in PEAK_BF16_FLOPS:
            if part in name:
                return flops, f"{part} data sheet"
    size = 4096 if device.type == "cuda" else 1024
    a, b = (torch.randn(size, size, device=device, dtype=dtype) for _ in range(2))
    return 2 * size**3 / best_seconds(lambda: a @ b, device, repeats=5), f"measured {size}^3 {dtype} GEMM"


def training_step(model, input_ids, device: torch.device, autocast: bool) -> Callable[[], None]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type in ("cpu", "cuda"))

    def step():
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            loss = model(input_ids=input_ids, labels=input_ids, use_cache=False).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def check_step_throughput(args, device: torch.device) -> list[dict]:
    from transformers import KimiLinearForCausalLM

    config = KimiK3Config() if args.quick else KimiK3Config(**K3_100M_ACTIVE)
    batch_size, seq_len = (2, 64) if args.quick else (8, 2048)
    autocast = has_fast_bf16_matmul(device)
    peak, peak_source = peak_flops(device, torch.bfloat16 if autocast else torch.float32)
    input_ids = torch.randint(3, config.vocab_size, (batch_size, seq_len), device=device)
    rows, rates = [], {}
    for name, build in (("Kimi K3", lambda: KimiK3ForCausalLM(config)),
                        ("KimiLinearForCausalLM", lambda: KimiLinearForCausalLM(kimi_linear_config(config)))):
        torch.manual_seed(0)
        model = build().to(device).train()
        active = active_parameters(model, model.config)
        step = training_step(model, input_ids, device, autocast)
        seconds = best_seconds(step, device, repeats=1 if args.quick else 5, warmup=1 if args.quick else 2)
        rates[name] = batch_size * seq_len / seconds
        mfu = 6 * active * rates[name] / peak
        rows.append(row(f"step: {name}", None, f"{rates[name]:,.0f} tokens/s, MFU {100 * mfu:.2f} %",
                        f"{active / 1e6:.1f} M active, batch {batch_size}x{seq_len}, "
                        f"{'bf16 autocast' if autocast else 'fp32'}, peak {peak / 1e12:.1f} TFLOP/s ({peak_source})"))
        del model
    ratio = rates["Kimi K3"] / rates["KimiLinearForCausalLM"]
    detail = "same batch, same precision" + ("; --quick: one timed step each, a smoke run" if args.quick else "")
    rows.append(row("step: K3 / KimiLinear tokens/s", None, f"{ratio:.2f}x", detail))
    return rows


# -------------------------------------------------------------------------------------------------------------- KDA
def kda_inputs(quick: bool, device: torch.device) -> tuple[torch.Tensor, ...]:
    batch_size, seq_len, heads, head_dim = (1, 256, 2, 32) if quick else (4, 4096, 6, 128)
    generator = torch.Generator().manual_seed(0)

    def draw(*shape):
        return torch.randn(*shape, generator=generator).to(device).requires_grad_()

    q, k, v = (draw(batch_size, seq_len, heads, head_dim) for _ in range(3))
    gate = torch.randn(batch_size, seq_len, heads, head_dim, generator=generator)
    g = (-5.0 * torch.sigmoid(gate)).to(device).requires_grad_()  # K3's gate: in (lower bound -5, 0)
    beta = torch.rand(batch_size, seq_len, heads, generator=generator).to(device).requires_grad_()
    return q, k, v, g, beta


def forward_backward(kernel: Callable, inputs: tuple[torch.Tensor, ...]) -> Callable[[], torch.Tensor]:
    arguments = {"scale": inputs[0].shape[-1] ** -0.5, "use_qk_l2norm_in_kernel": True, "safe_gate": True,
                 "lower_bound": -5.0}

    def run():
        output, _ = kernel(*inputs, **arguments)
        output.sum().backward()
        return output.detach()

    return run


def check_kda_seam(args, device: torch.device) -> list[dict]:
    inputs = kda_inputs(args.quick, device)
    repeats = 1 if args.quick else 5
    reference = torch_chunk_kimi_delta_attention
    torch_seconds = best_seconds(forward_backward(reference, inputs), device, repeats)
    shape = "x".join(map(str, inputs[0].shape))
    rows = [row("kda: torch body fwd+bwd", None, f"{1e3 * torch_seconds:.2f} ms", f"q [{shape}]")]
    if not package_kernel_runs("fla", inputs[0]):
        rows.append(row("kda: seam vs fla chunk_kda", None, "not run",
                        f"fla is not installed or does not run on {device.type}"))
        return rows
    from fla.ops.kda import chunk_kda as fla_chunk_kda

    seam_seconds = best_seconds(forward_backward(chunk_kimi_delta_attention, inputs), device, repeats)
    fla_seconds = best_seconds(forward_backward(fla_chunk_kda, inputs), device, repeats)
    difference = (forward_backward(chunk_kimi_delta_attention, inputs)() - forward_backward(reference, inputs)())
    rows.append(row("kda: seam / fla chunk_kda", seam_seconds <= 1.1 * fla_seconds, f"{seam_seconds / fla_seconds:.3f}x",
                    f"{1e3 * seam_seconds:.2f} ms vs {1e3 * fla_seconds:.2f} ms fwd+bwd, target <= 1.1x"))
    rows.append(row("kda: |seam - torch body|", None, f"{difference.abs().max().item():.2e}", "largest, outputs"))
    return rows


if __name__ == "__main__":
    raise SystemExit(main())
