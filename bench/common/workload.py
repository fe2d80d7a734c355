"""The standard engine workload: seeded chat prompts as token ids, plus Poisson arrival times,
and the named workloads of bench/engine_throughput.py (`WORKLOADS`).

Every system under test reads the very same token ids, so differences in the numbers come from
the systems and not from tokenisation or templating.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass
from typing import Any

# bench/engine_throughput.py's standard workload (its defaults) and seed
STANDARD = {"num_requests": 64, "max_prompt": 512, "max_output": 256, "seed": 0}
# The three workloads of issue 23 (--workload): request count, prompt and output length ranges.
WORKLOADS: dict[str, dict[str, int]] = {
    "standard": {"num_requests": 64, "min_prompt": 16, "max_prompt": 512, "min_output": 16,
                 "max_output": 256},
    # prefill-heavier: longer prompts, shorter answers
    "prefill": {"num_requests": 64, "min_prompt": 128, "max_prompt": 700, "min_output": 24,
                "max_output": 192},
    # long prompts (RAG, agents): prompt plus output within SmolLM2's 8,192-token context
    "long": {"num_requests": 16, "min_prompt": 2048, "max_prompt": 8000, "min_output": 16,
             "max_output": 64},
}

# (name, in features, out features) of SmolLM2-135M's projections: the linear-layer workload of
# bench/quantization.py (and of bench/archive/cpu_gemm.py)
LINEAR_SHAPES = [("qkv", 576, 960), ("o", 576, 576), ("gate_up", 576, 3072), ("down", 1536, 576),
                 ("lm_head", 576, 49152)]

# A fixed word list (plain English, written for this benchmark) so prompts need no download.
_WORD_TEXT = (
    "the of and to in is was for on that with as by at from his her they this had not are but "
    "one all were when we there can an which their said if do will each about how up out them "
    "then she many some so these would other into has more two like him see time could no make "
    "than first been its who now people my made over did down only way find use may water long "
    "little very after words called just where most know get through back much go good new "
    "write our me man too any day same right look think also around another came come work "
    "three word must because does part even place well such here take why things help put years "
    "different away again off went old number great tell men say small every found still "
    "between name should home big give air line set own under read last never us left end along "
    "while might next sound below saw something thought both few those always looked show large "
    "often together asked house world going want school important until form food keep "
    "children feet land side without boy once animals life enough took sometimes four head "
    "above kind began almost live page got earth need far hand high year mother light parts "
    "country father let night following picture being study second eyes soon times story boys "
    "since white days ever paper hard near sentence better best across during today others "
    "however sure means knew try told young miles sun ways thing whole hear example heard "
    "several change answer room sea against top turned learn point city play toward five "
    "using himself usually river engine garden window silver ocean mountain quiet question"
)
WORDS = tuple(_WORD_TEXT.split())

SYSTEM_MESSAGE = "Be brief."


@dataclass
class Request:
    """One benchmark request: templated prompt token ids and the exact number of tokens to make."""

    prompt_token_ids: list[int]
    max_tokens: int
    arrival_offset: float = 0.0  # seconds after the start, used by the online mode only


@dataclass
class Workload:
    """The request list plus everything needed to rebuild it (seed, bounds)."""

    seed: int
    requests: list[Request]
    max_prompt: int
    max_output: int
    rate: float

    def to_dict(self) -> dict[str, Any]:
        """Serialise for the child processes (JSON-friendly)."""
        return {
            "seed": self.seed,
            "max_prompt": self.max_prompt,
            "max_output": self.max_output,
            "rate": self.rate,
            "requests": [asdict(r) for r in self.requests],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Workload:
        """Inverse of `to_dict`."""
        return cls(
            seed=data["seed"],
            requests=[Request(**r) for r in data["requests"]],
            max_prompt=data["max_prompt"],
            max_output=data["max_output"],
            rate=data["rate"],
        )

    def summary(self) -> dict[str, Any]:
        """Length statistics, printed and stored so a result can be matched to its workload."""
        prompts = [len(r.prompt_token_ids) for r in self.requests]
        outputs = [r.max_tokens for r in self.requests]
        return {
            "num_requests": len(self.requests),
            "seed": self.seed,
            "prompt_tokens": {"min": min(prompts), "mean": sum(prompts) / len(prompts),
                              "max": max(prompts), "total": sum(prompts)},
            "output_tokens": {"min": min(outputs), "mean": sum(outputs) / len(outputs),
                              "max": max(outputs), "total": sum(outputs)},
            "rate_req_s": self.rate,
        }


def _template_ids(tokenizer: Any, user_text: str) -> list[int]:
    """Chat-template one user turn; handles both list and BatchEncoding return types."""
    messages = [
        {"role": "system", "content": SYSTEM_MESSAGE},
        {"role": "user", "content": user_text},
    ]
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(out, dict) or hasattr(out, "input_ids"):
        out = out["input_ids"]
    return [int(t) for t in out]


def _prompt_of_length(tokenizer: Any, rng: random.Random, target: int) -> list[int]:
    """A templated prompt as close to `target` tokens as the template allows (never above)."""
    words = [rng.choice(WORDS) for _ in range(target + 8)]
    text_ids = tokenizer(" ".join(words), add_special_tokens=False)["input_ids"]
    overhead = len(_template_ids(tokenizer, ""))
    n = max(1, target - overhead)
    best: list[int] = _template_ids(tokenizer, tokenizer.decode(text_ids[:1]))
    for _ in range(6):  # decode/re-encode can shift a token or two: converge on the target
        ids = _template_ids(tokenizer, tokenizer.decode(text_ids[:n]).strip())
        if len(ids) <= target and len(ids) >= len(best):
            best = ids
        if len(ids) == target:
            break
        n = max(1, n + target - len(ids))
    return best


def build_workload(
    tokenizer: Any,
    num_requests: int,
    max_prompt: int,
    max_output: int,
    seed: int,
    rate: float,
    *,
    min_prompt: int = 16,
    min_output: int = 16,
) -> Workload:
    """Seeded requests: prompts over [min_prompt, max_prompt] tokens, outputs over
    [min_output, max_output].

    Arrival offsets follow a Poisson process at `rate` req/s (exponential gaps), drawn from the
    same seed so online runs are repeatable too.
    """
    rng = random.Random(seed)
    lo_p, lo_o = min(min_prompt, max_prompt), min(min_output, max_output)
    requests: list[Request] = []
    t = 0.0
    for _ in range(num_requests):
        target = rng.randint(lo_p, max_prompt)
        max_tokens = rng.randint(lo_o, max_output)
        ids = _prompt_of_length(tokenizer, rng, target)
        requests.append(Request(prompt_token_ids=ids, max_tokens=max_tokens, arrival_offset=t))
        t += rng.expovariate(rate) if rate > 0 else 0.0
    return Workload(seed=seed, requests=requests, max_prompt=max_prompt, max_output=max_output,
                    rate=rate)


def decode_prompts(tokenizer: Any, n: int, prompt_len: int, seed: int) -> list[list[int]]:
    """`n` distinct prompts of exactly `prompt_len` raw tokens (no template) for decode timing.

    Distinct random words per prompt keep prefix caching from skipping any prefill work.
    """
    rng = random.Random(seed)
    prompts: list[list[int]] = []
    for _ in range(n):
        words = [rng.choice(WORDS) for _ in range(prompt_len + 8)]
        ids = tokenizer(" ".join(words), add_special_tokens=False)["input_ids"]
        while len(ids) < prompt_len:
            ids = ids + ids
        prompts.append([int(t) for t in ids[:prompt_len]])
    return prompts
