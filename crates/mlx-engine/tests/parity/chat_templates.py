"""The reference for tests/chat_templates.rs: each folder's chat template
rendered by transformers' `apply_chat_template` (what mlx_lm's tokenizer
wrapper calls), as text.

Usage: chat_templates.py CASES.json — a list of {"dir", "messages",
"add_generation_prompt"}; prints a JSON list of the rendered strings.
"""

import json
import sys

from transformers import AutoTokenizer


def main() -> None:
    cases = json.load(open(sys.argv[1]))
    out = []
    for case in cases:
        tokenizer = AutoTokenizer.from_pretrained(case["dir"])
        out.append(tokenizer.apply_chat_template(
            case["messages"], tokenize=False, add_generation_prompt=case["add_generation_prompt"]))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
