//! Builds the probe guest (guest-kernel/probe) with the machine's own assembler and linker, for
//! the tests and benchmarks that run it ([`mayfly_tests::probe::ELF`]).

use std::path::PathBuf;
use std::process::Command;

fn main() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../guest-kernel/probe");
    let source = dir.join("probe.S");
    let script = dir.join("probe.ld");
    println!("cargo:rerun-if-changed={}", source.display());
    println!("cargo:rerun-if-changed={}", script.display());
    let out =
        PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR")).join("probe.elf");
    let status = Command::new("gcc")
        .args(["-nostdlib", "-static", "-no-pie", "-Wl,--build-id=none"])
        .arg(format!("-Wl,-T,{}", script.display()))
        .arg("-o")
        .arg(&out)
        .arg(&source)
        .status()
        .expect("gcc runs (apt-get install build-essential)");
    assert!(status.success(), "building the probe guest failed");
    println!("cargo:rustc-env=MAYFLY_PROBE_ELF={}", out.display());
}
