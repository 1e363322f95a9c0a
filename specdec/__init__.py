"""specdec: exact speculative decoding for Hugging Face causal LMs.

from specdec import SpeculativeDecoder
decoder = SpeculativeDecoder.from_pretrained("qwen2.5-coder-1.5b", draft="qwen2.5-coder-0.5b")
out = decoder.generate("def fib(n):", max_new_tokens=64)
print(out.text, out.metrics.mean_acceptance_length)

Design notes (words, exactness contract, layering, cache invariant): docs/DESIGN.md.
"""

from specdec.adapters import HFCausalLM
from specdec.api import GenerationResult, SpeculativeDecoder, check_tokenizers_agree, generate
from specdec.batching import Session
from specdec.drafters import ModelDrafter, NgramDrafter
from specdec.inputs import SpecConfig
from specdec.metrics import SpeculativeMetrics
from specdec.resolution import ALIASES, fetch_alias, load_model, load_tokenizer
from specdec.sampling import SamplingConfig
from specdec.verify import greedy_verify, speculative_verify

__all__ = [
    "ALIASES",
    "GenerationResult",
    "HFCausalLM",
    "ModelDrafter",
    "NgramDrafter",
    "SamplingConfig",
    "Session",
    "SpecConfig",
    "SpeculativeDecoder",
    "SpeculativeMetrics",
    "check_tokenizers_agree",
    "fetch_alias",
    "generate",
    "greedy_verify",
    "load_model",
    "load_tokenizer",
    "speculative_verify",
]
