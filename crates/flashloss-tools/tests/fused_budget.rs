//! The fused LM-head kernels' peak allocation stays within their budget at a shape
//! where the logits, N·V·4 bytes, are 100x the budget. One test in its own binary: the
//! tracking allocator counts the whole process, so nothing else may run beside it.

mod common;
use common::cpu_steps::{ce_linear, grpo_linear};
use common::*;
use flashloss::memory::{self, TrackingAllocator};
use flashloss::{CeConfig, CrossEntropy, GrpoLoss, GrpoLossConfig, LossType};
use flashloss::{FusedOptions, Mode, Plan};

#[global_allocator]
static ALLOCATOR: TrackingAllocator = TrackingAllocator;

#[test]
fn fused_kernels_stay_within_the_budget() {
    // The budget includes the GEMM library's packing reserve (which depends on the
    // machine's cores); V is chosen so that N·V·4 is 100x the budget.
    let budget = flashloss::cpu::gemm_reserve_bytes() + (2 << 20);
    let (n, h) = (2048, 8);
    let v = (100 * budget).div_ceil(4 * n);
    assert!(n * v * 4 >= 100 * budget);
    let head = Head::<f32>::random(n, h, v, false, 7);
    let x = draw(1, n, v, 8);
    let grpo = GrpoLoss::new(GrpoLossConfig {
        loss_type: LossType::Grpo,
        ..GrpoLossConfig::default()
    })
    .unwrap();
    let ce = CrossEntropy::new(CeConfig {
        label_smoothing: 0.1,
        softcap: Some(30.0),
        ..CeConfig::default()
    })
    .unwrap();
    let outputs = (n * h + v * h) * 4 + n * 64;
    let measure = |name: &str, run: &dyn Fn() -> Plan| {
        let before = memory::in_use();
        memory::reset_peak();
        let plan = run();
        let above = memory::peak() - before;
        assert!(plan.workspace_bytes + plan.gemm_reserve_bytes <= budget);
        assert!(
            above <= outputs + budget,
            "{name}: peak {above} bytes above inputs, outputs {outputs} + budget {budget}"
        );
    };
    for mode in [Mode::Auto, Mode::TwoPass, Mode::Compact] {
        let opts = FusedOptions {
            bf16_products: Default::default(),
            mode,
            budget_bytes: Some(budget),
            grad_output: 1.0,
            head_grad: Default::default(),
        };
        measure(&format!("grpo {mode:?}"), &|| {
            grpo_linear(&grpo, &x.batch(), &head.inputs(), &opts)
                .unwrap()
                .plan
        });
        measure(&format!("ce {mode:?}"), &|| {
            ce_linear(&ce, &x.data.target_ids, &head.inputs(), &opts)
                .unwrap()
                .plan
        });
    }
}
