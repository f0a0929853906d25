"""``python -m grpo_core.tiny``: build (or reuse) a tiny model and print its sampled evaluation (``evaluate``).

The command lives here, not in ``evaluate``, because it builds the model: ``build`` itself runs ``evaluate``'s
sampled evaluation after a warm-up, so the two would import each other.
"""

from __future__ import annotations

import argparse

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from grpo_core.tiny import tasks
from grpo_core.tiny.build import build_tiny_model
from grpo_core.tiny.evaluate import sampled_eval
from grpo_core.tiny.tasks import arithmetic_dataset


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", default="arithmetic")
    parser.add_argument("--split", default="eval")
    parser.add_argument("--num", type=int, default=400)
    args = parser.parse_args()
    path = build_tiny_model(variant=args.variant)
    torch.set_num_threads(2)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    ds = arithmetic_dataset(num_train=args.num, num_eval=args.num, seed=1)[args.split]
    tools = [tasks.CALCULATOR_SCHEMA] if args.variant == "tools" else None
    res = sampled_eval(model, tokenizer, ds["prompt"], ds["solution"], tools=tools, max_turns=2 if tools else 1)
    print(res)
    for sample in res.samples[:5]:
        print(sample)


if __name__ == "__main__":
    main()
