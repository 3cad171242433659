/*
 * mayfly's probe guest: a freestanding x86-64 program that boots like a kernel (mayfly's
 * 64-bit Linux boot protocol: long mode, rsi = zero page), spends a few instructions at CPL0
 * to set up its own page tables and GDT, and then runs in user mode (CPL3), where KVM runs it
 * natively even on hosts that emulate guest kernel code.
 *
 * At CPL0 it also writes console=BYTES bytes to the serial port, or with stall=1 stops
 * there with the UART's interrupt pending, if the command line asks.
 *
 * In user mode it
 *   1. writes a pattern word into every 4 KiB page from 4 MiB to the end of low RAM
 *      (from the e820 map), and reports BOOTED (pages) and WRITTEN (checksum);
 *   2. waits, spinning on the VM generation ID (16 bytes at 0xef000, which mayfly changes on
 *      every restore and in every clone);
 *   3. on a change, reports RESUMED (the new ID's low 64 bits), verifies touch=PERCENT of the
 *      pages (spread evenly; from the kernel command line, default 100), writes its
 *      generation into a page of its own, and reports VERIFIED (checksum) and, if any page
 *      was wrong, MISMATCH (count); then waits again.
 *
 * Reports go to mayfly's probe device: the value to 0xd0000008, then the kind to 0xd0000000.
 * While waiting it reads 0xd0000010, which mayfly holds for up to 30 s: an idle probe
 * sleeps rather than spins.
 */

#define ZERO_PAGE_E820_COUNT 0x1e8
#define ZERO_PAGE_CMDLINE    0x228
#define ZERO_PAGE_E820_TABLE 0x2d0
#define REGION_START         0x400000
#define LOW_RAM_LIMIT        0xc0000000
#define VMGENID              0xef000
#define PROBE_DEVICE         0xd0000000
#define SEED                 0x9e3779b97f4a7c15

#define REPORT_BOOTED   1
#define REPORT_WRITTEN  2
#define REPORT_RESUMED  3
#define REPORT_VERIFIED 4
#define REPORT_MISMATCH 5
#define REPORT_WAITING  6

    .code64
    .text
    .globl _start
_start:
    /* CPL0: our page tables, our GDT, parameters; then down to user mode. */
    lea     pml4(%rip), %rax
    mov     %rax, %cr3
    lgdt    gdt_desc(%rip)

    /* End of low RAM: the highest end of an e820 RAM entry below the MMIO gap. */
    movzbl  ZERO_PAGE_E820_COUNT(%rsi), %ecx
    lea     ZERO_PAGE_E820_TABLE(%rsi), %rdx
    xor     %r8, %r8
1:  test    %ecx, %ecx
    jz      2f
    cmpl    $1, 16(%rdx)
    jne     3f
    mov     (%rdx), %rax
    add     8(%rdx), %rax
    mov     $LOW_RAM_LIMIT, %r10
    cmp     %r10, %rax
    ja      3f
    cmp     %r8, %rax
    cmovb   %r8, %rax
    mov     %rax, %r8
3:  add     $20, %rdx
    dec     %ecx
    jmp     1b
2:  sub     $REGION_START, %r8
    shr     $12, %r8
    mov     %r8, region_pages(%rip)

    /* touch=PERCENT from the command line. */
    mov     $100, %r9
    movl    ZERO_PAGE_CMDLINE(%rsi), %edi
    test    %edi, %edi
    jz      6f
4:  movb    (%rdi), %al
    test    %al, %al
    jz      6f
    cmpl    $0x63756f74, (%rdi)         /* "touc" */
    jne     5f
    cmpw    $0x3d68, 4(%rdi)            /* "h=" */
    jne     5f
    add     $6, %rdi
    xor     %r9, %r9
7:  movzbl  (%rdi), %eax
    sub     $'0', %eax
    cmp     $9, %eax
    ja      6f
    imul    $10, %r9
    add     %rax, %r9
    inc     %rdi
    jmp     7b
5:  inc     %rdi
    jmp     4b
6:  cmp     $100, %r9
    jbe     8f
    mov     $100, %r9
8:  mov     region_pages(%rip), %rax
    imul    %r9, %rax
    xor     %edx, %edx
    mov     $100, %ecx
    div     %rcx
    mov     %rax, touch_pages(%rip)

    /* console=BYTES from the command line: that many bytes ('x') written to the serial port
     * (COM1's data register) now, at CPL0: a guest that floods its console, for the tests of
     * the console's cap. */
    xor     %r9, %r9
    movl    ZERO_PAGE_CMDLINE(%rsi), %edi
    test    %edi, %edi
    jz      13f
10: movb    (%rdi), %al
    test    %al, %al
    jz      13f
    cmpl    $0x736e6f63, (%rdi)         /* "cons" */
    jne     12f
    cmpl    $0x3d656c6f, 4(%rdi)        /* "ole=" */
    jne     12f
    add     $8, %rdi
11: movzbl  (%rdi), %eax
    sub     $'0', %eax
    cmp     $9, %eax
    ja      13f
    imul    $10, %r9
    add     %rax, %r9
    inc     %rdi
    jmp     11b
12: inc     %rdi
    jmp     10b
13: mov     $0x3f8, %dx
    mov     $'x', %al
14: test    %r9, %r9
    jz      15f
    outb    %al, %dx
    dec     %r9
    jmp     14b
15:
    /* stall=1 on the command line: the UART's transmit interrupt enabled (so, the transmitter
     * being empty, pending at once), interrupts off, and a loop that never leaves the guest:
     * the shape of the lost console wake-up, for the test of the VMM's kick. */
    movl    ZERO_PAGE_CMDLINE(%rsi), %edi
    test    %edi, %edi
    jz      19f
16: movb    (%rdi), %al
    test    %al, %al
    jz      19f
    cmpl    $0x6c617473, (%rdi)         /* "stal" */
    jne     17f
    cmpl    $0x313d6c6c, 3(%rdi)        /* "ll=1" */
    jne     17f
    mov     $0x3f9, %dx                 /* IER */
    mov     $0x02, %al                  /* THRI */
    outb    %al, %dx
    cli
18: jmp     18b
17: inc     %rdi
    jmp     16b
19:
    /* iretq to user mode, interrupts off: nothing can interrupt a CPL3 loop. */
    lea     user_stack_top(%rip), %rax
    pushq   $0x23                       /* user data, RPL 3 */
    pushq   %rax
    pushq   $0x2                        /* rflags: IF clear */
    pushq   $0x1b                       /* user code, RPL 3 */
    lea     user_main(%rip), %rax
    pushq   %rax
    iretq

/* pattern(%rcx = page index) -> %rax */
pattern:
    lea     1(%rcx), %rax
    movabs  $SEED, %rdx
    imul    %rdx, %rax
    xor     %rdx, %rax
    ret

/* report(%rdi = kind, %rsi = value) */
report:
    mov     $PROBE_DEVICE, %rdx
    mov     %rsi, 8(%rdx)
    mov     %rdi, (%rdx)
    ret

user_main:
    /* 1. One word into every page. */
    mov     region_pages(%rip), %r12
    mov     $REGION_START, %rbx
    xor     %rcx, %rcx
    xor     %r13, %r13                  /* checksum */
1:  cmp     %r12, %rcx
    jae     2f
    call    pattern
    mov     %rcx, %rdi
    shl     $12, %rdi
    mov     %rax, (%rbx,%rdi)
    add     %rax, %r13
    inc     %rcx
    jmp     1b
2:  mov     $REPORT_BOOTED, %edi
    mov     %r12, %rsi
    call    report
    mov     $REPORT_WRITTEN, %edi
    mov     %r13, %rsi
    call    report
    mov     $VMGENID, %rax
    mov     (%rax), %rax
    mov     %rax, generation(%rip)
    /* From here on a snapshot's restore is noticed: say so, so nobody snapshots earlier. */
    mov     $REPORT_WAITING, %edi
    mov     %rax, %rsi
    call    report

    /* 2. Wait for a new generation: look first, and sleep only while it is the same (a
     *    generation that changed while the probe was busy is seen at once). */
wait:
    mov     $VMGENID, %rax
    mov     (%rax), %rax
    cmp     generation(%rip), %rax
    jne     changed
    mov     $PROBE_DEVICE, %rdx
    mov     16(%rdx), %rax              /* sleeps in the VMM */
    jmp     wait
changed:
    mov     %rax, generation(%rip)
    mov     $REPORT_RESUMED, %edi
    mov     %rax, %rsi
    call    report

    /* 3. Verify touch_pages pages, spread over the region. */
    mov     touch_pages(%rip), %r14
    xor     %r13, %r13                  /* checksum */
    xor     %r15, %r15                  /* mismatches */
    test    %r14, %r14
    jz      4f
    mov     region_pages(%rip), %rax
    xor     %edx, %edx
    div     %r14
    mov     %rax, %r12                  /* stride */
    xor     %r11, %r11                  /* j */
    mov     $REGION_START, %rbx
3:  cmp     %r14, %r11
    jae     4f
    mov     %r11, %rcx
    imul    %r12, %rcx                  /* page index */
    call    pattern
    mov     %rcx, %rdi
    shl     $12, %rdi
    mov     (%rbx,%rdi), %rdx
    add     %rdx, %r13
    cmp     %rax, %rdx
    je      5f
    inc     %r15
5:  inc     %r11
    jmp     3b
4:  mov     generation(%rip), %rax
    mov     %rax, own_page(%rip)
    mov     $REPORT_VERIFIED, %edi
    mov     %r13, %rsi
    call    report
    test    %r15, %r15
    jz      wait
    mov     $REPORT_MISMATCH, %edi
    mov     %r15, %rsi
    call    report
    jmp     wait

    .data
    .balign 16
gdt:
    .quad 0
    .quad 0x00af9a000000ffff            /* kernel code, 64-bit */
    .quad 0x00cf92000000ffff            /* kernel data */
    .quad 0x00affa000000ffff            /* user code, 64-bit, DPL 3 */
    .quad 0x00cff2000000ffff            /* user data, DPL 3 */
gdt_end:
gdt_desc:
    .word gdt_end - gdt - 1
    .quad gdt

region_pages: .quad 0
touch_pages:  .quad 0
generation:   .quad 0

    /* Identity map of the first 4 GiB with 2 MiB pages, user-accessible and writable. */
    .balign 4096
pml4:
    .quad pdpt + 0x7
    .fill 511, 8, 0
pdpt:
    .quad pd + 0x0000 + 0x7
    .quad pd + 0x1000 + 0x7
    .quad pd + 0x2000 + 0x7
    .quad pd + 0x3000 + 0x7
    .fill 508, 8, 0
pd:                                     /* four page directories, one after the other */
    .set i, 0
    .rept 2048
    .quad (i << 21) + 0x87
    .set i, i + 1
    .endr

    .bss
    .balign 4096
own_page:
    .fill 4096, 1, 0
user_stack:
    .fill 4096, 1, 0
user_stack_top:
