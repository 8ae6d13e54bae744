"""The step's matmul floor (benchmarks/step_profile.py) replays what it recorded, in 16 bits too."""

import torch

from benchmarks.step_profile import MatmulFloor, MatmulRecorder


def test_a_floor_replays_its_products_in_16_bits_and_those_without_a_16_bit_kernel_as_recorded():
    """KDA's triangular solve has no bf16 CPU kernel: a bf16 floor keeps it in its recorded dtype, the rest in bf16."""
    generator = torch.Generator().manual_seed(0)
    system = torch.randn(2, 16, 16, generator=generator).triu() + 4 * torch.eye(16)
    right, matrix = torch.randn(2, 16, 5, generator=generator), torch.randn(7, 16, generator=generator)
    with MatmulRecorder() as recorder:
        torch.linalg.solve_triangular(system, right, upper=True)
        matrix @ right[0]
    floor = MatmulFloor(recorder.calls)
    assert floor.count == 2 and floor.flops == 2 * 16 * 5 * 16 + 2 * 7 * 16 * 5
    for dtype in (None, torch.bfloat16):
        floor.replay(dtype)()


def test_each_phase_of_the_job_step_records_its_own_products():
    """Forward, backward and the optimizer step each record what they run: Newton–Schulz's batched products only in
    the optimizer step, and the whole step's floor is the three together."""
    from benchmarks.step_profile import PHASES, record_matmuls, record_phase_matmuls

    phases = record_phase_matmuls(batch_size=1, seq_len=16)
    assert tuple(phases) == PHASES and all(floor.count for floor in phases.values())
    newton_schulz = {torch.ops.aten.bmm.out, torch.ops.aten.baddbmm.out}
    operators = {phase: {func for func, _, _ in floor.calls} for phase, floor in phases.items()}
    assert newton_schulz <= operators["optimizer step"]
    assert not newton_schulz & (operators["forward"] | operators["backward"])
    whole = record_matmuls(batch_size=1, seq_len=16)
    assert whole.count == sum(floor.count for floor in phases.values())
    assert whole.flops == sum(floor.flops for floor in phases.values())


def test_each_stand_in_of_the_step_bounds_replaces_its_component_and_gives_it_back(monkeypatch):
    """benchmarks/step_bounds.py: under a stand-in the component's reference runs for none of the modules it stands in
    for, the loss changes, every parameter that had a gradient still gets one (the optimizer's work is unchanged), and
    afterwards the model computes what it did."""
    import modeling_kimi_k3
    from benchmarks.step_bounds import STAND_INS
    from kimi_k3.kernels import fused_situ
    from tests.conftest import tiny_config

    references = {"KDA chunk kernel": (modeling_kimi_k3, "chunk_kda"),
                  "SiTU-GLU": (modeling_kimi_k3.KimiK3GLUActivation, "forward"),
                  "short convolutions": (modeling_kimi_k3.KimiK3ShortConvolution, "forward"),
                  "RMSNorm outside AttnRes": (modeling_kimi_k3.KimiK3RMSNorm, "forward")}
    assert references.keys() == STAND_INS.keys()
    calls = {name: [] for name in references}
    for name, (owner, attribute) in references.items():
        def recording(*args, reference=getattr(owner, attribute), name=name, **kwargs):
            calls[name].append(args[0])  # the module, for a forward
            return reference(*args, **kwargs)

        monkeypatch.setattr(owner, attribute, recording)

    # The fused SiTU-GLU forward, as the job attaches it (eager kernels: what runs is the point, not compilation).
    monkeypatch.setattr(fused_situ, "fused_activation_forward",
                        lambda module, *args, forward=fused_situ.fused_activation_forward:
                        calls["SiTU-GLU"].append(module) or forward(module, *args))
    model = modeling_kimi_k3.KimiK3ForCausalLM(tiny_config()).train()
    eager_kernels = fused_situ.SiTUKernels()
    for kernel in eager_kernels.all():
        kernel.failed = True
    fused_situ.use_fused_situ(model, min_elements=1, kernels=eager_kernels)
    ids = torch.randint(3, model.config.vocab_size, (2, 20))

    def loss_and_graded():
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach(), {name for name, parameter in model.named_parameters() if parameter.grad is not None}

    reference, graded = loss_and_graded()
    assert all(calls.values())
    attached = {module: vars(module).get("forward") for module in model.modules()}
    for name, stand_in in STAND_INS.items():
        calls[name].clear()
        with stand_in(model):
            replaced_modules = [module for module in model.modules() if vars(module).get("forward") is not
                                attached[module]]
            replaced, graded_under_stand_in = loss_and_graded()
        if references[name][1] == "forward":
            assert replaced_modules and not any(any(m is r for r in replaced_modules) for m in calls[name]), name
        else:
            assert not calls[name], name
        assert not torch.equal(replaced, reference), name
        assert graded_under_stand_in == graded, name
        assert torch.equal(loss_and_graded()[0], reference), name
        assert all(vars(module).get("forward") is forward for module, forward in attached.items()), name
