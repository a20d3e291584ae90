//! Replays the fuzz corpus (`fuzz/corpus/<target>/`, the seeds and what `cargo fuzz`
//! kept) and every crash `cargo fuzz` found (`fuzz/regressions/<target>/`) through the
//! same bodies the fuzz targets run (`fuzz/src/bodies.rs`), so each crash stays a
//! test in `cargo test --workspace`.

#[path = "../../../fuzz/src/bodies.rs"]
#[allow(dead_code)]
mod bodies;

use std::path::Path;

fn replay(target: &str, body: fn(&[u8])) -> usize {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz");
    let mut n = 0;
    for dir in ["corpus", "regressions"] {
        let Ok(entries) = std::fs::read_dir(root.join(dir).join(target)) else {
            continue;
        };
        let mut files: Vec<_> = entries.flatten().map(|e| e.path()).collect();
        files.sort();
        for f in files.into_iter().filter(|f| f.is_file()) {
            let data = std::fs::read(&f).unwrap();
            let run = std::panic::catch_unwind(|| body(&data));
            assert!(run.is_ok(), "{} crashes {target}", f.display());
            n += 1;
        }
    }
    n
}

#[test]
fn config_overrides_corpus() {
    assert!(replay("config_overrides", bodies::config_overrides) >= 10);
}

#[test]
fn loaders_corpus() {
    assert!(replay("loaders", bodies::loaders) >= 3);
}

#[test]
fn batch_validation_corpus() {
    assert!(replay("batch_validation", bodies::batch_validation) >= 5);
}

/// The seeds are valid inputs: the loaders accept them (so the fuzzer starts from
/// inside the formats, not from their error paths).
#[test]
fn the_loader_seeds_load() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus/loaders");
    let st = std::fs::read(root.join("model.safetensors.bin")).unwrap();
    let tensors =
        candle_core::safetensors::load_buffer(&st[1..], &candle_core::Device::Cpu).unwrap();
    flashloss_train::model::Params::from_tensors(&bodies::tiny_config(), &tensors).unwrap();
    let cfg = std::fs::read(root.join("config.json.bin")).unwrap();
    let c: flashloss_train::model::Qwen2Config = serde_json::from_slice(&cfg[1..]).unwrap();
    assert_eq!(c, bodies::tiny_config());
    let tok = std::env::temp_dir().join(format!("flashloss_seed_tok_{}.json", std::process::id()));
    std::fs::write(
        &tok,
        &std::fs::read(root.join("tokenizer.json.bin")).unwrap()[1..],
    )
    .unwrap();
    let t = flashloss_train::tokenizer::Tokenizer::from_file(&tok, "<|endoftext|>").unwrap();
    assert_eq!(t.encode("1 + 2").unwrap(), [1, 3, 2]);
    std::fs::remove_file(tok).unwrap();
}
