#!/usr/bin/env bash
# Gets a fresh Debian 12 machine (as root) ready to build, run and test mayfly:
#   1. Debian packages: kernel source and build tools, busybox, QEMU (for the test rig), clang
#      headers for the userfaultfd bindings;
#   2. the guest kernel and initramfs, and the test rig's L1 kernel and initramfs, each built
#      once and cached by a hash of its inputs under $MAYFLY_CACHE (default ~/.cache/mayfly);
#   3. mayfly itself (release build, with the default guest built in).
# Every step is skipped when already done, so running it again takes seconds.
set -euo pipefail
cd "$(dirname "$0")/.."

say() { echo "setup: $*" >&2; }

packages=(
    linux-source-6.1 build-essential flex bison bc libelf-dev libssl-dev cpio xz-utils
    busybox-static qemu-system-x86 libclang-dev util-linux python3
)
missing=()
for p in "${packages[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
    [ "$(id -u)" -eq 0 ] || { say "installing ${missing[*]} needs root"; exit 1; }
    say "installing ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
command -v cargo >/dev/null || { say "cargo is missing: install Rust (https://rustup.rs), then run this again"; exit 1; }

guest-kernel/build.sh microvm >/dev/null
rootfs/build.sh guest >/dev/null

say "building mayfly (release)"
cargo build --release --workspace --bins --quiet

# The test rig's machine, needed where the host's KVM cannot run a Linux guest.
if [ "$(target/release/mayfly-rig where)" = rig ]; then
    guest-kernel/build.sh rig-l1 >/dev/null
    rootfs/build.sh rig-l1 >/dev/null
    say "ready: target/release/mayfly (this host's KVM cannot run Linux: guests run in the test rig)"
else
    say "ready: target/release/mayfly"
fi
