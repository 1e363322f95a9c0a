"""specdec's target-alone loop against transformers' `generate` on the real 1.5B target (bfloat16 on CPU),
the bench's first code prompt with its chat template, 48 greedy tokens, interleaved three times, then
each once under the torch profiler (its table by self CPU time).

    .venv/bin/python scripts/target_alone_check.py
"""

import time

import torch
from torch.profiler import profile

from specdec import SpeculativeDecoder
from specdec.bench import PROMPTS

NEW_TOKENS = 48


def main() -> None:
    decoder = SpeculativeDecoder.from_pretrained("qwen2.5-coder-1.5b", draft=None, device="cpu")
    model, tokenizer = decoder.target.model, decoder.tokenizer
    chat = [{"role": "user", "content": PROMPTS["code"][0]}]
    text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(text, return_tensors="pt").input_ids

    def transformers_generate():
        with torch.inference_mode():
            model.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)

    def specdec_alone():
        decoder.generate(ids[0].tolist(), max_new_tokens=NEW_TOKENS, temperature=0)

    methods = {"transformers": transformers_generate, "specdec": specdec_alone}
    for run in methods.values():  # warm-up
        run()
    for _ in range(3):
        speeds = {}
        for name, run in methods.items():
            start = time.perf_counter()
            run()
            speeds[name] = NEW_TOKENS / (time.perf_counter() - start)
        print(
            {k: round(v, 3) for k, v in speeds.items()},
            f"specdec / transformers {speeds['specdec'] / speeds['transformers']:.3f}",
        )
    for name, run in methods.items():
        with profile() as prof:
            run()
        print(name)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=8))


if __name__ == "__main__":
    main()
