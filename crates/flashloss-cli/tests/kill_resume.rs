//! `kill -9` at random moments of training (during steps, metric writes and checkpoint
//! writes, with a checkpoint after every step) and resuming each time: the run ends with
//! exactly the metrics of an uninterrupted run, step for step (no step lost, doubled or
//! changed). `FLASHLOSS_KILL_SEED` and `FLASHLOSS_KILLS` vary the kill moments and
//! how many kills are tried (default 40).

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn train(out_dir: &Path) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_flashloss"));
    c.current_dir(root())
        .args(["train", "--config", "configs/train/arith_tiny_fused.yaml"])
        .args(["--set", "steps=8", "--set", "sft.steps=8"])
        .args([
            "--set",
            "sft.batch_size=8",
            "--set",
            "grpo.prompts_per_step=3",
        ])
        .args(["--set", "grpo.group_size=3", "--set", "checkpoint_every=1"])
        .arg("--set")
        .arg(format!("out_dir={}", out_dir.display()))
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    c
}

/// Each line of metrics.jsonl without its times and memory (what must repeat exactly).
fn metrics(dir: &Path) -> Vec<String> {
    let text = std::fs::read_to_string(dir.join("metrics.jsonl")).unwrap();
    text.lines()
        .map(|l| {
            let mut v: serde_json::Value = serde_json::from_str(l).unwrap();
            let m = v.as_object_mut().unwrap();
            for k in [
                "step_time_s",
                "generate_time_s",
                "update_time_s",
                "peak_bytes",
            ] {
                m.remove(k);
            }
            v.to_string()
        })
        .collect()
}

#[test]
fn kill_9_at_random_moments_loses_no_step() {
    let base = std::env::temp_dir().join(format!("flashloss_kill_{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&base);
    let (whole, killed) = (base.join("whole"), base.join("killed"));

    let start = Instant::now();
    assert!(train(&whole).status().unwrap().success());
    let run_time = start.elapsed();
    let reference = metrics(&whole);
    assert_eq!(reference.len(), 16);

    let mut seed: u64 = std::env::var("FLASHLOSS_KILL_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(17);
    let kills: usize = std::env::var("FLASHLOSS_KILLS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(40);
    let mut landed = 0;
    let mut finished = false;
    for _ in 0..kills {
        seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        // A moment in the first 30% of a whole run's time (process start, restore,
        // steps, metric and checkpoint writes): each attempt gets at most that far.
        let frac = (seed >> 11) as f64 / (1u64 << 53) as f64;
        let delay = run_time.mul_f64(frac * 0.3);
        let mut child = train(&killed).spawn().unwrap();
        std::thread::sleep(delay);
        match child.try_wait().unwrap() {
            Some(status) => {
                assert!(status.success(), "a resumed run failed: {status}");
                finished = true;
                break;
            }
            None => {
                child.kill().unwrap(); // SIGKILL
                child.wait().unwrap();
                landed += 1;
            }
        }
    }
    if !finished {
        let status = train(&killed).status().unwrap();
        assert!(status.success(), "the final resume failed: {status}");
    }
    eprintln!("{landed} kills landed (run time {run_time:?})");
    assert!(landed >= 1, "no kill landed before the run finished");
    let after = metrics(&killed);
    assert_eq!(after.len(), reference.len(), "lost or doubled steps");
    for (i, (a, b)) in reference.iter().zip(&after).enumerate() {
        assert_eq!(a, b, "step {i} differs after the kills");
    }
    // No stray temporary or unreferenced tensor files are left.
    let names: Vec<String> = std::fs::read_dir(&killed)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().to_string())
        .collect();
    let tensors = names.iter().filter(|n| n.ends_with(".safetensors")).count();
    assert!(tensors <= 2, "{names:?}");
    assert!(!names.iter().any(|n| n.ends_with(".tmp")), "{names:?}");
    std::fs::remove_dir_all(&base).unwrap();
}
