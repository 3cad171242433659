#!/usr/bin/env bash
# Gets a fresh Debian 12 machine (as root) ready to build, run and test mayfly:
#   1. Debian packages: kernel source and build tools, busybox, QEMU and its firmware from
#      bookworm-backports (for the test rig), clang headers for the userfaultfd bindings;
#   2. the guest kernel, initramfs and Debian disk image, and the test rig's L1 kernel, initramfs and patched QEMU,
#      each built once and cached by a hash of its inputs under $MAYFLY_CACHE (default
#      ~/.cache/mayfly);
#   3. mayfly itself (release build, with the default guest built in).
# Every step is skipped when already done, so running it again takes seconds.
set -euo pipefail
cd "$(dirname "$0")/.."

say() { echo "setup: $*" >&2; }

# The test rig runs QEMU from bookworm-backports: its firmware packages, and the source package
# tests/rig/qemu/build.sh patches and builds. Add the suite (binaries and sources) if apt lacks it.
suites=$(apt-get indextargets --no-release-info --format '$(RELEASE) $(TARGET_OF)' 2>/dev/null || true)
for type in deb deb-src; do
    grep -qxF "bookworm-backports $type" <<< "$suites" && continue
    file=/etc/apt/sources.list.d/bookworm-backports.sources
    [ "$type" = deb ] || file=/etc/apt/sources.list.d/bookworm-backports-src.sources
    [ ! -e "$file" ] || { say "$file exists but apt has no bookworm-backports $type entry: fix it"; exit 1; }
    [ "$(id -u)" -eq 0 ] || { say "adding $file needs root"; exit 1; }
    say "adding $file"
    cat > "$file" <<EOF
Types: $type
URIs: http://deb.debian.org/debian
Suites: bookworm-backports
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
done

packages=(
    linux-source-6.1 build-essential flex bison bc libelf-dev libssl-dev cpio xz-utils
    busybox-static libclang-dev util-linux python3 mmdebstrap e2fsprogs
    iproute2 nftables curl
    python3-pytest python3-venv
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
# QEMU 10 and the firmware it loads (BIOS, option ROMs), from bookworm-backports (Debian 12's own
# QEMU is 7.2).
qemu_packages=(qemu-system-x86 qemu-system-data seabios ipxe-qemu)
missing=()
for p in "${qemu_packages[@]}"; do
    version=$(dpkg-query -W -f='${Status} ${Version}' "$p" 2>/dev/null | sed -n 's/^install ok installed //p' || true)
    case "$p" in
        qemu-*) [ -n "$version" ] && dpkg --compare-versions "$version" ge 1:10 ;;
        *) [ -n "$version" ] ;;
    esac || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
    [ "$(id -u)" -eq 0 ] || { say "installing ${missing[*]} from bookworm-backports needs root"; exit 1; }
    say "installing ${missing[*]} from bookworm-backports"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends -t bookworm-backports "${missing[@]}" >/dev/null
fi
command -v cargo >/dev/null || { say "cargo is missing: install Rust (https://rustup.rs), then run this again"; exit 1; }

# cargo-fuzz (libFuzzer), for the fuzz targets' short runs in tests/run (fuzz/run).
command -v cargo-fuzz >/dev/null || {
    say "installing cargo-fuzz (crates.io)"
    cargo install --quiet --locked cargo-fuzz@0.13.2
}

guest-kernel/build.sh microvm >/dev/null
rootfs/build.sh guest >/dev/null
# The Debian root file system image (`mayfly run --rootfs debian`; the disk tests boot it).
rootfs/build.sh debian >/dev/null

say "building mayfly (release)"
cargo build --release --workspace --bins --quiet

# The test rig's machine, needed where the host's KVM cannot run a Linux guest.
if [ "$(target/x86_64-unknown-linux-gnu/release/mayfly-rig where)" = rig ]; then
    guest-kernel/build.sh rig-l1 >/dev/null
    rootfs/build.sh rig-l1 >/dev/null
    tests/rig/qemu/build.sh >/dev/null
    say "ready: target/x86_64-unknown-linux-gnu/release/mayfly (this host's KVM cannot run Linux: guests run in the test rig)"
else
    say "ready: target/x86_64-unknown-linux-gnu/release/mayfly"
fi
