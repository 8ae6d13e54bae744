"""What the Kimi K3 classes change in transformers' model test mixins, shared by the text and vision-language tests.

Loading is strict by default (a missing tensor is refused, naming it); the mixins check transformers' lenient
behaviour (missing tensors initialised and reported), so the tests that load incomplete folders run with
``strict=False``. The mixins also assign ``self.model_tester`` in some tests, so it is a settable property over the
tester each test class builds in ``setUp``.
"""

from contextlib import contextmanager
from unittest import mock

from modeling_kimi_k3 import KimiK3PreTrainedModel


@contextmanager
def lenient_loading():
    """``from_pretrained`` as transformers' own models load: missing tensors initialised and reported, not refused."""
    strict_from_pretrained = KimiK3PreTrainedModel.from_pretrained.__func__

    def from_pretrained(cls, *args, **kwargs):
        return strict_from_pretrained(cls, *args, **{"strict": False, **kwargs})

    with mock.patch.object(KimiK3PreTrainedModel, "from_pretrained", classmethod(from_pretrained)):
        yield


class KimiK3MixinOverrides:
    """Put before `ModelTesterMixin` in a test class's bases; ``model_tester_class`` builds the tester."""

    model_tester_class = None

    def setUp(self):
        self._model_tester = self.model_tester_class(self)

    @property
    def model_tester(self):
        return self._model_tester

    @model_tester.setter
    def model_tester(self, value):
        self._model_tester = value

    def test_correct_missing_keys(self):
        with lenient_loading():
            super().test_correct_missing_keys()

    def test_model_weights_reload_no_missing_tied_weights(self):
        with lenient_loading():
            super().test_model_weights_reload_no_missing_tied_weights()

    def test_can_init_all_missing_weights(self):
        with lenient_loading():
            super().test_can_init_all_missing_weights()
