//! `flashloss plan` runs without a device: at N = 8192, H = 4096, V = 151936 on an 80 GB
//! H100 and a 141 GB H200, a bf16 head takes the bf16 chunk (4096 rows) within 0.5x the
//! unfused path's peak; an f32 head keeps the 160 MiB two-pass plan (its arguments and
//! outputs alone are above 0.5x).

use std::process::Command;

fn plan(args: &[&str]) -> serde_json::Value {
    let out = Command::new(env!("CARGO_BIN_EXE_flashloss"))
        .arg("plan")
        .args(["--n", "8192", "--h", "4096", "--v", "151936"])
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn the_plan_query_takes_the_chunk_within_half_the_unfused_peak() {
    for device in ["h100-80gb", "h200"] {
        let bf16 = plan(&["--device", device, "--dtype", "bf16", "--loss", "grpo"]);
        assert_eq!(bf16["mode"], "compact", "{bf16}");
        assert_eq!(bf16["block_rows"], 4096);
        assert!(bf16["peak_ratio"].as_f64().unwrap() <= 0.5, "{bf16}");
        assert!(bf16["predicted_ms"].as_f64().unwrap() > 0.0);
        let f32_head = plan(&["--device", device, "--dtype", "f32", "--loss", "ce"]);
        assert_eq!(f32_head["mode"], "two_pass", "{f32_head}");
        assert_eq!(f32_head["budget_mib"], 160.0);
    }
    let out = Command::new(env!("CARGO_BIN_EXE_flashloss"))
        .args([
            "plan", "--device", "tpu", "--n", "1", "--h", "1", "--v", "1",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
}
