//! The Qwen2-architecture model: every parameter trains, Hugging Face checkpoints and
//! tokenizers load, and the KV-cache path equals the full forward.

use candle_core::{DType, Device, Tensor};
use flashloss::{CeConfig, CrossEntropy};
use flashloss_candle::ops::baseline;
use flashloss_train::model::{Padded, Params, Qwen2Config, Sampling, attention_mask, generate};
use flashloss_train::tokenizer::Tokenizer;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use std::collections::HashMap;

fn tiny(tied: bool) -> Qwen2Config {
    Qwen2Config {
        vocab_size: 61,
        hidden_size: 32,
        intermediate_size: 48,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        num_key_value_heads: 2,
        max_position_embeddings: 64,
        rope_theta: 10_000.0,
        rms_norm_eps: 1e-6,
        tie_word_embeddings: tied,
    }
}

fn prompts() -> Vec<Vec<u32>> {
    vec![vec![5, 9, 3, 17], vec![40, 2], vec![7, 7, 8, 1, 30, 60]]
}

fn max_abs_diff(a: &Tensor, b: &Tensor) -> f32 {
    (a - b)
        .unwrap()
        .abs()
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap()
        .to_scalar::<f32>()
        .unwrap()
}

#[test]
fn every_parameter_receives_a_gradient() {
    for tied in [false, true] {
        let params = Params::random(&tiny(tied), 1).unwrap();
        let model = params.model(true);
        let padded = Padded::left(&prompts(), 0).unwrap();
        let hidden = padded.hidden(&model).unwrap();
        let (b, t, h) = hidden.dims3().unwrap();
        let hidden = hidden.reshape((b * t, h)).unwrap();
        let targets: Vec<i64> = (0..b * t).map(|i| (i * 7 % 61) as i64).collect();
        let ce = CrossEntropy::new(CeConfig::default()).unwrap();
        let logits = baseline::head_logits(&hidden, model.head_weight().unwrap()).unwrap();
        let grads = baseline::ce_loss(&logits, &targets, &ce)
            .unwrap()
            .backward()
            .unwrap();
        assert_eq!(params.vars.len(), tiny(tied).parameter_shapes().len());
        for (name, var) in &params.vars {
            let g = grads
                .get(var.as_tensor())
                .unwrap_or_else(|| panic!("{name}: no gradient"));
            let norm = g
                .sqr()
                .unwrap()
                .sum_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap();
            assert!(
                norm > 0.0 && norm.is_finite(),
                "{name} (tied {tied}): gradient norm² {norm}"
            );
        }
    }
}

#[test]
fn kv_cache_decoding_equals_the_full_forward() {
    let params = Params::random(&tiny(false), 2).unwrap();
    let model = params.model(false);
    let prompts = prompts();
    let tails: Vec<Vec<u32>> = vec![vec![11, 12, 13], vec![21, 22, 23], vec![31, 32, 33]];
    let prompt = Padded::left(&prompts, 0).unwrap();
    let full = prompt
        .append_right(&tails, 0, 0)
        .unwrap()
        .hidden(&model)
        .unwrap();
    // Prefill, then one token at a time through the cache.
    let mut cache = Default::default();
    let mut valid = prompt.valid.clone();
    let mask = attention_mask(&valid, 3, prompt.len).unwrap();
    let mut cached = vec![
        model
            .forward(&prompt.ids, &prompt.positions, 3, &mask, Some(&mut cache))
            .unwrap(),
    ];
    for j in 0..3 {
        let ids: Vec<u32> = tails.iter().map(|t| t[j]).collect();
        let pos: Vec<u32> = prompts.iter().map(|p| (p.len() + j) as u32).collect();
        let s = prompt.len + j;
        valid = (0..3)
            .flat_map(|b| valid[b * s..(b + 1) * s].iter().copied().chain([true]))
            .collect();
        let mask = attention_mask(&valid, 3, 1).unwrap();
        cached.push(
            model
                .forward(&ids, &pos, 3, &mask, Some(&mut cache))
                .unwrap(),
        );
    }
    let cached = Tensor::cat(&cached, 1).unwrap();
    // Left-padding rows differ (their outputs are unused); compare valid positions.
    for (b, p) in prompts.iter().enumerate() {
        let start = prompt.len - p.len();
        let len = prompt.len + 3 - start;
        let a = full.get(b).unwrap().narrow(0, start, len).unwrap();
        let c = cached.get(b).unwrap().narrow(0, start, len).unwrap();
        assert!(
            max_abs_diff(&a, &c) < 1e-4,
            "row {b}: {}",
            max_abs_diff(&a, &c)
        );
    }
    // Padding does not change a sequence's outputs: row 1 alone, unpadded.
    let alone = Padded::left(&prompts[1..2], 0)
        .unwrap()
        .append_right(&tails[1..2], 0, 0)
        .unwrap();
    let alone = alone.hidden(&model).unwrap().get(0).unwrap();
    let start = prompt.len - prompts[1].len();
    let padded_row = full
        .get(1)
        .unwrap()
        .narrow(0, start, alone.dim(0).unwrap())
        .unwrap();
    assert!(max_abs_diff(&alone, &padded_row) < 1e-4);
}

#[test]
fn sampling_is_seeded_and_greedy_at_zero_temperature() {
    let params = Params::random(&tiny(false), 3).unwrap();
    let model = params.model(false);
    let s = Sampling {
        temperature: 1.0,
        top_p: 0.9,
        max_new_tokens: 6,
    };
    let run = |seed, s: &Sampling| {
        generate(
            &model,
            &prompts(),
            1,
            0,
            s,
            &mut ChaCha8Rng::seed_from_u64(seed),
        )
        .unwrap()
    };
    assert_eq!(run(4, &s), run(4, &s));
    assert_ne!(run(4, &s), run(5, &s));
    let greedy = Sampling {
        temperature: 0.0,
        ..s.clone()
    };
    let tiny_p = Sampling { top_p: 1e-9, ..s };
    let g = run(4, &greedy);
    assert_eq!(
        g,
        run(9, &tiny_p),
        "top_p -> 0 keeps only the most likely token"
    );
    // Greedy tokens are the argmax of the full forward's last logits.
    let first: Vec<u32> = flashloss_train::model::last_logits(&model, &prompts(), 0)
        .unwrap()
        .argmax(1)
        .unwrap()
        .to_vec1()
        .unwrap();
    assert_eq!(first, g.iter().map(|c| c[0]).collect::<Vec<_>>());
}

#[test]
fn hugging_face_checkpoints_load_and_bad_ones_are_clear_errors() {
    let dir = std::env::temp_dir().join(format!("flashloss_hf_{}", std::process::id()));
    let params = Params::random(&tiny(false), 4).unwrap();
    params.save_pretrained(&dir).unwrap();
    // A config.json as Hugging Face writes it: extra keys are ignored.
    let mut json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    json["architectures"] = serde_json::json!(["Qwen2ForCausalLM"]);
    json["torch_dtype"] = serde_json::json!("bfloat16");
    std::fs::write(dir.join("config.json"), json.to_string()).unwrap();
    let loaded = Params::from_pretrained(&dir).unwrap();
    let (a, b) = (params.model(false), loaded.model(false));
    let la = flashloss_train::model::last_logits(&a, &prompts(), 0).unwrap();
    let lb = flashloss_train::model::last_logits(&b, &prompts(), 0).unwrap();
    assert_eq!(max_abs_diff(&la, &lb), 0.0);

    // bf16 weights load (converted to f32).
    let bf16: HashMap<String, Tensor> = params
        .tensors()
        .into_iter()
        .map(|(n, t)| (n, t.to_dtype(DType::BF16).unwrap()))
        .collect();
    assert!(Params::from_tensors(&tiny(false), &bf16).is_ok());

    let mut missing = params.tensors();
    missing.remove("model.layers.1.mlp.up_proj.weight");
    let e = Params::from_tensors(&tiny(false), &missing)
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("missing tensor model.layers.1.mlp.up_proj.weight"),
        "{e}"
    );
    let mut wrong = params.tensors();
    wrong.insert(
        "model.norm.weight".into(),
        Tensor::zeros(7, DType::F32, &Device::Cpu).unwrap(),
    );
    let e = Params::from_tensors(&tiny(false), &wrong)
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("model.norm.weight has shape [7]"), "{e}");
    let mut bad = tiny(false);
    bad.num_key_value_heads = 3;
    assert!(
        bad.validate()
            .unwrap_err()
            .to_string()
            .contains("num_key_value_heads")
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_tokenizer_json_loads_through_the_tokenizers_crate() {
    let path = std::env::temp_dir().join(format!("flashloss_tok_{}.json", std::process::id()));
    let json = serde_json::json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [{"id": 0, "content": "<|endoftext|>", "single_word": false, "lstrip": false,
                          "rstrip": false, "normalized": false, "special": true}],
        "normalizer": null,
        "pre_tokenizer": {"type": "Whitespace"},
        "post_processor": null,
        "decoder": null,
        "model": {"type": "WordLevel", "vocab": {"<|endoftext|>": 0, "what": 1, "is": 2, "3": 3,
                  "+": 4, "4": 5, "?": 6, "[UNK]": 7}, "unk_token": "[UNK]"}
    });
    std::fs::write(&path, json.to_string()).unwrap();
    let tok = Tokenizer::from_file(&path, "<|endoftext|>").unwrap();
    assert_eq!(
        tok.encode("what is 3 + 4 ?").unwrap(),
        vec![1, 2, 3, 4, 5, 6]
    );
    assert_eq!(tok.eos(), 0);
    assert_eq!(tok.vocab_size(), 8);
    assert!(tok.decode(&[1, 2, 0]).unwrap().starts_with("what is"));
    let e = Tokenizer::from_file(&path, "</s>")
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("</s>"), "{e}");
    std::fs::remove_file(&path).unwrap();

    let chars = Tokenizer::Chars;
    let ids = chars.encode("Q: 3+4=?\nA: 7 #### 7").unwrap();
    assert_eq!(chars.decode(&ids).unwrap(), "Q: 3+4=?\nA: 7 #### 7");
}
