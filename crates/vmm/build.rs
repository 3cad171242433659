//! Builds the default guest (kernel and initramfs) into the `mayfly` binary when the project's
//! scripts have built them: `guest-kernel/build.sh` and `rootfs/build.sh` keep the current
//! ones behind `<cache>/kernel/microvm.current` and `<cache>/rootfs/guest.current`.

use std::env;
use std::fmt::Write as _;
use std::path::PathBuf;

fn main() {
    let cache = env::var_os("MAYFLY_CACHE")
        .map(PathBuf::from)
        .or_else(|| env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/mayfly")));
    println!("cargo:rerun-if-env-changed=MAYFLY_CACHE");
    println!("cargo:rerun-if-env-changed=HOME");

    let mut out = String::new();
    for (name, konst, relative) in [
        ("kernel", "DEFAULT_KERNEL", "kernel/microvm.current/vmlinux"),
        (
            "initramfs",
            "DEFAULT_INITRAMFS",
            "rootfs/guest.current/initramfs.cpio",
        ),
    ] {
        let link = cache.as_ref().map(|c| c.join(relative));
        // Watch the link's directory too: relinking to an older build must still rebuild.
        if let Some(link) = &link {
            println!("cargo:rerun-if-changed={}", link.display());
            if let Some(dir) = link.parent().and_then(|p| p.parent()) {
                println!("cargo:rerun-if-changed={}", dir.display());
            }
        }
        match link.and_then(|l| l.canonicalize().ok()) {
            Some(path) => {
                let _ = writeln!(
                    out,
                    "/// The default guest {name}, built in.\npub const {konst}: Option<&[u8]> = Some(include_bytes!({:?}));",
                    path.display().to_string()
                );
                let _ = writeln!(
                    out,
                    "pub const {konst}_SOURCE: &str = {:?};",
                    path.display().to_string()
                );
            }
            None => {
                println!(
                    "cargo:warning=no default guest {name} at <cache>/{relative}: run guest-kernel/build.sh and rootfs/build.sh, then rebuild, to build one into mayfly"
                );
                let _ = writeln!(out, "pub const {konst}: Option<&[u8]> = None;");
                let _ = writeln!(out, "pub const {konst}_SOURCE: &str = \"\";");
            }
        }
    }
    let dest =
        PathBuf::from(env::var_os("OUT_DIR").expect("cargo sets OUT_DIR")).join("default_guest.rs");
    std::fs::write(dest, out).expect("OUT_DIR is writable");
}
