"""Speculative decoding on CUDA: greedy agreement (both proposers, fp32 and bf16), seeded
sampling histograms, and spec vs plain throughput on a SmolLM2-shaped random model.

Run on a CUDA machine from the repository root, with SmolLM2's tokenizer folder (and its
config.json saved as smollm2_config.json in it) at `--tokenizer`, since the bundled GGUF may
not be there:

    python bench/archive/speculative_cuda.py --tokenizer .gpu/tok

Writes `$OUT/spec_cuda.json` (or /tmp/out). Figures: docs/benchmarks.md "Speculative decoding".
"""

import argparse
import json
import os
import random
import sys
import time
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, os.getcwd())
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from workers import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", default=".gpu/tok")
    args = parser.parse_args()
    out = Path(os.environ.get("OUT", "/tmp/out"))
    out.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    report = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__}


    def tiny(folder, **over):
        settings = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                        max_position_embeddings=1024, tie_word_embeddings=True,
                        initializer_range=0.2, bos_token_id=tok.bos_token_id,
                        eos_token_id=tok.eos_token_id)
        settings.update(over)
        torch.manual_seed(0)
        LlamaForCausalLM(LlamaConfig(**settings)).eval().save_pretrained(folder)
        tok.save_pretrained(folder)
        return str(folder)


    target = tiny("/tmp/tiny")
    draft = tiny("/tmp/draft", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                 num_attention_heads=2, num_key_value_heads=1)
    ALPHABET = [1000, 2000, 3000, 4000]
    rng = random.Random(0)
    prompts = []
    for _ in range(16):
        motif = [rng.choice(ALPHABET) for _ in range(rng.randint(3, 8))]
        prompts.append([rng.randrange(100, 40000) for _ in range(rng.randint(2, 20))] + motif * 3)
    greedy = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True,
                            logit_bias={t: 100.0 for t in ALPHABET})
    configs = {"ngram": {"method": "ngram", "num_tokens": 4},
               "draft": {"method": "draft", "draft_model": draft, "num_tokens": 3},
               "self": {"method": "draft", "draft_model": target, "num_tokens": 3}}
    for dtype in ("float32", "bfloat16"):
        base = LLM(target, device="cuda", dtype=dtype, kv_cache_memory=64 << 20)
        report[f"attention_{dtype}"] = base.engine.runner.attention_backend
        expected = [o.token_ids for o in base.generate(prompts, greedy)]
        for name, cfg in configs.items():
            llm = LLM(target, device="cuda", dtype=dtype, kv_cache_memory=64 << 20, speculative=cfg)
            got = [o.token_ids for o in llm.generate(prompts, greedy)]
            same = sum(a == b for a, b in zip(got, expected, strict=True))
            stats = llm.engine.stats()
            report[f"{dtype}_{name}"] = {"identical_rows": f"{same}/{len(prompts)}",
                                         "proposed": stats["spec_proposed_tokens"],
                                         "accepted": stats["spec_accepted_tokens"],
                                         "free_blocks_ok": llm.engine.block_manager.num_free_blocks
                                         == llm.engine.block_manager.num_blocks}
            print(dtype, name, report[f"{dtype}_{name}"], flush=True)

    # seeded sampling, spec vs plain: whole 4-token outputs
    prompt = [500, 600] + ALPHABET[:3] * 4
    params = [SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True, seed=i,
                             detokenize=False, logit_bias={t: 100.0 for t in ALPHABET[:3]})
              for i in range(800)]
    hists = {}
    for name, cfg in (("plain", None), ("ngram", configs["ngram"]), ("draft", configs["draft"])):
        if cfg:
            cfg = cfg | {"max_batch": 256}
        llm = LLM(target, device="cuda", dtype="float32", kv_cache_memory=64 << 20,
                  max_num_seqs=256, speculative=cfg)
        hists[name] = Counter(tuple(o.token_ids) for o in llm.generate([prompt] * 800, params))


    def chi(a, b):
        na, nb = sum(a.values()), sum(b.values())
        s = 0.0
        for k in set(a) | set(b):
            t = a[k] + b[k]
            ea, eb = t * na / (na + nb), t * nb / (na + nb)
            s += (a[k] - ea) ** 2 / ea + (b[k] - eb) ** 2 / eb
        return s, len(set(a) | set(b)) - 1


    report["chi_square"] = {n: chi(hists[n], hists["plain"]) for n in ("ngram", "draft")}
    print("chi", report["chi_square"], flush=True)

    # SmolLM2 shape, random bf16 weights: 64 requests, spec (ngram) vs plain, same engine
    cfg = json.loads((Path(args.tokenizer) / "smollm2_config.json").read_text())
    cfg.pop("quantization_config", None)
    config = LlamaConfig(**{k: v for k, v in cfg.items() if k not in ("architectures",)})
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained("/tmp/sm")
    tok.save_pretrained("/tmp/sm")
    llm = LLM("/tmp/sm", device="cuda", dtype="bfloat16", max_num_seqs=64,
              speculative={"method": "ngram", "num_tokens": 4, "max_batch": 64})
    rng = random.Random(1)
    batch = [[rng.randrange(100, 40000) for _ in range(rng.randint(16, 512))] for _ in range(64)]
    outs = {}
    for _round in range(2):
        for arm in ("plain", "spec"):
            p = [SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True,
                                speculative_tokens=None if arm == "spec" else 0)] * 64
            torch.cuda.synchronize()
            t = time.perf_counter()
            llm.generate(batch, p)
            torch.cuda.synchronize()
            outs.setdefault(arm, []).append(64 * 128 / (time.perf_counter() - t))
    report["smollm2_random_64x128_tok_s"] = outs
    report["spec_stats"] = llm.engine.stats()
    print(outs, flush=True)
    (out / "spec_cuda.json").write_text(json.dumps(report, indent=1, default=str))


if __name__ == "__main__":
    main()
