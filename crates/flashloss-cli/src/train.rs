//! `flashloss train` (GRPO training on candle, with a progress bar) and `flashloss
//! report` (charts and a summary of training runs).

use flashloss_tools::config_file;
use indicatif::{ProgressBar, ProgressStyle};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

/// Runs `flashloss train`, with a progress bar showing the last step's metrics.
pub fn train(config: &Path, overrides: &[String]) -> ExitCode {
    use flashloss_train::train::{TrainConfig, Trainer};
    let trainer = config_file::load::<TrainConfig>(config, overrides)
        .map_err(|e| e.to_string())
        .and_then(|cfg| Trainer::new(cfg).map_err(|e| e.to_string()));
    let mut trainer = match trainer {
        Ok(t) => t,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    let bar = ProgressBar::new(trainer.total_steps() as u64).with_style(
        ProgressStyle::with_template("[{bar:30}] {pos}/{len} {msg}").expect("template"),
    );
    bar.set_position(trainer.done as u64);
    let result = trainer.run(|m| {
        bar.set_position(m.step as u64 + 1);
        let reward = m
            .reward_mean
            .map_or(String::new(), |r| format!(" reward {r:.3}"));
        bar.set_message(format!(
            "{} loss {:.4}{reward} {:.2}s",
            m.phase, m.loss, m.step_time_s
        ));
    });
    bar.finish();
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(2)
        }
    }
}

/// Runs `flashloss report`: charts and the markdown summary, which it prints.
pub fn report(runs: &[PathBuf], out: &Path) -> ExitCode {
    match flashloss_train::report::report(runs, out) {
        Ok(md) => {
            println!("{md}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(2)
        }
    }
}
