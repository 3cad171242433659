#!/usr/bin/env bash
# Builds an initramfs (uncompressed newc cpio) from Debian's busybox-static plus the overlay
# directory beside this script, and caches it by a hash of its inputs.
#
#   rootfs/build.sh [guest|rig-l1]
#
#   guest (default)  the microVM's root: busybox init, mounts proc/sys/dev, prints the readiness
#                    line "mayfly-guest: ready", keeps a shell on the serial console and runs
#                    the guest agent (/usr/bin/mayfly-agent, built here, statically linked)
#   rig-l1           the test rig's L1 machine: mounts the host's root over 9p and runs a command
#   debian           a Debian 12 root filesystem image (ext4) for `mayfly run --rootfs debian`:
#                    minbase plus DEBIAN_PACKAGES, the guest's init and agent; see build_debian
#
# Inputs hashed: the busybox-static package version, every file of the overlay, RECIPE below
# and, for guest, the agent binary's sha256 (cargo rebuilds it only when its sources change).
# Output: $MAYFLY_CACHE/rootfs/<flavour>-<hash>/initramfs.cpio (default cache ~/.cache/mayfly) and
# the link $MAYFLY_CACHE/rootfs/<flavour>.current to it. The last line printed is the directory.
set -euo pipefail

RECIPE=3

flavour=${1:-guest}
here=$(cd "$(dirname "$0")" && pwd)
cache=${MAYFLY_CACHE:-$HOME/.cache/mayfly}
overlay=$here/$flavour
busybox=/bin/busybox

die() { echo "rootfs: $*" >&2; exit 1; }
say() { echo "rootfs: $*" >&2; }

[ "$flavour" = debian ] && overlay=$here/guest
[ -d "$overlay" ] || die "no overlay directory $overlay (flavours: guest, rig-l1, debian)"
dpkg-query -W -f='${Status}' busybox-static 2>/dev/null | grep -q "install ok installed" \
    || die "busybox-static is not installed: apt-get install busybox-static cpio"
command -v cpio >/dev/null || die "cpio is missing: apt-get install cpio"

# The guest agent: a static binary, so it runs on busybox (no shared glibc in the image).
# Built from the repository root into its own target dir (its own profile: size-optimised,
# stripped, LTO) so the workspace's cache is untouched; --target keeps the static flag away
# from build scripts.
agent=
agent_sum=none
if [ "$flavour" = guest ] || [ "$flavour" = debian ]; then
    command -v cargo >/dev/null \
        || die "cargo is missing, and the guest image needs mayfly-agent built from source: install Rust (https://rustup.rs) and rerun"
    repo=$(cd "$here/.." && pwd)
    say "building mayfly-agent (static, release)"
    (cd "$repo" && RUSTFLAGS='-C target-feature=+crt-static' \
        CARGO_PROFILE_RELEASE_OPT_LEVEL=s CARGO_PROFILE_RELEASE_DEBUG=false \
        CARGO_PROFILE_RELEASE_STRIP=symbols CARGO_PROFILE_RELEASE_LTO=true \
        CARGO_PROFILE_RELEASE_CODEGEN_UNITS=1 \
        cargo build --release -p mayfly-agent --target x86_64-unknown-linux-gnu \
        --target-dir target/agent) >&2 \
        || die "building mayfly-agent failed (see cargo's output above)"
    agent=$repo/target/agent/x86_64-unknown-linux-gnu/release/mayfly-agent
    [ -x "$agent" ] || die "cargo succeeded but $agent is missing"
    # A dynamic binary lists its libraries as "name => path"; a static one has none.
    if ldd "$agent" 2>&1 | grep -q '=>'; then
        die "$agent is dynamically linked; it must be static to run in the busybox guest"
    fi
    agent_sum=$(sha256sum "$agent" | cut -d' ' -f1)
fi

# The Debian image: Debian's own userland (bash, python3, coreutils...) with the same init as
# the initramfs guest (busybox init running the guest overlay's inittab and rcS, so the
# readiness line, the console shell and the agent behave the same), as a read-only template:
# the VMM never writes it; each VM writes its own copy-on-write layer (see devices/src/disk).
#
# Cached by a hash of: RECIPE, the package list, the exact versions apt resolves for them on
# this machine's sources (from an empty system, so the whole closure counts), the agent and
# the overlay files used. An unchanged template is reused at once; a new package version, a
# changed overlay file or a new agent builds a new one.
# Bumped when the way the image is made changes (mmdebstrap or mke2fs options, files added).
DEBIAN_RECIPE=2
DEBIAN_PACKAGES=(busybox-static bash coreutils procps iproute2 e2fsprogs python3-minimal python3 python3-pip ca-certificates)
DEBIAN_OVERLAY=(etc/inittab etc/init.d/rcS etc/profile usr/bin/mayfly-identity)
build_debian() {
    command -v mmdebstrap >/dev/null || die "mmdebstrap is missing: apt-get install mmdebstrap e2fsprogs (scripts/setup.sh does)"
    command -v mke2fs >/dev/null || die "mke2fs is missing: apt-get install e2fsprogs"
    say "resolving the Debian package versions"
    local required resolved
    resolve() {
        required=$(apt-cache dumpavail | awk '/^Package:/{p=$2} /^Priority: required/{print p}' | sort -u)
        # shellcheck disable=SC2086
        resolved=$(apt-get -s -q -o Dir::State::status=/dev/null -o APT::Install-Recommends=false \
            install $required apt "${DEBIAN_PACKAGES[@]}" 2>/dev/null \
            | sed -n 's/^Inst \([^ ]*\) (\([^ ]*\) .*/\1 \2/p' | LC_ALL=C sort) || true
    }
    resolve
    # No package lists (a machine whose lists were cleaned): fetch them once, as root.
    if [ -z "$resolved" ] && [ "$(id -u)" -eq 0 ]; then
        say "apt has no package lists: running apt-get update"
        apt-get update -qq || die "apt-get update failed: check the machine's apt sources"
        resolve
    fi
    [ -n "$resolved" ] || die "apt cannot resolve ${DEBIAN_PACKAGES[*]}: run apt-get update (as root), then this again"
    local hash out
    hash=$( {
        echo "recipe $RECIPE debian $DEBIAN_RECIPE agent $agent_sum"
        echo "packages ${DEBIAN_PACKAGES[*]}"
        echo "$resolved"
        for f in "${DEBIAN_OVERLAY[@]}"; do sha256sum "$overlay/$f" | sed "s|$overlay/||"; done
    } | sha256sum | cut -c1-16)
    out=$cache/rootfs/debian-$hash
    if [ -f "$out/root.ext4" ]; then
        ln -sfn "debian-$hash" "$cache/rootfs/debian.current"
        say "debian image is cached: $out/root.ext4"
        echo "$out"
        exit 0
    fi
    say "building the Debian image ($(wc -l <<< "$resolved") packages; a few minutes the first time)"
    local staging
    staging=$(mktemp -d)
    trap 'rm -rf "$staging"' EXIT
    # minbase: Priority required plus apt; the host's apt sources (no mirror given).
    mmdebstrap --variant=minbase --include="$(IFS=,; echo "${DEBIAN_PACKAGES[*]}")" \
        --aptopt='Acquire::Retries "3"' --dpkgopt='path-exclude=/usr/share/doc/*' \
        --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/locale/*' \
        bookworm "$staging/root" >&2 || die "mmdebstrap failed (see its output above)"
    for f in "${DEBIAN_OVERLAY[@]}"; do
        install -D -m "$(stat -c %a "$overlay/$f")" "$overlay/$f" "$staging/root/$f"
    done
    install -m 0755 "$agent" "$staging/root/usr/bin/mayfly-agent"
    mkdir -p "$staging/root/etc/mayfly/on-restore.d" "$staging/root/etc/mayfly/on-fork.d"
    # busybox init as PID 1 (Debian's minbase has no init); the kernel runs /sbin/init.
    ln -sfn /bin/busybox "$staging/root/sbin/init"
    echo mayfly > "$staging/root/etc/hostname"
    # The disk's root is the whole device (no partition table): / is /dev/vda.
    printf '/dev/vda / ext4 rw,relatime 0 1\n' > "$staging/root/etc/fstab"
    local mib
    mib=$(( $(du -sm "$staging/root" | cut -f1) * 5 / 4 + 128 ))
    mkdir -p "$out.tmp"
    # 4 KiB blocks: the disk layers' block, so the guest's writes never need read-modify-write.
    mke2fs -q -F -t ext4 -b 4096 -L mayfly-root -d "$staging/root" "$out.tmp/root.ext4" "${mib}M" \
        || die "mke2fs failed to make the image"
    printf '%s\n' "$resolved" > "$out.tmp/packages.txt"
    rm -rf "$out"
    mv "$out.tmp" "$out"
    ln -sfn "debian-$hash" "$cache/rootfs/debian.current"
    say "built the debian image: $out/root.ext4 (${mib} MiB, $(du -h "$out/root.ext4" | cut -f1) used)"
    echo "$out"
    exit 0
}
[ "$flavour" = debian ] && build_debian

bbver=$(dpkg-query -W -f='${Version}' busybox-static)
hash=$( {
    echo "recipe $RECIPE busybox $bbver agent $agent_sum"
    (cd "$overlay" && find . -type f | LC_ALL=C sort | xargs sha256sum)
    (cd "$overlay" && find . -type f -perm -u+x | LC_ALL=C sort)
} | sha256sum | cut -c1-16)

out=$cache/rootfs/$flavour-$hash
if [ -f "$out/initramfs.cpio" ]; then
    ln -sfn "$flavour-$hash" "$cache/rootfs/$flavour.current"
    say "$flavour initramfs is cached"
    echo "$out"
    exit 0
fi

staging=$(mktemp -d)
trap 'rm -rf "$staging"' EXIT
mkdir -p "$staging"/{bin,sbin,usr/bin,usr/sbin,etc,proc,sys,dev,tmp,run,root,mnt,var/log}
cp "$busybox" "$staging/bin/busybox"
# One link per applet, where busybox itself would install it.
"$busybox" --list-full | while read -r applet; do
    [ -e "$staging/$applet" ] || ln -s /bin/busybox "$staging/$applet"
done
cp -a "$overlay"/. "$staging"/
if [ -n "$agent" ]; then
    install -m 0755 "$agent" "$staging/usr/bin/mayfly-agent"
    # Hook directories of the refresh op (the overlay keeps them with .keep files).
    mkdir -p "$staging/etc/mayfly/on-restore.d" "$staging/etc/mayfly/on-fork.d"
fi
# The kernel runs /init from an initramfs: busybox init, unless the overlay brings its own.
[ -e "$staging/init" ] || ln -s /bin/busybox "$staging/init"
chmod 1777 "$staging/tmp"
# The kernel opens /dev/console for init before anything mounts devtmpfs.
mknod -m 600 "$staging/dev/console" c 5 1
mknod -m 666 "$staging/dev/null" c 1 3

mkdir -p "$out.tmp"
(cd "$staging" && find . -print0 | LC_ALL=C sort -z | cpio --null -o -H newc -R 0:0 --quiet) > "$out.tmp/initramfs.cpio"
rm -rf "$out"
mv "$out.tmp" "$out"
ln -sfn "$flavour-$hash" "$cache/rootfs/$flavour.current"
say "built $flavour initramfs: $out/initramfs.cpio ($(du -h "$out/initramfs.cpio" | cut -f1))"
echo "$out"
