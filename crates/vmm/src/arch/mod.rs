//! x86-64 specifics: memory layout, CPUID, boot registers, and the tables that describe the
//! machine to the guest (MP table, ACPI).

pub mod acpi;
mod aml;
pub mod cpuid;
pub mod kvm_state;
pub mod layout;
pub mod mptable;
pub mod regs;
