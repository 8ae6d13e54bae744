"""Exporting the causal LM, the paths docs/ecosystem.md documents, each at a fixed length (chunked KDA loops over
its 32-token chunks in Python, so the length is specialised):

- ``torch.export`` computes the eager logits bit for bit.
- ``torch.onnx.export(..., dynamo=True)`` gives a graph that onnxruntime runs to the float64 model's logits as
  closely as the fp32 model does: while ONNX-exporting, KDA inverts its chunk matrix by forward substitution (ONNX
  has no triangular solve) and the experts run as batched products (ONNX has no grouped product).
"""

import pytest
import torch

from kda_kimi_k3 import forward_substitution_inverse, unit_lower_triangular_inverse
from modeling_kimi_k3 import KimiK3ForCausalLM
from tests.conftest import seeded_generator, tiny_config
from tests.numerics import assert_as_accurate, float64_copy, perturb_parameters


class Logits(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        return self.model(input_ids=input_ids, use_cache=False).logits


def test_exported_program_at_a_fixed_length_gives_the_eager_logits():
    model = Logits(KimiK3ForCausalLM(tiny_config()).eval())
    input_ids = torch.randint(3, 97, (2, 37), generator=seeded_generator(0))  # not a chunk multiple
    exported = torch.export.export(model, (input_ids,))
    other = torch.randint(3, 97, (2, 37), generator=seeded_generator(1))
    assert torch.equal(exported.module()(other), model(other))


@pytest.mark.parametrize("shape", [(1, 1), (2, 3, 5), (3, 16), (2, 2, 2, 32)])
def test_forward_substitution_inverts_the_unit_lower_triangular_matrix(shape):
    """The export path against torch's solve in float64, and in fp32 within the solve's own fp32 error."""
    lower = torch.randn(*shape, shape[-1], generator=seeded_generator(len(shape)), dtype=torch.float64) * 0.3
    lower += torch.randn(shape[-1], shape[-1], dtype=torch.float64).triu()  # never read: only L below the diagonal
    exact = unit_lower_triangular_inverse(lower)
    identity = torch.eye(shape[-1], dtype=torch.float64).expand_as(lower)
    assert torch.allclose((identity + lower.tril(-1)) @ exact, identity, atol=1e-12)
    assert torch.allclose(forward_substitution_inverse(lower), exact, rtol=0, atol=1e-12)
    solve_error = (unit_lower_triangular_inverse(lower.float()).double() - exact).abs().max()
    substitution_error = (forward_substitution_inverse(lower.float()).double() - exact).abs().max()
    assert substitution_error <= 4 * solve_error + 1e-6


def test_onnx_export_runs_in_onnxruntime_to_the_float64_logits():
    onnxruntime = pytest.importorskip("onnxruntime")  # a dev dependency, with onnxscript, which torch.onnx needs
    pytest.importorskip("onnxscript")
    model = KimiK3ForCausalLM(tiny_config()).eval()
    input_ids = torch.randint(3, 97, (2, 37), generator=seeded_generator(2))
    program = torch.onnx.export(Logits(model), (input_ids,), dynamo=True, optimize=False, verbose=False)
    session = onnxruntime.InferenceSession(program.model_proto.SerializeToString())
    other = torch.randint(3, 97, (2, 37), generator=seeded_generator(3))
    onnx_logits = torch.from_numpy(session.run(None, {session.get_inputs()[0].name: other.numpy()})[0])
    with torch.no_grad():
        trusted = model(other).logits
        exact = float64_copy(model)(other).logits
        perturbed = perturb_parameters(model, seed=4)(other).logits
    assert_as_accurate(onnx_logits, trusted, exact, [perturbed], what="onnxruntime logits")
