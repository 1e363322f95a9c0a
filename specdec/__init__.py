"""specdec: exact speculative decoding for Hugging Face causal LMs.

from specdec import SpeculativeDecoder
decoder = SpeculativeDecoder.from_pretrained("qwen2.5-coder-1.5b", draft="qwen2.5-coder-0.5b")
out = decoder.generate("def fib(n):", max_new_tokens=64)
print(out.text, out.metrics.mean_acceptance_length)

Design notes (words, exactness contract, layering, cache invariant): docs/DESIGN.md.
"""

from specdec.api import GenerationResult, SpeculativeDecoder, generate
from specdec.config import SpecConfig
from specdec.drafters import ModelDrafter, NgramDrafter
from specdec.loading import check_tokenizers_agree
from specdec.metrics import SpeculativeMetrics
from specdec.models.adapters import HFCausalLM
from specdec.models.resolution import ALIASES, fetch_alias, load_model, load_tokenizer
from specdec.serving.session import Session
from specdec.verify import greedy_verify, speculative_verify
from specdec.verify.sampling import SamplingConfig

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
