//! `flashloss plan`: the plan a call without a budget would take on a GPU, asked without
//! one (`flashloss::gpu_plan::query`), printed as JSON.

use flashloss::gpu_plan::query::{QueryArgs, answer};
use std::process::ExitCode;

/// Runs the command.
pub fn run(args: QueryArgs) -> ExitCode {
    match args.query().and_then(|q| answer(&q)) {
        Ok(report) => match serde_json::to_string_pretty(&report) {
            Ok(text) => {
                println!("{text}");
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("error: {e}");
                ExitCode::FAILURE
            }
        },
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(2)
        }
    }
}
