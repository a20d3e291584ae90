#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| flashloss_fuzz::config_overrides(data));
