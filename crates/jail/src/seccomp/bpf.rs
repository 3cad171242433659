//! The seccomp filters' BPF, laid out by mayfly: the allowed system calls as a search tree.
//!
//! seccompiler (whose `sock_filter`, `BpfProgram` and `apply_filter` this uses) lays out five
//! instructions for every allowed call (compare, two jumps, two returns), one after the other.
//! What a filter costs a thread that installs it, on this host's KVM: the kernel checks,
//! converts and JIT-compiles the program, and then, with interrupts off, runs it once for
//! every system call number to cache the calls it allows whatever their arguments. That walk
//! grows with the number of instructions a call number goes through before its answer, so with
//! a list it grew with the list: measured (20 installs each, median) 10 instructions 13 µs,
//! 155 98 µs, 305 181 µs, 605 349 µs, and in a fork's perf profile the install under the
//! signal lock (`do_seccomp`) took 10.7% of all samples against 0.6% for the JIT. A probe
//! clone installs six filters (its vCPU, two device threads, the control socket, the console
//! input, its wait for the fork's end). With seccompiler's layout (240-330 instructions)
//! they cost a clone 0.6-0.7 ms of its ~1.9 ms; as one `jeq` per allowed call (60-100
//! instructions, up to ~75 run for a call number) about 0.09 ms a thread; as this tree
//! (78-120 instructions, at most 16-23 run for any call number) about 0.04 ms a thread
//! (`probe --fork-only`: each helper thread's CPU time, `MAYFLY_SECCOMP=off` against on).
//!
//! The program, for x86-64:
//!
//! ```text
//!   ld  arch;  jeq AUDIT_ARCH_X86_64 ? next : kill the process
//!   ld  nr
//!   for each call with argument rules (first, hottest first: the vCPU's ioctl):
//!       jeq call ? next : past this block
//!       for each rule: for each condition: ld arg half; [and mask]; jeq value ? next : next rule
//!                      ret match
//!       ret mismatch
//!   for each refused call:  jeq call ? next : past;  ret its action (an errno)
//!   the allowed calls, sorted: jge middle ? right half : left half, down to leaves of at
//!       most four "jeq call ? ALLOW : next" (the last one's "next" is MISMATCH)
//!   MISMATCH: ret mismatch
//!   ALLOW: ret match
//! ```
//!
//! `tests` checks the layout against seccompiler's own on every system call number and a set
//! of argument values, with a small interpreter of the instructions both use.

use seccompiler::{sock_filter, BpfProgram};

// Instruction codes (linux/bpf_common.h): class | size | mode, class | op | source.
/// BPF_LD | BPF_W | BPF_ABS: load a 32-bit word of `seccomp_data`.
const BPF_LD_W_ABS: u16 = 0x20;
/// BPF_ALU | BPF_AND | BPF_K.
const BPF_ALU_AND_K: u16 = 0x04 | 0x50;
/// BPF_JMP | BPF_JEQ | BPF_K.
const BPF_JMP_JEQ_K: u16 = 0x05 | 0x10;
/// BPF_JMP | BPF_JGE | BPF_K.
const BPF_JMP_JGE_K: u16 = 0x05 | 0x30;
/// BPF_RET | BPF_K.
const BPF_RET_K: u16 = 0x06;

/// Offsets into `struct seccomp_data`.
const DATA_NR: u32 = 0;
const DATA_ARCH: u32 = 4;
const DATA_ARGS: u32 = 16;
/// `AUDIT_ARCH_X86_64`: EM_X86_64 | __AUDIT_ARCH_64BIT | __AUDIT_ARCH_LE.
const AUDIT_ARCH_X86_64: u32 = 62 | 0x8000_0000 | 0x4000_0000;

/// `(argument & mask) == value`, on the argument's low 32 bits or on all 64.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Cond {
    /// Which argument, 0 to 5.
    pub arg: u8,
    /// All 64 bits, or the low 32 only.
    pub qword: bool,
    pub mask: u64,
    pub value: u64,
}

impl Cond {
    /// The argument's low 32 bits equal `value`.
    pub fn eq32(arg: u8, value: u32) -> Self {
        Cond {
            arg,
            qword: false,
            mask: u64::from(u32::MAX),
            value: u64::from(value),
        }
    }

    /// The argument's low 32 bits, masked, equal `value`.
    pub fn masked32(arg: u8, mask: u32, value: u32) -> Self {
        Cond {
            arg,
            qword: false,
            mask: u64::from(mask),
            value: u64::from(value),
        }
    }

    /// All 64 bits of the argument equal `value`.
    pub fn eq64(arg: u8, value: u64) -> Self {
        Cond {
            arg,
            qword: true,
            mask: u64::MAX,
            value,
        }
    }
}

/// A call allowed when one of its rules holds (a rule: all of its conditions).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Guarded {
    pub call: i64,
    pub rules: Vec<Vec<Cond>>,
}

/// What a filter does with each system call: the seccomp return values (`SECCOMP_RET_*`,
/// from seccompiler's `SeccompAction`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Policy {
    /// Calls allowed whatever their arguments.
    pub allow: Vec<i64>,
    /// Calls allowed on conditions, checked first, in this order.
    pub guarded: Vec<Guarded>,
    /// Calls answered with their own action (a refusal with an errno).
    pub refuse: Vec<(i64, u32)>,
    /// The answer to an allowed call.
    pub matched: u32,
    /// The answer to every other call.
    pub mismatch: u32,
}

fn stmt(code: u16, k: u32) -> sock_filter {
    sock_filter {
        code,
        jt: 0,
        jf: 0,
        k,
    }
}

fn jump(code: u16, k: u32, jt: u8, jf: u8) -> sock_filter {
    sock_filter { code, jt, jf, k }
}

/// A jump distance, or an error naming what is too long.
fn distance(n: usize, what: &str) -> Result<u8, String> {
    u8::try_from(n).map_err(|_| format!("{what} is too long for a BPF jump ({n} instructions)"))
}

/// A system call number as the filter compares it (the kernel's `nr` is an int).
fn number(call: i64) -> Result<u32, String> {
    u32::try_from(call).map_err(|_| format!("{call} is not a system call number"))
}

/// The instructions of one condition, failing to `fail` instructions past their end.
fn condition(cond: &Cond, fail: usize) -> Result<Vec<sock_filter>, String> {
    if cond.arg > 5 {
        return Err(format!(
            "system calls have 6 arguments, not {}",
            cond.arg + 1
        ));
    }
    let offset = DATA_ARGS + 8 * u32::from(cond.arg);
    // (offset of the half, mask, value), low half last.
    let high = |v: u64| u32::try_from(v >> 32).unwrap_or(u32::MAX);
    let low = |v: u64| u32::try_from(v & u64::from(u32::MAX)).unwrap_or(u32::MAX);
    let mut halves = Vec::with_capacity(2);
    if cond.qword {
        halves.push((offset + 4, high(cond.mask), high(cond.value)));
    }
    halves.push((offset, low(cond.mask), low(cond.value)));
    let mut out = Vec::new();
    for (i, (at, mask, value)) in halves.iter().copied().enumerate() {
        let masked = mask != u32::MAX;
        // Instructions of this half after its jeq, then of the halves after it.
        let after: usize = halves[i + 1..]
            .iter()
            .map(|(_, m, _)| if *m != u32::MAX { 3 } else { 2 })
            .sum();
        out.push(stmt(BPF_LD_W_ABS, at));
        if masked {
            out.push(stmt(BPF_ALU_AND_K, mask));
        }
        out.push(jump(
            BPF_JMP_JEQ_K,
            value,
            0,
            distance(after + fail, "a rule")?,
        ));
    }
    Ok(out)
}

/// Where a jump of the search tree goes.
#[derive(Clone, Copy, Debug)]
enum Target {
    Next,
    /// An instruction of the tree, by its index in it.
    At(usize),
    Allow,
    Mismatch,
}

/// One comparison of the search tree.
struct TreeInsn {
    code: u16,
    k: u32,
    jt: Target,
    jf: Target,
}

/// Allowed calls this many or fewer are compared one by one (a leaf of the tree).
const LEAF: usize = 4;

/// The allowed calls `sorted` as a binary search tree: `jge` on the middle number down to
/// leaves of at most [`LEAF`] `jeq`s, so any call number is decided in about log2(n/LEAF) +
/// LEAF comparisons. Why not a list: besides running the filter on every system call, the
/// kernel runs it once for every call number when a thread installs it (to cache the calls
/// it allows whatever their arguments), with interrupts off; with one `jeq` per allowed call
/// that walk was most of what a filter cost a thread (perf: `do_seccomp` 10.7% of a fork's
/// samples, the JIT 0.6%).
fn search_tree(sorted: &[u32], out: &mut Vec<TreeInsn>) {
    if sorted.len() <= LEAF {
        for (i, &call) in sorted.iter().enumerate() {
            let last = i + 1 == sorted.len();
            out.push(TreeInsn {
                code: BPF_JMP_JEQ_K,
                k: call,
                jt: Target::Allow,
                jf: if last { Target::Mismatch } else { Target::Next },
            });
        }
        return;
    }
    let mid = sorted.len() / 2;
    let at = out.len();
    out.push(TreeInsn {
        code: BPF_JMP_JGE_K,
        k: sorted[mid],
        jt: Target::Mismatch,
        jf: Target::Next,
    });
    search_tree(&sorted[..mid], out);
    out[at].jt = Target::At(out.len());
    search_tree(&sorted[mid..], out);
}

/// A condition's value that stands for the process that installs the filter (its PID, which
/// a filter cannot read): programs are compiled once and copied into a fork's clones, each a
/// process of its own, so the value is put in at install time by [`for_process`]. Above the
/// kernel's largest PID (`PID_MAX_LIMIT`, 2^22), so no real PID is taken for it.
pub const THIS_PROCESS: u32 = 0x7fff_fff1;

/// `program` with every comparison to [`THIS_PROCESS`] made against `pid`.
pub fn for_process(program: &[sock_filter], pid: u32) -> BpfProgram {
    program
        .iter()
        .map(|insn| {
            let mut insn = insn.clone();
            if insn.code == BPF_JMP_JEQ_K && insn.k == THIS_PROCESS {
                insn.k = pid;
            }
            insn
        })
        .collect()
}

/// The program for `policy`.
pub fn compile(policy: &Policy) -> Result<BpfProgram, String> {
    let mut out = vec![
        stmt(BPF_LD_W_ABS, DATA_ARCH),
        jump(BPF_JMP_JEQ_K, AUDIT_ARCH_X86_64, 1, 0),
        stmt(BPF_RET_K, libc::SECCOMP_RET_KILL_PROCESS),
        stmt(BPF_LD_W_ABS, DATA_NR),
    ];
    for guarded in &policy.guarded {
        let mut body = Vec::new();
        for rule in &guarded.rules {
            // Each condition fails to the instruction after this rule's `ret match`.
            let lens: Vec<usize> = rule
                .iter()
                .map(|c| condition(c, 0).map(|v| v.len()))
                .collect::<Result<_, _>>()?;
            let mut left: usize = lens.iter().sum::<usize>() + 1;
            for (cond, len) in rule.iter().zip(&lens) {
                left -= len;
                body.extend(condition(cond, left)?);
            }
            body.push(stmt(BPF_RET_K, policy.matched));
        }
        body.push(stmt(BPF_RET_K, policy.mismatch));
        out.push(jump(
            BPF_JMP_JEQ_K,
            number(guarded.call)?,
            0,
            distance(body.len(), "a call's rules")?,
        ));
        out.extend(body);
    }
    for &(call, action) in &policy.refuse {
        out.push(jump(BPF_JMP_JEQ_K, number(call)?, 0, 1));
        out.push(stmt(BPF_RET_K, action));
    }
    let mut allowed: Vec<u32> = policy
        .allow
        .iter()
        .map(|&call| number(call))
        .collect::<Result<_, _>>()?;
    allowed.sort_unstable();
    allowed.dedup();
    let mut tree = Vec::new();
    search_tree(&allowed, &mut tree);
    // MISMATCH (`ret mismatch`) right after the tree, ALLOW (`ret match`) after it.
    let mismatch_at = out.len() + tree.len();
    for (i, insn) in tree.iter().enumerate() {
        let at = out.len();
        let to = |target: Target| -> Result<u8, String> {
            let position = match target {
                Target::Next => at + 1,
                Target::At(index) => mismatch_at - tree.len() + index,
                Target::Mismatch => mismatch_at,
                Target::Allow => mismatch_at + 1,
            };
            distance(position - (at + 1), "the tree of allowed calls")
        };
        debug_assert_eq!(at, mismatch_at - tree.len() + i);
        out.push(jump(insn.code, insn.k, to(insn.jt)?, to(insn.jf)?));
    }
    out.push(stmt(BPF_RET_K, policy.mismatch));
    out.push(stmt(BPF_RET_K, policy.matched));
    // The kernel's own limit (BPF_MAXINSNS).
    if out.len() > 4096 {
        return Err(format!("the filter has {} instructions", out.len()));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use seccompiler::{
        SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter,
        SeccompRule, TargetArch,
    };
    use std::collections::BTreeMap;

    /// Run `program` on one system call, as the kernel would: its return value.
    fn run(program: &[sock_filter], arch: u32, nr: u32, args: [u64; 6]) -> u32 {
        run_counted(program, arch, nr, args).0
    }

    /// The return value, and how many instructions ran to reach it.
    fn run_counted(program: &[sock_filter], arch: u32, nr: u32, args: [u64; 6]) -> (u32, usize) {
        let mut data = [0u8; 64];
        data[0..4].copy_from_slice(&nr.to_le_bytes());
        data[4..8].copy_from_slice(&arch.to_le_bytes());
        for (i, a) in args.iter().enumerate() {
            data[16 + 8 * i..24 + 8 * i].copy_from_slice(&a.to_le_bytes());
        }
        let mut acc = 0u32;
        let mut pc = 0usize;
        let mut steps = 0usize;
        loop {
            let ins = &program[pc];
            pc += 1;
            steps += 1;
            match ins.code {
                BPF_LD_W_ABS => {
                    let at = ins.k as usize;
                    acc = u32::from_le_bytes(data[at..at + 4].try_into().unwrap());
                }
                BPF_ALU_AND_K => acc &= ins.k,
                // JA (seccompiler's layout).
                0x05 => pc += ins.k as usize,
                // JEQ, JGT, JGE (seccompiler's layout uses them too).
                0x15 | 0x25 | 0x35 => {
                    let taken = match ins.code {
                        0x15 => acc == ins.k,
                        0x25 => acc > ins.k,
                        _ => acc >= ins.k,
                    };
                    pc += usize::from(if taken { ins.jt } else { ins.jf });
                }
                BPF_RET_K => return (ins.k, steps),
                other => panic!("instruction {other:#x} at {}", pc - 1),
            }
        }
    }

    /// The same policy through seccompiler: refused calls allowed there (as the filter
    /// mayfly stacked on top of seccompiler's refused them), so compared apart.
    fn reference(policy: &Policy) -> BpfProgram {
        let mut rules: BTreeMap<i64, Vec<SeccompRule>> = BTreeMap::new();
        for &call in &policy.allow {
            rules.insert(call, Vec::new());
        }
        for &(call, _) in &policy.refuse {
            rules.insert(call, Vec::new());
        }
        for g in &policy.guarded {
            let converted = g
                .rules
                .iter()
                .map(|rule| {
                    let conds = rule
                        .iter()
                        .map(|c| {
                            let len = if c.qword {
                                SeccompCmpArgLen::Qword
                            } else {
                                SeccompCmpArgLen::Dword
                            };
                            let op = if c.mask == u64::MAX || (!c.qword && c.mask == 0xffff_ffff) {
                                SeccompCmpOp::Eq
                            } else {
                                SeccompCmpOp::MaskedEq(c.mask)
                            };
                            SeccompCondition::new(c.arg, len, op, c.value).unwrap()
                        })
                        .collect();
                    SeccompRule::new(conds).unwrap()
                })
                .collect();
            rules.insert(g.call, converted);
        }
        let filter = SeccompFilter::new(
            rules,
            SeccompAction::Trap,
            SeccompAction::Allow,
            TargetArch::x86_64,
        )
        .unwrap();
        filter.try_into().unwrap()
    }

    /// Argument values that matter to the rules mayfly writes, and some that do not.
    fn argument_values() -> Vec<u64> {
        let mut values = vec![
            0,
            1,
            15,
            38,
            0xAE80,
            0xAE00,
            0xc018_aa3f,
            0x5401,
            libc::FIONBIO,
            libc::TUNSETOFFLOAD,
            libc::CLONE_THREAD as u64,
            (libc::CLONE_VM | libc::CLONE_THREAD | libc::CLONE_SIGHAND) as u64,
            libc::SIGCHLD as u64,
            1 << 32,
            (1 << 32) | 0xAE80,
            u64::MAX,
        ];
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        for _ in 0..40 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            values.push(x);
        }
        values
    }

    /// Compare the two layouts on every system call number, each argument position taking
    /// each value in turn.
    fn same_answers(policy: &Policy) {
        let ours = compile(policy).unwrap();
        let theirs = reference(policy);
        let allow = libc::SECCOMP_RET_ALLOW;
        let trap = libc::SECCOMP_RET_TRAP;
        let values = argument_values();
        for nr in 0..500u32 {
            let refused = policy
                .refuse
                .iter()
                .find(|(c, _)| *c == i64::from(nr))
                .map(|(_, a)| *a);
            for arg in 0..6 {
                for &v in &values {
                    let mut args = [0u64; 6];
                    args[arg] = v;
                    let mine = run(&ours, AUDIT_ARCH_X86_64, nr, args);
                    let reference = run(&theirs, AUDIT_ARCH_X86_64, nr, args);
                    match refused {
                        Some(action) => assert_eq!(mine, action, "nr {nr}"),
                        None => {
                            let mine = if mine == policy.matched { allow } else { trap };
                            assert_eq!(mine, reference, "nr {nr}, arg {arg} = {v:#x}");
                        }
                    }
                }
            }
        }
        // Another architecture's call is never let through.
        assert_eq!(
            run(&ours, 0x4000_0003, 0, [0; 6]),
            libc::SECCOMP_RET_KILL_PROCESS
        );
    }

    #[test]
    fn every_thread_kind_answers_as_seccompilers_layout_would() {
        for &kind in super::super::ThreadKind::ALL.iter() {
            let policy = super::super::policy(kind, super::super::Mode::Enforce);
            same_answers(&policy);
            // What the layout is for: a short filter (the kernel checks, converts and
            // compiles every instruction for each thread) that decides any call number in few
            // steps (the kernel runs it on every call number when a thread installs it).
            let (ours, theirs) = (compile(&policy).unwrap(), reference(&policy));
            let most_steps = |program: &[sock_filter]| {
                (0..500u32)
                    .map(|nr| run_counted(program, AUDIT_ARCH_X86_64, nr, [0; 6]).1)
                    .max()
                    .unwrap()
            };
            let (our_steps, their_steps) = (most_steps(&ours), most_steps(&theirs));
            assert!(
                ours.len() * 2 < theirs.len() && our_steps <= 32,
                "{kind:?}: {} instructions, at most {our_steps} run (seccompiler's: {}, {their_steps})",
                ours.len(),
                theirs.len()
            );
            eprintln!(
                "{kind:?}: {} instructions, at most {our_steps} run for a call number \
                 (seccompiler's layout: {}, {their_steps})",
                ours.len(),
                theirs.len()
            );
        }
    }

    #[test]
    fn a_condition_on_this_process_is_bound_at_install() {
        let policy = Policy {
            allow: vec![1],
            guarded: vec![Guarded {
                call: 234,
                rules: vec![vec![Cond::eq32(0, THIS_PROCESS)]],
            }],
            refuse: vec![],
            matched: libc::SECCOMP_RET_ALLOW,
            mismatch: libc::SECCOMP_RET_TRAP,
        };
        const ALLOW: u32 = libc::SECCOMP_RET_ALLOW;
        const TRAP: u32 = libc::SECCOMP_RET_TRAP;
        let compiled = compile(&policy).unwrap();
        let bound = for_process(&compiled, 4242);
        assert_eq!(
            run(&bound, AUDIT_ARCH_X86_64, 234, [4242, 1, 0, 0, 0, 0]),
            ALLOW
        );
        assert_eq!(
            run(&bound, AUDIT_ARCH_X86_64, 234, [1, 1, 0, 0, 0, 0]),
            TRAP
        );
        let placeholder = u64::from(THIS_PROCESS);
        assert_eq!(
            run(&bound, AUDIT_ARCH_X86_64, 234, [placeholder, 1, 0, 0, 0, 0]),
            TRAP
        );
        // Everything else is as compiled.
        assert_eq!(compiled.len(), bound.len());
        assert_eq!(run(&bound, AUDIT_ARCH_X86_64, 1, [0; 6]), ALLOW);
    }

    #[test]
    fn conditions_on_both_halves_and_masks_are_checked() {
        let policy = Policy {
            allow: vec![1, 2, 3],
            guarded: vec![
                Guarded {
                    call: 16,
                    rules: vec![
                        vec![Cond::masked32(1, 0xff00, 0xAE00)],
                        vec![Cond::eq32(1, 0x5421), Cond::eq32(2, 7)],
                    ],
                },
                Guarded {
                    call: 116,
                    rules: vec![vec![Cond::eq64(0, 0)]],
                },
                Guarded {
                    call: 56,
                    rules: vec![vec![Cond {
                        arg: 0,
                        qword: true,
                        mask: 0x0000_00ff_0001_0000,
                        value: 0x0000_0012_0001_0000,
                    }]],
                },
            ],
            refuse: vec![(257, libc::SECCOMP_RET_ERRNO | 13)],
            matched: libc::SECCOMP_RET_ALLOW,
            mismatch: libc::SECCOMP_RET_TRAP,
        };
        same_answers(&policy);
        let program = compile(&policy).unwrap();
        let allow = libc::SECCOMP_RET_ALLOW;
        let at = |nr, args| run(&program, AUDIT_ARCH_X86_64, nr, args);
        assert_eq!(at(16, [0, 0xAE80, 0, 0, 0, 0]), allow);
        assert_eq!(at(16, [0, 0x5421, 7, 0, 0, 0]), allow);
        assert_ne!(at(16, [0, 0x5421, 8, 0, 0, 0]), allow);
        assert_eq!(at(116, [0, 0, 0, 0, 0, 0]), allow);
        assert_ne!(at(116, [1 << 32, 0, 0, 0, 0, 0]), allow);
        assert_eq!(at(56, [0x0000_3412_ffff_ffff, 0, 0, 0, 0, 0]), allow);
        assert_ne!(at(56, [0x0000_3413_ffff_ffff, 0, 0, 0, 0, 0]), allow);
        assert_eq!(at(257, [0; 6]), libc::SECCOMP_RET_ERRNO | 13);
    }
}
