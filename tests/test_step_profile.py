"""The step's matmul floor (benchmarks/step_profile.py) replays what it recorded, in 16 bits too."""

import collections

import torch

from benchmarks.step_profile import Counts, MatmulFloor, MatmulRecorder


def as_recorded(calls) -> list:
    """The calls with every group-offsets operand as its values, to compare recordings."""
    return [(call.func, [value.values.tolist() if isinstance(value, Counts) else value for value in call.args],
             call.kwargs) for call in calls]


def test_a_floor_replays_its_products_in_order_on_operands_laid_out_as_the_step_had_them():
    """Recorded again, the replay is the same calls: in the same order, each operand a view of the same shape, strides
    and offset of a storage shared exactly where the recorded ones shared one (a weight read twice, a buffer written
    then read, a view into the middle of a tensor), and a grouped product with the recorded, uneven group sizes."""
    generator = torch.Generator().manual_seed(0)
    inputs, weight = torch.randn(5, 8, generator=generator), torch.randn(8, 6, generator=generator)
    stack, experts = torch.randn(2, 3, 4, generator=generator), torch.randn(3, 8, 4, generator=generator)
    gram, polynomial = torch.empty(2, 3, 3), torch.empty(2, 3, 3)
    offsets = torch.tensor([1, 1, 5], dtype=torch.int32)  # an empty group between two uneven ones
    with MatmulRecorder() as recorder:
        hidden = inputs @ weight
        torch.bmm(stack, stack.mT, out=gram)
        torch.baddbmm(gram, gram, gram, beta=-4.775, alpha=2.0315, out=polynomial)
        hidden.T @ inputs[:, 1:7]
        weight.T @ inputs[1:, :].T
        torch._grouped_mm(inputs, experts, offs=offsets)
    floor = MatmulFloor(recorder.calls)
    assert floor.count == 6 and len({operand.storage for call in floor.calls for operand in call.operands()
                                     if not isinstance(operand, Counts)}) == 7
    with MatmulRecorder() as again:
        floor.replay()()
    assert as_recorded(again.calls) == as_recorded(recorder.calls)

    # On shared operands: the same products, shape by shape, with the grouped rows split evenly.
    with MatmulRecorder() as shared:
        floor.replay(shared_operands=True)()
    assert collections.Counter(call.signature for call in shared.calls) == collections.Counter(
        call.signature for call in floor.calls)
    assert [value.values.tolist() for call in shared.calls for value in call.args if isinstance(value, Counts)] == [
        [2, 3, 5]]


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
    import kda_kimi_k3
    import modeling_kimi_k3
    from benchmarks.step_bounds import STAND_INS
    from kimi_k3.kernels import fused_situ
    from tests.conftest import tiny_config

    references = {"KDA chunk kernel": (kda_kimi_k3, "chunk_kda"),
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
