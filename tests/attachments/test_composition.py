"""Features composed by the training job: ``kimi-k3-train --qat mxfp4`` on the default model, with SiTU-GLU fused at
every size (the default model's activations are below the size from which it fuses on a CPU), runs the fused
concatenated SiTU-GLU kernel and the sorted experts for every MoE layer and the fused Block AttnRes at every site in
every training step, beside QAT's fake-quantized experts.

Each feature once undid another's: QAT's unbinding removed the fused experts' activation, so from the second forward
on the routed experts ran the split kernel. Counted here per optimizer step, over several steps."""

import torch

from configuration_kimi_k3 import KimiK3Config
from kimi_k3.attachments.seams import find_routed_experts, find_situ_activations
from kimi_k3.job.trainer import KimiK3Trainer
from kimi_k3.kernels import fused_attention_residual, fused_situ, sorted_experts
from kimi_k3.kernels.fused_attention_residual import SHARED_KERNELS as ATTENTION_RESIDUAL_KERNELS
from kimi_k3.kernels.fused_situ import SHARED_KERNELS
from kimi_k3.quantization import qat
from modeling_kimi_k3 import KimiK3ForCausalLM
from tests.conftest import CallCounter
from tests.job.test_train import run_main

STEPS = 3



def test_default_job_with_qat_and_situ_fused_at_every_size_runs_every_kernel_in_every_step(tmp_path, monkeypatch):
    # The eager bodies of the kernels (same bits): which path runs is the point here, not compilation.
    for kernel in (*SHARED_KERNELS.all(), *ATTENTION_RESIDUAL_KERNELS.all(), qat.COMPILED_MXFP4):
        monkeypatch.setattr(kernel, "failed", True)
    # The default model's activations are below the size from which SiTU-GLU runs compiled on a CPU; what collides
    # with QAT is the fused layout, so every activation takes it here.
    monkeypatch.setattr(fused_situ, "fused_min_elements", lambda device_type: 1)
    counters = {
        "concatenated": CallCounter(monkeypatch, fused_situ, "fused_situ_glu"),
        "separate": CallCounter(monkeypatch, fused_situ, "fused_situ_and_mul"),
        "fake-quantized weights": CallCounter(monkeypatch, qat, "fake_quantize_mxfp4"),
        "attention residuals": CallCounter(monkeypatch, fused_attention_residual, "fused_attention_residual"),
        "sorted experts": CallCounter(monkeypatch, sorted_experts, "sorted_experts"),
    }
    per_step, training_step = [], KimiK3Trainer.training_step

    def counted_step(self, *args, **kwargs):
        before = {name: counter.calls for name, counter in counters.items()}
        loss = training_step(self, *args, **kwargs)
        per_step.append({name: counter.calls - before[name] for name, counter in counters.items()})
        return loss

    monkeypatch.setattr(KimiK3Trainer, "training_step", counted_step)
    status, printed = run_main(["--output_dir", str(tmp_path / "run"), "--qat", "mxfp4", "--max_steps", str(STEPS),
                                "--eval_steps", str(STEPS), "--save_steps", str(STEPS), "--max_eval_samples", "2"])
    assert status == 0, printed

    with torch.device("meta"):
        model = KimiK3ForCausalLM(KimiK3Config())
    routed = len(find_routed_experts(model))
    dense = len(find_situ_activations(model)) - routed  # layer 0's MLP and every MoE layer's shared experts
    # AttnRes: before every layer's attention but the first's, before every feed-forward, and the output mix.
    expected = {"concatenated": routed, "separate": dense, "fake-quantized weights": 2 * routed,
                "attention residuals": 2 * model.config.num_hidden_layers, "sorted experts": routed}
    assert per_step == [expected] * STEPS
