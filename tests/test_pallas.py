"""The shared test base run against the Pallas kernels in interpret mode (CPU)."""
from tests.attention_base import AttentionTests


class TestPallasInterpret(AttentionTests):
  IMPLEMENTATION = "pallas"
