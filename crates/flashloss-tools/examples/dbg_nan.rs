use flashloss_tools::gradcheck::GradcheckConfig;
use flashloss_tools::inputs::GrpoInputs;
fn main() {
    let ov: Vec<String> = std::env::args().skip(1).collect();
    let cfg: GradcheckConfig = flashloss_tools::config_file::load(
        std::path::Path::new("configs/gradcheck/default.yaml"),
        &ov,
    )
    .unwrap();
    let x = GrpoInputs::random(&cfg.input_spec(), cfg.seed);
    let layout = flashloss::LogitsLayout::contiguous(cfg.batch, cfg.seq_len, cfg.vocab);
    let t = flashloss::Temperature::new(cfg.loss.temperature).unwrap();
    let st = flashloss::cpu::selective_log_softmax(&x.logits, &layout, &x.data.target_ids, None, t)
        .unwrap();
    for i in 0..3 {
        println!(
            "row {i}: {:?} old {:?} mask {}",
            st[i],
            x.data.old_logp.as_ref().map(|o| o[i]),
            x.data.mask[i]
        );
    }
    let row = &x.logits[0..cfg.vocab];
    let mx = row.iter().cloned().fold(f32::MIN, f32::max);
    let loss = flashloss::GrpoLoss::new(cfg.loss.clone()).unwrap();
    let batch = x.batch();
    let logp: Vec<f32> = st.iter().map(|s| s.logp).collect();
    let ent: Vec<f32> = st.iter().map(|s| s.entropy).collect();
    let out = flashloss::policy::policy_stage(
        &loss,
        &batch,
        flashloss::policy::Normalizers::local(&batch),
        &logp,
        &ent,
    );
    println!(
        "loss {} row_loss0 {:?} dlogp0 {} kl0 {}",
        out.loss,
        out.token_loss.first(),
        out.dlogp[0],
        out.kl[0]
    );
    println!("max {mx} target z {}", row[x.data.target_ids[0] as usize]);
}
#[allow(dead_code)]
fn unused() {}
