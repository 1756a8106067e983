"""One short prompt encoded by Strata's Tokenizer (tokenizers' Rust object directly, where that
gives transformers' ids: engine/tokenizer.py `_rust_encoder`) against transformers' own `encode`
on the same tokenizer, the default model's; best of 5 repeats, in one run:

    .venv/bin/python -m bench.tokenize_speed [--text "..."] [--number 20000]

Not asserted; the ids are checked equal first."""

from __future__ import annotations

import argparse
import os
import timeit

from engine.files import default_model_path
from engine.tokenizer import Tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--text", default="Question: what is the capital of France?\nAnswer:")
    parser.add_argument("--number", type=int, default=20000)
    args = parser.parse_args()
    tok = Tokenizer.from_model_path(default_model_path())
    wrapped = tok._tok  # transformers' tokenizer, which Tokenizer.encode goes around
    assert tok.encode(args.text) == list(wrapped.encode(args.text))
    us = []
    for name, encode in (("transformers' encode", lambda: wrapped.encode(args.text)),
                         ("Tokenizer.encode", lambda: tok.encode(args.text))):
        us.append(min(timeit.repeat(encode, number=args.number, repeat=5)) / args.number * 1e6)
        print(f"{name}: {us[-1]:.1f} us")
    print(f"ratio {us[0] / us[1]:.2f}x; {len(tok.encode(args.text))} tokens; "
          f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
