//! The GSM8K-format math task: problems (`question`, `answer` ending in `#### N`) from
//! GSM8K JSON lines or from a generator of easy arithmetic, the prompt format, and the
//! reward (exact numeric match of the final answer plus a small format reward).

use candle_core::Result;
use rand::Rng;
use serde::{Deserialize, Serialize};
use std::path::Path;

/// One problem.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Problem {
    /// The question text.
    pub question: String,
    /// The worked answer, ending in `#### N`.
    pub answer: String,
}

impl Problem {
    /// The number after the answer's last `####`.
    pub fn final_answer(&self) -> Option<f64> {
        extract_answer(&self.answer)
    }

    /// The prompt the model completes.
    pub fn prompt(&self) -> String {
        format!("Q: {}\nA: ", self.question)
    }
}

/// The number after the last `####` of `text` (commas, `$` and spaces ignored).
pub fn extract_answer(text: &str) -> Option<f64> {
    let (_, tail) = text.rsplit_once("####")?;
    let number: String = tail
        .trim()
        .chars()
        .take_while(|c| !c.is_whitespace())
        .filter(|&c| c != ',' && c != '$')
        .collect();
    number.parse::<f64>().ok().filter(|x| x.is_finite())
}

/// Reads GSM8K JSON lines (`{"question": ..., "answer": "... #### N"}`); a line that
/// does not parse, or whose answer has no final number, is an error naming the line.
pub fn load_gsm8k(path: &Path) -> Result<Vec<Problem>> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| candle_core::Error::msg(format!("{}: {e}", path.display())))?;
    let mut problems = Vec::new();
    for (i, line) in text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
    {
        let p: Problem = serde_json::from_str(line)
            .map_err(|e| candle_core::Error::msg(format!("{}:{}: {e}", path.display(), i + 1)))?;
        if p.final_answer().is_none() {
            candle_core::bail!(
                "{}:{}: answer has no `#### N` final number",
                path.display(),
                i + 1
            )
        }
        problems.push(p);
    }
    if problems.is_empty() {
        candle_core::bail!("{}: no problems", path.display())
    }
    Ok(problems)
}

/// A generator of GSM8K-style arithmetic: `a + b` or `a - b` with operands in
/// `0..=max_operand`, answered as `a+b=c #### c`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Arithmetic {
    /// Largest operand.
    pub max_operand: u32,
}

impl Default for Arithmetic {
    fn default() -> Self {
        Arithmetic { max_operand: 9 }
    }
}

impl Arithmetic {
    /// One problem drawn from `rng`.
    pub fn sample(&self, rng: &mut impl Rng) -> Problem {
        let a = rng.random_range(0..=self.max_operand) as i64;
        let b = rng.random_range(0..=self.max_operand) as i64;
        let (op, c) = if rng.random_bool(0.5) {
            ('+', a + b)
        } else {
            ('-', a - b)
        };
        Problem {
            question: format!("{a}{op}{b}"),
            answer: format!("{a}{op}{b}={c} #### {c}"),
        }
    }
}

/// The reward of a completion: 1 if its final answer equals the problem's, plus
/// `format_reward` if it has a parsable `#### N`.
pub fn reward(completion: &str, problem: &Problem, format_reward: f64) -> (f64, bool) {
    let answer = extract_answer(completion);
    let correct = answer.is_some() && answer == problem.final_answer();
    let format = if answer.is_some() { format_reward } else { 0.0 };
    (correct as u8 as f64 + format, correct)
}
