"""How much room RL has on the SmolLM2 demo's task: pass@k and the least KL a +g gain needs.

For a policy exported to Hugging Face (the demo's ``sft_hf/``) and held-out prompts (its
``data/prompts_val.parquet``), samples ``k`` replies to each question at ``--temperature``
(prefill once per question, the KV cache repeated k times) and scores them with the task's
checker. Prints, as one JSON line:

- greedy accuracy (``--k 0`` skips sampling and measures only that);
- pass@k for k = 1, 2, 4, ... (the unbiased estimator of Chen et al. 2021) at the temperature;
- for gains g of sampled accuracy, the least mean KL(new || policy) per *sequence* any policy
  needs to gain g (and per token at the mean reply length): the binary push-forward of any two
  reply distributions has no more KL than they do (data processing), and over questions the
  cheapest way to move the chance of a right reply from p_i to q_i with mean(q) = mean(p) + g
  is logit(q_i) = logit(p_i) + lambda (the KL-regularised optimum for a 0/1 reward). p_i is
  estimated as c_i / k, floored at 0.5 / k for questions never answered right.

    python benchmarks/smollm2_headroom.py MODEL_DIR PROMPTS_PARQUET [--n 200] [--k 32]
        [--temperature 1.0] [--max-new-tokens 16]
"""

from __future__ import annotations

import argparse
import json
import math
import time

import pyarrow.parquet as pq
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from megatron_rlhf.rewards.verifiable import ReasoningGymReward


def sample(model, tok, rows, k: int, temperature: float, max_new: int) -> list[list[str]]:
    """``k`` replies to each row's chat prompt (greedy when ``temperature`` is 0)."""
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    texts = [tok.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True) for r in rows]
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    attn = enc["attention_mask"]
    with torch.no_grad():
        out = model(input_ids=enc["input_ids"], attention_mask=attn,
                    position_ids=(attn.cumsum(-1) - 1).clamp(min=0), use_cache=True)
        cache = out.past_key_values
        cache.batch_repeat_interleave(k)
        logits, attn = out.logits[:, -1].repeat_interleave(k, 0), attn.repeat_interleave(k, 0)
        done, steps = torch.zeros(attn.shape[0], dtype=torch.bool), []
        for _ in range(max_new):
            if temperature > 0:
                nxt = torch.multinomial(torch.softmax(logits / temperature, -1), 1)
            else:
                nxt = logits.argmax(-1, keepdim=True)
            nxt[done] = eos
            steps.append(nxt)
            done |= nxt[:, 0] == eos
            if done.all():
                break
            attn = torch.cat([attn, torch.ones_like(nxt)], 1)
            out = model(input_ids=nxt, attention_mask=attn, position_ids=attn.sum(-1, keepdim=True) - 1,
                        past_key_values=cache, use_cache=True)
            cache, logits = out.past_key_values, out.logits[:, -1]
    ids = torch.cat(steps, 1).tolist()
    replies = [tok.decode([t for t in seq if t != eos], skip_special_tokens=True) for seq in ids]
    return [replies[i * k:(i + 1) * k] for i in range(len(rows))]


def pass_at(correct: int, n: int, k: int) -> float:
    return 1.0 if n - correct < k else 1.0 - math.comb(n - correct, k) / math.comb(n, k)


def least_kl(p: list[float], gain: float) -> float:
    """Mean over questions of the least KL(q || p) (Bernoulli, per question) with mean(q) =
    mean(p) + gain, q_i = sigmoid(logit(p_i) + lambda), lambda found by bisection."""
    target, lo, hi = sum(p) / len(p) + gain, -30.0, 30.0
    logit = [math.log(x / (1 - x)) for x in p]
    for _ in range(200):
        lam = (lo + hi) / 2
        q = [1 / (1 + math.exp(-(z + lam))) for z in logit]
        lo, hi = (lam, hi) if sum(q) / len(q) < target else (lo, lam)
    return sum(a * math.log(a / b) + (1 - a) * math.log((1 - a) / (1 - b)) for a, b in zip(q, p)) / len(p)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("prompts")
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--k", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    args = ap.parse_args()
    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(args.model)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.float32).eval()
    rows = pq.read_table(args.prompts).to_pylist()[:args.n]
    checker, start = ReasoningGymReward(rows[0]["task"]), time.time()

    def right(reply: str, row: dict) -> bool:
        return checker(reply, row["ground_truth"], "", {"metadata": row["metadata"]})["score"] == 1.0

    result: dict = {"model": args.model, "n": len(rows)}
    greedy = [r for i in range(0, len(rows), 20) for r in sample(model, tok, rows[i:i + 20], 1, 0.0,
                                                                 args.max_new_tokens)]
    result["greedy_accuracy"] = sum(right(g[0], row) for g, row in zip(greedy, rows)) / len(rows)
    if args.k:
        counts, lengths = [], []
        for i in range(0, len(rows), 4):
            for replies, row in zip(sample(model, tok, rows[i:i + 4], args.k, args.temperature,
                                           args.max_new_tokens), rows[i:i + 4]):
                counts.append(sum(right(r, row) for r in replies))
                lengths += [len(tok(r, add_special_tokens=False)["input_ids"]) + 1 for r in replies]
            print(f"[headroom] {len(counts)}/{len(rows)} questions, {time.time() - start:.0f}s", flush=True)
        p = [min(max(c / args.k, 0.5 / args.k), 1 - 0.5 / args.k) for c in counts]
        mean_len = sum(lengths) / len(lengths)
        result.update(k=args.k, temperature=args.temperature, mean_reply_tokens=round(mean_len, 2),
                      pass_at={kk: round(sum(pass_at(c, args.k, kk) for c in counts) / len(rows), 4)
                               for kk in (1, 2, 4, 8, 16, 32, 64, 128) if kk <= args.k},
                      least_kl={f"+{g:.2f}": {"per_sequence": round(least_kl(p, g), 4),
                                              "per_token": round(least_kl(p, g) / mean_len, 5)}
                                for g in (0.05, 0.10, 0.15, 0.20)},
                      correct_counts=counts)
    result["seconds"] = round(time.time() - start)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
