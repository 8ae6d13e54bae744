"""Print a continuation of a prompt from any saved Kimi K3 folder or hub repo.

    python scripts/generate.py outputs/kimi-k3-small/model --prompt "The with statement"

Only transformers is used: the model and configuration code come from the folder itself (trust_remote_code).
"""

import argparse

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="saved model folder or hub repo id")
    parser.add_argument("--prompt", default="The with statement")
    parser.add_argument("--max_new_tokens", type=int, default=60)
    parser.add_argument("--do_sample", action="store_true", help="sample instead of greedy decoding")
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--top_k", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def continuation(model, tokenizer, prompt: str, **generate_kwargs) -> str:
    inputs = tokenizer(prompt, return_tensors="pt").to(model.device)
    output = model.generate(**inputs, **generate_kwargs)
    return tokenizer.decode(output[0], skip_special_tokens=True)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    tokenizer = AutoTokenizer.from_pretrained(args.model, trust_remote_code=True)
    model = AutoModelForCausalLM.from_pretrained(args.model, trust_remote_code=True).eval()
    decoding = {"do_sample": True, "temperature": args.temperature, "top_k": args.top_k} if args.do_sample else {
        "do_sample": False
    }
    torch.manual_seed(args.seed)
    print(continuation(model, tokenizer, args.prompt, max_new_tokens=args.max_new_tokens, **decoding))


if __name__ == "__main__":
    main()
