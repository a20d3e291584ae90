"""The GSM8K-format arithmetic task of ``flashloss train`` (``crates/flashloss-train/src/task.rs``
and ``tokenizer.rs``) in Python: the character tokenizer, the problem generator, the prompt
format and the verifiable reward, rule for rule. Problems are drawn with NumPy's generator
(the Rust side draws with ChaCha8), so the two draw different problems from the same task."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import numpy as np

#: The built-in alphabet: ids 0, 1, 2 are pad, end-of-sequence and unknown; then these characters.
CHARS = " \n0123456789+-*/=().,:;?!#$%'\"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
PAD, EOS, UNK = 0, 1, 2


class CharTokenizer:
    """One id per character of :data:`CHARS` (the methods Tunix's ``TokenizerAdapter`` asks for)."""

    def encode(self, text: str, **_: object) -> list[int]:
        return [CHARS.index(c) + 3 if c in CHARS else UNK for c in text]

    def decode(self, ids, **_: object) -> str:
        """The text of ``ids``; special and out-of-alphabet ids are dropped."""
        return "".join(CHARS[i - 3] for i in (int(i) for i in ids) if 3 <= i < 3 + len(CHARS))

    def bos_id(self) -> int:
        return 0  # none: Tunix's sampler prepends no BOS when this is 0

    def eos_id(self) -> int:
        return EOS

    def pad_id(self) -> int:
        return PAD

    @property
    def vocab_size(self) -> int:
        return 3 + len(CHARS)


@dataclass(frozen=True)
class Problem:
    question: str
    answer: str  # the worked answer, ending in "#### N"

    def prompt(self) -> str:
        return f"Q: {self.question}\nA: "

    def final_answer(self) -> Optional[float]:
        return extract_answer(self.answer)


def extract_answer(text: str) -> Optional[float]:
    """The number after the last ``####`` of ``text`` (commas, ``$`` and spaces ignored)."""
    if "####" not in text:
        return None
    tail = text.rsplit("####", 1)[1].strip()
    word = tail.split()[0] if tail.split() else ""
    number = "".join(c for c in word if c not in ",$")
    if "_" in number:
        return None  # Python's float() takes digit separators; Rust's f64 parse does not
    try:
        x = float(number)
    except ValueError:
        return None
    return x if math.isfinite(x) else None


def sample(rng: np.random.Generator, max_operand: int) -> Problem:
    """``a + b`` or ``a - b`` with operands in ``0..=max_operand``, answered ``a+b=c #### c``."""
    a, b = int(rng.integers(0, max_operand + 1)), int(rng.integers(0, max_operand + 1))
    op, c = ("+", a + b) if rng.random() < 0.5 else ("-", a - b)
    return Problem(f"{a}{op}{b}", f"{a}{op}{b}={c} #### {c}")


def reward(completion: str, problem: Problem, format_reward: float) -> tuple[float, bool]:
    """1 if the completion's final answer equals the problem's, plus ``format_reward`` if it
    has a parsable ``#### N``."""
    answer = extract_answer(completion)
    correct = answer is not None and answer == problem.final_answer()
    return float(correct) + (format_reward if answer is not None else 0.0), correct
