"""specdec: exact speculative decoding for Hugging Face causal LMs."""

from specdec.metrics import SpeculativeMetrics
from specdec.sampling import SamplingConfig
from specdec.verify import greedy_verify, speculative_verify

__all__ = ["SamplingConfig", "SpeculativeMetrics", "greedy_verify", "speculative_verify"]
