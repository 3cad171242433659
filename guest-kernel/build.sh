#!/usr/bin/env bash
# Builds a Linux 6.1 kernel from Debian's linux-source-6.1 with one of the config fragments
# beside this script, and caches it by a hash of its inputs.
#
#   guest-kernel/build.sh [microvm|rig-l1]
#
#   microvm (default)  the guest mayfly boots: vmlinux (ELF with a PVH entry) and bzImage
#   rig-l1             the test rig's L1 machine, which gives the tests a real /dev/kvm
#
# Inputs hashed: the linux-source-6.1 package version, the fragment's options, the flavour's
# patches (patches/<flavour>/*.patch) and RECIPE below. Output: $MAYFLY_CACHE/kernel/<flavour>-<hash>/ (default cache
# ~/.cache/mayfly), and the link $MAYFLY_CACHE/kernel/<flavour>.current to it. A second run with
# the same inputs returns at once. The last line printed is the output directory.
set -euo pipefail

# Bump when the way the kernel is built changes (not the options: those are hashed).
RECIPE=1

flavour=${1:-microvm}
here=$(cd "$(dirname "$0")" && pwd)
cache=${MAYFLY_CACHE:-$HOME/.cache/mayfly}
fragment=$here/$flavour.config
tarball=/usr/src/linux-source-6.1.tar.xz

die() { echo "guest-kernel: $*" >&2; exit 1; }
say() { echo "guest-kernel: $*" >&2; }

[ -f "$fragment" ] || die "no config fragment $fragment (flavours: $(cd "$here" && ls ./*.config | sed 's|./||; s|.config||' | tr '\n' ' '))"
[ -f "$tarball" ] || die "$tarball is missing: apt-get install linux-source-6.1 flex bison bc libelf-dev libssl-dev"
for tool in make gcc flex bison bc; do
    command -v "$tool" >/dev/null || die "'$tool' is missing: apt-get install build-essential flex bison bc libelf-dev libssl-dev"
done

srcver=$(dpkg-query -W -f='${Version}' linux-source-6.1)
options=$(grep -E '^CONFIG_' "$fragment" | sort)
patches=$(find "$here/patches/$flavour" -name '*.patch' 2>/dev/null | sort || true)
hash=$( {
    echo "recipe $RECIPE source $srcver"
    echo "$options"
    for p in $patches; do sha256sum < "$p"; done
} | sha256sum | cut -c1-16)

out=$cache/kernel/$flavour-$hash
if [ -f "$out/vmlinux" ] && [ -f "$out/bzImage" ]; then
    ln -sfn "$flavour-$hash" "$cache/kernel/$flavour.current"
    say "$flavour kernel is cached"
    echo "$out"
    exit 0
fi

# One extracted source tree per set of patches serves every flavour; builds go out of tree.
patch_hash=$(for p in $patches; do sha256sum < "$p"; done | sha256sum | cut -c1-8)
src=$cache/src/linux-$srcver-$patch_hash
if [ ! -f "$src/.mayfly-ready" ]; then
    say "extracting $tarball (about 10 s)"
    rm -rf "$src" "$src.tmp"
    mkdir -p "$src.tmp"
    tar -xf "$tarball" -C "$src.tmp" --strip-components=1
    for p in $patches; do
        say "applying $(basename "$p")"
        patch -d "$src.tmp" -p1 --quiet < "$p"
    done
    touch "$src.tmp/.mayfly-ready"
    mv "$src.tmp" "$src"
fi

build=$cache/build/$flavour-$hash
mkdir -p "$build"
log=$build/build.log
say "configuring $flavour (allnoconfig + $(echo "$options" | wc -l) options)"
KCONFIG_ALLCONFIG=$fragment make -C "$src" O="$build" allnoconfig >"$log" 2>&1 || { tail -20 "$log" >&2; die "allnoconfig failed, log: $log"; }
make -C "$src" O="$build" olddefconfig >>"$log" 2>&1 || { tail -20 "$log" >&2; die "olddefconfig failed, log: $log"; }

# Every option the fragment asks for must have survived dependency resolution.
missing=()
while IFS= read -r line; do
    grep -qxF "$line" "$build/.config" || missing+=("$line")
done <<< "$options"
if [ ${#missing[@]} -gt 0 ]; then
    die "these options did not survive olddefconfig (missing dependencies?): ${missing[*]}"
fi

jobs=$(nproc)
say "building $flavour with $jobs jobs (about 5 min on 2 cores); log: $log"
start=$(date +%s)
set +e
make -C "$src" O="$build" -j"$jobs" vmlinux bzImage 2>&1 | tee -a "$log" | awk '
    /^  (CC|AS|LD|AR)/ { n++; if (n % 250 == 0) { printf "guest-kernel:   %d objects...\n", n > "/dev/stderr" } }'
status=${PIPESTATUS[0]}
set -e
[ "$status" -eq 0 ] || { tail -30 "$log" >&2; die "kernel build failed, log: $log"; }

rm -rf "$out.tmp"
mkdir -p "$out.tmp"
cp "$build/vmlinux" "$out.tmp/vmlinux"
cp "$build/arch/x86/boot/bzImage" "$out.tmp/bzImage"
cp "$build/.config" "$out.tmp/config"
rm -rf "$out"
mv "$out.tmp" "$out"
ln -sfn "$flavour-$hash" "$cache/kernel/$flavour.current"
# Build trees are large; keep only this one per flavour (outputs stay in kernel/).
find "$cache/build" -maxdepth 1 -name "$flavour-*" ! -name "$flavour-$hash" -exec rm -rf {} +
say "built $flavour in $(( $(date +%s) - start )) s: $out/{vmlinux,bzImage}"
echo "$out"
