"""`torch.export` of the causal LM at a fixed length, the path docs/ecosystem.md documents: the exported program
computes the eager logits bit for bit (chunked KDA loops over its 32-token chunks in Python, so the length is
specialised; ONNX has no function for the triangular solve inside a chunk)."""

import torch

from modeling_kimi_k3 import KimiK3ForCausalLM
from tests.conftest import tiny_config


class Logits(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        return self.model(input_ids=input_ids, use_cache=False).logits


def test_exported_program_at_a_fixed_length_gives_the_eager_logits():
    model = Logits(KimiK3ForCausalLM(tiny_config()).eval())
    input_ids = torch.randint(3, 97, (2, 37), generator=torch.Generator().manual_seed(0))  # not a chunk multiple
    exported = torch.export.export(model, (input_ids,))
    other = torch.randint(3, 97, (2, 37), generator=torch.Generator().manual_seed(1))
    assert torch.equal(exported.module()(other), model(other))
