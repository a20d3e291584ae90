//! `FLASHLOSS_BF16_PRODUCTS` against the `bf16_products` option, in a process of its own
//! (the variable is process-wide; this is the binary's only test): it decides `auto`
//! (`auto` in it measures), an explicit option wins over it, and a bad value is an error
//! naming it, as is `avx512bf16` on a CPU without AVX512-BF16.

use flashloss::Bf16Products;
use flashloss::cpu::{Avx512Bf16, BF16_PRODUCTS_ENV, Bf16Reason, bf16_products_choice};

fn with_env(value: &str) {
    // SAFETY: the binary's only test, so no other thread reads the environment.
    unsafe { std::env::set_var(BF16_PRODUCTS_ENV, value) };
}

#[test]
fn the_environment_decides_auto_and_options_win() {
    let has = Avx512Bf16::detect().is_some();
    with_env("widened");
    let c = bf16_products_choice(Bf16Products::Auto).unwrap();
    assert_eq!(
        (c.runs, c.by, c.rates),
        (Bf16Products::Widened, Bf16Reason::Environment, None)
    );
    let c = bf16_products_choice(Bf16Products::Avx512Bf16);
    match has {
        true => assert_eq!(c.unwrap().runs, Bf16Products::Avx512Bf16),
        false => assert!(c.unwrap_err().to_string().contains("bf16_products")),
    }
    with_env("avx512bf16");
    let c = bf16_products_choice(Bf16Products::Auto);
    match has {
        true => assert_eq!(c.unwrap().runs, Bf16Products::Avx512Bf16),
        false => assert!(c.is_err()),
    }
    let c = bf16_products_choice(Bf16Products::Widened).unwrap();
    assert_eq!((c.runs, c.by), (Bf16Products::Widened, Bf16Reason::Option));
    with_env("auto");
    let c = bf16_products_choice(Bf16Products::Auto).unwrap();
    let by = if has {
        Bf16Reason::Measured
    } else {
        Bf16Reason::NoAvx512Bf16
    };
    assert_eq!((c.by, c.rates.is_some()), (by, has));
    with_env("amx");
    let e = bf16_products_choice(Bf16Products::Auto)
        .unwrap_err()
        .to_string();
    assert!(e.contains(BF16_PRODUCTS_ENV) && e.contains("amx"), "{e}");
    assert!(
        bf16_products_choice(Bf16Products::Widened).is_ok(),
        "an option wins"
    );
}
